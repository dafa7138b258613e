"""What a built engine actually bound: counted, not assumed.

* ``probe_hal_calls`` runs one dummy forward (with attention metadata) and the lm_head, counting HAL
  backend calls per routed module; a module of a routed kind that makes none fails the check
  (``require_hal_calls``). It runs at the start of every HAL-bound engine (the CPU worker's warm-up
  step, patched by ``install``), and on demand through ``hal.vllm.worker.HalWorkerExtension.hal_binding``.
* ``routed_binding`` reads the binding a built module's HAL route holds (for the same report).

The binding's identity itself (``EngineBinding``, the engine/trainer check) is ``hal.vllm.binding``,
which imports no vLLM; this module needs vLLM's layer classes.
"""

from __future__ import annotations

import torch

from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import LinearBase
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding, RotaryEmbeddingBase
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

from hal.backend import Backend
from hal.errors import HalError
from hal.vllm.binding import EngineBinding
from hal.vllm.quant import HalConfig, HalFp8LinearMethod, HalLinearMethod, HalLMHeadMethod, HalRouterMethod


def _moe_kinds() -> tuple[type, ...]:
    """vLLM's MoE layer (the runner a model calls; it calls the router and the experts' quant method)."""
    try:
        from vllm.model_executor.layers.fused_moe.runner.moe_runner_interface import MoERunnerInterface
    except ImportError:        # a vLLM without this layer builds no MoE model the plugin routes
        return ()
    return (MoERunnerInterface,)


MOE_KINDS = _moe_kinds()

#: module kinds whose forward must call the HAL in a HAL-bound engine (the lm_head is probed apart:
#: vLLM calls its quant method from the logits processor, never its forward)
ROUTED_KINDS = (LinearBase, RMSNorm, SiluAndMul, RotaryEmbeddingBase, Attention, *MOE_KINDS)

#: tokens of the probe's dummy forward
PROBE_TOKENS = 8

LM_HEAD_PROBE = "lm_head (logits)"


class CallCounter:
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

    def counting(self, backend: Backend) -> "CountingBackend":
        """``backend`` seen through this counter (what ``HalConfig.backend()`` returns during a probe)."""
        return CountingBackend(backend, self)


class CountingBackend:
    """A backend whose every method call is counted for the running routed module."""

    def __init__(self, backend: Backend, counter: CallCounter):
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
        raise HalError("hal vLLM plugin: probe_hal_calls needs a HAL-bound engine (quantization='hal'), got "
                       f"quantization config {config!r}")
    model = model_runner.get_model()
    counter = CallCounter()
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, ROUTED_KINDS):
            counter.counts[name] = 0
            handles.append(module.register_forward_pre_hook(lambda m, args, name=name: counter.enter(name)))
            handles.append(module.register_forward_hook(lambda m, args, out: counter.leave()))
    counter.counts[LM_HEAD_PROBE] = 0
    config.backend()                       # created outside the count (creation makes no routed call)
    config._call_counter = counter
    # A compiled model (enforce_eager=False) runs its forward as one graph: module hooks do not fire
    # there. For the probe, vLLM's compiled modules run their Python forward (``do_not_compile``, which
    # their __call__ reads on every call); the ops are the same torch.ops.hal calls either way.
    compiled = [m for m in model.modules() if getattr(m, "do_not_compile", True) is False]
    for module in compiled:
        module.do_not_compile = True
    try:
        with torch.no_grad():
            _, hidden = model_runner._dummy_run(PROBE_TOKENS, force_attention=True, **_eager_run())
            counter.enter(LM_HEAD_PROBE)
            model.compute_logits(hidden)
            counter.leave()
    finally:
        for module in compiled:
            module.do_not_compile = False
        config._call_counter = None
        for handle in handles:
            handle.remove()
    return counter.counts


def _eager_run() -> dict:
    """On CUDA the probe forward must not replay (or capture) a CUDA graph: module hooks fire only in
    an eager forward, and a graph outside capture_model fails vLLM's capture check."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return {}
    from vllm.config import CUDAGraphMode

    return {"cudagraph_runtime_mode": CUDAGraphMode.NONE}


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


def routed_binding(module: torch.nn.Module) -> tuple[str | None, EngineBinding | None]:
    """(the routed kind of ``module`` or None, the binding its HAL route holds or None)."""
    if isinstance(module, (LinearBase, ParallelLMHead)):
        method = getattr(module, "quant_method", None)
        routed = isinstance(method, (HalLinearMethod, HalFp8LinearMethod, HalLMHeadMethod, HalRouterMethod))
        config = getattr(method, "config", None) if routed else None
        return type(module).__name__, config.binding if config is not None else None
    if MOE_KINDS and isinstance(module, MOE_KINDS):
        from hal.vllm.moe import HalFusedMoEMethod

        method = getattr(getattr(module, "routed_experts", None), "quant_method", None)
        config = method.config if isinstance(method, HalFusedMoEMethod) else None
        return f"MoE ({type(method).__name__})", config.binding if config is not None else None
    if isinstance(module, (RMSNorm, SiluAndMul, RotaryEmbedding)):
        config = getattr(module, "hal", None)
        return type(module).__name__, config.binding if config is not None else None
    if isinstance(module, Attention):
        impl = module.impl
        config = getattr(impl, "hal", None)
        return f"Attention ({type(impl).__name__})", config.binding if config is not None else None
    return None, None


_stock_warm_up = None


def _checked_warm_up(self):
    """The worker's warm-up step (after the KV cache exists), then, in a HAL-bound engine, the
    call-count probe: an engine whose routed modules do not all call the HAL does not start."""
    result = _stock_warm_up(self)
    if isinstance(self.vllm_config.quant_config, HalConfig):
        self.hal_probe_counts = require_hal_calls(self.model_runner)
    return result


def install() -> None:
    """Run the call-count check at the end of the worker's warm-up (the CPU worker, or vLLM's GPU worker
    on CUDA)."""
    global _stock_warm_up
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        from vllm.v1.worker.gpu_worker import Worker
    else:
        from vllm.v1.worker.cpu_worker import CPUWorker as Worker

    if Worker.compile_or_warm_up_model is not _checked_warm_up:
        _stock_warm_up = Worker.compile_or_warm_up_model
        Worker.compile_or_warm_up_model = _checked_warm_up
