"""Mixture-of-experts kernels ([moe]; the steps are written out in ``hal/moe.py``): routing, and the
grouped expert GEMM over token-sorted slots.

Routing: ROUTE_ROWS token rows per program, each row one tile row of E_PAD lanes reduced along its
own lanes only: every row gets the same reduction tree whichever program and tile row it lands in,
so nothing about a row's bits depends on the other rows or on the batch size.

Grouped GEMM (``grouped_linear``): the (token, rank) slots are sorted by expert and each expert's run
padded to whole BLOCK_M tiles (``sort_slots``, on the GPU, no host synchronisation); a program owns
one (BLOCK_M, BLOCK_N) tile of one expert, gathers its rows, and reduces K exactly as the dense GEMM
(``hal/kernels/gemm.py``, direct launch): chunks of K_CHUNK at absolute offsets, each from zero by
``tl.dot`` steps, chunk sums added in ascending order from +0, one rounding. A slot's output is
therefore the dense ``linear`` of its token's row alone: which tokens share the expert, how many
there are and where the expert sits change only which tile the row lands in, never its bits. Decode
batches skip the sort (``sort_slots``' slot tiles: each slot a tile of its own) for the same reason.

Routing reduction structure:
  softmax: max over the row (exact), e = exp(fl32(x - max)), S = one ``tl.sum`` over the E_PAD lanes
  (masked lanes hold 0; the tree is fixed by E_PAD: the [reduce] row block when E <= row_block, which
  is the only case launched), p = div_rn(e, S). Sigmoid: div_rn(1, fl32(1 + exp(-x))).
  top-k: TOP_K rounds of (row max, lowest index holding it, remove it): ties to the lower index,
  ranks in value-descending order; group-limited routing the same over group scores fl32(a + b) of
  each group's two best. The renormalising sum adds the chosen weights in rank order (rank 0 first).
No FMA: every launch passes ``enable_fp_fusion=False``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hal.contract import Gemm, Reduce
from hal.errors import UnsupportedError
from hal.kernels.common import INTERPRET, LAUNCH, cdiv, next_power_of_2, silu_mul_f32, to_activation
from hal.kernels.launcher import launch
from hal.kernels.gemm import _tma_ok
from hal.kernels.policy import LaunchPolicy


@triton.jit
def _best(values, offs, BIG: tl.constexpr):
    """(each row's max of ``values`` (ROWS, L), the lowest lane holding it), both (ROWS, 1)."""
    best = tl.max(values, axis=1, keep_dims=True)
    return best, tl.min(tl.where(values == best, offs, BIG), axis=1, keep_dims=True)


@triton.jit(do_not_specialize=["num_tokens", "num_experts", "scaling"])
def _route_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_tokens, num_experts, stride_l, scaling,
                  SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr, SCALE: tl.constexpr,
                  TOP_K: tl.constexpr, K_PAD: tl.constexpr, GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr,
                  GROUP_SIZE: tl.constexpr, G_PAD: tl.constexpr, E_PAD: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < num_tokens
    offs = tl.arange(0, E_PAD)[None, :]
    lane_ok = offs < num_experts
    x = tl.load(logits_ptr + rows[:, None] * stride_l + offs, mask=row_ok[:, None] & lane_ok, other=0.0)
    x = tl.where(lane_ok, x, float("-inf"))           # rows past the batch hold zeros: computed, never stored
    if SOFTMAX:
        e = tl.where(lane_ok, tl.exp(x - tl.max(x, axis=1, keep_dims=True)), 0.0)
        scores = tl.div_rn(e, tl.sum(e, axis=1, keep_dims=True))
    else:
        scores = tl.div_rn(1.0, 1.0 + tl.exp(-x))
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + offs, mask=lane_ok, other=0.0)
    choice = tl.where(lane_ok, choice, float("-inf"))

    if GROUPS > 1:
        group_offs = tl.arange(0, G_PAD)[None, :]
        group_scores = tl.full((ROWS, G_PAD), float("-inf"), tl.float32)
        for g in tl.static_range(GROUPS):
            in_group = (offs >= g * GROUP_SIZE) & (offs < (g + 1) * GROUP_SIZE)
            first, at = _best(tl.where(in_group, choice, float("-inf")), offs, E_PAD)
            second = tl.max(tl.where(in_group & (offs != at), choice, float("-inf")), axis=1, keep_dims=True)
            group_scores = tl.where(group_offs == g, first + second, group_scores)
        kept = tl.zeros((ROWS, E_PAD), tl.int32) != 0     # all False
        for _ in tl.static_range(TOPK_GROUPS):
            _, g = _best(group_scores, group_offs, G_PAD)
            kept = kept | ((offs >= g * GROUP_SIZE) & (offs < (g + 1) * GROUP_SIZE))
            group_scores = tl.where(group_offs == g, float("-inf"), group_scores)
        choice = tl.where(kept, choice, float("-inf"))    # selected out: never chosen

    rank_offs = tl.arange(0, K_PAD)[None, :]
    weights = tl.zeros((ROWS, K_PAD), tl.float32)
    ids = tl.zeros((ROWS, K_PAD), tl.int32)
    for r in tl.static_range(TOP_K):
        _, at = _best(choice, offs, E_PAD)
        weight = tl.sum(tl.where(offs == at, scores, 0.0), axis=1, keep_dims=True)   # the one chosen lane: exact
        weights = tl.where(rank_offs == r, weight, weights)
        ids = tl.where(rank_offs == r, at, ids)
        choice = tl.where(offs == at, float("-inf"), choice)
    if RENORMALIZE:
        total = tl.sum(tl.where(rank_offs == 0, weights, 0.0), axis=1, keep_dims=True)
        for r in tl.static_range(1, TOP_K):
            total = total + tl.sum(tl.where(rank_offs == r, weights, 0.0), axis=1, keep_dims=True)
        weights = tl.div_rn(weights, total)
    if SCALE:
        weights = weights * scaling
    keep = row_ok[:, None] & (rank_offs < TOP_K)
    tl.store(weights_ptr + rows[:, None] * TOP_K + rank_offs, weights, mask=keep)
    tl.store(ids_ptr + rows[:, None] * TOP_K + rank_offs, ids, mask=keep)


#: token rows per routing program: one per warp, so each row's reductions stay inside its warp (one
#: row per program of four warps reduced through shared memory: 47 us at 8192 tokens on the H200; four
#: rows 9.6 us, vLLM's topkGating 9.5 us: bench/results/h200-2026-12-04-session16). Fixed, never chosen
#: by the batch: a row's tree is the same in any program.
ROUTE_ROWS = 4


def route(router_logits: torch.Tensor, routing, correction_bias: torch.Tensor | None,
          spec: Reduce) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 weights (T, k), int32 ids (T, k)) of fp32 router logits (T, E); see the module docstring."""
    t, num_experts = router_logits.shape
    if num_experts > spec.row_block:
        raise UnsupportedError(f"cuda moe_route: {num_experts} experts exceed [reduce].row_block "
                               f"({spec.row_block}); the routing kernel sums a row's exps in one block")
    logits = router_logits.contiguous()
    weights = torch.empty(t, routing.top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, routing.top_k, dtype=torch.int32, device=logits.device)
    bias = correction_bias.float().contiguous() if correction_bias is not None else logits
    if t:
        launch(_route_kernel, (cdiv(t, ROUTE_ROWS),), logits, bias, weights, ids, t, num_experts, logits.stride(0),
               float(routing.scaling),
               SOFTMAX=routing.scoring == "softmax", HAS_BIAS=correction_bias is not None,
               RENORMALIZE=routing.renormalize, SCALE=routing.scaling != 1.0, TOP_K=routing.top_k,
               K_PAD=next_power_of_2(routing.top_k), GROUPS=routing.num_groups, TOPK_GROUPS=routing.topk_groups,
               GROUP_SIZE=num_experts // routing.num_groups, G_PAD=next_power_of_2(routing.num_groups),
               E_PAD=next_power_of_2(num_experts), ROWS=ROUTE_ROWS, num_warps=ROUTE_ROWS, **LAUNCH)
    return weights, ids


# ---------------------------------------------------------------------------------------------
# The grouped expert GEMM
# ---------------------------------------------------------------------------------------------

@triton.jit
def _x_tile(x, rows, row_ok, pid_m, ks, k0, K, stride_xm, X_TMA: tl.constexpr, UPCAST: tl.constexpr,
            BLOCK_M: tl.constexpr):
    """The (BLOCK_M, BLOCK_K) A tile of one K step: the tile's rows of ``x`` by descriptor (sorted rows) or
    gathered by pointer (``rows``; padding rows read as zeros)."""
    if X_TMA:
        a = x.load([pid_m * BLOCK_M, k0])
    else:
        a = tl.load(x + rows.to(tl.int64)[:, None] * stride_xm + ks[None, :],
                    mask=row_ok[:, None] & (ks[None, :] < K), other=0.0)
    if UPCAST:  # the interpreter cannot do bf16 arithmetic; the upcast is exact
        a = a.to(tl.float32)
    return a


@triton.jit
def _mma(a, b, acc, FP32_INPUTS: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b (b upcast to fp32 in the interpreter, as ``_x_tile`` does a); fp32 operands exactly."""
    if UPCAST:
        b = b.to(tl.float32)
    if FP32_INPUTS or UPCAST:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _dot_step(a, w, w_e, w_row, offs_n, ks, k0, N, K, stride_wn, acc, FP32_INPUTS: tl.constexpr,
              UPCAST: tl.constexpr, W_TMA: tl.constexpr):
    """acc + a @ (weight rows from ``w_row`` (descriptor) / ``w_e`` (pointer), columns ``ks``).T: one BLOCK_K step."""
    if W_TMA:
        b = w.load([w_row, k0]).T
    else:
        b = tl.load(w_e + offs_n[None, :] * stride_wn + ks[:, None],
                    mask=(offs_n[None, :] < N) & (ks[:, None] < K), other=0.0)
    return _mma(a, b, acc, FP32_INPUTS, UPCAST)


@triton.jit
def _wide_gated(x, w, rows, row_ok, out_ptr, pid_m, pid_n, expert, N, K, stride_xm, stride_we, stride_wn, stride_om,
                offs_m, K_CHUNK: tl.constexpr, OUT_BF16: tl.constexpr, FP32_INPUTS: tl.constexpr, UPCAST: tl.constexpr,
                W_TMA: tl.constexpr, X_TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """The GATED program of ``_grouped_gemm_kernel`` with WIDE: output column c < BLOCK_N is gate column
    pid_n BLOCK_N + c, column BLOCK_N + c its up column; K reduced as there (chunk sums from +0, added in
    ascending order), then the same epilogue."""
    offs_c = tl.arange(0, 2 * BLOCK_N)
    col = pid_n * BLOCK_N + offs_c % BLOCK_N              # the gate/up column of each MMA column
    w_rows = (offs_c // BLOCK_N) * N + col                # its weight row inside the expert's [gate; up]
    w_e = w
    if not W_TMA:
        w_e = w + expert.to(tl.int64) * stride_we
    offs_k = tl.arange(0, BLOCK_K)
    total = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        a = _x_tile(x, rows, row_ok, pid_m, ks, k0, K, stride_xm, X_TMA, UPCAST, BLOCK_M)
        if W_TMA:
            b = w.load([2 * expert, pid_n * BLOCK_N, k0]).reshape(2 * BLOCK_N, BLOCK_K).T
        else:
            b = tl.load(w_e + w_rows[None, :] * stride_wn + ks[:, None],
                        mask=(col[None, :] < N) & (ks[:, None] < K), other=0.0)
        acc = _mma(a, b, acc, FP32_INPUTS, UPCAST)
        if ((k0 + BLOCK_K) % K_CHUNK == 0) | (k0 + BLOCK_K >= K):   # the chunk's last step
            total = total + acc
            acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
    rounded = to_activation(total, OUT_BF16).to(tl.float32)
    # column h BLOCK_N + j -> [j, h]: the gate (h = 0) and up (h = 1) halves, moved, not computed
    gate, up = tl.split(tl.permute(tl.reshape(rounded, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
             to_activation(silu_mul_f32(gate, up), OUT_BF16), mask=row_ok[:, None] & (offs_n[None, :] < N))


@triton.jit
def _grouped_gemm_kernel(x, w, rows_ptr, tile_expert_ptr, out_ptr, num_tiles, N, K,
                         stride_xm, stride_we, stride_wn, stride_om,
                         K_CHUNK: tl.constexpr, OUT_BF16: tl.constexpr, FP32_INPUTS: tl.constexpr,
                         UPCAST: tl.constexpr, W_TMA: tl.constexpr, X_TMA: tl.constexpr, X_SORTED: tl.constexpr,
                         GATED: tl.constexpr, WIDE: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[p] = x[rows[p]] @ w[e].T for the sorted positions p of each tile (e: the tile's expert).
    GATED (the gate/up projection, w[e] = [gate; up] of 2N rows): the program also reduces the up
    rows N + n of its gate columns n, beside them in the same K loop (the same A tiles), and stores
    ``silu_mul`` of the two rounded results: act[p, n] = round(silu(round(g)) * round(u)), the bits of
    the gate/up linear rounded to the activation dtype and then the row kernel, without writing
    the (P, 2N) gate/up rows. WIDE (GATED only): one dot over the 2 BLOCK_N rows [gate; up] instead of
    two of BLOCK_N (one MMA twice as wide: the A tile is read once per step, not twice); each output
    column is still its own dot, so the bits are the same; with W_TMA ``w`` is then a descriptor of the
    (2E, N, K) view with (2, BLOCK_N, BLOCK_K) blocks, the expert's gate and up rows in one load.
    W_TMA: ``w`` is a tensor descriptor of the (E*N, K) view with (BLOCK_N, BLOCK_K) blocks; a tile
    past N reads the next expert's rows into columns that are never stored (each output column is
    its own dot). X_TMA (the down projection, whose rows are the sorted positions themselves): ``x``
    is a descriptor of (P, K) with (BLOCK_M, BLOCK_K) blocks; its padding rows hold whatever was
    there (never written) where the masked pointer loads read zeros, which reaches only those rows'
    outputs (each MMA row is its own dot), never stored. Every slot's row meets the same values in the
    same MMAs either way."""
    # column tiles fastest: the programs of one row tile run side by side, so its gathered rows are
    # read from HBM once and then from L2 (row tiles fastest re-read them per column tile: 1.3-1.6x
    # slower than the dense GEMM on as many rows, H200 session 15)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    expert = tl.load(tile_expert_ptr + pid_m)
    if expert >= 0:                                   # tiles past the last expert's run: nothing to do
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        rows = tl.load(rows_ptr + offs_m)
        row_ok = rows >= 0                            # padding positions: store nothing
        if X_SORTED:                                  # x's row p is position p (rows: the tokens, for row_ok)
            rows = offs_m
        w_e = w                                       # the expert's gate (or only) rows, and its up rows
        w_up = w
        if not W_TMA:
            w_e = w + expert.to(tl.int64) * stride_we
            w_up = w_e + N * stride_wn
        if WIDE:
            _wide_gated(x, w, rows, row_ok, out_ptr, pid_m, pid_n, expert, N, K, stride_xm, stride_we, stride_wn,
                        stride_om, offs_m, K_CHUNK, OUT_BF16, FP32_INPUTS, UPCAST, W_TMA, X_TMA, BLOCK_M, BLOCK_N,
                        BLOCK_K)
        else:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            total_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)    # GATED only
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + offs_k
                a = _x_tile(x, rows, row_ok, pid_m, ks, k0, K, stride_xm, X_TMA, UPCAST, BLOCK_M)
                acc = _dot_step(a, w, w_e, expert * (2 * N if GATED else N) + pid_n * BLOCK_N, offs_n, ks, k0, N, K,
                                stride_wn, acc, FP32_INPUTS, UPCAST, W_TMA)
                if GATED:
                    acc_up = _dot_step(a, w, w_up, expert * 2 * N + N + pid_n * BLOCK_N, offs_n, ks, k0,
                                       N, K, stride_wn, acc_up, FP32_INPUTS, UPCAST, W_TMA)
                if ((k0 + BLOCK_K) % K_CHUNK == 0) | (k0 + BLOCK_K >= K):   # the chunk's last step
                    total = total + acc
                    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                    if GATED:
                        total_up = total_up + acc_up
                        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            if GATED:
                gate = to_activation(total, OUT_BF16).to(tl.float32)
                up = to_activation(total_up, OUT_BF16).to(tl.float32)
                total = silu_mul_f32(gate, up)
            tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
                     to_activation(total, OUT_BF16), mask=row_ok[:, None] & (offs_n[None, :] < N))


@dataclass(frozen=True)
class SortedSlots:
    """The (token, rank) slots of one MoE call sorted by expert, each expert's run padded to whole
    tiles of ``block_m`` positions. ``token[p]``: the token at sorted position p (-1: padding);
    ``position[t, r]``: where slot (t, r) sits; ``tile_expert[i]``: the expert of tile i (-1: unused)."""

    block_m: int
    token: torch.Tensor          # (P,) int32
    position: torch.Tensor       # (T, k) int64
    tile_expert: torch.Tensor    # (P // block_m,) int32

    @property
    def positions(self) -> int:
        return self.token.shape[0]


@triton.jit
def _one_hot(ids_ptr, chunk, slots, CHUNK: tl.constexpr, E_PAD: tl.constexpr):
    """(slot indices, their expert ids, (CHUNK, E_PAD) int32 one-hot) of one chunk of the flat slots;
    slots past the end have the id E_PAD and an all-zero row."""
    j = chunk * CHUNK + tl.arange(0, CHUNK)
    e = tl.load(ids_ptr + j, mask=j < slots, other=E_PAD)
    return j, e, (e[:, None] == tl.arange(0, E_PAD)[None, :]).to(tl.int32)


@triton.jit
def _slot_counts_kernel(ids_ptr, counts_ptr, slots, CHUNK: tl.constexpr, E_PAD: tl.constexpr):
    """counts[c, e]: the slots of chunk c routed to expert e."""
    c = tl.program_id(0)
    _, _, onehot = _one_hot(ids_ptr, c, slots, CHUNK, E_PAD)
    tl.store(counts_ptr + c * E_PAD + tl.arange(0, E_PAD), tl.sum(onehot, axis=0))


@triton.jit
def _runs(counts, BLOCK_M: tl.constexpr):
    """Each expert's run of whole tiles from its slot count (lanes past the experts: 0 slots, empty runs):
    (run_start, run_end)."""
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    run_end = tl.cumsum(padded, axis=0)
    return run_end - padded, run_end


@triton.jit
def _store_run_padding(token_ptr, run_start, run_end, counts, BLOCK_M: tl.constexpr):
    """token -1 at the padding positions at the end of each expert's run."""
    pad = run_start[:, None] + counts[:, None] + tl.arange(0, BLOCK_M)[None, :]
    tl.store(token_ptr + pad, tl.full(pad.shape, -1, tl.int32), mask=pad < run_end[:, None])


@triton.jit
def _store_tile_experts(run_end, tile_expert_ptr, token_ptr, tiles, num_tiles, num_experts, BLOCK_M: tl.constexpr):
    """The expert of each of ``tiles``: how many runs end at or before its first position (empty runs
    included); -1, and token -1 over the whole tile, past the last run."""
    first = tiles * BLOCK_M
    ended = tl.sum((run_end[None, :] <= first[:, None]).to(tl.int32), axis=1)
    expert = tl.where(ended < num_experts, ended, -1)
    tl.store(tile_expert_ptr + tiles, expert, mask=tiles < num_tiles)
    unused = first[:, None] + tl.arange(0, BLOCK_M)[None, :]
    tl.store(token_ptr + unused, tl.full(unused.shape, -1, tl.int32),
             mask=(tiles[:, None] < num_tiles) & (expert[:, None] < 0))


@triton.jit
def _store_slots(token_ptr, position_ptr, j, position, slots, TOP_K: tl.constexpr):
    valid = j < slots
    tl.store(position_ptr + j, position.to(tl.int64), mask=valid)
    tl.store(token_ptr + position, (j // TOP_K).to(tl.int32), mask=valid)


@triton.jit
def _slot_sort_one_program(ids_ptr, token_ptr, position_ptr, tile_expert_ptr, slots, num_experts, num_tiles,
                           TOP_K: tl.constexpr, CHUNK: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                           TILE_BLOCK: tl.constexpr):
    """The whole sort in one program when every slot fits one chunk (decode batches: three launches
    cost more than the work)."""
    j, e, onehot = _one_hot(ids_ptr, 0, slots, CHUNK, E_PAD)
    counts = tl.sum(onehot, axis=0)
    run_start, run_end = _runs(counts, BLOCK_M)
    _store_run_padding(token_ptr, run_start, run_end, counts, BLOCK_M)
    rank = tl.sum((tl.cumsum(onehot, axis=0) - onehot) * onehot, axis=1)
    _store_slots(token_ptr, position_ptr, j, tl.sum(onehot * run_start[None, :], axis=1) + rank, slots, TOP_K)
    for t0 in range(0, num_tiles, TILE_BLOCK):
        _store_tile_experts(run_end, tile_expert_ptr, token_ptr, t0 + tl.arange(0, TILE_BLOCK), num_tiles,
                            num_experts, BLOCK_M)


@triton.jit
def _slot_runs_kernel(counts_ptr, base_ptr, run_start_ptr, run_end_ptr, token_ptr, chunks,
                      BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK_BLOCK: tl.constexpr):
    """One program: base[c, e] = expert e's slots in chunks before c; each expert's run of whole tiles
    [run_start[e], run_end[e]); token -1 at the padding positions at the end of each run."""
    experts = tl.arange(0, E_PAD)
    blocks = tl.arange(0, CHUNK_BLOCK)
    running = tl.zeros((E_PAD,), tl.int32)
    for c0 in range(0, chunks, CHUNK_BLOCK):
        c = c0 + blocks
        at = c[:, None] * E_PAD + experts[None, :]
        counts = tl.load(counts_ptr + at, mask=c[:, None] < chunks, other=0)
        tl.store(base_ptr + at, running[None, :] + tl.cumsum(counts, axis=0) - counts, mask=c[:, None] < chunks)
        running += tl.sum(counts, axis=0)
    run_start, run_end = _runs(running, BLOCK_M)
    tl.store(run_start_ptr + experts, run_start)
    tl.store(run_end_ptr + experts, run_end)
    _store_run_padding(token_ptr, run_start, run_end, running, BLOCK_M)


@triton.jit
def _slot_scatter_kernel(ids_ptr, base_ptr, run_start_ptr, run_end_ptr, token_ptr, position_ptr, tile_expert_ptr,
                         slots, chunks, num_experts, num_tiles, TOP_K: tl.constexpr, CHUNK: tl.constexpr,
                         E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, TILE_BLOCK: tl.constexpr):
    """Program c: the sorted position of each slot of chunk c (its expert's run start + the expert's
    slots in earlier chunks + the earlier slots of its own chunk with that expert: a stable counting
    sort), and the experts of tiles [c TILE_BLOCK, (c + 1) TILE_BLOCK)."""
    c = tl.program_id(0)
    if c < chunks:
        j, e, onehot = _one_hot(ids_ptr, c, slots, CHUNK, E_PAD)
        rank = tl.sum((tl.cumsum(onehot, axis=0) - onehot) * onehot, axis=1)
        e = tl.where(j < slots, e, 0)
        position = tl.load(run_start_ptr + e) + tl.load(base_ptr + c * E_PAD + e) + rank
        _store_slots(token_ptr, position_ptr, j, position, slots, TOP_K)
    if c * TILE_BLOCK < num_tiles:
        _store_tile_experts(tl.load(run_end_ptr + tl.arange(0, E_PAD)), tile_expert_ptr, token_ptr,
                            c * TILE_BLOCK + tl.arange(0, TILE_BLOCK), num_tiles, num_experts, BLOCK_M)


@triton.jit
def _slot_tiles_kernel(token_ptr, position_ptr, slots, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK: tl.constexpr):
    """Tile j holds slot j alone, at its first row: position[j] = j BLOCK_M, token[j BLOCK_M] = j // TOP_K,
    token -1 on the tile's other rows (``sort_slots``' slot tiles)."""
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = j < slots
    tl.store(position_ptr + j, j.to(tl.int64) * BLOCK_M, mask=ok)
    row = tl.arange(0, BLOCK_M)[None, :]
    tl.store(token_ptr + j[:, None] * BLOCK_M + row, tl.where(row == 0, (j // TOP_K)[:, None], -1),
             mask=ok[:, None])


#: slots per expert up to which ``sort_slots`` gives each slot a tile of its own instead of sorting: a
#: decode batch touches about as many experts as it has slots, so a sort groups almost nothing and costs
#: a launch of dependent steps plus a grid sized for the worst routing (E (BLOCK_M - 1) padding rows:
#: 121 row tiles for the 8 slots of one Qwen3-30B-A3B token). vLLM's fused MoE takes the same shortcut
#: at the same bound (its "naive block assignment", slots * 4 <= experts). bench/moe_gpu.py --slot-tiles
#: times both layouts and checks their bits.
SLOT_TILES_MAX_PER_EXPERT = 0.25


def takes_slot_tiles(slots: int, num_experts: int) -> bool:
    """Whether ``sort_slots`` gives ``slots`` slots over ``num_experts`` experts slot tiles by default."""
    return slots <= SLOT_TILES_MAX_PER_EXPERT * num_experts

#: warps of the one-program sort (free: it counts and scans integers, exact in any order; bench/moe_gpu.py
#: --sort-warps times them)
ONE_PROGRAM_SORT_WARPS = 4


def sort_slots(ids: torch.Tensor, num_experts: int, block_m: int, *, slot_tiles: bool | None = None) -> SortedSlots:
    """Sort the slots by expert on the device, without a host synchronisation (so a CUDA graph can
    capture it): the padded length is the bound T*k + E*(block_m - 1) rounded up to a tile, whatever
    the routing. A stable counting sort: one program when the slots fit one chunk, else three kernels
    (per-chunk expert counts; one program for the runs and their padding; the scatter and the tiles'
    experts), not ``torch.sort`` + ``searchsorted`` (about ten kernels: 20-40 us at 1-64 tokens on the
    H200). The order of the slots inside an expert's run does not change any bits (each row is its own
    GEMM); it is the stable order anyway.

    ``slot_tiles`` (default: at most SLOT_TILES_MAX_PER_EXPERT slots per expert): no sort, tile j is slot j
    alone (its expert ``ids`` itself, its row j // k at the tile's first position, T k tiles). Each row is
    still its own GEMM, so the bits are those of the sorted layout; slots of one expert read its weights
    once per tile instead of once."""
    t, k = ids.shape
    device = ids.device
    slots = t * k
    flat = ids.reshape(-1).to(torch.int32).contiguous()
    if slot_tiles is None:
        slot_tiles = takes_slot_tiles(slots, num_experts)
    if slot_tiles:
        token = torch.empty(slots * block_m, dtype=torch.int32, device=device)
        position = torch.empty(slots, dtype=torch.long, device=device)
        if slots:
            block = min(64, max(16, next_power_of_2(slots)))
            launch(_slot_tiles_kernel, (cdiv(slots, block),), token, position, slots, TOP_K=k, BLOCK_M=block_m,
                   BLOCK=block, num_warps=1, **LAUNCH)
        return SortedSlots(block_m, token, position.view(t, k), flat)
    e_pad = next_power_of_2(num_experts)
    chunk = max(16, min(256, 16384 // e_pad))        # a (chunk, E_PAD) one-hot per program
    chunks = max(1, cdiv(slots, chunk))
    total = -(-(slots + num_experts * (block_m - 1)) // block_m) * block_m
    num_tiles = total // block_m
    token = torch.empty(total, dtype=torch.int32, device=device)
    position = torch.empty(slots, dtype=torch.long, device=device)
    tile_expert = torch.empty(num_tiles, dtype=torch.int32, device=device)
    if chunks == 1:
        # a one-hot only as tall as the slots (8 at one token of top-8: the 128-row one's scan took 9 us on
        # the H200, three times the rest of the sort)
        launch(_slot_sort_one_program, (1,), flat, token, position, tile_expert, slots, num_experts, num_tiles,
               TOP_K=k, CHUNK=max(16, next_power_of_2(slots)), E_PAD=e_pad, BLOCK_M=block_m,
               TILE_BLOCK=max(16, 4096 // max(e_pad, block_m)), num_warps=ONE_PROGRAM_SORT_WARPS, **LAUNCH)
        return SortedSlots(block_m, token, position.view(t, k), tile_expert)
    counts = torch.empty((chunks, e_pad), dtype=torch.int32, device=device)
    base = torch.empty_like(counts)
    run_start = torch.empty(e_pad, dtype=torch.int32, device=device)
    run_end = torch.empty_like(run_start)
    tile_block = 16
    launch(_slot_counts_kernel, (chunks,), flat, counts, slots, CHUNK=chunk, E_PAD=e_pad, num_warps=4, **LAUNCH)
    launch(_slot_runs_kernel, (1,), counts, base, run_start, run_end, token, chunks, BLOCK_M=block_m, E_PAD=e_pad,
           CHUNK_BLOCK=max(1, 16384 // e_pad), num_warps=8, **LAUNCH)
    launch(_slot_scatter_kernel, (max(chunks, cdiv(num_tiles, tile_block)),), flat, base, run_start, run_end, token,
           position, tile_expert, slots, chunks, num_experts, num_tiles, TOP_K=k, CHUNK=chunk, E_PAD=e_pad,
           BLOCK_M=block_m, TILE_BLOCK=tile_block, num_warps=4, **LAUNCH)
    return SortedSlots(block_m, token, position.view(t, k), tile_expert)


#: Launch configurations of the two grouped GEMMs (free: the bits do not depend on them), by slots per
#: expert: (most slots per expert, tile rows, the gate/up (gated) launch, the down launch). A gated
#: column reduces a gate and an up row, so its BLOCK_N is half the MMA width. H200, bench/moe_gpu.py
#: --sweep (session 16, Qwen3-30B-A3B: 264 launches per token count, all bit-identical): the fastest
#: pair at 1-64 tokens (<= 4 slots per expert), 512 (32), 2048 (128) and 8192 (512); the 256 between the
#: last two is not measured. At 8192 the 128-row tiles with the gathered copy and one wide MMA took
#: 965 + 596 us, the 64-row ones (no copy) 1008 + 595.
GROUPED_CONFIGS = [
    (8, 16, dict(BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=3),
     dict(BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3)),
    (48, 32, dict(BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4),
     dict(BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3)),
    (256, 64, dict(BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3, tma=True, wide=True),
     dict(BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4)),
    (None, 128, dict(BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3, tma=True, gather=True, wide=True),
     dict(BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3, tma=True)),
]
INTERPRETER_CONFIG = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=1)


def grouped_configs(slots: int, num_experts: int) -> tuple[dict, dict]:
    """(gate/up launch, down launch) of the grouped GEMMs for ``slots`` (token, rank) slots over
    ``num_experts`` experts; both have the same BLOCK_M (the tile rows the slots are sorted into)."""
    if INTERPRET:
        return dict(INTERPRETER_CONFIG, BLOCK_N=32), dict(INTERPRETER_CONFIG)
    per_expert = slots / max(1, num_experts)
    _, bm, gate, down = next(row for row in GROUPED_CONFIGS if row[0] is None or per_expert <= row[0])
    return dict(gate, BLOCK_M=bm), dict(down, BLOCK_M=bm)


#: the tile rows the tuner (``hal.kernels.tuning.tune_moe``) and bench/moe_gpu.py --sweep try, and per tile-row
#: count the column widths of the gate/up (gated: 128 here is the MMA work of a 256-wide tile) and down GEMMs
TILE_ROWS = (16, 32, 64, 128)
CANDIDATE_WIDTHS = {16: ((32, 64, 128), (64, 128, 256)), 32: ((64, 128), (128, 256)), 64: ((64, 128), (128, 256)),
                    128: ((32, 64, 128), (128, 256))}


def candidates(block_m: int, gated: bool) -> list[dict]:
    """Launch configurations of one grouped GEMM at ``block_m`` tile rows (free: the bits do not depend on
    them; bench/moe_gpu.py --sweep checks every one at Qwen3-30B-A3B's shape): column widths, BLOCK_K,
    warps, stages, descriptor loads, the gate/up GEMM's sorted copy of the rows. A gated column reduces two
    weight rows, so it counts twice for the warps (four fp32 tiles per program): 8 warps above 128 x 128 of
    MMA work, both at it, 4 below."""
    # how A and W are read: by pointer, W by descriptor, and (gated) the rows gathered into sorted order
    # first and then both by descriptor (``gate_up``); the down GEMM's A is sorted already. Gated, with
    # descriptors: also as one MMA over the gate and up rows (``wide``)
    loads = ([dict(tma=False, gather=False, wide=False)]
             + [dict(tma=True, gather=gather, wide=wide) for gather in (False, True) for wide in (False, True)]
             if gated else [dict(tma=False), dict(tma=True)])
    out = []
    for bn in CANDIDATE_WIDTHS[block_m][0 if gated else 1]:
        work = block_m * bn * (2 if gated else 1)
        for warps in ((4, 8) if work == 128 * 128 else (8,) if work > 128 * 128 else (4,)):
            for bk in ((64,) if work >= 128 * 128 else (64, 128)):
                for stages in (3, 4):
                    for load in loads:
                        out.append(dict(BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages,
                                        **load))
    return out


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor, sorted_slots: SortedSlots,
                   out_dtype: torch.dtype, spec: Gemm, cfg: dict, *, x_sorted: bool = False,
                   gated: bool = False) -> torch.Tensor:
    """(P, N) ``out_dtype``: sorted position p holds ``x[rows[p]] @ weight[e].T`` (e: its tile's expert),
    K reduced as [gemm] says; padding rows (rows[p] = -1) are never written: nothing reads them but the
    down projection, whose padding rows are not stored either, and each MMA row is its own dot, so
    whatever they hold reaches no slot's bits. x: (R, K); weight: (E, N, K). ``x_sorted``: x's row p is
    position p (``rows`` then only marks the padding, < 0): with ``cfg["tma"]`` x is read by descriptor too.
    ``cfg["tma"]``: the weights by descriptor where bf16 and aligned. ``gated``: weight is (E, 2N, K)
    = [gate; up] and the result is ``silu_mul`` of the two rounded halves, (P, N) (the kernel's GATED);
    ``cfg["wide"]`` with it: one MMA over a column tile's gate and up rows (the kernel's WIDE)."""
    e, n, k = weight.shape
    if gated:
        n //= 2
    p = sorted_slots.positions
    # no zero fill: at 8192 tokens the padded outputs are ~0.9 GB, ~0.3 ms of memset for rows nobody reads
    # (the interpreter's numpy warns about the overflows that uninitialised rows give in silu: zero them there)
    out = (torch.zeros if INTERPRET else torch.empty)((p, n), device=x.device, dtype=out_dtype)
    if p == 0 or n == 0:
        return out
    if spec.k_chunk % cfg["BLOCK_K"]:
        raise UnsupportedError(f"grouped GEMM: BLOCK_K {cfg['BLOCK_K']} must divide k_chunk {spec.k_chunk}")
    x = x.contiguous()
    weight = weight.contiguous()
    w_arg, x_arg = weight, x
    # the dense GEMM's descriptor conditions (bf16, row-major, 16-byte aligned base and rows)
    rows_of_w = weight.view(e * weight.shape[1], k)
    w_tma = cfg.get("tma", False) and not INTERPRET and _tma_ok(rows_of_w)
    x_tma = w_tma and x_sorted and _tma_ok(x)
    wide = gated and cfg.get("wide", False)
    if w_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        if wide:      # (2E, N, K): block [2e, n, k] holds expert e's gate rows n.. and its up rows n..
            w_arg = TensorDescriptor.from_tensor(weight.view(2 * e, n, k), [2, cfg["BLOCK_N"], cfg["BLOCK_K"]])
        else:
            w_arg = TensorDescriptor.from_tensor(rows_of_w, [cfg["BLOCK_N"], cfg["BLOCK_K"]])
        if x_tma:
            x_arg = TensorDescriptor.from_tensor(x, [sorted_slots.block_m, cfg["BLOCK_K"]])
    grid = (cdiv(n, cfg["BLOCK_N"]), p // sorted_slots.block_m)
    if grid[1] > 65535:   # CUDA's limit on a grid's second axis
        raise UnsupportedError(f"grouped GEMM: {grid[1]} row tiles of {sorted_slots.block_m} exceed 65535; "
                               f"pass fewer tokens per call")
    launch(_grouped_gemm_kernel, grid,
           x_arg, w_arg, rows, sorted_slots.tile_expert, out, grid[1], n, k, x.stride(0), weight.stride(0),
           weight.stride(1), out.stride(0), K_CHUNK=spec.k_chunk, OUT_BF16=out_dtype == torch.bfloat16,
           FP32_INPUTS=x.dtype == torch.float32, UPCAST=INTERPRET and x.dtype != torch.float32, W_TMA=w_tma,
           X_TMA=x_tma, X_SORTED=x_sorted, GATED=gated, WIDE=wide, BLOCK_M=sorted_slots.block_m, BLOCK_N=cfg["BLOCK_N"],
           BLOCK_K=cfg["BLOCK_K"],
           num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **LAUNCH)
    return out


@triton.jit
def _gather_rows_kernel(x_ptr, token_ptr, out_ptr, positions, K, stride_x, stride_o, ROWS: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    """out[p] = x[token[p]] for ROWS sorted positions per program; padding positions (token -1) are
    left as they are (``gather_rows``)."""
    p = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    token = tl.load(token_ptr + p, mask=p < positions, other=-1)
    ok = token >= 0
    src = x_ptr + tl.where(ok, token, 0).to(tl.int64)[:, None] * stride_x
    dst = out_ptr + p.to(tl.int64)[:, None] * stride_o
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)[None, :]
        mask = ok[:, None] & (ks < K)
        tl.store(dst + ks, tl.load(src + ks, mask=mask), mask=mask)


def gather_rows(x: torch.Tensor, sorted_slots: SortedSlots) -> torch.Tensor:
    """(P, K): row p is x[token[p]], the token at sorted position p; padding rows are never written (nothing
    stores their GEMM rows). A copy, so every slot's row holds the same values: the gate/up GEMM reads
    it as the down GEMM reads its input, contiguous tiles by descriptor (``gate_up``'s ``gather``).
    Not ``index_select``: that would copy a row for every padding position too (up to E*(BLOCK_M-1))."""
    p, k = sorted_slots.positions, x.shape[1]
    x = x.contiguous()
    out = (torch.zeros if INTERPRET else torch.empty)((p, k), device=x.device, dtype=x.dtype)
    if p and k:
        rows = 16
        launch(_gather_rows_kernel, (cdiv(p, rows),), x, sorted_slots.token, out, p, k, x.stride(0), out.stride(0),
               ROWS=rows, BLOCK_K=min(512, next_power_of_2(k)), num_warps=4, **LAUNCH)
    return out


def gate_up(x: torch.Tensor, w13: torch.Tensor, sorted_slots: SortedSlots, spec: Gemm, cfg: dict) -> torch.Tensor:
    """The gated gate/up grouped GEMM of ``experts`` ((P, N) activations in x's dtype). ``cfg["gather"]``:
    first copy the tokens' rows into sorted order (``gather_rows``) so the GEMM reads A as contiguous tiles
    (by descriptor with ``cfg["tma"]``) instead of gathering rows by pointer in its K loop: the same values in
    the same MMAs, so the same bits; a launch choice like the tiles. H200, 8192 Qwen3-30B-A3B tokens: the
    copy takes 105-140 us (~2.8 TB/s; its 16 rows per program are not tuned) and pays for itself only
    with 128-row tiles and the wide MMA (session 16: 965 us with the copy against 1008 without it at 64
    rows; the dense GEMM on as many rows 699)."""
    if cfg.get("gather", False):
        return grouped_linear(gather_rows(x, sorted_slots), w13, sorted_slots.token, sorted_slots, x.dtype, spec,
                              cfg, x_sorted=True, gated=True)
    return grouped_linear(x, w13, sorted_slots.token, sorted_slots, x.dtype, spec, cfg, gated=True)


@triton.jit
def _combine_kernel(down_ptr, position_ptr, weights_ptr, shared_ptr, out_ptr, H, stride_d, stride_s, stride_o,
                    TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr, OUT_BF16: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t] = round_act(fl32(... fl32(fl32(w_0 y_0) + fl32(w_1 y_1)) ... + shared[t])), ranks in order
    ([moe].combine; the same IEEE steps as ``hal.moe.combine``). y_r: row position[t, r] of ``down``."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for r in tl.static_range(TOP_K):
        row = tl.load(position_ptr + t * TOP_K + r).to(tl.int64)
        y = tl.load(down_ptr + row * stride_d + offs, mask=mask, other=0.0)
        product = tl.load(weights_ptr + t * TOP_K + r) * y
        if r == 0:
            acc = product
        else:
            acc = acc + product
    if HAS_SHARED:
        acc = acc + tl.load(shared_ptr + t * stride_s + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + offs, to_activation(acc, OUT_BF16), mask=mask)


def combine(down: torch.Tensor, position: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None,
            dtype: torch.dtype, block: int = 512, num_warps: int = 4) -> torch.Tensor:
    """[moe].combine of fp32 expert outputs ``down`` (P, H) at ``position`` (T, k): (T, H) in ``dtype``.
    ``block`` (columns per program) and ``num_warps`` are free: each column is its own sum (H200, 8192
    Qwen3-30B-A3B tokens: 512 columns 157 us, 1024 225 us)."""
    t, k = position.shape
    h = down.shape[1]
    out = torch.empty((t, h), device=down.device, dtype=dtype)
    if t == 0:
        return out
    block = min(block, next_power_of_2(h))
    shared_arg = shared.contiguous() if shared is not None else out
    launch(_combine_kernel, (t, cdiv(h, block)),
           down, position.contiguous(), weights.contiguous(), shared_arg, out, h, down.stride(0),
           shared_arg.stride(0), out.stride(0), TOP_K=k, HAS_SHARED=shared is not None,
           OUT_BF16=dtype == torch.bfloat16, BLOCK_H=block, num_warps=num_warps, **LAUNCH)
    return out


def experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
            topk_ids: torch.Tensor, shared: torch.Tensor | None, spec: Gemm, config: dict | None = None,
            gate_up_config: dict | None = None, *, policy: LaunchPolicy | None = None,
            slot_tiles: bool | None = None) -> torch.Tensor:
    """The expert half of an MoE layer without a host synchronisation: sort the slots, the gate/up
    grouped GEMM with ``silu_mul`` in its epilogue (GATED: the bits of the gate/up linear rounded to
    the activation dtype and then the row kernel), the down grouped GEMM (fp32), then the rank-order
    combine (``combine``: ``hal.moe.combine``'s steps). The launches are ``grouped_configs``', or the
    ``policy``'s (a tuning cache's choice, ``hal tune``) where it has one; ``config``: the down projection's
    launch over both (and the tile rows of both); ``gate_up_config``: the gate/up one (default with a
    ``config``: it with half as many columns, since each gated column reduces a gate and an up row);
    ``slot_tiles``: ``sort_slots``' (default: by SLOT_TILES_MAX_PER_EXPERT)."""
    t, k = topk_ids.shape
    num_experts = w13.shape[0]
    tuned = policy.moe_tiles(t * k, num_experts, x.shape[1], w2.shape[2], spec, x.dtype) if policy else None
    default_gate, default_down = tuned or grouped_configs(t * k, num_experts)
    cfg = config or default_down
    gate_cfg = gate_up_config or (default_gate if config is None else dict(cfg, BLOCK_N=max(16, cfg["BLOCK_N"] // 2)))
    if gate_cfg["BLOCK_M"] != cfg["BLOCK_M"]:
        raise UnsupportedError(f"grouped GEMM: the gate/up and down launches need the same BLOCK_M "
                               f"({gate_cfg['BLOCK_M']} != {cfg['BLOCK_M']}): the slots are sorted into its tiles")
    slots = sort_slots(topk_ids, num_experts, cfg["BLOCK_M"], slot_tiles=slot_tiles)
    act = gate_up(x, w13, slots, spec, gate_cfg)
    # the down projection reads the activations in sorted order: row p of act is position p
    down = grouped_linear(act, w2, slots.token, slots, torch.float32, spec, cfg, x_sorted=True)
    return combine(down, slots.position, topk_weights, shared, x.dtype)
