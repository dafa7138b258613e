"""The KV-cache write: K and V rows stored at their slots, without a host synchronisation.

No arithmetic, so nothing for a contract to pin: ``write_kv`` is an exact copy whatever the backend.
What this kernel changes is the host side. ``Backend.write_kv``'s default selects the valid slots with
a boolean mask (``slot_mapping[slot_mapping >= 0]``), and a masked select needs the count of kept
elements on the host: one synchronisation per call, i.e. per layer and step in vLLM, whose KV writes
run eagerly between its CUDA-graph pieces. Here one program per (token, KV head) loads its slot and
stores its row only where the slot is >= 0 (vLLM's padding tokens carry -1), so the call never waits
for the device. A slot past the caches is refused on the CPU (where reading it is free) and never
stored on a device (where refusing it would cost the synchronisation this kernel exists to avoid).

The cuda backend's ``write_kv``. Checked under the interpreter (tests/test_cuda_interpreter.py) and on the
H200 by ``bench/write_kv_check.py`` (bitwise against the indexed copy, vLLM's layout and plain caches).

``write_kv_fp8`` is the FP8 KV cache's write ([fp8].kv_format / kv_scale): the same program per (token,
KV head) quantises each vector by [fp8]'s scale rule (hal/fp8.py) before it stores it, so it does have
arithmetic, pinned by the contract and checked bitwise against ``hal.fp8.write_kv_exact``
(tests/test_cuda_fp8_kv.py under the interpreter, bench/fp8_kv_gpu.py on the H200).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hal.errors import UnsupportedError
from hal.kernels.common import LAUNCH, next_power_of_2
from hal.kernels.launcher import launch
from hal.kernels.fp8_gemm import _FORMAT_BITS, round_to_fp8


@triton.jit
def _slot(slot_ptr, token, page_size, capacity, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """(offs, keep, page, row) of ``token``'s slot: slot -1 (or one past the cache) stores nothing; a
    (BLOCK_D,) mask throughout (the interpreter turns a scalar bool broadcast into the vector mask into int32)."""
    slot = tl.load(slot_ptr + token).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    slot_row = slot + tl.zeros([BLOCK_D], dtype=tl.int64)
    valid = (slot_row >= 0) & (slot_row < capacity)
    keep = (offs < HEAD_DIM) & valid
    page = tl.where(valid, slot_row, 0) // page_size
    row = tl.where(valid, slot_row, 0) % page_size
    return offs, keep, page, row


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kp, stride_kr, stride_kh_cache, stride_vp, stride_vr, stride_vh_cache, page_size,
                     capacity, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    offs, keep, page, row = _slot(slot_ptr, token, page_size, capacity, HEAD_DIM, BLOCK_D)
    t = token.to(tl.int64)
    k = tl.load(k_ptr + t * stride_kt + head * stride_kh + offs, mask=keep)
    v = tl.load(v_ptr + t * stride_vt + head * stride_vh + offs, mask=keep)
    tl.store(k_cache_ptr + page * stride_kp + row * stride_kr + head * stride_kh_cache + offs, k, mask=keep)
    tl.store(v_cache_ptr + page * stride_vp + row * stride_vr + head * stride_vh_cache + offs, v, mask=keep)


def _checked_slots(op: str, k, v, k_cache, v_cache, slot_mapping) -> tuple[torch.Tensor, int]:
    """The checks both writes share (contiguous head_dim, rows that fit the caches, on the CPU no slot past
    the caches); returns (contiguous integer slots, the caches' slot count)."""
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise UnsupportedError(f"{op}: {name}'s head_dim must be contiguous (stride 1); got strides "
                                   f"{tuple(t.stride())}")
    if k_cache.shape[2:] != k.shape[1:]:
        raise UnsupportedError(f"{op}: rows (T, Hkv, D) = {tuple(k.shape)} do not fit caches of shape "
                               f"{tuple(k_cache.shape)} (pages, P, Hkv, D)")
    capacity = k_cache.shape[0] * k_cache.shape[1]
    if slot_mapping.device.type == "cpu":    # reading values is free here; on a device it would synchronise
        high = int(slot_mapping.max())
        if high >= capacity:
            raise UnsupportedError(f"{op}: slot {high} is outside the caches' {capacity} slots")
    slots = slot_mapping if slot_mapping.dtype in (torch.int32, torch.int64) else slot_mapping.long()
    return slots.contiguous(), capacity


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v (T, Hkv, D) into caches (pages, P, Hkv, D) at flat slots ``page * P + row``; slot -1 skips.
    The caches may be strided views (vLLM keeps K and V side by side); head_dim must be contiguous."""
    slots, capacity = _checked_slots("write_kv", k, v, k_cache, v_cache, slot_mapping)
    tokens, heads, head_dim = k.shape
    launch(_write_kv_kernel, (tokens, heads),
           k, v, k_cache, v_cache, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0),
           k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
           k_cache.shape[1], capacity, HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim), **LAUNCH)


# -- the FP8 KV cache ([fp8]: kv_format, kv_scale; hal/fp8.py has the rules in exact torch ops) --------

@triton.jit
def _write_kv_fp8_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr,
                         stride_kt, stride_kh, stride_vt, stride_vh, stride_cp, stride_cr, stride_ch,
                         stride_sp, stride_sr, stride_sh, page_size, capacity, floor, fmax,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PER_TOKEN_HEAD: tl.constexpr,
                         MANT: tl.constexpr, MIN_EXP: tl.constexpr, OUT_E5M2: tl.constexpr):
    """One program per (token, KV head): each of its K and V vectors quantised as one piece (its scale
    from that vector alone, ``per_token_head``) or with the layer's fixed scale, then stored with its
    scale; slot -1 stores nothing, as in ``_write_kv_kernel``."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    offs, keep, page, row = _slot(slot_ptr, token, page_size, capacity, HEAD_DIM, BLOCK_D)
    t = token.to(tl.int64)
    cache_off = page * stride_cp + row * stride_cr + head * stride_ch + offs
    scale_off = page * stride_sp + row * stride_sr + head * stride_sh     # (BLOCK_D,) copies of one offset
    _quantise_store(k_ptr + t * stride_kt + head * stride_kh + offs, k_cache_ptr + cache_off, k_scale_ptr,
                    scale_off, keep, offs, floor, fmax, PER_TOKEN_HEAD, MANT, MIN_EXP, OUT_E5M2)
    _quantise_store(v_ptr + t * stride_vt + head * stride_vh + offs, v_cache_ptr + cache_off, v_scale_ptr,
                    scale_off, keep, offs, floor, fmax, PER_TOKEN_HEAD, MANT, MIN_EXP, OUT_E5M2)


@triton.jit
def _quantise_store(x_ptrs, q_ptrs, scale_ptr, scale_off, keep, offs, floor, fmax, PER_TOKEN_HEAD: tl.constexpr,
                    MANT: tl.constexpr, MIN_EXP: tl.constexpr, OUT_E5M2: tl.constexpr):
    """[fp8]'s scale rule and quantisation of one vector (the activation quantiser's, hal/kernels/fp8_gemm.py):
    scale = div_rn(max(amax, floor), FMAX), q = rne_fp8(clamp(div_rn(x, scale)))."""
    x = tl.load(x_ptrs, mask=keep, other=0.0).to(tl.float32)        # bf16 -> fp32 is exact; padding is 0
    if PER_TOKEN_HEAD:
        scale = tl.div_rn(tl.maximum(tl.max(tl.abs(x), axis=0), floor), fmax)
        tl.store(scale_ptr + scale_off, scale + tl.zeros_like(x), mask=keep & (offs == 0))
    else:
        scale = tl.load(scale_ptr)
    y = tl.minimum(tl.maximum(tl.div_rn(x, scale), -fmax), fmax)
    y = round_to_fp8(y, MANT, MIN_EXP)                              # the cast below is then exact
    if OUT_E5M2:
        q = y.to(tl.float8e5)
    else:
        q = y.to(tl.float8e4nv)
    tl.store(q_ptrs, q, mask=keep)


def write_kv_fp8(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 k_scale: torch.Tensor, v_scale: torch.Tensor, slot_mapping: torch.Tensor, spec) -> None:
    """``write_kv`` into an FP8 KV cache (``hal.fp8.Fp8KVCache``'s layout: K and V caches of one shape and
    strides, per-token-head scales (pages, P, Hkv) of one shape and strides, or 0-dim fixed scales),
    quantising as [fp8] says: the same bits as ``hal.fp8.write_kv_exact``. One launch, no host sync."""
    slots, capacity = _checked_slots("fp8 write_kv", k, v, k_cache, v_cache, slot_mapping)
    if k_cache.stride() != v_cache.stride() or k_scale.stride() != v_scale.stride():
        raise UnsupportedError("fp8 write_kv: the K and V caches (and their scales) must have the same strides")
    tokens, heads, head_dim = k.shape
    per_token = spec.kv_scale == "per_token_head"
    scale_strides = k_scale.stride() if per_token else (0, 0, 0)
    mant, min_exp = _FORMAT_BITS[spec.kv_format]
    floor = float(torch.tensor(spec.amax_floor, dtype=torch.float32))   # fl32(floor)
    launch(_write_kv_fp8_kernel, (tokens, heads),
           k, v, k_cache, v_cache, k_scale, v_scale, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
           k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *scale_strides, k_cache.shape[1], capacity,
           floor, spec.fmax(spec.kv_format), HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim),
           PER_TOKEN_HEAD=per_token, MANT=mant, MIN_EXP=min_exp, OUT_E5M2=spec.kv_format == "e5m2", **LAUNCH)
