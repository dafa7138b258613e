"""Helpers shared by the Triton kernels (every vendor that runs them).

Two things every kernel must get right, whatever its tiling:

* **Rounding to bf16 is round-to-nearest-even**, done by ``round_to_bf16`` on the fp32 bit pattern.
  On the GPU this gives the same bits as Triton's own ``.to(tl.bfloat16)``; under Triton's CPU
  interpreter (which truncates) it keeps the contract's rounding, so interpreter runs in CI compute
  the same function.
* **No FMA contraction.** The contract writes ``fl(fl(a * b) + c)``; every launch passes
  ``enable_fp_fusion=False`` (``LAUNCH``) so the compiler cannot fuse a multiply and an add into
  one rounding. ``tl.dot`` accumulates inside the MMA and is unaffected.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Launch options for every kernel: see the module docstring.
LAUNCH = {"enable_fp_fusion": False}


@triton.jit
def round_to_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), returned as fp32. NaN stays NaN."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(x != x, x, rounded.to(tl.float32, bitcast=True))


@triton.jit
def to_activation(x, IS_BF16: tl.constexpr):
    """Round an fp32 tensor once to the activation dtype (bf16 or fp32), for a store."""
    if IS_BF16:
        y = round_to_bf16(x).to(tl.bfloat16)
    else:
        y = x
    return y


@triton.jit
def silu_mul_f32(g, u):
    """[silu_mul] on fp32 values of the rounded gate and up: fl32(fl32(g / fl32(1 + exp(-g))) * u), before the
    one rounding to the activation dtype. The one copy of the formula: the row kernel and the grouped
    expert GEMM's gated epilogue both call it, so both give the same bits."""
    return tl.div_rn(g, 1.0 + tl.exp(-g)) * u


@triton.jit
def zero_scalar():
    """An fp32 scalar tensor +0, the start of every ascending sum (a loop-carried value needs a tensor)."""
    return tl.sum(tl.zeros((1,), dtype=tl.float32), axis=0)


# Host-side integer helpers in plain Python. Triton's own ``triton.cdiv`` / ``triton.next_power_of_2`` are
# constexpr functions (3.9: each call unwraps its arguments through Triton's constexpr machinery, ~3-7 us
# on a slow host), and a GEMM launch computes several: they were a visible share of the host cost per op.
def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints, b > 0."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    n = int(n)
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
