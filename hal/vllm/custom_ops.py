"""Row and pointwise ops: RMSNorm, SiluAndMul and RotaryEmbedding as ``CustomOp.register_oot`` replacements.

Each routed forward calls ``torch.ops.hal.*`` (``hal.torch_ops``) with the engine's key: one opaque
node for torch.compile, the engine's backend at run time.

vLLM builds its out-of-tree replacement wherever a model constructs the in-tree op (matched by the
exact class name), for every engine in the process; each replacement decides once, at construction,
from that engine's config (``quant.bound_config()``) whether it routes through the HAL or stays the stock
op. Every other op of these families (other norms, activations, RoPE variants) is registered as a
*refusing* subclass: constructing it in a HAL-bound engine raises, so it never runs a stock kernel in
place of a routed one.
"""

from __future__ import annotations

import torch

from vllm.model_executor.custom_op import CustomOp, op_registry_oot
from vllm.model_executor.layers import activation as vllm_activation
from vllm.model_executor.layers import layernorm as vllm_layernorm
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding, RotaryEmbeddingBase

from hal.errors import UnsupportedError
from hal.rope import cos_sin_cache
from hal.vllm import quant


class _HalRouted:
    """Mixed in before a vLLM CustomOp: ``hal`` is the engine's HalConfig (None: not HAL-bound, the stock
    op runs), decided once at construction; every platform's forward goes to ``_hal_forward`` when bound."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.hal = quant.bound_config()

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
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if residual is None:
            return torch.ops.hal.rms_norm(self.hal.op_key, x2, self.weight.data, self.variance_epsilon).view(shape)
        out, new_residual = torch.ops.hal.add_rms_norm(self.hal.op_key, x2, residual.reshape(-1, shape[-1]),
                                                       self.weight.data, self.variance_epsilon)
        return out.view(shape), new_residual.view(shape)


class HalSiluAndMul(_HalRouted, SiluAndMul):
    def _hal_forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.hal.silu_mul(self.hal.op_key, x)


class HalRotaryEmbedding(_HalRouted, RotaryEmbedding):
    """Neox RoPE with ``hal.rope``'s table (the trainer's), not vLLM's torch-computed cos/sin cache."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.hal is not None:
            if not self.is_neox_style:
                raise UnsupportedError("hal vLLM plugin: only neox-style rotary embeddings have a HAL route")
            # A buffer on the device vLLM builds the model on (its default-device context; vLLM never
            # calls model.to()), so the forward (traced by torch.compile, replayed in CUDA graphs) never
            # copies it from the host: a host copy cannot be captured in a CUDA graph. The table itself
            # is computed on the CPU (hal.rope), then moved: the same bits as the trainer's.
            self.register_buffer("hal_table", cos_sin_cache(self.rotary_dim, self.max_position_embeddings,
                                                            self.base, device=torch.get_default_device()),
                                 persistent=False)
            # vLLM's positions stay below max_model_len (its own cos/sin cache has the same rows and no
            # check): where that fits the table, the backend's range check (a host synchronisation on an
            # accelerator, once per new positions tensor: hal.torch_ops.rotary) is skipped; otherwise it runs.
            self.hal_positions_in_range = _engine_max_model_len() <= self.max_position_embeddings

    def _hal_forward(self, positions, query, key=None):
        if key is None:
            raise UnsupportedError("hal vLLM plugin: rotary embedding without keys has no HAL route")
        positions = positions.flatten()
        t = positions.shape[0]
        table = self.hal_table
        if table.device != query.device:
            raise UnsupportedError(f"hal vLLM plugin: the RoPE table is on {table.device}, the query on {query.device}: "
                                   f"the model was not built on its device (a per-step host copy would follow)")
        q, k = torch.ops.hal.rotary(self.hal.op_key, positions, query.reshape(t, -1, self.head_size),
                                    key.reshape(t, -1, self.head_size), table, self.hal_positions_in_range)
        return q.reshape(query.shape), k.reshape(key.shape)


def _engine_max_model_len() -> float:
    """The max_model_len of the engine whose model is being built (vLLM builds its modules inside its config's
    context); inf without a model config: every call checks."""
    from vllm.config import get_current_vllm_config

    model_config = get_current_vllm_config().model_config
    return float("inf") if model_config is None else model_config.max_model_len


#: in-tree class name -> its HAL replacement
ROUTED_OPS = {"RMSNorm": HalRMSNorm, "SiluAndMul": HalSiluAndMul, "RotaryEmbedding": HalRotaryEmbedding}


def _refusing(cls: type) -> type:
    """A same-named subclass of an op the HAL does not route: constructing it in a HAL-bound engine
    raises, anywhere else it is the stock op."""

    def __init__(self, *args, **kwargs):
        if quant.bound_config() is not None:
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
    not_refused = {*ROUTED_OPS, "CustomOp"}
    return [c for c in dict.fromkeys(found) if c.__name__ not in not_refused]


def install() -> None:
    """Register the routed ops and a refusing subclass of every unrouted op of their families (names that
    are registered already, e.g. by an earlier call, are left as they are)."""
    for name, cls in ROUTED_OPS.items():
        if name not in op_registry_oot:
            CustomOp.register_oot(cls, name=name)
    for cls in _unrouted_ops():
        if cls.__name__ not in op_registry_oot:
            CustomOp.register_oot(_refusing(cls), name=cls.__name__)
