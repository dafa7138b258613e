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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hal.errors import UnsupportedError
from hal.kernels.common import LAUNCH, next_power_of_2


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kp, stride_kr, stride_kh_cache, stride_vp, stride_vr, stride_vh_cache, page_size,
                     capacity, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    # slot -1: nothing is stored, nor past the cache; a (BLOCK_D,) mask throughout (the interpreter turns a
    # scalar bool broadcast into the vector mask into int32)
    slot_row = slot + tl.zeros([BLOCK_D], dtype=tl.int64)
    valid = (slot_row >= 0) & (slot_row < capacity)
    keep = (offs < HEAD_DIM) & valid
    page = tl.where(valid, slot_row, 0) // page_size
    row = tl.where(valid, slot_row, 0) % page_size
    t = token.to(tl.int64)
    k = tl.load(k_ptr + t * stride_kt + head * stride_kh + offs, mask=keep)
    v = tl.load(v_ptr + t * stride_vt + head * stride_vh + offs, mask=keep)
    tl.store(k_cache_ptr + page * stride_kp + row * stride_kr + head * stride_kh_cache + offs, k, mask=keep)
    tl.store(v_cache_ptr + page * stride_vp + row * stride_vr + head * stride_vh_cache + offs, v, mask=keep)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v (T, Hkv, D) into caches (pages, P, Hkv, D) at flat slots ``page * P + row``; slot -1 skips.
    The caches may be strided views (vLLM keeps K and V side by side); head_dim must be contiguous."""
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise UnsupportedError(f"write_kv: {name}'s head_dim must be contiguous (stride 1); got strides "
                                   f"{tuple(t.stride())}")
    if k_cache.shape[2:] != k.shape[1:]:
        raise UnsupportedError(f"write_kv: rows (T, Hkv, D) = {tuple(k.shape)} do not fit caches of shape "
                               f"{tuple(k_cache.shape)} (pages, P, Hkv, D)")
    tokens, heads, head_dim = k.shape
    capacity = k_cache.shape[0] * k_cache.shape[1]
    if slot_mapping.device.type == "cpu":    # reading values is free here; on a device it would synchronise
        high = int(slot_mapping.max())
        if high >= capacity:
            raise UnsupportedError(f"write_kv: slot {high} is outside the caches' {capacity} slots")
    slots = slot_mapping if slot_mapping.dtype in (torch.int32, torch.int64) else slot_mapping.long()
    _write_kv_kernel[(tokens, heads)](
        k, v, k_cache, v_cache, slots.contiguous(), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), k_cache.shape[1], capacity, HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim), **LAUNCH)
