"""Block-FP8 experts (DeepSeek-V3's layout) as grouped GEMMs over expert-sorted slots, without a host
synchronisation, so a CUDA graph can capture the layer.

The steps, each giving a slot the bits of ``fp8_linear`` / ``silu_mul`` / ``fp8_linear`` of its token's
row alone (``hal.moe.fp8_expert_outputs``, what the reference computes):

1. the tokens' rows quantised per 1 x G group (``fp8_gemm.quantise_activations``): a group's scale and
   values come from that group alone, so quantising all T rows at once gives each row the bits
   quantising it alone gives, and a slot reads its token's quantised row;
2. the slots sorted by expert into tiles of BLOCK_M (``moe.sort_slots``, on the device);
3. the gate/up grouped GEMM (``_fp8_grouped_kernel`` with GATED): per tile, the rows gathered from
   the quantised tokens, K reduced as the dense FP8 GEMM does (``hal/kernels/fp8_gemm.py``): per K block
   of G one ``tl.dot`` of fp8 tiles from zero, then acc = fl32(acc + fl32(partial * fl32(a_scale *
   w_scale_inv))) in ascending block order from +0, for the gate columns and, beside them with the same
   A tiles, their up columns; the epilogue rounds both to the activation dtype and stores ``silu_mul`` of
   them rounded once (the row kernel's formula, ``silu_mul_f32``);
4. those activations quantised per group (row by row, as 1.), then the down grouped GEMM (fp32 out);
5. the [moe] rank-order combine (``moe.combine``).

Tiles (BLOCK_M, BLOCK_N, warps, stages) are free, as in the dense FP8 GEMM: each column's block partial
is its own dot of the same fp8 values, and the adds keep the order. Hopper's FP8 wgmma needs BLOCK_M >= 64.
The block partial, block scale and scaled add are ``fp8_gemm``'s own jit functions: one copy of the
reduction step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hal.contract import Fp8
from hal.errors import UnsupportedError
from hal.kernels import moe
from hal.kernels.common import INTERPRET, LAUNCH, cdiv, silu_mul_f32, to_activation
from hal.kernels.fp8_gemm import _block_partial, _scaled_add, quantise_activations
from hal.kernels.launcher import launch


@triton.jit
def _fp8_grouped_kernel(xq, xs_ptr, wq, ws_ptr, rows_ptr, tile_expert_ptr, out_ptr, N, K,
                        stride_xm, stride_xsm, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
                        GROUP: tl.constexpr, GATED: tl.constexpr, OUT_BF16: tl.constexpr, UPCAST: tl.constexpr,
                        X_SORTED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[p] = fp8 GEMM of xq[rows[p]] (scales xs) with expert e's wq[e] (scales ws[e]), e: the tile's
    expert. GATED: wq[e] is [gate; up] (2N rows) and out[p] = round(silu_mul(round(gate), round(up))).
    X_SORTED: xq's row p is position p (``rows`` then only marks the padding, < 0)."""
    pid_n = tl.program_id(0)          # column tiles fastest: a row tile's gathered rows stay in L2
    pid_m = tl.program_id(1)
    expert = tl.load(tile_expert_ptr + pid_m)
    if expert >= 0:                   # tiles past the last expert's run: nothing to do
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rows = tl.load(rows_ptr + offs_m)
        row_ok = rows >= 0            # padding positions: read as zeros, never stored
        if X_SORTED:
            rows = offs_m
        rows = rows.to(tl.int64)
        n_first = pid_n * BLOCK_N
        offs_n = n_first + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        w_e = wq + expert.to(tl.int64) * stride_we
        s_e = ws_ptr + expert.to(tl.int64) * stride_wse
        w_up = w_e + N * stride_wn                      # GATED: the up rows N + n and their scale rows
        s_up = s_e + (N // GROUP) * stride_wsn          # (N is whole blocks: the host checks it)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # ascending K blocks from +0: acc = fl32(acc + fl32(partial * fl32(a_scale * w_scale_inv)))
        for kb in range(0, K // GROUP):
            partial = _block_partial(xq, w_e, rows, offs_n, row_ok, n_ok, pid_m, n_first, kb, stride_xm, 1,
                                     stride_wn, 1, GROUP, UPCAST, False, BLOCK_M)
            acc = _scaled_add(acc, partial, xs_ptr, s_e, rows, offs_n, row_ok, n_ok, n_first, kb, stride_xsm, 1,
                              stride_wsn, 1, GROUP, BLOCK_N)
            if GATED:
                partial_up = _block_partial(xq, w_up, rows, offs_n, row_ok, n_ok, pid_m, n_first, kb, stride_xm, 1,
                                            stride_wn, 1, GROUP, UPCAST, False, BLOCK_M)
                acc_up = _scaled_add(acc_up, partial_up, xs_ptr, s_up, rows, offs_n, row_ok, n_ok, n_first, kb,
                                     stride_xsm, 1, stride_wsn, 1, GROUP, BLOCK_N)
        if GATED:
            gate = to_activation(acc, OUT_BF16).to(tl.float32)
            up = to_activation(acc_up, OUT_BF16).to(tl.float32)
            acc = silu_mul_f32(gate, up)
        tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :], to_activation(acc, OUT_BF16),
                 mask=row_ok[:, None] & n_ok[None, :])


#: The launch (free: the bits do not depend on it). BLOCK_M >= 64 for Hopper's FP8 wgmma; a gated
#: column reduces a gate and an up row, so its tile is half as wide. Not tuned yet: bench/fp8_moe_gpu.py
#: times and bit-checks ``CANDIDATES`` on the GPU.
DEFAULT_CONFIG = dict(BLOCK_M=64, GATE_BLOCK_N=64, DOWN_BLOCK_N=128, num_warps=4, num_stages=3)
INTERPRETER_CONFIG = dict(BLOCK_M=16, GATE_BLOCK_N=32, DOWN_BLOCK_N=64, num_warps=4, num_stages=1)
CANDIDATES = [dict(BLOCK_M=bm, GATE_BLOCK_N=gbn, DOWN_BLOCK_N=dbn, num_warps=w, num_stages=s)
              for bm in (64, 128) for gbn, dbn in ((32, 64), (64, 128), (128, 128)) for w in (4, 8) for s in (3, 4)
              if not (bm == 128 and gbn == 128 and w == 4)]


def grouped_linear(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale_inv: torch.Tensor,
                   rows: torch.Tensor, sorted_slots: moe.SortedSlots, out_dtype: torch.dtype, spec: Fp8,
                   block_n: int, num_warps: int, num_stages: int, *, x_sorted: bool = False,
                   gated: bool = False) -> torch.Tensor:
    """(P, N) ``out_dtype``: sorted position p holds the FP8 GEMM of ``xq[rows[p]]`` with its tile's expert
    (``gated``: silu_mul of the rounded gate and up halves of wq (E, 2N, K)); padding rows are never written.
    xq (R, K) fp8 with x_scale (R, K/G); wq (E, N or 2N, K) fp8 with w_scale_inv (E, rows/G, K/G)."""
    e, n, k = wq.shape
    group = spec.activation_group
    if gated:
        n //= 2
    if n % group or k % group:
        raise UnsupportedError(f"fp8 grouped GEMM: N = {n} and K = {k} must be whole {group}-blocks")
    p = sorted_slots.positions
    # no zero fill on the GPU (padding rows are never read into a stored output); the interpreter's numpy
    # warns about the overflows that uninitialised rows give, so zero them there
    out = (torch.zeros if INTERPRET else torch.empty)((p, n), device=xq.device, dtype=out_dtype)
    if p == 0 or n == 0:
        return out
    grid = (cdiv(n, block_n), p // sorted_slots.block_m)
    if grid[1] > 65535:   # CUDA's limit on a grid's second axis
        raise UnsupportedError(f"fp8 grouped GEMM: {grid[1]} row tiles of {sorted_slots.block_m} exceed 65535; "
                               f"pass fewer tokens per call")
    launch(_fp8_grouped_kernel, grid,
           xq, x_scale, wq, w_scale_inv, rows, sorted_slots.tile_expert, out, n, k, xq.stride(0), x_scale.stride(0),
           wq.stride(0), wq.stride(1), w_scale_inv.stride(0), w_scale_inv.stride(1), out.stride(0),
           GROUP=group, GATED=gated, OUT_BF16=out_dtype == torch.bfloat16, UPCAST=INTERPRET, X_SORTED=x_sorted,
           BLOCK_M=sorted_slots.block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages, **LAUNCH)
    return out


def experts(x: torch.Tensor, w13: torch.Tensor, w13_scale_inv: torch.Tensor, w2: torch.Tensor,
            w2_scale_inv: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
            shared: torch.Tensor | None, spec: Fp8, config: dict | None = None, *,
            slot_tiles: bool | None = None) -> torch.Tensor:
    """The expert half of a block-FP8 MoE layer (the module docstring's five steps), ``x.dtype`` (T, H).
    ``config``: the launch (``DEFAULT_CONFIG``'s keys); ``slot_tiles``: ``moe.sort_slots``'."""
    cfg = dict(INTERPRETER_CONFIG if INTERPRET else DEFAULT_CONFIG, **(config or {}))
    num_experts = w13.shape[0]
    xq, xs = quantise_activations(x.contiguous(), spec)
    slots = moe.sort_slots(topk_ids, num_experts, cfg["BLOCK_M"], slot_tiles=slot_tiles)
    w13, w13_scale_inv = w13.contiguous(), w13_scale_inv.contiguous()
    w2, w2_scale_inv = w2.contiguous(), w2_scale_inv.contiguous()
    act = grouped_linear(xq, xs, w13, w13_scale_inv, slots.token, slots, x.dtype, spec, cfg["GATE_BLOCK_N"],
                         cfg["num_warps"], cfg["num_stages"], gated=True)
    # the activations in sorted order, quantised row by row (padding rows too: each group is its own, and
    # no stored output reads them)
    aq, as_ = quantise_activations(act, spec)
    down = grouped_linear(aq, as_, w2, w2_scale_inv, slots.token, slots, torch.float32, spec, cfg["DOWN_BLOCK_N"],
                          cfg["num_warps"], cfg["num_stages"], x_sorted=True)
    return moe.combine(down, slots.position, topk_weights, shared, x.dtype)
