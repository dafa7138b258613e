"""The HAL's ops as ``torch.library`` custom ops (``torch.ops.hal.*``), for compiled code.

torch.compile (Dynamo) traces Python; a backend's op is Python around kernel launches, with input
checks that read values and lazy state. Called as a custom op it is one opaque node instead: the
graph keeps it, a fake (meta) implementation gives the compiler shapes and dtypes, and at run time
(eager, compiled or CUDA-graph capture) the real implementation calls the bound backend. vLLM's
compiled model forward (and its piecewise CUDA graphs) then still runs every routed op on the HAL.

Which backend: every op takes a ``binding`` string first, the key under which a caller registered a
provider with ``bind(key, provider)``; ``provider()`` returns the backend to call at that moment (an
engine's ``HalConfig.backend``, which may return a counting view while the binding probe runs). A
string is a compile-time constant, so the compiled graph names the binding, never a Python object.

These ops compute exactly what the backend's methods compute (same bits): the custom op is only the
calling convention. Attention metadata is passed as its three tensors.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

from hal.backend import AttentionMetadata, Backend, mark_values_checked
from hal.errors import HalError

_providers: dict[str, Callable[[], Backend]] = {}
_lock = threading.Lock()


def bind(key: str, provider: Callable[[], Backend]) -> str:
    """Register ``provider`` (returns the backend to call) under ``key``; returns ``key``. Binding a key
    again replaces its provider (an engine process re-binding after unpickling its config)."""
    with _lock:
        _providers[key] = provider
    return key


def unbind(key: str) -> None:
    with _lock:
        _providers.pop(key, None)


def backend_for(key: str) -> Backend:
    try:
        provider = _providers[key]
    except KeyError:
        raise HalError(f"torch.ops.hal: no backend is bound under {key!r} in this process (bound: "
                       f"{sorted(_providers) or 'none'}); call hal.torch_ops.bind(key, provider) first (a vLLM graph "
                       f"compiled for another binding, from a compile cache shared across bindings? vLLM's cache is "
                       f"under VLLM_CACHE_ROOT)") from None
    return provider()


# -- the ops ------------------------------------------------------------------------------------
# Each: the real implementation (calls the backend), then its fake implementation (shapes only).

@torch.library.custom_op("hal::linear", mutates_args=())
def linear(binding: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           fp32_out: bool) -> torch.Tensor:
    """``Backend.linear``; ``fp32_out``: fp32 logits (the lm_head), else the activation dtype."""
    return backend_for(binding).linear(x, weight, bias, out_dtype=torch.float32 if fp32_out else None)


@linear.register_fake
def _(binding, x, weight, bias, fp32_out):
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32 if fp32_out else x.dtype)


@torch.library.custom_op("hal::fp8_linear", mutates_args=())
def fp8_linear(binding: str, x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
    """``Backend.fp8_linear``: x quantised per the contract's [fp8] groups, e4m3 weight with its per-block
    ``weight_scale_inv``; output in the activation dtype."""
    return backend_for(binding).fp8_linear(x, weight, weight_scale_inv, bias)


@fp8_linear.register_fake
def _(binding, x, weight, weight_scale_inv, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("hal::rms_norm", mutates_args=())
def rms_norm(binding: str, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return backend_for(binding).rms_norm(x, weight, eps)


@rms_norm.register_fake
def _(binding, x, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op("hal::add_rms_norm", mutates_args=())
def add_rms_norm(binding: str, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``Backend.rms_norm`` with the fused residual add: (norm(x + residual) * weight, x + residual)."""
    return backend_for(binding).rms_norm(x, weight, eps, residual)


@add_rms_norm.register_fake
def _(binding, x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("hal::silu_mul", mutates_args=())
def silu_mul(binding: str, gate_up: torch.Tensor) -> torch.Tensor:
    return backend_for(binding).silu_mul(gate_up)


@silu_mul.register_fake
def _(binding, gate_up):
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


@torch.library.custom_op("hal::rotary", mutates_args=())
def rotary(binding: str, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
           cos_sin_cache: torch.Tensor, positions_in_range: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``positions_in_range``: the caller guarantees 0 <= positions < cos_sin_cache rows (a vLLM engine whose
    max_model_len fits the table), so the backend's range check is skipped. That check reads the positions'
    range once per new positions tensor on an accelerator: a host synchronisation in every eager (prefill,
    mixed) step of a vLLM engine, which holds the host until the GPU has drained the work queued before it,
    so the host cannot prepare the next step meanwhile (session 10's 8B Python profile: 0.52 s in
    ``check_positions`` over a generate's 360 rotary calls, 10 eager steps x 36 layers)."""
    if positions_in_range:
        mark_values_checked(positions)
    return backend_for(binding).rotary(positions, q, k, cos_sin_cache)


@rotary.register_fake
def _(binding, positions, q, k, cos_sin_cache, positions_in_range=False):
    return torch.empty_like(q), torch.empty_like(k)


@torch.library.custom_op("hal::log_softmax", mutates_args=())
def log_softmax(binding: str, logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return backend_for(binding).log_softmax(logits, temperature)


@log_softmax.register_fake
def _(binding, logits, temperature):
    return logits.new_empty(logits.shape, dtype=torch.float32)


@torch.library.custom_op("hal::attention", mutates_args=())
def attention(binding: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
              scale: float) -> torch.Tensor:
    """``Backend.attention`` with the metadata as its tensors (``AttentionMetadata``'s fields)."""
    meta = AttentionMetadata(query_start_loc=query_start_loc, seq_lens=seq_lens, block_table=block_table)
    return backend_for(binding).attention(q, k_cache, v_cache, meta, scale=scale)


@attention.register_fake
def _(binding, q, k_cache, v_cache, query_start_loc, seq_lens, block_table, scale):
    return torch.empty_like(q)


@torch.library.custom_op("hal::write_kv", mutates_args=("k_cache", "v_cache"))
def write_kv(binding: str, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    backend_for(binding).write_kv(k, v, k_cache, v_cache, slot_mapping)


@write_kv.register_fake
def _(binding, k, v, k_cache, v_cache, slot_mapping):
    return None


@torch.library.custom_op("hal::moe_route", mutates_args=())
def moe_route(binding: str, router_logits: torch.Tensor, correction_bias: torch.Tensor | None, num_experts: int,
              top_k: int, scoring: str, renormalize: bool, num_groups: int, topk_groups: int,
              scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``Backend.moe_route`` with the ``hal.moe.Routing`` fields as scalars."""
    from hal.moe import Routing

    routing = Routing(num_experts, top_k, scoring, renormalize, num_groups, topk_groups, scaling)
    return backend_for(binding).moe_route(router_logits, routing, correction_bias)


@moe_route.register_fake
def _(binding, router_logits, correction_bias, num_experts, top_k, scoring, renormalize, num_groups, topk_groups,
      scaling):
    t = router_logits.shape[0]
    return (router_logits.new_empty((t, top_k), dtype=torch.float32),
            router_logits.new_empty((t, top_k), dtype=torch.int32))


@torch.library.custom_op("hal::moe_experts", mutates_args=())
def moe_experts(binding: str, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, shared: torch.Tensor | None) -> torch.Tensor:
    return backend_for(binding).moe_experts(x, w13, w2, topk_weights, topk_ids, shared)


@moe_experts.register_fake
def _(binding, x, w13, w2, topk_weights, topk_ids, shared):
    return torch.empty_like(x)


@torch.library.custom_op("hal::fp8_moe_experts", mutates_args=())
def fp8_moe_experts(binding: str, x: torch.Tensor, w13: torch.Tensor, w13_scale_inv: torch.Tensor, w2: torch.Tensor,
                    w2_scale_inv: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    shared: torch.Tensor | None) -> torch.Tensor:
    """``Backend.fp8_moe_experts``: block-FP8 experts (e4m3 weights with per-expert block scales)."""
    return backend_for(binding).fp8_moe_experts(x, w13, w13_scale_inv, w2, w2_scale_inv, topk_weights, topk_ids,
                                                shared)


@fp8_moe_experts.register_fake
def _(binding, x, w13, w13_scale_inv, w2, w2_scale_inv, topk_weights, topk_ids, shared):
    return torch.empty_like(x)


#: every op of this module (what the opcheck test covers)
OPS = {"linear": linear, "rms_norm": rms_norm, "add_rms_norm": add_rms_norm, "silu_mul": silu_mul,
       "rotary": rotary, "log_softmax": log_softmax, "attention": attention, "write_kv": write_kv,
       "moe_route": moe_route, "moe_experts": moe_experts}
