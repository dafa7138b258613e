"""Position-independent numerics for the reference backend.

Why this module exists: on a CPU, neither BLAS nor torch's own kernels give a row the same bits
wherever it sits. A GEMM's micro-kernel rounds rows differently by their position in its tile;
a reduction is split across threads when there are few rows; a unary op such as ``torch.exp``
runs a SIMD polynomial on the body of a tensor and the C library on its tail. The reference
backend therefore builds every bit-deciding step out of operations whose result is defined
element by element:

* **Correctly rounded sums.** Every reduction chunk (a K chunk of a GEMM, a head-dim dot, one
  KV chunk's row sum or P@V, one row block) is the *correctly rounded* fp32 value of the exact
  sum. That value does not depend on any order, so no layout, batch or thread count can change
  it. It is computed fast: bf16/fp32 products are exact in fp64, BLAS sums them in fp64 in some
  order, and a rigorous error bound shows whether that approximation already decides the fp32
  rounding (it does for all but ~1e-5 of the elements). The undecided few are summed exactly with
  ``math.fsum`` (correctly rounded fp64) plus a residual sign for the one ambiguous case, an fp32
  rounding midpoint.
* **exp, exp2, log from IEEE add/mul/div only**, evaluated in fp64 and rounded once to fp32,
  so the same input gives the same bits at any position of any tensor.
* ``sqrt`` and ``/`` in fp64, rounded once to fp32 (correctly rounded fp32 results): torch's fp32
  CPU sqrt is not correctly rounded on every host (1 ulp off for ~20% of inputs on one AMD EPYC).

Zero sums are returned as +0, because the sign of an exact-zero sum of mixed-sign terms depends
on how an implementation starts its accumulator.
"""

from __future__ import annotations

import math

import torch

_U = 2.0 ** -52  # twice the fp64 unit roundoff: a safety factor of 2 on every bound below
LN2 = math.log(2.0)
LOG2E = 1.0 / LN2


# ---------------------------------------------------------------------------------------------
# Correctly rounded fp32 sums.
# ---------------------------------------------------------------------------------------------

def _exact_sums_to_fp32(terms: torch.Tensor) -> torch.Tensor:
    """Correctly rounded (nearest-even) fp32 sums of the rows of ``terms`` (n, K), fp64, exact values."""
    rows = terms.tolist()
    sums = [math.fsum(r) for r in rows]  # fsum: the correctly rounded fp64 value of the exact sum
    s64 = torch.tensor(sums, dtype=torch.float64)
    f32 = s64.float()
    # s64 = RN64(exact). RN32(s64) == RN32(exact) unless s64 sits exactly on an fp32 rounding
    # midpoint; then the sign of the residual exact - s64 decides the direction.
    toward = torch.where(f32.double() < s64, torch.tensor(float("inf")), torch.tensor(float("-inf")))
    other = torch.nextafter(f32, toward.float())
    midpoint = (f32.double() + other.double()) * 0.5 == s64
    midpoint &= f32.double() != s64
    for i in midpoint.nonzero().flatten().tolist():
        residual = math.fsum(rows[i] + [-sums[i]])
        if residual != 0.0:
            nudged = math.nextafter(sums[i], math.copysign(math.inf, residual))
            f32[i] = torch.tensor(nudged, dtype=torch.float64).float()
    return f32


def _decide(approx: torch.Tensor, bound: torch.Tensor, exact_in_fp64: torch.Tensor, exact_terms) -> torch.Tensor:
    """Round fp64 approximations to fp32 where they are exact or the error bound decides the
    rounding; sum exactly elsewhere.

    ``exact_in_fp64`` marks sums that every summation order computes exactly (all partial sums are
    multiples of a common quantum and stay below 2**53 quanta): for bf16 data that is most of them,
    and those are exactly the sums that often land on an fp32 rounding midpoint.
    ``exact_terms(index)`` returns, for a (n, ndim) index of undecided elements, their (n, K)
    terms as exact fp64 values.
    """
    lo = (approx - bound).float()
    hi = (approx + bound).float()
    result = approx.float()
    # Non-finite sums (inf/nan inputs) are order-independent already.
    undecided = (lo != hi) & ~exact_in_fp64 & torch.isfinite(approx)
    if bool(undecided.any()):
        index = undecided.nonzero()
        result[undecided] = _exact_sums_to_fp32(exact_terms(index)).to(result.device)
    return result + 0.0  # -0 -> +0


def _min_exponent(x64: torch.Tensor, dim: int) -> torch.Tensor:
    """Smallest binary exponent (frexp convention) of the non-zero elements along ``dim``; 2000 if none."""
    exponent = torch.frexp(x64)[1].to(torch.int64)
    return torch.where(x64 == 0, torch.full_like(exponent, 2000), exponent).amin(dim)


def _below_2_53_quanta(magnitude: torch.Tensor, quantum_exponent: torch.Tensor) -> torch.Tensor:
    """magnitude < 2**(53 + quantum_exponent): then every partial sum is exact in fp64."""
    limit = _pow2_int((quantum_exponent + 53).clamp(-1022, 1023).double())
    return magnitude < limit


# Significant bits of a value of each input dtype: its quantum is >= 2**(frexp exponent - bits).
MANTISSA_BITS = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}


def sum_fp32(terms: torch.Tensor, term_bits: int = 53) -> torch.Tensor:
    """Correctly rounded fp32 sum over the last dim of ``terms``.

    Values must be exact in fp64. ``term_bits`` is an upper bound on the significant bits of every
    term (8 for bf16 values, 16 for products of two bf16, 24 for fp32 values); it only speeds up
    the common case and must never be understated.
    """
    t = terms.double()
    n = t.shape[-1]
    approx = t.sum(-1)
    magnitude = t.abs().sum(-1)
    bound = _U * ((n + 1) * magnitude + 2 * approx.abs())
    exact = _below_2_53_quanta(magnitude * (1.0 + (n + 4) * _U), _min_exponent(t, -1) - term_bits)
    flat = t.reshape(-1, n)

    def exact_terms(index: torch.Tensor) -> torch.Tensor:
        lin = torch.zeros(index.shape[0], dtype=torch.long, device=index.device)
        for d, size in enumerate(approx.shape):
            lin = lin * size + index[:, d]
        return flat[lin].cpu()

    return _decide(approx, bound, exact, exact_terms)


def blocked_sum_fp32(x: torch.Tensor, block: int, term_bits: int = 53) -> torch.Tensor:
    """Sum over the last dim: correctly rounded fp32 sums of blocks of ``block`` elements at absolute
    offsets 0, block, ..., then the block sums added in ascending order in fp32."""
    n = x.shape[-1]
    total = None
    for start in range(0, max(n, 1), block):
        part = sum_fp32(x[..., start:start + block], term_bits)
        total = part if total is None else total + part
    return total


def matmul_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 dot products: ``a`` (..., M, K) @ ``b`` (..., K, N), batch dims broadcast.

    Inputs must be bf16, fp16 or fp32 so that every product is exact in fp64. The bound on the
    fp64 BLAS error uses Cauchy-Schwarz (sum |a_k b_k| <= |a| |b|), which costs O(MN) instead of
    a second GEMM and is within ~1.6x of the true sum of magnitudes for typical data.
    """
    if a.dtype not in (torch.bfloat16, torch.float16, torch.float32) or b.dtype != a.dtype:
        raise TypeError(f"matmul_fp32 takes two bf16/fp16/fp32 tensors of one dtype, got {a.dtype} and {b.dtype}")
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a64 = a.double().expand(*batch, *a.shape[-2:]).reshape(-1, *a.shape[-2:])   # (B, M, K)
    b64 = b.double().expand(*batch, *b.shape[-2:]).reshape(-1, *b.shape[-2:])   # (B, K, N)
    k = a64.shape[-1]
    approx = torch.bmm(a64, b64)
    norm_a = a64.square().sum(-1).sqrt()          # (B, M)
    norm_b = b64.square().sum(-2).sqrt()          # (B, N)
    magnitude = (norm_a.unsqueeze(-1) * norm_b.unsqueeze(-2)) * (1.0 + (k + 4) * _U)
    bound = _U * ((k + 1) * magnitude + 2 * approx.abs())
    bits = MANTISSA_BITS[a.dtype]
    quantum = (_min_exponent(a64, -1) - bits).unsqueeze(-1) + (_min_exponent(b64, -2) - bits).unsqueeze(-2)
    exact = _below_2_53_quanta(magnitude, quantum)

    def exact_terms(index: torch.Tensor) -> torch.Tensor:
        bi, i, j = index.unbind(-1)
        return (a64[bi, i, :] * b64[bi, :, j]).cpu()

    out = _decide(approx, bound, exact, exact_terms)
    return out.reshape(*batch, *out.shape[-2:])


# ---------------------------------------------------------------------------------------------
# exp2 / exp / log from add, mul, div: the same bits at every position.
# ---------------------------------------------------------------------------------------------

# Taylor coefficients of e^y, highest first; |y| <= ln2/2 so 14 terms reach fp64 precision.
_EXP_COEFFS = [1.0 / math.factorial(i) for i in range(14, -1, -1)]


def _pow2_int(n: torch.Tensor) -> torch.Tensor:
    """2**n for integer-valued fp64 n in [-1022, 1023], built from the exponent bits (exact)."""
    return ((n.to(torch.int64) + 1023) << 52).view(torch.float64)


def _exp2_f64(t: torch.Tensor) -> torch.Tensor:
    """2**t in fp64 to ~2 ulp, for t in fp64. Only the fp32-relevant range matters: clamp to +-200."""
    nan = torch.isnan(t)
    t = t.clamp(-200.0, 200.0)
    n = torch.round(t)
    y = (t - n) * LN2                              # t - n is exact; |y| <= ln2 / 2
    p = torch.full_like(y, _EXP_COEFFS[0])
    for c in _EXP_COEFFS[1:]:
        p = p * y + c                              # two separate IEEE ops: no FMA contraction
    # 2**n in two halves so that n = -200..200 never leaves the normal fp64 range.
    half = torch.trunc(n * 0.5)
    out = p * _pow2_int(half) * _pow2_int(n - half)
    return torch.where(nan, t, out)


def exp2_fp32(x: torch.Tensor) -> torch.Tensor:
    """exp2 of an fp32 tensor: fp64 evaluation, one rounding to fp32. exp2(-inf) = +0, exp2(0) = 1."""
    return _exp2_f64(x.double()).float()


def exp_fp32(x: torch.Tensor) -> torch.Tensor:
    """e**x of an fp32 tensor via exp2(x * log2 e) in fp64, one rounding to fp32."""
    return _exp2_f64(x.double() * LOG2E).float()


_LOG_TERMS = 13  # atanh series terms: |t| <= 0.1716, t**26 / 27 < 1e-21


def log_fp32(x: torch.Tensor) -> torch.Tensor:
    """Natural log of an fp32 tensor: fp64 evaluation from add/mul/div, one rounding to fp32."""
    x64 = x.double()
    mantissa, exponent = torch.frexp(x64)         # x = m * 2**e, m in [0.5, 1): exact
    small = mantissa < math.sqrt(0.5)
    mantissa = torch.where(small, mantissa * 2.0, mantissa)
    exponent = (exponent - small.to(exponent.dtype)).double()
    t = (mantissa - 1.0) / (mantissa + 1.0)       # log m = 2 atanh(t)
    t2 = t * t
    s = torch.full_like(t, 1.0 / (2 * _LOG_TERMS - 1))
    for k in range(_LOG_TERMS - 2, -1, -1):
        s = s * t2 + 1.0 / (2 * k + 1)
    out = exponent * LN2 + (2.0 * t) * s
    out = torch.where(x64 == 0, torch.tensor(float("-inf"), dtype=torch.float64), out)
    out = torch.where(torch.isinf(x64) & (x64 > 0), x64, out)
    out = torch.where((x64 < 0) | torch.isnan(x64), torch.tensor(float("nan"), dtype=torch.float64), out)
    return out.float()
