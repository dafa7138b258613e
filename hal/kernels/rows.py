"""Row and pointwise kernels: RMSNorm (+residual), SiLU*up, rotary, sum/mean.

Reduction structure of RMSNorm and sum/mean (contract [rms_norm].row_block, [reduce].row_block):
  the row is reduced in blocks of ROW_BLOCK elements at absolute offsets 0, ROW_BLOCK, ...; each
  block is one ``tl.sum`` over a loaded tile of BLOCK = min(ROW_BLOCK, next_pow2(n)) lanes (a tree
  fixed by that width: the same for every row, batch size and warp count); the block sums are
  added in ascending order into an fp32 total that starts at +0. RMSNorm's mean is div_rn(ss, n), or
  with [rms_norm].inv_rms = "mul_reciprocal_div_rn_sqrt_rn" fl32(ss * div_rn(1, n)) (MEAN_RECIPROCAL).
Pointwise ops have no reduction; their rounding points follow the contract, with no FMA.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from hal.contract import Reduce, RmsNorm
from hal.kernels import launcher
from hal.kernels.common import LAUNCH, cdiv, next_power_of_2, round_to_bf16, silu_mul_f32, to_activation, zero_scalar
from hal.kernels.launcher import launch


@triton.jit
def _load_row(x_ptr, res_ptr, offs, mask, HAS_RESIDUAL: tl.constexpr, IS_BF16: tl.constexpr):
    """The row the norm reads: x, or residual_out = round_act(fl32(x + residual))."""
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x = x + tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if IS_BF16:
            x = round_to_bf16(x)
    return x


@triton.jit
def _row_sum(x_ptr, res_ptr, n, SQUARE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, IS_BF16: tl.constexpr,
             BLOCK: tl.constexpr):
    """Sum (or sum of squares) of one row in blocks of BLOCK at absolute offsets, ascending."""
    total = zero_scalar()
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = _load_row(x_ptr, res_ptr, offs, offs < n, HAS_RESIDUAL, IS_BF16)
        if SQUARE:
            x = x * x
        total = total + tl.sum(x, axis=0)
    return total


@triton.jit
def _inverse_rms(sum_sq, n, eps, MEAN_RECIPROCAL: tl.constexpr):
    """1 / sqrt(mean + eps), correctly rounded steps; the mean as [rms_norm].inv_rms says."""
    if MEAN_RECIPROCAL:
        mean_sq = sum_sq * tl.div_rn(1.0, n.to(tl.float32))
    else:
        mean_sq = tl.div_rn(sum_sq, n.to(tl.float32))
    return tl.div_rn(1.0, tl.sqrt_rn(mean_sq + eps))


def _rms_norm_body(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n, stride_x, stride_r, stride_o, stride_ro, eps,
                   HAS_RESIDUAL: tl.constexpr, IS_BF16: tl.constexpr, BLOCK: tl.constexpr,
                   MEAN_RECIPROCAL: tl.constexpr, ONE_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    r_row = res_ptr + row * stride_r
    if ONE_BLOCK:
        # The row is one block (n <= BLOCK): read once and kept in registers for the second step. The
        # same sum as _row_sum's (+0 plus the block's tl.sum) over the same loaded tile: the same bits,
        # with half the loads.
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        x = _load_row(x_row, r_row, offs, mask, HAS_RESIDUAL, IS_BF16)
        sum_sq = zero_scalar() + tl.sum(x * x, axis=0)
        inv = _inverse_rms(sum_sq, n, eps, MEAN_RECIPROCAL)
        if HAS_RESIDUAL:
            tl.store(res_out_ptr + row * stride_ro + offs, to_activation(x, IS_BF16), mask=mask)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + offs, to_activation((x * inv) * w, IS_BF16), mask=mask)
    else:
        # The residual sum is recomputed in each pass instead of re-read from res_out: a load after a
        # store by other threads of the program would need a barrier.
        sum_sq = _row_sum(x_row, r_row, n, True, HAS_RESIDUAL, IS_BF16, BLOCK)
        inv = _inverse_rms(sum_sq, n, eps, MEAN_RECIPROCAL)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n
            x = _load_row(x_row, r_row, offs, mask, HAS_RESIDUAL, IS_BF16)
            if HAS_RESIDUAL:
                tl.store(res_out_ptr + row * stride_ro + offs, to_activation(x, IS_BF16), mask=mask)
            w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_ptr + row * stride_o + offs, to_activation((x * inv) * w, IS_BF16), mask=mask)



# ``n`` is specialised (Triton notes whether it is a multiple of 16): with it unknown the ``offs < n``
# mask kept every load and store scalar, and RMSNorm + residual at 8192 x 2048 bf16 ran at 1.4 TB/s
# (95 us on the H200, torch 48 us). Specialisation changes the instructions, not the arithmetic.
# Triton also turns an integer argument equal to 1 into a constant, which has no ``.to()``: rows of
# width 1 take the unspecialised compile of the same source.
_rms_norm_kernel = triton.jit(_rms_norm_body)
_rms_norm_kernel_width_1 = triton.jit(do_not_specialize=["n"])(_rms_norm_body)

NARROW = 128   # rows of 2..NARROW elements take the many-rows kernel (``rms_norm_rows``)


def _contiguous_vector(v: torch.Tensor) -> torch.Tensor:
    """The kernels read a weight vector as contiguous: a strided view (w[::2]) is copied first."""
    return v if v.stride(0) == 1 else v.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
             spec: RmsNorm, num_warps: int | None = None, *,
             many_rows: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out, residual_out or None); the sum of squares in row blocks of ``spec.row_block``.

    Which kernel runs depends on the row width alone (so a row's bits never depend on the batch). With
    ``many_rows`` (the cuda backend), rows of 2..NARROW elements (per-head q/k norms) go many to a
    program with the pairwise tree of ``rms_norm_rows`` (1.5-1.8x faster than one row per program at
    3584..262144 rows of 64-128 on the H200; at 256 wide it was 2x slower: bench/norm_rows.py); wider
    rows, and every row without it (a vendor whose compiler has not been shown to take that kernel: the
    ascend backend), one to a program. ``num_warps`` forces the one-row kernel with that many warps (its
    ``tl.sum`` tree depends on them: bench/tile_freedom.py)."""
    weight = _contiguous_vector(weight)
    key = None
    if launcher.ENABLED:
        key = (x.shape, x.stride(), x.dtype, x.data_ptr() % 16 == 0, weight.shape, weight.dtype,
               weight.data_ptr() % 16 == 0, None if residual is None else
               (residual.shape, residual.stride(), residual.dtype, residual.data_ptr() % 16 == 0),
               eps, spec, num_warps, many_rows, x.device, launcher.current_device())
        plan = _NORM_PLANS.get(key)
        if plan is not None:
            return plan(x, weight, residual)
    n = x.shape[-1]
    if many_rows and num_warps is None and 2 <= n and next_power_of_2(n) <= min(NARROW, spec.row_block):
        return rms_norm_rows(x, weight, eps, residual, spec, plan_key=key)
    x2, res2, out, res_out = _norm_buffers(x, residual)
    block = min(spec.row_block, next_power_of_2(n))
    if x2.shape[0]:
        kernel = _rms_norm_kernel_width_1 if n == 1 else _rms_norm_kernel
        args = (x2, res2, weight, out, res_out, n, x2.stride(0), res2.stride(0), out.stride(0), res_out.stride(0),
                _fp32(eps))
        _launch_and_plan(key, kernel, (x2.shape[0],), args, HAS_RESIDUAL=residual is not None,
                         IS_BF16=x.dtype == torch.bfloat16, BLOCK=block,
                         MEAN_RECIPROCAL=spec.inv_rms == "mul_reciprocal_div_rn_sqrt_rn", ONE_BLOCK=n <= block,
                         num_warps=num_warps or (8 if block >= 2048 else 4), **LAUNCH)
    return out.view(x.shape), (res_out.view(x.shape) if residual is not None else None)


# Launch plans of ``rms_norm`` by call signature (issue #20: host cost per op call), as ``gemm``'s: the first call
# of a signature takes the whole path and records its launch; a later one allocates its outputs and launches the
# recorded compiled kernel with them. The signature (shapes, strides, dtypes, 16-byte alignment, eps, the
# contract's [rms_norm], the launch choices, the device) fixes every other argument and Triton's specialisation.
_NORM_PLANS = launcher.Plans()


class _NormPlan:
    """The launch of one ``rms_norm`` signature: its compiled kernel and the arguments after the five tensors."""

    __slots__ = ("prepared", "scalars")

    def __init__(self, prepared: launcher.Prepared, scalars: tuple):
        self.prepared, self.scalars = prepared, scalars

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None):
        x2, res2, out, res_out = _norm_buffers(x, residual)
        self.prepared(x2, res2, weight, out, res_out, *self.scalars)
        return out.view(x.shape), (res_out.view(x.shape) if residual is not None else None)


def _launch_and_plan(key: tuple | None, kernel, grid: tuple, args: tuple, **meta) -> None:
    """``launch(kernel, grid, *args, **meta)`` for an RMSNorm call (its five tensors first); with a plan ``key``,
    also the plan later calls of the signature take."""
    if key is None:
        launch(kernel, grid, *args, **meta)
        return
    prepared = launcher.prepare(kernel, grid, *args, **meta)
    if prepared is not None:
        _NORM_PLANS.keep(key, _NormPlan(prepared, args[5:]))


@triton.jit
def _pairwise_row_sums(x, LEVELS: tl.constexpr):
    """(ROWS, W) -> (ROWS,): each row summed by one fixed binary tree (adjacent pairs, then pairs of those
    sums, ...; LEVELS = log2(W)). Every step is an elementwise fp32 add, so the tree does not depend on how
    the compiler lays the tile out over threads and warps (a ``tl.sum`` tree does) nor on how many rows
    share it."""
    for _ in tl.static_range(LEVELS):
        left, right = tl.split(tl.reshape(x, (x.shape[0], x.shape[1] // 2, 2)))
        x = left + right
    return tl.reshape(x, (x.shape[0],))


@triton.jit
def _rms_norm_rows_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, rows, n, stride_x, stride_r, stride_o,
                          stride_ro, eps, HAS_RESIDUAL: tl.constexpr, IS_BF16: tl.constexpr, BLOCK: tl.constexpr,
                          LEVELS: tl.constexpr, ROWS: tl.constexpr, MEAN_RECIPROCAL: tl.constexpr):
    """RMSNorm of ROWS narrow rows (n <= BLOCK) per program: the sum of squares by ``_pairwise_row_sums``,
    so a row's bits depend on its width alone, not on ROWS or the warps."""
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    offs = tl.arange(0, BLOCK)[None, :]
    mask = (r < rows) & (offs < n)
    x = tl.load(x_ptr + r * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x = x + tl.load(res_ptr + r * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        if IS_BF16:
            x = round_to_bf16(x)
        tl.store(res_out_ptr + r * stride_ro + offs, to_activation(x, IS_BF16), mask=mask)
    sum_sq = zero_scalar() + _pairwise_row_sums(x * x, LEVELS)
    inv = _inverse_rms(sum_sq, n, eps, MEAN_RECIPROCAL)[:, None]
    w = tl.load(w_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * stride_o + offs, to_activation((x * inv) * w, IS_BF16), mask=mask)


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
                  spec: RmsNorm, rows_per_program: int | None = None, num_warps: int = 4, *,
                  plan_key: tuple | None = None):
    """``rms_norm`` for rows of 2..256 elements, many rows per program (default: a tile of 1024 elements,
    the fastest on the H200 at 128-wide rows). Launch choices never change the bits. ``rms_norm`` sends
    it rows of up to NARROW elements only: at 256 wide it was slower than one row per program. ``plan_key``:
    ``rms_norm``'s call signature, under which the launch is kept as that signature's plan."""
    weight = _contiguous_vector(weight)
    n = x.shape[-1]
    block = next_power_of_2(n)
    if n < 2 or block > min(256, spec.row_block):
        raise ValueError(f"rms_norm_rows: rows of {n} elements; it takes 2..{min(256, spec.row_block)}")
    rows_per_program = rows_per_program or max(1, 1024 // block)
    if rows_per_program & (rows_per_program - 1):
        raise ValueError(f"rms_norm_rows: rows_per_program must be a power of two, got {rows_per_program}")
    x2, res2, out, res_out = _norm_buffers(x, residual)
    if x2.shape[0]:
        args = (x2, res2, weight, out, res_out, x2.shape[0], n, x2.stride(0), res2.stride(0), out.stride(0),
                res_out.stride(0), _fp32(eps))
        _launch_and_plan(plan_key, _rms_norm_rows_kernel, (cdiv(x2.shape[0], rows_per_program),), args,
                         HAS_RESIDUAL=residual is not None, IS_BF16=x.dtype == torch.bfloat16, BLOCK=block,
                         LEVELS=block.bit_length() - 1, ROWS=rows_per_program,
                         MEAN_RECIPROCAL=spec.inv_rms == "mul_reciprocal_div_rn_sqrt_rn", num_warps=num_warps, **LAUNCH)
    return out.view(x.shape), (res_out.view(x.shape) if residual is not None else None)


def _norm_buffers(x: torch.Tensor, residual: torch.Tensor | None):
    """(x2, res2, out, res_out): x and the residual as rows, and the outputs to write. Without a residual,
    res2 is x2 and res_out is out (the kernels read and write neither)."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    out = torch.empty_like(x2)
    res2 = residual.reshape(-1, n) if residual is not None else x2
    res_out = torch.empty_like(x2) if residual is not None else out
    return x2, res2, out, res_out


@functools.lru_cache(maxsize=64)
def _fp32(value: float) -> float:
    """The fp32 value nearest ``value``, as a Python float (the kernels take eps as fp32)."""
    return float(torch.tensor(value, dtype=torch.float32))


@triton.jit(do_not_specialize=["n"])
def _reduce_kernel(x_ptr, out_ptr, n, stride_x, MEAN: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    total = _row_sum(x_ptr + row * stride_x, x_ptr, n, False, False, False, BLOCK)
    if MEAN:
        total = tl.div_rn(total, n.to(tl.float32))
    tl.store(out_ptr + row, total)


def reduce_last(x: torch.Tensor, mean: bool, spec: Reduce, num_warps: int = 4) -> torch.Tensor:
    """fp32 sum (or mean) over the last dim in row blocks of ``spec.row_block``."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    out = torch.empty(x2.shape[0], device=x.device, dtype=torch.float32)
    if x2.shape[0]:
        launch(_reduce_kernel, (x2.shape[0],),
               x2, out, n, x2.stride(0), MEAN=mean, BLOCK=min(spec.row_block, next_power_of_2(n)),
               num_warps=num_warps, **LAUNCH)
    return out.view(x.shape[:-1])


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, IS_BF16: tl.constexpr, BLOCK: tl.constexpr):
    """out = round_act(fl32(fl32(g / fl32(1 + exp(-g))) * u)) for [g | u] rows."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, to_activation(silu_mul_f32(g, u), IS_BF16), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    inter = gate_up.shape[-1] // 2
    x2 = gate_up.reshape(-1, 2 * inter)
    out = torch.empty((x2.shape[0], inter), device=gate_up.device, dtype=gate_up.dtype)
    block = min(1024, next_power_of_2(inter))
    if x2.shape[0]:
        launch(_silu_mul_kernel, (x2.shape[0], cdiv(inter, block)),
               x2, out, inter, x2.stride(0), out.stride(0), IS_BF16=gate_up.dtype == torch.bfloat16, BLOCK=block,
               **LAUNCH)
    return out.view(*gate_up.shape[:-1], inter)


@triton.jit
def _rotate_heads(src, dst, cos, sin, head_block, heads, head_dim, stride_h, stride_oh, HALF: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr, IS_BF16: tl.constexpr):
    """Neox rotary of BLOCK_H heads of one token: o1 = fl(fl(x1 c) - fl(x2 s)), o2 = fl(fl(x2 c) + fl(x1 s));
    dims >= 2*HALF copied. ``cos``, ``sin``: (1, BLOCK_HALF) fp32."""
    h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    i = tl.arange(0, BLOCK_HALF)[None, :]
    m = (h < heads) & (i < HALF)
    x1 = tl.load(src + h * stride_h + i, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + h * stride_h + HALF + i, mask=m, other=0.0).to(tl.float32)
    tl.store(dst + h * stride_oh + i, to_activation(x1 * cos - x2 * sin, IS_BF16), mask=m)
    tl.store(dst + h * stride_oh + HALF + i, to_activation(x2 * cos + x1 * sin, IS_BF16), mask=m)
    if BLOCK_D > 0:  # partial rotary: the dims past 2*HALF pass through
        d = 2 * HALF + tl.arange(0, BLOCK_D)[None, :]
        tail = (h < heads) & (d < head_dim)
        tl.store(dst + h * stride_oh + d, tl.load(src + h * stride_h + d, mask=tail, other=0.0), mask=tail)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, table_ptr, q_heads, k_heads, head_dim,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_oqt, stride_oqh, stride_okt, stride_okh,
                   stride_table, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                   BLOCK_D: tl.constexpr, IS_BF16: tl.constexpr):
    """One token's q and k heads, BLOCK_H of each per program (axis 1): the cos/sin row is read once for
    both. Pointwise: the tiling decides nothing about the bits."""
    token = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(table_ptr + pos * stride_table + i, mask=i < HALF, other=0.0)
    sin = tl.load(table_ptr + pos * stride_table + HALF + i, mask=i < HALF, other=0.0)
    _rotate_heads(q_ptr + token * stride_qt, q_out_ptr + token * stride_oqt, cos, sin, head_block, q_heads, head_dim,
                  stride_qh, stride_oqh, HALF, BLOCK_H, BLOCK_HALF, BLOCK_D, IS_BF16)
    _rotate_heads(k_ptr + token * stride_kt, k_out_ptr + token * stride_okt, cos, sin, head_block, k_heads, head_dim,
                  stride_kh, stride_okh, HALF, BLOCK_H, BLOCK_HALF, BLOCK_D, IS_BF16)


def _rows_of_heads(x: torch.Tensor) -> torch.Tensor:
    """x (T, H, D) with head_dim contiguous (the kernel indexes tokens and heads by stride): q and k
    sliced out of a fused QKV output need no copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
           table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox rotary of q (T, Hq, D) and k (T, Hk, D) in one launch; new contiguous outputs."""
    q, k = _rows_of_heads(q), _rows_of_heads(k)
    tokens, q_heads, head_dim = q.shape
    k_heads = k.shape[1]
    half = table.shape[-1] // 2
    q_out, k_out = torch.empty(q.shape, device=q.device, dtype=q.dtype), torch.empty(k.shape, device=k.device,
                                                                                        dtype=k.dtype)
    # 16 heads x 64 dims per program at head_dim 128: a token of a 1.7B/8B model in 1-2 programs (one
    # program per token and head, as before, was 4-5x slower than the bytes allow at 8192 tokens).
    block_h = min(16, next_power_of_2(max(q_heads, k_heads)))
    if tokens:
        launch(_rotary_kernel, (tokens, cdiv(max(q_heads, k_heads), block_h)),
               q, k, q_out, k_out, positions, table, q_heads, k_heads, head_dim, q.stride(0), q.stride(1),
               k.stride(0), k.stride(1), q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
               table.stride(0), HALF=half, BLOCK_H=block_h, BLOCK_HALF=next_power_of_2(half),
               BLOCK_D=next_power_of_2(head_dim - 2 * half) if head_dim > 2 * half else 0,
               IS_BF16=q.dtype == torch.bfloat16, **LAUNCH)
    return q_out, k_out


__all__ = ["rms_norm", "reduce_last", "silu_mul", "rotary", "round_to_bf16"]
