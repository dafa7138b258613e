"""GEMM ``y = x @ w.T (+ bias)``.

Reduction structure (contract [gemm], read from ``k_chunk``):
  K is cut into chunks of K_CHUNK at absolute offsets 0, K_CHUNK, 2 K_CHUNK, ...; each chunk is
  accumulated from zero in fp32 by ``tl.dot`` steps of BLOCK_K in ascending k (the order inside a
  chunk is the MMA's: implementation-defined, the same for every tile shape); chunk sums are added
  in ascending order into an fp32 total that starts at +0; the bias is added in fp32; one rounding.

The K loop is one flat loop over BLOCK_K steps: ``acc`` collects the current chunk and is flushed
into ``total`` (and restarted from zero) after the chunk's last step. A loop nested per chunk
restarts Triton's software pipeline at every chunk (the first version did: 1.2x slower than this
loop with the same pointer loads at M >= 1024 on the H200); the flat loop keeps the loads streaming
across chunk boundaries and adds the same sums in the same order.

Launch choices that give the same bits, chosen per call for speed only:
  * direct: each program owns a (BLOCK_M, BLOCK_N) tile and walks all chunks;
  * split-K: each program walks CHUNKS_PER_PROGRAM chunks and stores each chunk's sum separately;
    ``_combine_kernel`` adds the chunk sums in ascending order;
  * loads by pointer, or (``TMA``, bf16 on Hopper, M > 16) by tensor descriptor, the copy engine:
    the same tiles of the same values reach the same MMAs.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from hal.contract import Gemm
from hal.kernels import launcher
from hal.kernels.common import INTERPRET, LAUNCH, cdiv, next_power_of_2, to_activation
from hal.kernels.launcher import launch
from hal.kernels.policy import LaunchPolicy


@triton.jit(do_not_specialize=["M"])
def _gemm_kernel(x, w, bias_ptr, out_ptr, partial_ptr, M, N, K,
                 stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
                 K_CHUNK: tl.constexpr, SPLIT: tl.constexpr, CHUNKS_PER_PROGRAM: tl.constexpr,
                 HAS_BIAS: tl.constexpr, OUT_BF16: tl.constexpr, FP32_INPUTS: tl.constexpr, UPCAST: tl.constexpr,
                 TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr):
    """x, w: pointers, or with TMA tensor descriptors of (BLOCK_M, BLOCK_K) and (BLOCK_N, BLOCK_K)
    blocks (out-of-range rows and columns read as zeros, like the masked pointer loads)."""
    # Tiles in groups of GROUP_M rows of tiles, so programs that run together share W tiles in L2.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % rows_in_group
    pid_n = (pid % (GROUP_M * tiles_n)) // rows_in_group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    out_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SPLIT:
        k_begin = tl.program_id(1) * CHUNKS_PER_PROGRAM * K_CHUNK
        k_end = tl.minimum(k_begin + CHUNKS_PER_PROGRAM * K_CHUNK, K)
    else:
        k_begin = 0
        k_end = K
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        if TMA:
            a = x.load([pid_m * BLOCK_M, k0])
            b = w.load([pid_n * BLOCK_N, k0]).T
        else:
            ks = k0 + offs_k
            a = tl.load(x + offs_m[:, None] * stride_xm + ks[None, :] * stride_xk,
                        mask=(offs_m[:, None] < M) & (ks[None, :] < K), other=0.0)
            b = tl.load(w + offs_n[None, :] * stride_wn + ks[:, None] * stride_wk,
                        mask=(offs_n[None, :] < N) & (ks[:, None] < K), other=0.0)
        if UPCAST:  # the interpreter cannot do bf16 arithmetic; the upcast is exact
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if FP32_INPUTS or UPCAST:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        if ((k0 + BLOCK_K) % K_CHUNK == 0) | (k0 + BLOCK_K >= k_end):  # the chunk's last step
            if SPLIT:
                chunk = k0 // K_CHUNK
                base = chunk.to(tl.int64) * M * N
                tl.store(partial_ptr + base + offs_m[:, None] * N + offs_n[None, :], acc, mask=out_mask)
            else:
                total = total + acc
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if not SPLIT:
        if HAS_BIAS:
            total = total + tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on,
                 to_activation(total, OUT_BF16), mask=out_mask)


@triton.jit(do_not_specialize=["M"])
def _combine_kernel(partial_ptr, bias_ptr, out_ptr, M, N, CHUNKS, stride_om, stride_on,
                    HAS_BIAS: tl.constexpr, OUT_BF16: tl.constexpr, BLOCK: tl.constexpr):
    """total = +0 + chunk 0 + chunk 1 + ... in ascending order; + bias; one rounding."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for chunk in range(0, CHUNKS):
        total = total + tl.load(partial_ptr + chunk * M * N + offs, mask=mask, other=0.0)
    n = offs % N
    if HAS_BIAS:
        total = total + tl.load(bias_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + (offs // N) * stride_om + n * stride_on, to_activation(total, OUT_BF16), mask=mask)


def _config(m: int, n: int, k: int, spec: Gemm, tma: bool, sms: int) -> dict:
    """Tiling per shape: free (does not change the bits), the fastest in device time on the H200 of
    the shapes bench/speed_sweep.py tries per M class, for the reasons given at each rule below.
    ``tma``: descriptor loads are possible (bf16,
    aligned); ``sms``: the GPU's multiprocessors. Each small-M rule keeps the grid within one wave
    of two programs per multiprocessor: a second, partial wave cost 26-28% (N = 14336 with
    32-wide tiles: 448 programs)."""
    chunks = spec.chunk_count(k)
    base = dict(split=False, chunks_per_program=1, GROUP_M=1, tma=False)
    if INTERPRET:
        return dict(base, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, split=chunks > 1 and m <= 16, num_warps=4,
                    num_stages=1)
    wide = n > 16384  # lm_head: enough N tiles to fill the GPU at any M
    one_wave_of_32 = cdiv(n, 32) <= 2 * sms
    if m <= 16:
        # Weight-read bound: thin N tiles (enough programs for every multiprocessor), a deep K pipeline.
        if one_wave_of_32:
            direct = dict(base, BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=4)
        else:
            direct = dict(base, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=5)
        return _weight_stream_split(m, n, chunks, sms, direct) or direct
    if m <= 32 and tma and not wide:
        # 32-row tiles: a 64-row tile for 17..32 rows is half padding. `hal tune` on the H200 chose these
        # for every M = 32 linear of Qwen2.5-32B, 1.15-1.90x faster than the 64-row rule below
        # (bench/results/h200-2026-12-02-session8/call9-hal-tune/).
        if one_wave_of_32:
            direct = dict(base, BLOCK_M=32, BLOCK_N=32, BLOCK_K=256, tma=True, num_warps=4, num_stages=4)
            return _weight_stream_split(m, n, chunks, sms, direct) or direct
        return dict(base, BLOCK_M=32, BLOCK_N=128, BLOCK_K=128, tma=True, num_warps=4, num_stages=4)
    if m <= 64:
        if tma and not wide:  # descriptor loads: 44 registers instead of 228, and the MMAs overlap
            if one_wave_of_32:
                direct = dict(base, BLOCK_M=64, BLOCK_N=32, BLOCK_K=128, tma=True, num_warps=4, num_stages=6)
                return _weight_stream_split(m, n, chunks, sms, direct) or direct
            return dict(base, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, tma=True, num_warps=4, num_stages=6)
        return dict(base, BLOCK_M=64, BLOCK_N=64 if wide else 32, BLOCK_K=64 if wide else 128, num_warps=4,
                    num_stages=4)
    if not tma:  # fp32 (or unaligned) operands: pointer loads, the tiles their registers allow
        return dict(base, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4)

    # Descriptor loads, above 64 rows: the tile with the least estimated time, where a launch takes as many
    # whole waves as its programs need (a partial wave costs a whole one) and a wave takes (programs per
    # multiprocessor x tile area / the tile's MMA rate). Session 13's family sweep found the old rule
    # ("the largest tile that fills nine tenths of a wave") at 0.51-0.55x cuBLAS where its tiles spilled
    # into a second, mostly empty wave (M = 1024, N = 5120: 160 tiles of 128 x 256 on 132 multiprocessors);
    # session 11 had found it at 0.43-0.49x where one wave was a third full (M = 1024, N = 2048).
    if sms <= 0:      # a policy that knows no multiprocessor count: the largest tile
        return dict(base, **_WAVE_TILES[0][0])
    return dict(base, **min(_WAVE_TILES, key=lambda t: _wave_cost(t, m, n, sms))[0])


# Split-K tiles for few rows, wider first: (rows, BLOCK_N, BLOCK_K, warps, stages, descriptor loads). Up to 16 rows the
# two pointer tiles `hal tune` picked on the H200 where it split (bench/results/h200-2026-12-02-session8/call9-hal-tune/);
# 17-32 rows the two descriptor tiles that won the most cells of bench/gemm_split_gpu.py on an H100; 33-64 rows the
# direct launch's own tile (bench/results/h100-2026-12-07-gemm-split/).
_SPLIT_TILES = {16: ((128, 128, 4, 4, False), (64, 256, 4, 3, False)),
                32: ((128, 128, 4, 4, True), (32, 256, 4, 4, True)),
                64: ((32, 128, 4, 6, True),)}


def _weight_stream_split(m: int, n: int, chunks: int, sms: int, direct: dict) -> dict | None:
    """Split-K for a GEMM of few rows (M <= 64) whose direct grid leaves most multiprocessors idle: narrow N over
    deep K, the down projections of small models (N = 896-2048, K = 2048-11008). The direct launch gives each
    program 32 columns and all of K, so N = 1536 is 48 programs on 132 multiprocessors, each streaming its slice
    of the weight: 0.63-0.87x cuBLAS on an H100 at M = 1-32 (bench/results/h100-2026-12-07-gemm-split/).
    Splitting K over chunk ranges puts more programs on the weight; each stores its chunks' sums and
    ``_combine_kernel`` adds them in ascending order, the contract's sum (bitwise the direct launch's:
    tests/test_cuda_interpreter.py, and on the GPU that benchmark's checks).

    When (fitted on that benchmark's 70 cells, H100): the chunk sums cost M x N x chunks x 8 bytes of traffic (at
    64 rows half the weight's) and a second kernel, so a split pays only where the direct grid is far from
    filling the GPU and K is deep. Up to 32 rows: at least four chunks, and the direct grid at most 3/8 of the
    multiprocessors, or at most half with at least 12 chunks (N = 2048, K = 6144: 0.87 -> 0.97; N = 2048,
    K = 1536 or 2048 and N = 2560 lost 6-16% split). 33-64 rows: at least four chunks and at most a quarter
    of the multiprocessors (N = 896-1024: 0.80-0.99 -> 0.96-1.10; at N = 2048 the split lost 11-18%).
    Which launch: of ``_SPLIT_TILES`` the wider tile, unless the narrower gives at least twice its programs;
    each program takes the fewest chunks that keep the grid within one wave. None: keep the direct launch."""
    rows = 16 if m <= 16 else 32 if m <= 32 else 64
    direct_programs = cdiv(m, direct["BLOCK_M"]) * cdiv(n, direct["BLOCK_N"])
    if chunks < 4 or sms <= 0:
        return None
    if rows <= 32:
        if not (8 * direct_programs <= 3 * sms or (2 * direct_programs <= sms and chunks >= 12)):
            return None
    elif 4 * direct_programs > sms:
        return None
    best, best_programs = None, 0
    for block_n, block_k, warps, stages, tma in _SPLIT_TILES[rows]:
        tiles = cdiv(m, rows) * cdiv(n, block_n)
        if tiles > sms:
            continue
        per_program = next(c for c in range(1, chunks + 1) if tiles * cdiv(chunks, c) <= sms)
        programs = tiles * cdiv(chunks, per_program)
        if best is None or programs >= 2 * best_programs:
            best_programs = programs
            best = dict(direct, BLOCK_M=rows, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
                        tma=tma, split=True, chunks_per_program=per_program)
    return best if best is not None and best_programs > direct_programs else None


# (configuration, programs per multiprocessor, MMA rate per multiprocessor relative to 128 x 256) of the tiles
# the rule above chooses from. Rates from the H200's times: 128 x 256 2-7% faster than 128 x 128 at
# M >= 4096 (full waves); 64 x 128 (two programs a multiprocessor) 1.19x the time of 128 x 128 at
# M = 1024, N = 2048 (one wave each: bench/results/h200-2026-12-02-session11); 64 x 64 not measured beside
# them, rated low so it is chosen only where it saves a wave.
#   128 x 256 on two warpgroups: the contract's second fp32 accumulator makes it spill a little (255
#   registers + 48 bytes of stack), yet the fastest tile on full waves (a quarter fewer L2 reads per MMA).
_WAVE_TILES = (
    (dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, tma=True, num_warps=8, num_stages=3), 1, 1.0),
    (dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, tma=True, num_warps=8, num_stages=5), 1, 0.95),
    (dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, tma=True, num_warps=4, num_stages=4), 2, 0.80),
    (dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, tma=True, num_warps=4, num_stages=6), 2, 0.65),
)


def _wave_cost(tile, m: int, n: int, sms: int) -> float:
    """Estimated relative time of an (m, n) GEMM in ``tile`` (an entry of _WAVE_TILES): whole waves x the
    time of one wave. Ties go to the earlier (larger) tile: ``min`` keeps the first."""
    cfg, per_sm, rate = tile
    programs = cdiv(m, cfg["BLOCK_M"]) * cdiv(n, cfg["BLOCK_N"])
    return cdiv(programs, per_sm * sms) * per_sm * cfg["BLOCK_M"] * cfg["BLOCK_N"] / rate


# The launch configurations the autotuner (hal/kernels/tuning.py) may choose from: every one keeps the
# reduction structure above (BLOCK_K divides the contract's k_chunk; split-K stores whole chunks), so
# every one gives the same bits (tests/test_cuda_interpreter.py and bench/tile_freedom.py check it over
# this set). Tiles (M, N, K, warps, stages) that fit the H200's 227 KB of shared memory per block.
_TILES = [
    (16, 32, 256, 4, 4), (16, 64, 128, 4, 5), (16, 64, 256, 4, 3), (16, 128, 128, 4, 4), (32, 32, 256, 4, 4),
    (32, 64, 128, 4, 4), (32, 128, 128, 4, 4), (64, 32, 128, 4, 4), (64, 64, 64, 4, 6), (64, 64, 128, 4, 4),
    (64, 128, 64, 4, 4), (64, 256, 64, 8, 3), (128, 64, 64, 4, 4), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3),
    # session 11's landscape: among the fastest at M = 128..1024 (128 x 64 x 128: the fastest at M = 128, N = 24576)
    (128, 128, 64, 8, 5), (128, 64, 128, 4, 4),
]
SHARED_BYTES = 227 * 1024


def candidates(m: int, n: int, k: int, spec: Gemm, tma_ok: bool, tiles=None) -> list[dict]:
    """Every contract-preserving launch configuration worth timing for an (m, n, k) GEMM: the tiles of
    ``_TILES`` whose BLOCK_K divides k_chunk, whose BLOCK_M is not far above M (a 128-row tile for 8 rows
    only wastes MMAs) and that fit in shared memory, each by pointer and (where the tensors allow) by
    descriptor, and split-K over 1 or 2 chunks per program (by pointer, and from 17 rows by descriptor) where K
    has several chunks and M is small.
    ``tiles``: another tile list than ``_TILES`` (bench/gemm_landscape.py explores beyond it)."""
    chunks = spec.chunk_count(k)
    out = []
    for bm, bn, bk, warps, stages in (_TILES if tiles is None else tiles):
        if spec.k_chunk % bk or bm > max(16, next_power_of_2(m)) * 2:
            continue
        if (bm + bn) * bk * 2 * stages > SHARED_BYTES:
            continue
        base = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages,
                    GROUP_M=8 if m > 64 else 1, split=False, chunks_per_program=1, tma=False)
        out.append(base)
        if tma_ok and m > 16:
            out.append(dict(base, tma=True))
        if chunks > 1 and m <= 64:
            out += [dict(base, split=True, chunks_per_program=c) for c in (1, 2) if c < chunks]
            if tma_ok and m > 16:    # split launches read by descriptor too (the table's from 17 rows)
                out += [dict(base, split=True, chunks_per_program=c, tma=True) for c in (1, 2) if c < chunks]
    return out


def _tma_ok(t: torch.Tensor) -> bool:
    """A tensor descriptor needs a bf16 row-major matrix with 16-byte aligned base and rows."""
    return (t.dtype == torch.bfloat16 and t.stride(1) == 1 and t.data_ptr() % 16 == 0
            and (t.stride(0) * t.element_size()) % 16 == 0)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
           spec: Gemm, config: dict | None = None, *, policy: LaunchPolicy) -> torch.Tensor:
    """x (M, K) @ weight (N, K).T (+ bias) -> (M, N) out_dtype, K reduced as ``spec`` ([gemm]) says.
    The tiling is ``_config``'s, with the ``policy``'s tiles over it, and ``config`` over both (tests).
    A call whose signature was seen runs its recorded plan (``_Plan``): the same launches, less host time."""
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()          # the kernels read the bias as contiguous (a strided view misread it)
    key = None
    if launcher.ENABLED and config is None:
        key = (x.shape, x.stride(), x.dtype, x.data_ptr() % 16 == 0, weight.shape, weight.stride(), weight.dtype,
               weight.data_ptr() % 16 == 0, None if bias is None else (bias.dtype, bias.data_ptr() % 16 == 0),
               out_dtype, x.device, launcher.current_device(), spec, policy)
        plan = _PLANS.get(key)
        if plan is not None:
            return plan(x, weight, bias)
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), device=x.device, dtype=out_dtype)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.copy_((bias.float() if bias is not None else torch.zeros(n, device=x.device)).expand(m, n))
    tma_ok = not INTERPRET and _tma_ok(x) and _tma_ok(weight)
    cfg = _planned(m, n, k, spec, tma_ok, policy, x.device, x.element_size(), out_dtype)
    if config:
        cfg = dict(cfg, **config)
    record = {} if key is not None else None
    _launch(x, weight, bias, out, cfg, spec, tma_ok, keep_partials=False, record=record)
    if record and record.get("gemm") is not None and (not record["split"] or record.get("combine") is not None):
        _PLANS.keep(key, _Plan(out, record))
    return out


# Launch plans of ``linear`` by call signature (issue #20: host cost per op call). The first call of a
# signature takes the whole path (the tile table, the launcher's key) and records its launches as
# ``launcher.Prepared``; a later call allocates its outputs and launches them. The signature fixes all that
# the launches take from the arguments besides the tensors' data: shapes and strides (the table's input and
# every int argument), dtypes and 16-byte alignment (Triton's specialisation), the device, the contract's
# [gemm] and the launch policy; the output and the chunk sums are fresh allocations (aligned, contiguous).
# So a plan launches the compiled kernels the whole path would, with the same arguments: the same bits.
_PLANS = launcher.Plans()


def _descriptor_template(desc):
    """A tensor descriptor's geometry without its tensor (a plan must not keep its first call's tensors alive)."""
    if not hasattr(desc, "__dict__"):                # a Triton whose descriptors have slots: rebuild them checked
        return desc.block_shape, desc.padding
    return type(desc), {name: value for name, value in desc.__dict__.items() if name != "base"}


def _same_descriptor(template, tensor: torch.Tensor):
    """The descriptor of the signature's first call (``_descriptor_template``) over ``tensor``.
    ``TensorDescriptor.from_tensor`` validates the geometry on every call (~3 us of host time); the plan's key
    fixes all it checks (shape, strides, dtype, 16-byte alignment), so the first call's validation holds."""
    if not isinstance(template[0], type):
        from triton.tools.tensor_descriptor import TensorDescriptor

        return TensorDescriptor.from_tensor(tensor, *template)
    cls, fields = template
    desc = object.__new__(cls)
    desc.__dict__.update(fields)
    desc.base = tensor
    return desc


class _Plan:
    """The launches of one ``linear`` signature (``_launch`` recorded them)."""

    __slots__ = ("m", "n", "out_dtype", "split", "chunks", "x_desc", "w_desc", "ints", "combine_ints", "gemm",
                 "combine")

    def __init__(self, out: torch.Tensor, record: dict):
        (self.m, self.n), self.out_dtype = out.shape, out.dtype
        self.split, self.chunks, self.ints = record["split"], record["chunks"], record["ints"]
        self.x_desc, self.w_desc = record["x_desc"], record["w_desc"]
        self.gemm, self.combine = record["gemm"], record.get("combine")
        self.combine_ints = (self.m, self.n, self.chunks, *out.stride())

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = torch.empty((self.m, self.n), device=x.device, dtype=self.out_dtype)
        bias_arg = bias if bias is not None else out
        partial = torch.empty((self.chunks, self.m, self.n), device=x.device, dtype=torch.float32) if self.split else out
        if self.x_desc is not None:
            x_arg, w_arg = _same_descriptor(self.x_desc, x), _same_descriptor(self.w_desc, weight)
        else:
            x_arg, w_arg = x, weight
        self.gemm(x_arg, w_arg, bias_arg, out, partial, *self.ints)
        if self.split:
            self.combine(partial, bias_arg, out, *self.combine_ints)
        return out


@functools.lru_cache(maxsize=8192)
def _planned(m: int, n: int, k: int, spec: Gemm, tma_ok: bool, policy: LaunchPolicy, device: torch.device,
             in_bytes: int, out_dtype: torch.dtype) -> dict:
    """``_config``'s tiles with the policy's (a tuning cache's) over them, computed once per shape: the
    policy reads its cache once per process, so the answer never changes (and the bits never depend on
    it). Callers must not change the returned dict."""
    cfg = _config(m, n, k, spec, tma_ok, policy.multiprocessors(device))
    tiles = policy.gemm_tiles(m, n, k, spec, in_bytes, out_dtype=out_dtype)
    if tiles:
        cfg.update(tiles)
    return cfg


def chunk_partials(x: torch.Tensor, weight: torch.Tensor, spec: Gemm, config: dict | None = None, *,
                   policy: LaunchPolicy) -> torch.Tensor:
    """The fp32 sums of x @ weight.T's K chunks, uncombined: (C, M, N), chunk i over columns
    [i k_chunk, (i + 1) k_chunk), each from zero as in ``linear`` (the split-K launch's partials, which
    ``combine`` adds in ascending order: ``combine(chunk_partials(x, w)) == linear(x, w)`` bitwise).
    The row-parallel linear (hal.parallel) gathers them across ranks before the one combine."""
    m, k = x.shape
    n = weight.shape[0]
    chunks = spec.chunk_count(k)
    partial = torch.empty((chunks, m, n), device=x.device, dtype=torch.float32)   # every element is stored
    if m == 0 or n == 0 or k == 0:
        return partial
    tma_ok = not INTERPRET and _tma_ok(x) and _tma_ok(weight)
    # The split launch's tiles (M is small at decode, large in prefill: the table's own rule for M).
    cfg = dict(_config(m, n, k, spec, False, policy.multiprocessors(x.device)), split=True, tma=False)
    cfg["chunks_per_program"] = 1
    if config:
        cfg.update(config)
    return _launch(x, weight, None, None, cfg, spec, tma_ok, keep_partials=True, partial=partial)


def combine(partials: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
            out: torch.Tensor | None = None, *, record: dict | None = None) -> torch.Tensor:
    """[gemm]'s combine of (C, M, N) fp32 chunk partials in ascending chunk order: +0, then each
    partial, then the bias in fp32, then one rounding to ``out_dtype``. Returns (M, N) (``out``).
    ``record``: a dict that gets the launch as ``launcher.Prepared`` under "combine" (``linear``'s plans)."""
    chunks, m, n = partials.shape
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()          # read as contiguous by the kernel
    if out is None:
        out = torch.empty((m, n), device=partials.device, dtype=out_dtype)
    if m == 0 or n == 0:
        return out
    block = 1024
    run = launch if record is None else functools.partial(_recorded, record, "combine")
    run(_combine_kernel, (cdiv(m * n, block),),
        partials.contiguous(), bias if bias is not None else out, out, m, n, chunks, out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, OUT_BF16=out_dtype == torch.bfloat16, BLOCK=block, **LAUNCH)
    return out


def _recorded(record: dict, name: str, kernel, grid, *args, **kwargs) -> None:
    """``launch``, keeping the launch's ``launcher.Prepared`` (or None) in ``record[name]``."""
    record[name] = launcher.prepare(kernel, grid, *args, **kwargs)


def _launch(x, weight, bias, out, cfg: dict, spec: Gemm, tma_ok: bool, *, keep_partials: bool,
            partial: torch.Tensor | None = None, record: dict | None = None):
    """One GEMM launch with the tiles of ``cfg``: the combined output into ``out``, or with
    ``keep_partials`` the chunk sums into ``partial`` (returned uncombined). ``record``: a dict that gets
    what ``_Plan`` needs to repeat the launches (``linear``)."""
    m, k = x.shape
    n = weight.shape[0]
    out_dtype = out.dtype if out is not None else torch.float32
    k_chunk = spec.k_chunk
    if k_chunk % cfg["BLOCK_K"]:
        raise ValueError(f"BLOCK_K {cfg['BLOCK_K']} must divide k_chunk {k_chunk}")
    chunks = spec.chunk_count(k)
    if keep_partials:
        split = True
    else:
        split = cfg["split"] and chunks > 1
    per_program = min(cfg["chunks_per_program"], chunks) if split else chunks
    out_arg = out if out is not None else partial
    bias_arg = bias if bias is not None else out_arg
    if partial is None:
        partial = torch.empty((chunks, m, n), device=x.device, dtype=torch.float32) if split else out
    # "tma" asks for descriptor loads where the tensors allow them (the bits are the same), split or not.
    tma = cfg["tma"] and tma_ok
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        x_arg = TensorDescriptor.from_tensor(x, [cfg["BLOCK_M"], cfg["BLOCK_K"]])
        w_arg = TensorDescriptor.from_tensor(weight, [cfg["BLOCK_N"], cfg["BLOCK_K"]])
    else:
        x_arg, w_arg = x, weight
    grid = (cdiv(m, cfg["BLOCK_M"]) * cdiv(n, cfg["BLOCK_N"]), cdiv(chunks, per_program))
    ints = (m, n, k, x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out_arg.stride(0), out_arg.stride(1))
    if record is not None:
        record.update(split=split, chunks=chunks, ints=ints, x_desc=_descriptor_template(x_arg) if tma else None,
                      w_desc=_descriptor_template(w_arg) if tma else None)
    run = launch if record is None else functools.partial(_recorded, record, "gemm")
    run(_gemm_kernel, grid, x_arg, w_arg, bias_arg, out_arg, partial, *ints, K_CHUNK=k_chunk, SPLIT=split,
        CHUNKS_PER_PROGRAM=per_program, HAS_BIAS=bias is not None, OUT_BF16=out_dtype == torch.bfloat16,
        FP32_INPUTS=x.dtype == torch.float32, UPCAST=INTERPRET and x.dtype != torch.float32, TMA=tma,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **LAUNCH)
    if keep_partials:
        return partial
    if split:
        return combine(partial, bias, out_dtype, out, record=record)
    return out
