"""The fingerprint of ``hal.digest`` on the GPU: one read of the tensor's words, integer math in registers.

Reduction: each program sums its words' mixed values as two 16-bit halves per lane in int64, and the
host adds the programs' sums; integer addition is exact, so neither the grid nor the order changes
the value (``hal.digest``'s torch implementation is the specification; tests/test_digest.py checks the
two agree under Triton's interpreter, bench/digest_gpu.py on the GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hal import digest as spec
from hal.kernels.common import INTERPRET, LAUNCH, cdiv
from hal.kernels.launcher import launch

BLOCK = 1024 if not INTERPRET else 64
ITERS = 16 if not INTERPRET else 2       # words per program: BLOCK * ITERS


@triton.jit
def _fmix32(x):
    """murmur3's 32-bit finaliser on uint32 (products wrap mod 2**32)."""
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    return x ^ (x >> 16)


@triton.jit
def _lane(word, lo, hi, seed: tl.constexpr):
    key = _fmix32(lo * 0x9E3779B1 + hi * 0x85EBCA77 + seed)
    return _fmix32(word ^ key)


@triton.jit
def _lane_sums_kernel(w_ptr, out_ptr, n, SEED0: tl.constexpr, SEED1: tl.constexpr, BLOCK: tl.constexpr,
                      ITERS: tl.constexpr):
    pid = tl.program_id(0)
    hi0 = tl.zeros((BLOCK,), dtype=tl.int64)
    lo0 = tl.zeros((BLOCK,), dtype=tl.int64)
    hi1 = tl.zeros((BLOCK,), dtype=tl.int64)
    lo1 = tl.zeros((BLOCK,), dtype=tl.int64)
    for it in range(ITERS):
        offs = (pid.to(tl.int64) * ITERS + it) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        word = tl.load(w_ptr + offs, mask=mask, other=0).to(tl.uint32, bitcast=True)
        pos_lo = (offs & 0xFFFFFFFF).to(tl.uint32)
        pos_hi = (offs >> 32).to(tl.uint32)
        h0 = tl.where(mask, _lane(word, pos_lo, pos_hi, SEED0), 0)
        h1 = tl.where(mask, _lane(word, pos_lo, pos_hi, SEED1), 0)
        hi0 += (h0 >> 16).to(tl.int64)
        lo0 += (h0 & 0xFFFF).to(tl.int64)
        hi1 += (h1 >> 16).to(tl.int64)
        lo1 += (h1 & 0xFFFF).to(tl.int64)
    tl.store(out_ptr + pid * 4 + 0, tl.sum(hi0, axis=0))
    tl.store(out_ptr + pid * 4 + 1, tl.sum(lo0, axis=0))
    tl.store(out_ptr + pid * 4 + 2, tl.sum(hi1, axis=0))
    tl.store(out_ptr + pid * 4 + 3, tl.sum(lo1, axis=0))


def lane_sums(w: torch.Tensor) -> torch.Tensor:
    """``hal.digest``'s four sums (lane 0's high and low 16-bit halves, then lane 1's) of the int32 words
    ``w`` (1-D, contiguous), as a (4,) int64 tensor on ``w``'s device (no host synchronisation)."""
    n = w.numel()
    if n == 0:
        return torch.zeros(4, dtype=torch.int64, device=w.device)
    programs = cdiv(n, BLOCK * ITERS)
    partial = torch.empty((programs, 4), dtype=torch.int64, device=w.device)
    launch(_lane_sums_kernel, (programs,),
           w, partial, n, SEED0=spec.SEEDS[0], SEED1=spec.SEEDS[1], BLOCK=BLOCK, ITERS=ITERS, **LAUNCH)
    return partial.sum(0)       # < n * 2**16 each: exact in int64
