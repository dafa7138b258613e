"""Block-FP8 linear ``y = quant(x) @ dequant(w).T (+ bias)``: activation quantisation and the GEMM.

Reduction structure (contract [fp8], read from ``activation_group``; see hal/fp8.py for the rules):
  * quantisation: a program takes a few rows' groups of G = 128 along K, each reduced on its own axis;
    amax = tl.max |x| (exact in any order); scale = div_rn(max(amax, floor), FMAX); q = nearest-even fp8 of clamp(div_rn(x, scale)).
    The rounding to the fp8 grid is done here on the fp32 bits (``round_to_fp8``), so the cast that
    follows is exact: Triton's interpreter rounds fp32 -> fp8 half-up and flushes subnormals, the
    GPU's cvt.rn.satfinite rounds to nearest even; the explicit rounding gives both the contract's.
  * GEMM: K is cut into blocks of G at absolute offsets 0, G, 2G, ... (= the activation groups);
    each block's partial is one ``tl.dot`` of (BLOCK_M, G) and (G, BLOCK_N) fp8 tiles accumulated
    from zero in fp32 (the order inside the block is the MMA's: implementation-defined, and it must
    be the same for every tile shape: re-prove on the GPU); then
    acc = fl32(acc + fl32(partial * fl32(a_scale * w_scale_inv))) in ascending block order from +0
    (``LAUNCH`` disables FMA contraction); the bias in fp32; one rounding.

Tiling (BLOCK_M, BLOCK_N, warps, stages), descriptor (TMA) or pointer loads, one or two K blocks per
loop step (PAIR) and a tile's columns as one MMA or two (HALVES) are free: every launch walks the same
blocks, gives each column its own block partials, and adds them in the same order.
``candidates`` lists them; the tuner (hal/kernels/tuning.py) picks by timing. BLOCK_K is G, so one
``tl.dot`` is one K block: splitting a block into two dots would change the order inside it, which the
contract leaves to the backend but which must then be fixed.
Under the interpreter the fp8 tiles are upcast to fp64 before the dot, and the partial rounded once to
fp32. That is exact, not an approximation: an e4m3 product is a multiple of 2**-18 below 2**18, so a
block's sum of 128 of them is a multiple of 2**-18 below 2**25, which fp64 holds exactly in every
summation order; its one rounding is the correctly rounded fp32 partial, the reference's choice. So
the interpreter's bits equal the reference's (tests/test_cuda_fp8.py), while numpy's fp32 dot would
differ from it by an ulp. The GPU's fp8 MMA does not round that way (Hopper's fp8 accumulation keeps
fewer bits than fp32): there only the invariances hold, not equality with the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hal.contract import Fp8
from hal.fp8 import FORMATS
from hal.kernels.common import INTERPRET, LAUNCH, cdiv, to_activation
from hal.kernels.launcher import launch
from hal.kernels.policy import LaunchPolicy

# Mantissa bits and the smallest normal exponent of each format (its subnormal quantum is
# 2**(MIN_EXP - MANT)).
_FORMAT_BITS = {"e4m3": (3, -6), "e5m2": (2, -14)}


@triton.jit
def round_to_fp8(y, MANT: tl.constexpr, MIN_EXP: tl.constexpr):
    """fp32 y with |y| <= FMAX -> the nearest value of the fp8 grid (ties to even), as fp32, sign kept.

    Normals: round the fp32 mantissa to MANT bits on the bit pattern (a carry moves the exponent up).
    Subnormals (|y| < 2**MIN_EXP): (a + C) - C with C = 2**(MIN_EXP - MANT + 23), whose fp32 ulp is the
    subnormal quantum, rounds a to a multiple of it, nearest even; the subtraction is exact."""
    bits = y.to(tl.uint32, bitcast=True)
    sign = bits & 0x80000000
    mag_bits = bits & 0x7FFFFFFF
    drop: tl.constexpr = 23 - MANT
    half: tl.constexpr = (1 << (drop - 1)) - 1
    keep: tl.constexpr = (0xFFFFFFFF >> drop) << drop
    normal = (mag_bits + half + ((mag_bits >> drop) & 1)) & keep
    a = mag_bits.to(tl.float32, bitcast=True)
    c: tl.constexpr = 2.0 ** (MIN_EXP - MANT + 23)
    sub = ((a + c) - c).to(tl.uint32, bitcast=True)
    out = tl.where(a < 2.0 ** MIN_EXP, sub, normal)
    return (out | sign).to(tl.float32, bitcast=True)


@triton.jit
def _quant_kernel(x_ptr, q_ptr, s_ptr, M, NG, stride_xm, stride_qm, stride_sm, floor, fmax, GROUP: tl.constexpr,
                  ROWS: tl.constexpr, GROUPS: tl.constexpr, MANT: tl.constexpr, MIN_EXP: tl.constexpr,
                  OUT_E5M2: tl.constexpr):
    """One program per ROWS x GROUPS groups (of NG groups a row): each group's scale from that group alone
    (a max along the group's own axis), then its fp8 values. How many groups a program takes does not
    change a bit: the max is exact in any order and the rest is elementwise."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    ok = (rows < M)[:, None] & (groups < NG)[None, :]                          # (ROWS, GROUPS)
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]             # (GROUPS, GROUP)
    r64 = rows.to(tl.int64)[:, None, None]
    x = tl.load(x_ptr + r64 * stride_xm + cols[None, :, :], mask=ok[:, :, None], other=0.0)
    x = x.to(tl.float32)                                                       # bf16 -> fp32 is exact
    amax = tl.maximum(tl.max(tl.abs(x), axis=2), floor)
    scale = tl.div_rn(amax, fmax)
    y = tl.div_rn(x, scale[:, :, None])
    y = tl.minimum(tl.maximum(y, -fmax), fmax)
    y = round_to_fp8(y, MANT, MIN_EXP)
    if OUT_E5M2:
        q = y.to(tl.float8e5)
    else:
        q = y.to(tl.float8e4nv)
    tl.store(q_ptr + r64 * stride_qm + cols[None, :, :], q, mask=ok[:, :, None])
    tl.store(s_ptr + rows.to(tl.int64)[:, None] * stride_sm + groups[None, :], scale, mask=ok)


@triton.jit
def _block_partial(xq, wq, offs_m, offs_n, m_ok, n_ok, pid_m, n_first, kb, stride_xm, stride_xk, stride_wn,
                   stride_wk, GROUP: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr):
    """K block ``kb``'s fp32 partial product of the (BLOCK_M, len(offs_n)) tile whose columns start at
    ``n_first``, accumulated from zero."""
    if TMA:   # descriptors of (BLOCK_M, GROUP) and (columns, GROUP) blocks; rows past M or N read as zeros
        a = xq.load([pid_m * BLOCK_M, kb * GROUP])
        b = wq.load([n_first, kb * GROUP]).T
    else:
        ks = kb * GROUP + tl.arange(0, GROUP)
        a = tl.load(xq + offs_m[:, None] * stride_xm + ks[None, :] * stride_xk, mask=m_ok[:, None], other=0.0)
        b = tl.load(wq + offs_n[None, :] * stride_wn + ks[:, None] * stride_wk, mask=n_ok[None, :], other=0.0)
    if UPCAST:  # interpreter: an fp64 dot, exact in any order (module docstring), rounded once
        a64 = a.to(tl.float32).to(tl.float64)   # fp8 -> fp64 in two exact casts (the interpreter
        b64 = b.to(tl.float32).to(tl.float64)   # has no direct one)
        return tl.dot(a64, b64, input_precision="ieee", out_dtype=tl.float64).to(tl.float32)
    return tl.dot(a, b)


@triton.jit
def _block_scale(xs_ptr, ws_ptr, offs_m, offs_n, m_ok, n_ok, n_first, kb, stride_xsm, stride_xsk, stride_wsn,
                 stride_wsk, GROUP: tl.constexpr, BLOCK_N: tl.constexpr):
    """fl32(a_scale * w_scale_inv) of K block ``kb`` for every (row, column) of the (BLOCK_M, BLOCK_N) tile
    whose columns start at ``n_first``."""
    a_s = tl.load(xs_ptr + offs_m * stride_xsm + kb * stride_xsk, mask=m_ok, other=0.0)
    # [fp8].weight_block = activation_group: column n's scale row is n // GROUP
    if GROUP % BLOCK_N == 0:
        # the tile lies inside one weight block: one scale, so one product per row, not per element (the
        # same fl32(a_scale * w_scale_inv) each column would get)
        w_s = tl.load(ws_ptr + (n_first // GROUP) * stride_wsn + kb * stride_wsk)
        return tl.broadcast_to((a_s * w_s)[:, None], (a_s.shape[0], BLOCK_N))
    w_s = tl.load(ws_ptr + (offs_n // GROUP) * stride_wsn + kb * stride_wsk, mask=n_ok, other=0.0)
    return a_s[:, None] * w_s[None, :]


@triton.jit
def _scaled_add(acc, partial, xs_ptr, ws_ptr, offs_m, offs_n, m_ok, n_ok, n_first, kb, stride_xsm, stride_xsk,
                stride_wsn, stride_wsk, GROUP: tl.constexpr, BLOCK_N: tl.constexpr):
    """acc = fl32(acc + fl32(partial * fl32(a_scale * w_scale_inv))): one K block's step."""
    return acc + partial * _block_scale(xs_ptr, ws_ptr, offs_m, offs_n, m_ok, n_ok, n_first, kb, stride_xsm,
                                        stride_xsk, stride_wsn, stride_wsk, GROUP, BLOCK_N)


@triton.jit
def _store_columns(acc, bias_ptr, out_ptr, offs_m, offs_n, m_ok, n_ok, stride_om, stride_on, HAS_BIAS: tl.constexpr,
                   OUT_BF16: tl.constexpr):
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on,
             to_activation(acc, OUT_BF16), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(xq, xs_ptr, wq, ws_ptr, bias_ptr, out_ptr, M, N, K,
                     stride_xm, stride_xk, stride_xsm, stride_xsk, stride_wn, stride_wk, stride_wsn, stride_wsk,
                     stride_om, stride_on, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, OUT_BF16: tl.constexpr,
                     UPCAST: tl.constexpr, TMA: tl.constexpr, PAIR: tl.constexpr, HALVES: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """xq, wq: pointers, or (TMA) tensor descriptors (wq's blocks are one column half wide with HALVES).
    PAIR: two K blocks per step, both partials computed before either is added, so one block's MMAs can
    run while the other's scaled add does; the adds keep the ascending order, so the bits are PAIR=0's.
    HALVES (not with PAIR): the tile's columns as two halves, each its own MMA, partial and accumulator
    (one A tile for both; two half-width partials hold half the registers of one full-width one, which is
    what lets a 256-column tile keep its per-block partial beside its accumulator); a column's block
    partial is its own dot either way, so the bits are the same."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % rows_in_group
    pid_n = (pid % (GROUP_M * tiles_n)) // rows_in_group
    STEP_N: tl.constexpr = BLOCK_N // 2 if HALVES else BLOCK_N     # the columns of one MMA
    lo = pid_n * BLOCK_N                                             # first column of each half
    hi = lo + STEP_N
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = lo + tl.arange(0, STEP_N)
    offs_hi = hi + tl.arange(0, STEP_N)                              # HALVES only
    m_ok = offs_m < M
    n_ok = offs_n < N
    hi_ok = offs_hi < N
    blocks = K // GROUP
    acc = tl.zeros((BLOCK_M, STEP_N), dtype=tl.float32)
    acc_hi = tl.zeros((BLOCK_M, STEP_N), dtype=tl.float32)
    # ascending K blocks from +0: acc = fl32(acc + fl32(partial * fl32(a_scale * w_scale_inv)))
    for kb in range(0, blocks - PAIR, 1 + PAIR):
        first = _block_partial(xq, wq, offs_m, offs_n, m_ok, n_ok, pid_m, lo, kb, stride_xm, stride_xk,
                               stride_wn, stride_wk, GROUP, UPCAST, TMA, BLOCK_M)
        if HALVES:
            first_hi = _block_partial(xq, wq, offs_m, offs_hi, m_ok, hi_ok, pid_m, hi, kb, stride_xm, stride_xk,
                                      stride_wn, stride_wk, GROUP, UPCAST, TMA, BLOCK_M)
        if PAIR:
            second = _block_partial(xq, wq, offs_m, offs_n, m_ok, n_ok, pid_m, lo, kb + 1, stride_xm,
                                    stride_xk, stride_wn, stride_wk, GROUP, UPCAST, TMA, BLOCK_M)
        acc = _scaled_add(acc, first, xs_ptr, ws_ptr, offs_m, offs_n, m_ok, n_ok, lo, kb, stride_xsm, stride_xsk,
                          stride_wsn, stride_wsk, GROUP, STEP_N)
        if HALVES:
            acc_hi = _scaled_add(acc_hi, first_hi, xs_ptr, ws_ptr, offs_m, offs_hi, m_ok, hi_ok, hi, kb, stride_xsm,
                                 stride_xsk, stride_wsn, stride_wsk, GROUP, STEP_N)
        if PAIR:
            acc = _scaled_add(acc, second, xs_ptr, ws_ptr, offs_m, offs_n, m_ok, n_ok, lo, kb + 1, stride_xsm,
                              stride_xsk, stride_wsn, stride_wsk, GROUP, STEP_N)
    if PAIR:
        if blocks % 2 == 1:   # the odd last block
            last = _block_partial(xq, wq, offs_m, offs_n, m_ok, n_ok, pid_m, lo, blocks - 1, stride_xm,
                                  stride_xk, stride_wn, stride_wk, GROUP, UPCAST, TMA, BLOCK_M)
            acc = _scaled_add(acc, last, xs_ptr, ws_ptr, offs_m, offs_n, m_ok, n_ok, lo, blocks - 1, stride_xsm,
                              stride_xsk, stride_wsn, stride_wsk, GROUP, STEP_N)
    _store_columns(acc, bias_ptr, out_ptr, offs_m, offs_n, m_ok, n_ok, stride_om, stride_on, HAS_BIAS, OUT_BF16)
    if HALVES:
        _store_columns(acc_hi, bias_ptr, out_ptr, offs_m, offs_hi, m_ok, hi_ok, stride_om, stride_on, HAS_BIAS,
                       OUT_BF16)


def quantise(x: torch.Tensor, group: int, fmt: str, spec: Fp8) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) bf16/fp32, K a multiple of ``group`` -> (q (M, K) fp8, fp32 scales (M, K / group))."""
    m, k = x.shape
    q = torch.empty((m, k), device=x.device, dtype=FORMATS[fmt])
    s = torch.empty((m, k // group), device=x.device, dtype=torch.float32)
    if m == 0 or k == 0:
        return q, s
    mant, min_exp = _FORMAT_BITS[fmt]
    floor = float(torch.tensor(spec.amax_floor, dtype=torch.float32))   # fl32(floor), passed as an fp32 scalar
    groups_per_row = k // group
    rows, groups = _quant_tile(m, groups_per_row)
    launch(_quant_kernel, (cdiv(m, rows), cdiv(groups_per_row, groups)),
           x, q, s, m, groups_per_row, x.stride(0), q.stride(0), s.stride(0), floor, spec.fmax(fmt), GROUP=group,
           ROWS=rows, GROUPS=groups, MANT=mant, MIN_EXP=min_exp, OUT_E5M2=fmt == "e5m2",
           num_warps=1 if INTERPRET else max(1, min(4, rows * groups // 4)), **LAUNCH)
    return q, s


_QUANT_PROGRAMS = 264   # two per H200 SM: below this a quantisation is latency-bound, not bandwidth-bound


def _quant_tile(m: int, groups_per_row: int) -> tuple[int, int]:
    """(rows, groups) of one quantisation program: up to 32 groups (4k elements), fewer where that would
    leave the GPU with few programs (one token's row: one group each, as at M = 1 before session 18);
    one group a program at large M left the GPU mostly idle (150 us for 8192 x 4096 on the H200, 38 us
    with 32). The interpreter takes two rows of two groups so that both edges are masked in CI."""
    if INTERPRET:
        return 2, 2
    groups = min(16, triton.next_power_of_2(groups_per_row))
    rows = max(1, 32 // groups)
    while rows > 1 and cdiv(m, rows) * cdiv(groups_per_row, groups) < _QUANT_PROGRAMS:
        rows //= 2
    while groups > 1 and cdiv(m, rows) * cdiv(groups_per_row, groups) < _QUANT_PROGRAMS:
        groups //= 2
    return rows, groups


def quantise_activations(x: torch.Tensor, spec: Fp8) -> tuple[torch.Tensor, torch.Tensor]:
    if x.stride(-1) != 1:
        x = x.contiguous()
    return quantise(x, spec.activation_group, spec.activation_format, spec)


def _config(m: int, n: int) -> dict:
    """The kernel's own launch per shape: free (it does not change the bits); a tuning cache of the device
    (``hal tune``, hal/kernels/tuning.py) replaces it per shape class. These are what the H200 tuning chose
    in 12 of 12 DeepSeek-V3-like shapes (bench/results/h200-2026-12-03-session14: 64 x 32 tiles, two K
    blocks a step at M <= 64; 64 x 128 by descriptor, 3-4 stages, above), 1.1-1.8x faster there than
    the table before. Since session 17 (HALVES, bench/results/h200-2026-12-04-session17): 128 x 256 tiles
    as two 128-column halves by descriptor where they still give at least one program per SM and N >= 4096
    (the tuner's pick at M = 1024 and 8192 for N = 4096 and 7168: 1.07-1.26x the 64 x 128 tiles; at N = 2112
    it kept 128 x 64 and 128 x 128 tiles, within 1-9% of 64 x 128). Hopper's FP8 wgmma needs BLOCK_M >= 64;
    the interpreter takes small tiles so that N and M edges are crossed."""
    if INTERPRET:
        return dict(BLOCK_M=16, BLOCK_N=64, GROUP_M=1, num_warps=4, num_stages=1, tma=False, pair=False, halves=False)
    if m <= 64:
        return dict(BLOCK_M=64, BLOCK_N=32, GROUP_M=1, num_warps=4, num_stages=4, tma=False, pair=True, halves=False)
    if n >= 4096 and cdiv(m, 128) * cdiv(n, 256) >= 128:
        return dict(BLOCK_M=128, BLOCK_N=256, GROUP_M=8, num_warps=8, num_stages=3, tma=True, pair=False, halves=True)
    return dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=8, num_warps=4, num_stages=3, tma=True, pair=False, halves=False)


# (BLOCK_M, BLOCK_N, num_warps, num_stages) worth timing on Hopper. A stage holds (BLOCK_M + BLOCK_N) x 128
# fp8 bytes (one K block of each operand). The first H200 tuning (bench/results/h200-2026-12-03-session14)
# picked one-warpgroup tiles with a few stages everywhere (two or three programs per SM hide each block's
# MMA wait behind another's), so that corner is sampled densely; 32-wide tiles give a weight-read-bound
# small M more programs than the 132 SMs.
_TILES = [(64, 32, 4, 4), (64, 32, 4, 6), (64, 64, 4, 3), (64, 64, 4, 4), (64, 64, 4, 6), (64, 128, 4, 2),
          (64, 128, 4, 3), (64, 128, 4, 4), (64, 128, 4, 6), (64, 256, 4, 3),
          (128, 64, 4, 3), (128, 64, 4, 4), (128, 128, 4, 3), (128, 128, 8, 3), (128, 128, 8, 4), (128, 256, 8, 3),
          (128, 256, 8, 4)]
_SHARED_BYTES = 200 * 1024   # of the H200's 227 KB per block, room left for the layout conversions
_PAIR_ACC_PER_THREAD = 64    # fp32 accumulator values per thread up to which PAIR's two extra tiles fit
_HALVES_MIN_N = 128          # HALVES (two half-width MMAs and partials) for tiles at least this wide, above 64 rows


# The Gluon kernels' launches (hal/kernels/fp8_gemm_sm90.py; BLOCK_M, BLOCK_N, warps, stages, K blocks a step,
# warp-specialised), offered above 64 rows on a Hopper GPU, where the operands allow descriptors. Blocks a step:
# as many as the registers hold without spilling (three at 128 columns and 4 stages, four at 64 columns); on an
# H100 three were 2-11 % faster than two at 128x128 (bench/results/h100-2026-12-06-fp8sm90-prefill/unroll/).
# The warp-specialised, persistent kernel (ws: a loader warp, a partition per math warpgroup) was 1.04-1.33x the
# Triton kernel's default launch at M >= 4096 there (bench/results/h100-2026-12-06-ws/); its 256-column tile (two
# weight blocks, one half at a time, so no overlap inside a warpgroup) reads a sixth less from L2 and was 2-3 %
# faster on 4096 x 4096, slower elsewhere: one more candidate.
_SM90_TILES = [(128, 128, 8, 3, 2, False), (128, 128, 8, 4, 3, False), (64, 128, 4, 4, 3, False),
               (64, 128, 4, 6, 2, False), (128, 64, 8, 4, 4, False), (128, 64, 8, 6, 4, False),
               (128, 128, 4, 4, 2, True), (128, 128, 4, 6, 2, True), (128, 128, 4, 4, 3, True),
               (128, 128, 4, 6, 3, True), (128, 256, 4, 4, 1, True)]
# On a Hopper GPU the kernel's own launch from this many rows on is the warp-specialised Gluon kernel (the same
# bits: bench/fp8_sm90_gpu.py checks them); below it, and where Gluon or descriptors are not available, the
# Triton kernel's ``_config``.
_WS_DEFAULT = dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=4, num_stages=4, tma=True, pair=False,
                   halves=False, sm90=True, unroll=2, ws=True)
_WS_DEFAULT_MIN_M = 1024


def candidates(m: int, n: int, k: int, group: int, tma_ok: bool, tiles=None, sm90: bool = False) -> list[dict]:
    """Every contract-preserving launch configuration worth timing for an (m, n, k) FP8 GEMM: the tiles
    of ``_TILES`` whose BLOCK_M is not above M (rounded up to a power of two, at least 64) and that fit
    in shared memory; each by pointer and, above 64 rows where the tensors allow it, by descriptor (two
    descriptors cost ~25 us of host time a call, more than they save of a small M's device time); with
    one or two K blocks per step (PAIR, where the registers allow it and K has two blocks). None of
    these choices changes a bit (tests/test_cuda_fp8.py under the interpreter, bench/fp8_gpu.py's tiles
    section on the GPU over this same list). ``sm90`` (the caller's device can run ``fp8_gemm_sm90``): the
    Gluon kernel's launches too, above 64 rows where descriptors apply (its bits are checked on the GPU only:
    it does not run under the interpreter)."""
    out = []
    for bm, bn, warps, stages in (_TILES if tiles is None else tiles):
        if bm > max(64, 1 << max(0, (m - 1).bit_length())) or (bm + bn) * group * stages > _SHARED_BYTES:
            continue
        pairs = (False, True) if bm * bn <= _PAIR_ACC_PER_THREAD * warps * 32 and k >= 2 * group else (False,)
        for tma in ((False, True) if tma_ok and m > 64 else (False,)):
            for pair in pairs:
                out.append(dict(BLOCK_M=bm, BLOCK_N=bn, GROUP_M=8 if m > 64 else 1, num_warps=warps,
                                num_stages=stages, tma=tma, pair=pair, halves=False))
            if bn >= _HALVES_MIN_N and m > 64:
                out.append(dict(BLOCK_M=bm, BLOCK_N=bn, GROUP_M=8, num_warps=warps, num_stages=stages, tma=tma,
                                pair=False, halves=True))
    if sm90 and tma_ok and m > 64:
        for bm, bn, warps, stages, unroll, ws in _SM90_TILES:
            in_blocks = group % bn == 0 or (ws and bn == 2 * group)   # a tile's halves each in one weight block
            if in_blocks and (bm + bn) * group * stages <= _SHARED_BYTES:
                out.append(dict(BLOCK_M=bm, BLOCK_N=bn, GROUP_M=8, num_warps=warps, num_stages=stages, tma=True,
                                pair=False, halves=False, sm90=True, unroll=unroll, ws=ws))
    return out


def tma_ok(t: torch.Tensor) -> bool:
    """A tensor descriptor needs a row-major matrix with a 16-byte aligned base and rows (never under the
    interpreter here: the kernels' interpreter runs take the pointer path)."""
    return (not INTERPRET and t.dim() == 2 and t.stride(1) == 1 and t.data_ptr() % 16 == 0
            and (t.stride(0) * t.element_size()) % 16 == 0)


def gemm(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale_inv: torch.Tensor,
         bias: torch.Tensor | None, out_dtype: torch.dtype, spec: Fp8, config: dict | None = None, *,
         policy: LaunchPolicy | None = None) -> torch.Tensor:
    """xq (M, K) fp8 with x_scale (M, K/G) @ wq (N, K).T fp8 with w_scale_inv (ceil(N/G), K/G) -> (M, N).
    The tiles are ``_config``'s, with the ``policy``'s (a tuning cache's choice) over them, and ``config``
    over both (tests, the tuner); with neither, from ``_WS_DEFAULT_MIN_M`` rows on a Hopper GPU, the
    warp-specialised Gluon kernel's ``_WS_DEFAULT`` (the same bits)."""
    m, k = xq.shape
    n = wq.shape[0]
    out = torch.empty((m, n), device=xq.device, dtype=out_dtype)
    if m == 0 or n == 0:
        return out
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()          # the kernels read the bias as contiguous (a strided view misread it)
    group = spec.activation_group
    tuned = policy.fp8_tiles(m, n, k, spec, out_dtype) if policy is not None else None
    override = {**(tuned or {}), **(config or {})}   # a launch without sm90 = True is the Triton kernel's
    cfg = _config(m, n) if override else own_config(xq, wq, group)
    cfg.update(override)
    halves = bool(cfg.get("halves", False))
    if halves and (cfg["pair"] or cfg["BLOCK_N"] % 32):
        raise ValueError(f"fp8 GEMM launch {cfg}: halves needs pair=False and BLOCK_N a multiple of 32")
    if cfg.get("sm90"):
        return _gemm_sm90(xq, x_scale, wq, w_scale_inv, bias, out, group, cfg)
    tma = cfg["tma"] and tma_ok(xq) and tma_ok(wq)   # descriptor loads where the tensors allow (same bits)
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        x_arg = TensorDescriptor.from_tensor(xq, [cfg["BLOCK_M"], group])
        w_arg = TensorDescriptor.from_tensor(wq, [cfg["BLOCK_N"] // (2 if halves else 1), group])
    else:
        x_arg, w_arg = xq, wq
    grid = (cdiv(m, cfg["BLOCK_M"]) * cdiv(n, cfg["BLOCK_N"]),)
    launch(_fp8_gemm_kernel, grid,
           x_arg, x_scale, w_arg, w_scale_inv, bias if bias is not None else out, out, m, n, k, xq.stride(0),
           xq.stride(1), x_scale.stride(0), x_scale.stride(1), wq.stride(0), wq.stride(1), w_scale_inv.stride(0),
           w_scale_inv.stride(1), out.stride(0), out.stride(1), GROUP=group, HAS_BIAS=bias is not None,
           OUT_BF16=out_dtype == torch.bfloat16, UPCAST=INTERPRET, TMA=tma, PAIR=bool(cfg["pair"]), HALVES=halves,
           BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], GROUP_M=cfg["GROUP_M"], num_warps=cfg["num_warps"],
           num_stages=cfg["num_stages"], **LAUNCH)
    return out


def own_config(xq: torch.Tensor, wq: torch.Tensor, group: int) -> dict:
    """The kernel's own launch for xq @ wq.T (no tuning cache, no explicit launch): on a Hopper GPU from
    ``_WS_DEFAULT_MIN_M`` rows the warp-specialised Gluon kernel, else the Triton kernel's ``_config``."""
    m, n = xq.shape[0], wq.shape[0]
    if (m >= _WS_DEFAULT_MIN_M and group % _WS_DEFAULT["BLOCK_N"] == 0 and tma_ok(xq) and tma_ok(wq)
            and _hopper_gluon(xq.device)):
        return dict(_WS_DEFAULT)
    return _config(m, n)


def _hopper_gluon(device: torch.device) -> bool:
    """Whether ``fp8_gemm_sm90`` can run on ``device`` (imported only for a CUDA device: Gluon is not loaded on
    the CPU or under the interpreter)."""
    if device.type != "cuda" or INTERPRET:
        return False
    from hal.kernels import fp8_gemm_sm90
    return fp8_gemm_sm90.available(device)


def _gemm_sm90(xq, x_scale, wq, w_scale_inv, bias, out, group: int, cfg: dict) -> torch.Tensor:
    """The same GEMM by ``fp8_gemm_sm90`` (Gluon, Hopper): each K block's scaled add overlapped with the
    next block's MMAs, the same bits. A launch choice like the others, so an unusable one is an error,
    not a silent fallback."""
    from hal.kernels import fp8_gemm_sm90   # Gluon imported only where this launch is asked for

    m, k = xq.shape
    n = wq.shape[0]
    if not fp8_gemm_sm90.available(xq.device):
        raise ValueError(f"fp8 GEMM launch {cfg}: sm90 needs Triton's Gluon and a Hopper GPU (device {xq.device})")
    if not fp8_gemm_sm90.config_ok(cfg, group):
        raise ValueError(f"fp8 GEMM launch {cfg}: sm90 takes BLOCK_M = 64 per 4 warps (ws: BLOCK_M = 128 on 4 "
                         f"warps), BLOCK_N in (64, 128) inside a weight block and num_stages >= 2")
    if not (tma_ok(xq) and tma_ok(wq)):
        raise ValueError("fp8 GEMM launch sm90: the activations and weights must be row-major, 16-byte aligned")
    x_desc, w_desc = fp8_gemm_sm90.descriptors(xq, wq, cfg["BLOCK_M"], cfg["BLOCK_N"], group)
    grid = (cdiv(m, cfg["BLOCK_M"]) * cdiv(n, cfg["BLOCK_N"]),)
    if cfg.get("ws"):   # the warp-specialised kernel: a loader warp, a partition per math warpgroup; persistent
        grid = (min(grid[0], fp8_gemm_sm90.sm_count(xq.device)),)
        kernel, extra = fp8_gemm_sm90._fp8_gemm_ws_kernel, dict(MATH_REGS=fp8_gemm_sm90.WS_MATH_REGS,
                                                                maxnreg=fp8_gemm_sm90.WS_MAXNREG)
    else:
        kernel, extra = fp8_gemm_sm90._fp8_gemm_sm90_kernel, {}
    launch(kernel, grid,
           x_desc, w_desc, x_scale, w_scale_inv, bias if bias is not None else out, out, m, n, k,
           x_scale.stride(0), x_scale.stride(1), w_scale_inv.stride(0), w_scale_inv.stride(1), out.stride(0),
           out.stride(1), GROUP=group, HAS_BIAS=bias is not None, OUT_BF16=out.dtype == torch.bfloat16,
           BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], GROUP_M=cfg["GROUP_M"], STAGES=cfg["num_stages"],
           UNROLL=cfg.get("unroll", 2), num_warps=cfg["num_warps"], **extra, **LAUNCH)
    return out


def linear(x: torch.Tensor, wq: torch.Tensor, w_scale_inv: torch.Tensor, bias: torch.Tensor | None,
           out_dtype: torch.dtype, spec: Fp8, config: dict | None = None, *,
           policy: LaunchPolicy | None = None) -> torch.Tensor:
    """x (M, K) activations -> quantised per group -> the block-FP8 GEMM, as [fp8] says."""
    xq, xs = quantise_activations(x, spec)
    return gemm(xq, xs, wq, w_scale_inv, bias, out_dtype, spec, config, policy=policy)
