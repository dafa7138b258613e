"""Unified paged attention (prefill, chunked prefill, decode, training).

Reduction structure (contract [attention], read from the ``Attention`` section: ``kv_chunk``,
``split_size``, ``folded_scale``):
  s = fl32(q.k * fl32(scale * log2 e)); keys in splits of KV_SPLIT at absolute positions 0, S, ...;
  inside a split, chunks of KV_CHUNK keys at absolute positions (KV_CHUNK is also the key tile), ascending:
      masked keys are selected out (-inf) before the row max; a row with no visible key in the
      chunk keeps its state untouched; a masked key's NaN/Inf V never reaches P @ V (selected to 0;
      an output element whose row sees a non-finite V entry is NaN; ``_chunk``)
      m' = max(m, rowmax s); alpha = exp2(m - m'); p = exp2(s - m') (0 where masked)
      p_r = round_act(p); rowsum = p_r @ ones (the MMA sums the same rounded P that multiplies V:
      a generic tl.sum over the MMA-layout P changes bits with the tile shape); with
      [attention].row_sum = "sum_of_fp32_p" rowsum = p @ ones in fp32 ("ieee": FMA steps in key order)
  [attention].exp = "exp" (scale = "multiply"): exp replaces exp2 everywhere (EXP2 = False)
      l = fl(fl(l * alpha) + rowsum); acc = fl(fl(acc * alpha) + p_r @ v)
  splits are merged in ascending order into (M, L, A), starting from (-inf, 0, 0):
      M' = max(M, m); a = exp2(M - M'); b = exp2(m - M'); L = fl(L*a) + fl(l*b); A = fl(A*a) + fl(acc*b)
  out = round_act(div_rn(A, L)).
An FP8 KV cache ([fp8], ``hal.fp8.Fp8KVCache``) is read through [fp8]'s one read path: each K/V tile is
dequantised as it is loaded, k = round_act(fl32(fp32(k_fp8) * scale)), and the recurrence above runs
on it unchanged: the bits of the same kernel over a bf16 cache holding the dequantised values
(``_dequantise`` says what keeps the MMA's operand layout, and so its sums, the same). Under
[fp8].kv_dequant = "f16_operands" (one fixed K and V scale per layer; F16_OPERANDS) no element is scaled:
K and V tiles enter the MMAs as f16 (exact for e4m3 / e5m2), q is rounded to f16 once, the score factor is
fl32(fl32(scale * log2 e) * k_scale), P is rounded to f16 instead of the activation dtype, and
out = round_act(fl32(div_rn(A, L) * v_scale)) (in-kernel and in ``_merge_kernel``): one conversion per two
elements, the bf16 cache's loop for half its bytes.

A program owns BLOCK_Q query tokens of one sequence times the query heads that share one KV head
(rows = token x head), or a slice of those heads (``HEAD_SPLIT`` programs per KV head). Free launch
choices (every row's recurrence is its own, so its bits are the same either way):
  * the query-tile size, how many programs share one KV head's query heads, warps and pipeline
    depth, how a GQA group that is not a power of two lays out its rows (``GROUP_PAD``: padded to a
    power of two, or packed, e.g. 12 tokens x 5 heads = 60 of a 64-row tile instead of 8 x 8 = 40 of
    its rows useful), and the order in which programs are numbered (``HEADS_FASTEST``: the programs reading
    the same pages run side by side; for prefill, the longest tiles of every head start first);
  * the loop structure: ``NESTED_SPLITS`` (prefill), a loop over the splits with each split's chunks in
    inner loops, which keeps a wgmma tile's MMAs pipelined; or (decode) one flat loop over the chunks
    that hands each split's state on after its last chunk, so the K/V loads stream across split
    boundaries;
  * whether a program walks all splits (``SPLIT_PARALLEL`` off: prefill; the state merged into
    (M, L, A) after each split) or each split runs in its own program and
    ``_merge_kernel`` merges them (decode: fills and balances the GPU at any batch), and how many
    consecutive splits one such program walks (``SPLITS_PER_PROGRAM``, each stored as its own
    partial: fewer, longer programs pay the start-up - finding the sequence, the first loads - less
    often);
  * whether a masked chunk of a wgmma tile first tries the update on V as loaded (``_chunk``: exact when
    V is finite and every row sees the chunk, else the guarded update runs);
  * chunks that every row of the tile sees entirely (below the causal diagonal) skip the mask:
    there the masked formulas reduce exactly to the unmasked ones (every key visible, every row
    visits), so only the chunks that cross a row's position pay for masking.
All metadata is read on the device (each program finds its sequence from ``query_start_loc``): no
host synchronisation, so a call costs two launches at most and can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hal.contract import Attention
from hal.kernels.common import INTERPRET, LAUNCH, cdiv, next_power_of_2, round_to_bf16, to_activation, zero_scalar
from hal.kernels.launcher import launch
from hal.kernels.policy import LaunchPolicy

BLOCK_B = 128  # sequences scanned per step when a program looks for its sequence


@triton.jit
def _locate(index, query_start_ptr, num_seqs, BLOCK_Q: tl.constexpr, BLOCK_B: tl.constexpr):
    """(b, first query of the tile) for tile ``index``: sequence b owns cdiv(q_len_b, BLOCK_Q)
    consecutive tiles, sequences in order. Past the last tile, b = num_seqs."""
    b = tl.sum(tl.zeros((1,), dtype=tl.int32), axis=0)
    tiles_before = b
    seq_first_tile = b
    for s0 in range(0, num_seqs, BLOCK_B):
        seqs = s0 + tl.arange(0, BLOCK_B)
        ok = seqs < num_seqs
        q_len = (tl.load(query_start_ptr + seqs + 1, mask=ok, other=0)
                 - tl.load(query_start_ptr + seqs, mask=ok, other=0))
        tiles = (q_len + BLOCK_Q - 1) // BLOCK_Q
        ends = tiles_before + tl.cumsum(tiles, 0)  # one past each sequence's last tile
        before = ok & (ends <= index)              # sequences entirely before this tile
        b += tl.sum(before.to(tl.int32), axis=0)
        seq_first_tile = tl.maximum(seq_first_tile, tl.max(tl.where(before, ends, 0), axis=0))
        tiles_before += tl.sum(tiles, axis=0)
    return b, (index - seq_first_tile) * BLOCK_Q


@triton.jit
def _coordinates(HEADS_FASTEST: tl.constexpr):
    """(tile index, head program, split) of this program. The GPU starts programs in grid order,
    axis 0 fastest: HEADS_FASTEST launches a (head programs, splits, tiles) grid, else (tiles, head
    programs, splits). (A flat grid divided into coordinates costs the prefill tile registers it
    does not have: 216 bytes of spill instead of 160, by bench/sm90_report.py.)"""
    if HEADS_FASTEST:
        return tl.program_id(2), tl.program_id(0), tl.program_id(1)
    return tl.program_id(0), tl.program_id(1), tl.program_id(2)


@triton.jit
def _exp(x, EXP2: tl.constexpr):
    """[attention].exp: exp2 (scale folded with log2 e) or the natural exp (scale = "multiply")."""
    if EXP2:
        y = tl.exp2(x)
    else:
        y = tl.exp(x)
    return y


@triton.jit
def _dequantise(x, scale_ptr, scale_off, key_ok, MASKED: tl.constexpr, PER_TOKEN_SCALE: tl.constexpr,
                IS_BF16: tl.constexpr, UPCAST: tl.constexpr, OPERAND_BARRIER: tl.constexpr,
                F16_OPERANDS: tl.constexpr):
    """[fp8]'s KV read path for a (KV_CHUNK, HEAD_DIM) fp8 tile: round_act(fl32(fp32(x) * scale)), with
    each key's (token, head) scale or the layer's fixed one; keys past the sequence (masked loads: x is
    0) take scale 0, not the NaN of a never-written slot. F16_OPERANDS: the tile as f16, exact, unscaled."""
    if F16_OPERANDS:
        y = x.to(tl.float16)
        if OPERAND_BARRIER:  # as below: the MMA takes the f16 tile as it would take an f16 cache's
            y = tl.inline_asm_elementwise("mov.b16 $0, $1;", "=h,h", [y], dtype=tl.float16, is_pure=False, pack=1)
        if UPCAST:  # the interpreter: fp32 operands holding the f16 values
            y = y.to(tl.float32)
    else:
        y = _dequantise_scaled(x, scale_ptr, scale_off, key_ok, MASKED, PER_TOKEN_SCALE, IS_BF16, UPCAST,
                               OPERAND_BARRIER)
    return y


@triton.jit
def _dequantise_scaled(x, scale_ptr, scale_off, key_ok, MASKED: tl.constexpr, PER_TOKEN_SCALE: tl.constexpr,
                       IS_BF16: tl.constexpr, UPCAST: tl.constexpr, OPERAND_BARRIER: tl.constexpr):
    """[fp8].kv_dequant = "fp32_multiply_round_act": round_act(fl32(fp32(x) * scale)) (``_dequantise``)."""
    if PER_TOKEN_SCALE:
        if MASKED:
            s = tl.load(scale_ptr + scale_off, mask=key_ok, other=0.0)
        else:
            s = tl.load(scale_ptr + scale_off)
        y = x.to(tl.float32) * s[:, None]
    else:
        y = x.to(tl.float32) * tl.load(scale_ptr)
    if IS_BF16:
        if UPCAST:  # the interpreter's .to(bf16) truncates: fp32 holding the nearest-even bf16 value
            y = round_to_bf16(y)
        else:
            y = y.to(tl.bfloat16)
    if OPERAND_BARRIER:
        # Triton picks an MMA operand's register layout (kWidth) from the narrowest load it finds behind
        # the operand through elementwise ops: an 8-bit load gives a wider kWidth, which regroups the MMA's
        # K steps and so changes the fp32 sums (H200: other bits than the bf16 cache's, and decode's 16-row
        # tiles then differ from prefill's). An identity move the compiler must keep (not pure) ends that
        # search here, so the MMA takes the dequantised tile exactly as it takes a bf16 cache's tile.
        if IS_BF16:
            y = tl.inline_asm_elementwise("mov.b16 $0, $1;", "=h,h", [y], dtype=tl.bfloat16, is_pure=False, pack=1)
        else:
            y = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [y], dtype=tl.float32, is_pure=False, pack=1)
    return y


@triton.jit
def _chunk(q, m, l, acc, n0, b, kvh, positions, first_position, seq_len, q_row_ok, ones, k_cache_ptr, v_cache_ptr,
           block_table_ptr, stride_bt, stride_kp, stride_kr, stride_kh, scale_log2e, offs_d, k_scale_ptr, v_scale_ptr,
           stride_sp, stride_sr, stride_sh,
           PAGE_SIZE: tl.constexpr, KV_CHUNK: tl.constexpr, HEAD_DIM: tl.constexpr, IS_BF16: tl.constexpr,
           UPCAST: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr, EXP2: tl.constexpr,
           ROUNDED_SUM: tl.constexpr, KV_FP8: tl.constexpr, PER_TOKEN_SCALE: tl.constexpr,
           OPERAND_BARRIER: tl.constexpr, BAD_V_BY_MIN: tl.constexpr, FINITE_V_FAST_PATH: tl.constexpr,
           F16_OPERANDS: tl.constexpr):
    """One KV chunk of the recurrence in the module docstring. MASKED=False only for chunks every
    row of the tile sees entirely; the unmasked formulas are the masked ones with every key visible.
    TMA: the chunk lies in one page and the caches are tensor descriptors of 2-D views whose rows
    are one token apart (row stride ``stride_kr``): one head's KV_CHUNK keys are a (KV_CHUNK,
    HEAD_DIM) block at the row and column of its first element. The copy engine brings the same
    K/V rows (rows past the sequence: the masked pointer loads zero them, ``_masked_repair`` those by TMA).
    KV_FP8: the caches hold [fp8].kv_format values (never by descriptor), dequantised as they are
    loaded by [fp8]'s one read path (``_dequantise``): the MMAs then see the very K/V tiles that a bf16
    cache holding the dequantised values would give them, so the bits are that cache's. F16_OPERANDS: q, K, V
    and P are f16 MMA operands (``scale_log2e`` then holds the K scale too; the module docstring)."""
    NATIVE: tl.constexpr = (IS_BF16 or F16_OPERANDS) and not UPCAST  # 16-bit MMA operands, else "ieee" fp32 dots
    keys = n0 + tl.arange(0, KV_CHUNK)
    if TMA:
        page = tl.load(block_table_ptr + b * stride_bt + n0 // PAGE_SIZE)
        first = page.to(tl.int64) * stride_kp + kvh * stride_kh + (n0 % PAGE_SIZE) * stride_kr
        row = (first // stride_kr).to(tl.int32)
        col = (first % stride_kr).to(tl.int32)
        k = k_cache_ptr.load([row, col])
        v = v_cache_ptr.load([row, col])
        key_ok = keys < seq_len
        if MASKED and not FINITE_V_FAST_PATH:  # else only if the chunk needs ``_masked_repair``
            v = tl.where(key_ok[:, None], v, 0.0)  # never-written slots may hold NaN: 0 * NaN is NaN
    elif PAGE_SIZE % KV_CHUNK == 0:  # the chunk lies in one page
        page = tl.load(block_table_ptr + b * stride_bt + n0 // PAGE_SIZE).to(tl.int64)
        kv_rows = page * stride_kp + (n0 % PAGE_SIZE + tl.arange(0, KV_CHUNK)) * stride_kr
        scale_rows = page * stride_sp + (n0 % PAGE_SIZE + tl.arange(0, KV_CHUNK)) * stride_sr
    else:
        if MASKED:
            page = tl.load(block_table_ptr + b * stride_bt + keys // PAGE_SIZE, mask=keys < seq_len, other=0)
        else:
            page = tl.load(block_table_ptr + b * stride_bt + keys // PAGE_SIZE)
        kv_rows = page.to(tl.int64) * stride_kp + (keys % PAGE_SIZE) * stride_kr
        scale_rows = page.to(tl.int64) * stride_sp + (keys % PAGE_SIZE) * stride_sr
    if not TMA:
        kv_off = kv_rows[:, None] + kvh * stride_kh + offs_d[None, :]
        if MASKED:
            key_ok = keys < seq_len
            k = tl.load(k_cache_ptr + kv_off, mask=key_ok[:, None], other=0.0)
            v = tl.load(v_cache_ptr + kv_off, mask=key_ok[:, None], other=0.0)
        else:
            k = tl.load(k_cache_ptr + kv_off)
            v = tl.load(v_cache_ptr + kv_off)
        if KV_FP8:
            k = _dequantise(k, k_scale_ptr, scale_rows + kvh * stride_sh, keys < seq_len, MASKED, PER_TOKEN_SCALE,
                            IS_BF16, UPCAST, OPERAND_BARRIER, F16_OPERANDS)
            v = _dequantise(v, v_scale_ptr, scale_rows + kvh * stride_sh, keys < seq_len, MASKED, PER_TOKEN_SCALE,
                            IS_BF16, UPCAST, OPERAND_BARRIER, F16_OPERANDS)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    if NATIVE:
        s = tl.dot(q, tl.trans(k))
    else:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    s = s * scale_log2e
    if MASKED:
        visible = (keys[None, :] <= positions[:, None]) & key_ok[None, :] & q_row_ok[:, None]
        s = tl.where(visible, s, float("-inf"))
        # Rows past their position see no key of the chunk: rows are queries at positions < seq_len, so a
        # row sees the chunk's first key iff it sees any (the max over ``visible`` along the keys).
        row_visits = q_row_ok & (positions >= n0)
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(row_visits, m_new, 0.0)
        alpha = _exp(m - m_safe, EXP2)
        p = tl.where(visible, _exp(s - m_safe[:, None], EXP2), 0.0)
    else:
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = _exp(m - m_new, EXP2)
        p = _exp(s - m_new[:, None], EXP2)
    if not ROUNDED_SUM:
        # [attention].row_sum = "sum_of_fp32_p": the fp32 P before its rounding, summed by an fp32
        # "ieee" dot (FMA steps along the keys, the same for every tile shape), never a tl.sum tree
        row_sum = tl.max(tl.dot(p, tl.full((KV_CHUNK, 16), 1.0, dtype=tl.float32), input_precision="ieee"), axis=1)
    if F16_OPERANDS:
        p = p.to(tl.float16)  # nearest even (the interpreter's numpy cast too)
        if UPCAST:
            p = p.to(tl.float32)
    elif IS_BF16:
        if UPCAST:  # the interpreter's .to(bf16) truncates; keep fp32 operands holding bf16 values
            p = round_to_bf16(p)
        else:  # round-to-nearest-even, the same bits as round_to_bf16
            p = p.to(tl.bfloat16)
    if ROUNDED_SUM:
        row_sum = tl.max(_dot(p, ones, NATIVE), axis=1)
    l_new = l * alpha + row_sum
    acc_new = acc * alpha[:, None] + _dot(p, v, NATIVE)
    if MASKED:
        # [attention].mask: a masked key contributes nothing, whatever its K and V hold (NaN, Inf, a
        # never-written slot). Its score is selected out above (a NaN s stays in its own column: q.k is
        # per key). Its V row is not: P is 0 there, but 0 * NaN = NaN inside P @ V, and a key masked for
        # one row may be visible to another, so V cannot be selected per row; ``_masked_repair`` does it.
        # With finite V and every row of the tile seeing the chunk (n0 <= the first row's position) the
        # update above is already exact (0 * x adds nothing for a finite x), and the repair's selects
        # change no bit. A non-finite V entry reaches every row's P @ V (as NaN or +-Inf: P is finite),
        # so a finite sum of ``acc_new`` proves the chunk's V finite, at one add an element. The
        # repair's select code made every masked chunk cost 5x an unmasked one (sm_90 SASS of the
        # 64-row prefill tile: 2323 instructions against 417) when it ran each time.
        if FINITE_V_FAST_PATH:
            total = tl.sum(tl.sum(acc_new, axis=1), axis=0)  # finite only if every entry is (or a repair in vain)
            repair = ~(tl.abs(total) < float("inf")) | (n0 > first_position)
            if TMA:  # slots past the sequence came with the chunk (never written: they may hold NaN)
                repair = repair | (n0 + KV_CHUNK > seq_len)
        else:
            repair: tl.constexpr = True
        if repair:
            m, l, acc = _masked_repair(acc, alpha, p, v, m, l, m_new, l_new, keys, key_ok, positions, q_row_ok,
                                       visible, row_visits, TMA and FINITE_V_FAST_PATH, NATIVE, BAD_V_BY_MIN)
        else:
            m, l, acc = m_new, l_new, acc_new
    else:
        m, l, acc = m_new, l_new, acc_new
    return m, l, acc


@triton.jit
def _dot(a, b, NATIVE: tl.constexpr):
    """a @ b on the tensor cores: bf16 / f16 operands natively, fp32 ones (the interpreter's upcast 16-bit
    values, fp32 models) with "ieee" precision."""
    if NATIVE:
        return tl.dot(a, b)
    else:
        return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _masked_repair(acc, alpha, p, v, m, l, m_new, l_new, keys, key_ok, positions, q_row_ok, visible, row_visits,
                   ZERO_PAST_END: tl.constexpr, NATIVE: tl.constexpr, BAD_V_BY_MIN: tl.constexpr):
    """A masked chunk's update when its V holds a non-finite entry or rows past the sequence: V rows past
    the sequence and non-finite V entries selected to 0, then the update; the (row, dim) outputs whose row
    sees a non-finite V entry are NaN (and stay NaN in every later update); rows that see no key of the
    chunk keep their state. "Sees" two equal ways: a dot of 0/1 indicators (counts <= KV_CHUNK, exact in
    any dot), or, since a row sees the keys up to its position (and before seq_len), the column's first
    bad key at or before the row's position (a min over the keys per column: BAD_V_BY_MIN). The dot's
    fp32 (rows x head_dim) tile costs a 64-row tile 64 registers a thread, which made ptxas serialise
    every wgmma of the nested-loop prefill kernel (its C7512); a 16-row decode tile's masked chunk is
    shorter with the dot (sm_90 SASS: 1276 instructions against 1628 with the min)."""
    if ZERO_PAST_END:  # V rows past the sequence, brought by TMA (pointer loads zero them)
        v = tl.where(key_ok[:, None], v, 0.0)  # never-written slots may hold NaN: 0 * NaN is NaN
    v_bad = (v != v) | (tl.abs(v) == float("inf"))
    v = tl.where(v_bad, 0.0, v)
    if BAD_V_BY_MIN:
        first_bad = tl.min(tl.where(v_bad & key_ok[:, None], keys[:, None], 2147483647), axis=0)
        sees_bad = q_row_ok[:, None] & (first_bad[None, :] <= positions[:, None])
    elif NATIVE:
        sees_bad = tl.dot(visible.to(tl.bfloat16), v_bad.to(tl.bfloat16)) > 0
    else:
        sees_bad = tl.dot(visible.to(tl.float32), v_bad.to(tl.float32), input_precision="ieee") > 0
    acc_new = acc * alpha[:, None] + _dot(p, v, NATIVE)
    # Selected on the sum, not on P @ V: a select between the dot and the add changed finite outputs'
    # bits on the H200 (the dot's result must feed the add directly, presumably so that the compiler
    # keeps using fl(acc * alpha) as the MMA's accumulator as in every unmasked chunk).
    acc_new = tl.where(sees_bad, float("nan"), acc_new)
    m = tl.where(row_visits, m_new, m)
    l = tl.where(row_visits, l_new, l)
    acc = tl.where(row_visits[:, None], acc_new, acc)
    return m, l, acc


@triton.jit
def _nan_if_not_finite(out):
    """[attention].mask: an output element whose row sees a non-finite V entry is NaN, one NaN. A masked chunk's
    repair selects NaN; an unmasked chunk has no guard, and its arithmetic gives +-Inf (p * Inf) or another NaN
    (0 * Inf, Inf - Inf). Which one a row meets depends on its tile (a chunk is unmasked for a tile whose first
    query sees all of it), so without this map a row was +Inf in one tiling and NaN in another (H100, 2026-12-07).
    Finite values pass unchanged."""
    return tl.where(tl.abs(out) < float("inf"), out, float("nan"))


@triton.jit
def _merge(big_m, big_l, big_a, m, l, acc, merging, EXP2: tl.constexpr):
    """Fold one split's (m, l, acc) into (M, L, A) for the rows in ``merging``."""
    m_merged = tl.maximum(big_m, m)
    m_ref = tl.where(merging, m_merged, 0.0)
    a = _exp(big_m - m_ref, EXP2)
    bb = _exp(m - m_ref, EXP2)
    l_merged = big_l * a + l * bb
    a_merged = big_a * a[:, None] + acc * bb[:, None]
    big_m = tl.where(merging, m_merged, big_m)
    big_l = tl.where(merging, l_merged, big_l)
    big_a = tl.where(merging[:, None], a_merged, big_a)
    return big_m, big_l, big_a


@triton.jit
def _store_split(part_m_ptr, part_l_ptr, part_a_ptr, m, l, acc, split_index, rows_ok, token, head, num_q_heads,
                 max_splits, offs_d, HEAD_DIM: tl.constexpr):
    """One split's (m, l, acc) for ``_merge_kernel``, at [token, head, split] of the partials."""
    part = (token.to(tl.int64) * num_q_heads + head) * max_splits + split_index
    tl.store(part_m_ptr + part, m, mask=rows_ok)
    tl.store(part_l_ptr + part, l, mask=rows_ok)
    tl.store(part_a_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=rows_ok[:, None])


@triton.jit
def _end_of_chunk(big_m, big_l, big_a, m, l, acc, n0, hi, q_row_ok, positions, token, head, num_q_heads, max_splits,
                  part_m_ptr, part_l_ptr, part_a_ptr, offs_d, HEAD_DIM: tl.constexpr, KV_CHUNK: tl.constexpr,
                  KV_SPLIT: tl.constexpr, SPLIT_PARALLEL: tl.constexpr, SPLITS_PER_PROGRAM: tl.constexpr,
                  EXP2: tl.constexpr):
    """The flat chunk loop's step after the chunk at n0: if it was its split's last chunk, hand the split on
    and restart the split state. An in-kernel walk merges it into (M, L, A); a program of parallel splits stores it
    as that split's partial (its last split is stored after the loop). Rows that see the split only."""
    if SPLIT_PARALLEL:
        if SPLITS_PER_PROGRAM > 1:
            if ((n0 + KV_CHUNK) % KV_SPLIT == 0) & (n0 + KV_CHUNK < hi):
                start = n0 + KV_CHUNK - KV_SPLIT
                _store_split(part_m_ptr, part_l_ptr, part_a_ptr, m, l, acc, start // KV_SPLIT,
                             q_row_ok & (positions >= start), token, head, num_q_heads, max_splits, offs_d, HEAD_DIM)
                m = tl.full(m.shape, float("-inf"), dtype=tl.float32)
                l = tl.zeros(l.shape, dtype=tl.float32)
                acc = tl.zeros(acc.shape, dtype=tl.float32)
    else:
        if (n0 + KV_CHUNK) % KV_SPLIT == 0:
            merging = q_row_ok & (positions >= n0 + KV_CHUNK - KV_SPLIT)
            big_m, big_l, big_a = _merge(big_m, big_l, big_a, m, l, acc, merging, EXP2)
            m = tl.full(m.shape, float("-inf"), dtype=tl.float32)
            l = tl.zeros(l.shape, dtype=tl.float32)
            acc = tl.zeros(acc.shape, dtype=tl.float32)
    return big_m, big_l, big_a, m, l, acc


# Per-call counts are not specialised: Triton compiles a variant for each pattern of "equal to 1 /
# multiple of 16" its integer arguments show, and the batch's sequence and tile counts (and, outside
# vLLM, the block table's width and split count) change from call to call: a vLLM run compiled new
# variants in the middle of its timed generate. None of them strides a vectorised load.
@triton.jit(do_not_specialize=["num_seqs", "num_tiles", "stride_bt", "max_splits"])
def _attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_m_ptr, part_l_ptr, part_a_ptr, part_pos_ptr,
                      query_start_ptr, seq_lens_ptr, block_table_ptr, num_seqs, num_tiles,
                      stride_qt, stride_qh, stride_bt, stride_kp, stride_kr, stride_kh, stride_ot, stride_oh,
                      num_q_heads, max_splits, scale_log2e, group, k_scale_ptr, v_scale_ptr, stride_sp, stride_sr,
                      stride_sh,
                      PAGE_SIZE: tl.constexpr, KV_SPLIT: tl.constexpr, GROUP_PAD: tl.constexpr, ROWS: tl.constexpr,
                      HEAD_SPLIT: tl.constexpr, HEADS_FASTEST: tl.constexpr, SPLITS_PER_PROGRAM: tl.constexpr,
                      BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr, SPLIT_PARALLEL: tl.constexpr,
                      IS_BF16: tl.constexpr, UPCAST: tl.constexpr, KV_CHUNK: tl.constexpr, BLOCK_B: tl.constexpr,
                      TMA: tl.constexpr, EXP2: tl.constexpr, ROUNDED_SUM: tl.constexpr, KV_FP8: tl.constexpr,
                      PER_TOKEN_SCALE: tl.constexpr, OPERAND_BARRIER: tl.constexpr, NESTED_SPLITS: tl.constexpr,
                      F16_OPERANDS: tl.constexpr):
    """k_cache_ptr, v_cache_ptr: pointers, or with TMA tensor descriptors (``_chunk``); with KV_FP8 the
    caches are fp8 and k_scale_ptr / v_scale_ptr their (pages, P, Hkv) scales (strides stride_s*) or,
    without PER_TOKEN_SCALE, one fixed scale each. GROUP_PAD: the GQA group as a program's rows lay it out,
    the group padded to a power of two or (packed) the group itself; ROWS: the tile's rows, a power of two
    >= BLOCK_Q x GROUP_PAD // HEAD_SPLIT (more only when packed: the rows past the tokens' are idle).
    F16_OPERANDS: [fp8].kv_dequant = "f16_operands" over fixed scales (the module docstring)."""
    tile_index, head_program, split = _coordinates(HEADS_FASTEST)
    # Highest tile first: later tiles of a sequence see more keys, so the long ones start early.
    tile = num_tiles - 1 - tile_index
    kvh = head_program // HEAD_SPLIT
    b, q_first = _locate(tile, query_start_ptr, num_seqs, BLOCK_Q, BLOCK_B)
    tile_ok = b < num_seqs  # the grid is an upper bound on the number of tiles
    b = tl.where(tile_ok, b, 0)
    q_begin = tl.load(query_start_ptr + b)
    q_len = tl.where(tile_ok, tl.load(query_start_ptr + b + 1) - q_begin, 0)
    seq_len = tl.load(seq_lens_ptr + b)

    HEADS: tl.constexpr = GROUP_PAD // HEAD_SPLIT  # query heads per program (a slice of the group as laid out)
    BLOCK_M: tl.constexpr = ROWS
    rows = tl.arange(0, BLOCK_M)
    tok = q_first + rows // HEADS                # query index inside the sequence
    head_in_group = head_program % HEAD_SPLIT * HEADS + rows % HEADS
    q_row_ok = (tok < q_len) & (head_in_group < group)
    if BLOCK_Q * HEADS < BLOCK_M:                # packed rows: the last ones would reach the next tile's tokens
        q_row_ok = q_row_ok & (rows < BLOCK_Q * HEADS)
    positions = seq_len - q_len + tok            # absolute position of each row's query
    token = q_begin + tok
    head = kvh * group + head_in_group
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + token.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=q_row_ok[:, None], other=0.0)
    if F16_OPERANDS:
        q = q.to(tl.float16)                             # nearest even, once
        scale_log2e = scale_log2e * tl.load(k_scale_ptr)  # fl32(fl32(scale * log2 e) * k_scale)
    if F16_OPERANDS and not UPCAST:
        ones = tl.full((KV_CHUNK, 16), 1.0, dtype=tl.float16)
    elif IS_BF16 and not UPCAST:
        ones = tl.full((KV_CHUNK, 16), 1.0, dtype=tl.bfloat16)
    else:
        ones = tl.full((KV_CHUNK, 16), 1.0, dtype=tl.float32)
    if UPCAST:
        q = q.to(tl.float32)

    # Keys [lo, hi) are this program's; [lo, full_end) are visible to every row of the tile.
    last_key = tl.max(tl.where(q_row_ok, positions, -1)) + 1
    if SPLIT_PARALLEL:  # ``split``: this program's group of SPLITS_PER_PROGRAM consecutive splits
        lo = split * (SPLITS_PER_PROGRAM * KV_SPLIT)
        hi = tl.minimum(lo + SPLITS_PER_PROGRAM * KV_SPLIT, last_key)
    else:
        lo = 0
        hi = last_key
    first_position = seq_len - q_len + q_first
    full_end = tl.maximum(lo, tl.minimum(hi, (first_position + 1) // KV_CHUNK * KV_CHUNK))

    # Masked chunks of wgmma tiles take ``_chunk``'s finite-V fast path; 16-row tiles always repair: with
    # both paths their kernel held 32 KB more shared memory (sm_90: 102.5 KB against 70.5 KB a program,
    # 2 programs a multiprocessor instead of 3) and decoded 12-13% slower at two cells on the H100.
    FINITE_V_FAST_PATH: tl.constexpr = BLOCK_M >= 64
    big_m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    big_l = tl.zeros((BLOCK_M,), dtype=tl.float32)
    big_a = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    if NESTED_SPLITS:
        # One outer step per split: its state restarted before its chunks, handed on after them (merged into
        # (M, L, A) by a walk, stored as the split's partial by parallel splits). The accumulator is defined
        # outside the chunk loops only: a restart inside the flat chunk loop below made ptxas serialise every
        # wgmma of the prefill kernel (its C7515), and its predicated merge code ran in every chunk (sm_90
        # SASS: 856 instructions per unmasked prefill chunk, 16 wgmma waits, 110 spill accesses; here 417, 2, 7).
        for split_start in range(lo, hi, KV_SPLIT):
            split_end = tl.minimum(split_start + KV_SPLIT, hi)
            unmasked_end = tl.minimum(split_end, tl.maximum(split_start, full_end))
            m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
            l = tl.zeros((BLOCK_M,), dtype=tl.float32)
            acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
            for n0 in range(split_start, unmasked_end, KV_CHUNK):
                m, l, acc = _chunk(q, m, l, acc, n0, b, kvh, positions, first_position, seq_len, q_row_ok, ones,
                               k_cache_ptr, v_cache_ptr, block_table_ptr, stride_bt, stride_kp, stride_kr, stride_kh,
                               scale_log2e, offs_d, k_scale_ptr, v_scale_ptr, stride_sp, stride_sr, stride_sh,
                               PAGE_SIZE, KV_CHUNK, HEAD_DIM, IS_BF16, UPCAST, False, TMA, EXP2, ROUNDED_SUM, KV_FP8,
                               PER_TOKEN_SCALE, OPERAND_BARRIER, BLOCK_M >= 64, FINITE_V_FAST_PATH,
                               F16_OPERANDS)
            for n0 in range(unmasked_end, split_end, KV_CHUNK):
                m, l, acc = _chunk(q, m, l, acc, n0, b, kvh, positions, first_position, seq_len, q_row_ok, ones,
                               k_cache_ptr, v_cache_ptr, block_table_ptr, stride_bt, stride_kp, stride_kr, stride_kh,
                               scale_log2e, offs_d, k_scale_ptr, v_scale_ptr, stride_sp, stride_sr, stride_sh,
                               PAGE_SIZE, KV_CHUNK, HEAD_DIM, IS_BF16, UPCAST, True, TMA, EXP2, ROUNDED_SUM, KV_FP8,
                               PER_TOKEN_SCALE, OPERAND_BARRIER, BLOCK_M >= 64, FINITE_V_FAST_PATH,
                               F16_OPERANDS)
            sees_split = q_row_ok & (positions >= split_start)
            if SPLIT_PARALLEL:
                _store_split(part_m_ptr, part_l_ptr, part_a_ptr, m, l, acc, split_start // KV_SPLIT, sees_split,
                             token, head, num_q_heads, max_splits, offs_d, HEAD_DIM)
            else:
                big_m, big_l, big_a = _merge(big_m, big_l, big_a, m, l, acc, sees_split, EXP2)
    else:
        # One flat loop over the chunks, the split handed on after each split's last chunk (``_end_of_chunk``):
        # the K/V loads stream across split boundaries (a walk over many splits with 16-row tiles, whose
        # MMAs are not wgmmas, keeps its pipeline full), at the price above for wgmma tiles.
        m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
        for n0 in range(lo, full_end, KV_CHUNK):
            m, l, acc = _chunk(q, m, l, acc, n0, b, kvh, positions, first_position, seq_len, q_row_ok, ones,
                               k_cache_ptr, v_cache_ptr, block_table_ptr, stride_bt, stride_kp, stride_kr, stride_kh,
                               scale_log2e, offs_d, k_scale_ptr, v_scale_ptr, stride_sp, stride_sr, stride_sh,
                               PAGE_SIZE, KV_CHUNK, HEAD_DIM, IS_BF16, UPCAST, False, TMA, EXP2, ROUNDED_SUM, KV_FP8,
                               PER_TOKEN_SCALE, OPERAND_BARRIER, False, FINITE_V_FAST_PATH, F16_OPERANDS)
            big_m, big_l, big_a, m, l, acc = _end_of_chunk(
                big_m, big_l, big_a, m, l, acc, n0, hi, q_row_ok, positions, token, head, num_q_heads, max_splits,
                part_m_ptr, part_l_ptr, part_a_ptr, offs_d, HEAD_DIM, KV_CHUNK, KV_SPLIT, SPLIT_PARALLEL,
                SPLITS_PER_PROGRAM, EXP2)
        for n0 in range(full_end, hi, KV_CHUNK):
            m, l, acc = _chunk(q, m, l, acc, n0, b, kvh, positions, first_position, seq_len, q_row_ok, ones,
                               k_cache_ptr, v_cache_ptr, block_table_ptr, stride_bt, stride_kp, stride_kr, stride_kh,
                               scale_log2e, offs_d, k_scale_ptr, v_scale_ptr, stride_sp, stride_sr, stride_sh,
                               PAGE_SIZE, KV_CHUNK, HEAD_DIM, IS_BF16, UPCAST, True, TMA, EXP2, ROUNDED_SUM, KV_FP8,
                               PER_TOKEN_SCALE, OPERAND_BARRIER, False, FINITE_V_FAST_PATH, F16_OPERANDS)
            big_m, big_l, big_a, m, l, acc = _end_of_chunk(
                big_m, big_l, big_a, m, l, acc, n0, hi, q_row_ok, positions, token, head, num_q_heads, max_splits,
                part_m_ptr, part_l_ptr, part_a_ptr, offs_d, HEAD_DIM, KV_CHUNK, KV_SPLIT, SPLIT_PARALLEL,
                SPLITS_PER_PROGRAM, EXP2)
        last_start = tl.maximum(lo, (hi - 1) // KV_SPLIT * KV_SPLIT)  # the last split, full or not
        sees_split = q_row_ok & (positions >= last_start)                # none when hi <= lo: no row reaches lo
        if SPLIT_PARALLEL:
            _store_split(part_m_ptr, part_l_ptr, part_a_ptr, m, l, acc, last_start // KV_SPLIT, sees_split,
                         token, head, num_q_heads, max_splits, offs_d, HEAD_DIM)
        elif (hi > 0) & ((tl.cdiv(hi, KV_CHUNK) * KV_CHUNK) % KV_SPLIT != 0):  # not merged by _end_of_chunk
            big_m, big_l, big_a = _merge(big_m, big_l, big_a, m, l, acc, sees_split, EXP2)

    if SPLIT_PARALLEL:
        # The merge needs each token's position: one program and one row per token writes it.
        writer = q_row_ok & (head_in_group + kvh + split == 0)
        tl.store(part_pos_ptr + token, positions, mask=writer)
    else:
        out = tl.div_rn(big_a, tl.where(q_row_ok, big_l, 1.0)[:, None])
        if F16_OPERANDS:
            out = out * tl.load(v_scale_ptr)
        out = _nan_if_not_finite(out)
        tl.store(out_ptr + token.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 to_activation(out, IS_BF16), mask=q_row_ok[:, None])


@triton.jit(do_not_specialize=["max_splits"])   # per call outside vLLM (the block table's width)
def _merge_kernel(part_m_ptr, part_l_ptr, part_a_ptr, part_pos_ptr, out_ptr, query_start_loc_ptr, num_seqs, stride_ot,
                  stride_oh, num_q_heads, max_splits, v_scale_ptr, KV_SPLIT: tl.constexpr, HEAD_DIM: tl.constexpr,
                  IS_BF16: tl.constexpr, EXP2: tl.constexpr, F16_OPERANDS: tl.constexpr):
    """Merge the splits of one (token, head) in ascending order; the same formula as in-kernel (with
    F16_OPERANDS the quotient times the fixed V scale, as there).
    The loop is not software-pipelined: 3 stages measured 15% slower at B = 1 x 32k keys, 6 within
    1-2%; eight splits loaded before they were folded made this kernel 10-33% slower at every
    decode shape (H200, device time)."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    # A row no sequence owns (q rows past query_start_loc[-1], e.g. vLLM's CUDA-graph padding) reads no
    # split and its output is 0. Every row before query_start_loc[-1] belongs to a sequence, whose first
    # program wrote its position; the rows after it were never written (part_pos is not initialised:
    # a fill would be one more launch per call).
    owned = token < tl.load(query_start_loc_ptr + num_seqs)
    position = tl.load(part_pos_ptr + token, mask=owned, other=-1)
    splits = tl.where(position >= 0, tl.minimum(position // KV_SPLIT + 1, max_splits), 0)
    offs_d = tl.arange(0, HEAD_DIM)
    big_m = zero_scalar() + float("-inf")
    big_l = zero_scalar()
    big_a = tl.zeros((HEAD_DIM,), dtype=tl.float32)
    base = (token.to(tl.int64) * num_q_heads + head) * max_splits
    for split in tl.range(0, splits, num_stages=1):
        m = tl.load(part_m_ptr + base + split)
        l = tl.load(part_l_ptr + base + split)
        acc = tl.load(part_a_ptr + (base + split) * HEAD_DIM + offs_d)
        m_merged = tl.maximum(big_m, m)
        a = _exp(big_m - m_merged, EXP2)
        bb = _exp(m - m_merged, EXP2)
        big_l = big_l * a + l * bb
        big_a = big_a * a + acc * bb
        big_m = m_merged
    out = tl.div_rn(big_a, tl.where(splits > 0, big_l, 1.0))  # an owned row's L >= 1
    if F16_OPERANDS:
        out = out * tl.load(v_scale_ptr)
    out = _nan_if_not_finite(out)
    tl.store(out_ptr + token.to(tl.int64) * stride_ot + head * stride_oh + offs_d, to_activation(out, IS_BF16))


def _launch_shape(tokens: int, num_seqs: int, group_pad: int) -> dict:
    """Launch shape from the call's shape alone (the query lengths stay on the device): free,
    the fastest in device time on the H200 of the shapes bench/speed_sweep.py tries, for the
    reasons given at each rule. ``rows``: token x head rows per program
    (the MMA tile's M). Programs are numbered head fastest: the programs of one tile (or split)
    read the same pages' K/V of every KV head side by side, and prefill's longest tiles of every head start first
    (tiles fastest started every head's long tiles one head after another: prefill at L = 1024 /
    2048 took 1.29 / 1.17x longer, 1% less at 4096; decode up to 3% longer at batch >= 8)."""
    base = dict(head_split=1, heads_fastest=True, splits_per_program=1, tma=False)
    if INTERPRET:  # programs run one after another: parallel splits only add work
        return dict(base, rows=16, num_warps=4, num_stages=1, decode=tokens <= 16 * num_seqs)
    if tokens <= 16 * num_seqs:
        # Decode-like, bound by streaming K/V: one 16-row MMA tile and by default 5 stages: the
        # depth at which Triton 3.6 double-buffers the page-table-indirect K/V loads (with 3 or 4 its
        # TTGIR has one buffer, waited for at the top of every chunk; ``_decode_launch`` takes fewer
        # only where a register cap lets more programs share a multiprocessor and hide it). The GQA group's
        # query heads stay in one program: split over 2 or 4 programs, each streams the whole K/V
        # (1.2-4x slower). K/V by pointer: tensor descriptors measured 4-8% slower here (16-row
        # tiles take their MMA operands from registers: 215-220 registers with descriptors, 189-193
        # without, at 64-key pages). Parallel or walked splits, splits per program, warps, stages and
        # register cap: ``_decode_launch``.
        return dict(base, rows=16, num_warps=4, num_stages=5, decode=True)
    # Prefill, MMA bound: 64 query rows (one warpgroup) per program; 128 rows on 8 warps measured
    # 2-4% slower at L = 2048..8192. K/V by tensor descriptor where the pages allow (64-key pages)
    # and the call has 1024 query tokens or more: 0.2-2% faster at L = 512..8192.
    # Short prompts with GQA groups of 2 (a vLLM prefill step of 8192 tokens in prompts of 94..493,
    # Qwen3-1.7B's 16/8 heads): 32 rows, 226 us against 265 us with 64 (bench/prefill_step.py
    # --attention-sweep); the causal tiles are short, and more programs balance them. Not measured
    # for other groups: they keep 64 rows.
    rows = 32 if tokens < 512 * num_seqs and group_pad == 2 else 64
    return dict(base, tma=True, rows=rows, num_warps=4, num_stages=2, decode=False)


def _tile_count(tokens: int, num_seqs: int, block_q: int) -> int:
    """Query tiles of ``block_q`` tokens for a batch, from shapes alone (the query lengths stay on the device): an
    upper bound on sum_b cdiv(q_len_b, block_q)."""
    return min(tokens, (tokens + num_seqs * (block_q - 1)) // block_q)


def _prefill_wide_tile(shape: dict, tokens: int, num_seqs: int, heads: int, head_dim: int, head_programs: int,
                       sms: int) -> dict:
    """Prefill's launch shape with 128 query rows on 8 warps instead of 64 on 4, where the 128-row programs fit in one
    wave on the multiprocessors and the 64-row ones do not. Why: compiled for sm_90 (bench/sm90_report.py) a 128-row
    program holds 255 registers on 256 threads, the whole register file, so one runs per multiprocessor (544 bytes
    of spill, the 64-row program's 832); 64-row programs run two a multiprocessor but at twice the count. Where the
    wide tiles fit one wave they take the causal tail in one step: on the H100, head dim 128 and GQA groups 2-8,
    1.03-1.10x faster (L = 384 / 512 at 32/8 heads, 512 at 32/4, 1024 at 16/8; 1.00x at 24/8). Outside the rule they
    lost: in a second wave at 32/8 heads (L = 640..1024, 0.69-0.71x of 64 rows), at head dim 64 (0.91x), with one
    query head a KV head (0.92x), and where the 64-row programs already fit one wave (L = 256 at 32/8, 512 at 16/2
    and 16/8: 0.84-0.94x). Not explained, so not in the rule: in a second wave at 64/8 and 40/8 heads (L = 384 /
    512) they still won, 1.03-1.13x. bench/prefill_launch_gpu.py, bench/results/h100-2026-12-07-session12/.
    ``heads``: the query heads a program's rows hold per token; ``head_programs``: programs per token tile."""
    if shape["decode"] or shape["rows"] != 64 or head_dim < 128 or heads < 2 or not sms:
        return shape

    def programs(rows: int) -> int:
        return _tile_count(tokens, num_seqs, max(1, rows // heads)) * head_programs
    if programs(128) <= sms < programs(64):
        return dict(shape, rows=128, num_warps=8)
    return shape


def _tma_ok(k_cache: torch.Tensor, v_cache: torch.Tensor, kv_chunk: int) -> bool:
    """Descriptor loads (``_chunk``) need bf16 caches on a GPU, every chunk inside one page (page
    size a multiple of the chunk), 16-byte aligned bases and token stride, head_dim contiguous, and
    each head's row inside one row of the token-rows view: true of NHD and HND (hal.kvcache)."""
    def fits(t):
        _, _, heads, dim = t.shape
        rows = t.stride(1)
        return (t.dtype == torch.bfloat16 and t.stride(3) == 1 and t.data_ptr() % 16 == 0 and rows * 2 % 16 == 0
                and t.stride(0) % rows == 0 and all(h * t.stride(2) % rows + dim <= rows for h in range(heads)))
    return not INTERPRET and k_cache.shape[1] % kv_chunk == 0 and fits(k_cache) and fits(v_cache)


def _token_rows_descriptor(cache: torch.Tensor, kv_chunk: int):
    """A tensor descriptor of ``cache`` seen as 2-D rows one token apart (row stride ``stride(1)``)
    with (kv_chunk, head_dim) blocks: NHD rows hold every head of a token, HND rows one head's."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows = cache.stride(1)
    span = 1 + sum((size - 1) * stride for size, stride in zip(cache.shape, cache.stride()))
    return TensorDescriptor(cache, [cdiv(span, rows), rows], [rows, 1], [kv_chunk, cache.shape[3]])


def _decode_launch(programs: int, sms: int, kv_fp8: bool, *, max_splits: int, head_dim: int, page: int,
                   f16_operands: bool = False) -> dict:
    """The decode launch (parallel or walked splits, splits per program, warps, stages, register cap; one
    program per GQA group) from the number of one-split programs, the multiprocessors, the block table's
    splits, the head dim, the page size and the cache's format. Always one of ``decode_candidates``, so ``hal tune``'s bit
    checks cover it; ``bench/decode_rule_fit.py`` scores it on a launch search's every-candidate times.

    bf16 (or fp32) caches, head dims up to 128: fitted on the launch search (H100, 94 cells: pages 16-128,
    GQA 1-8, head dims 64 / 128, B = 1-256, 512-32k keys; bench/results/h100-2026-12-06-decode-tune/ and
    h100-2026-12-06-decode-rule/search/), then checked on the family sweep (below). ``walkers``: sequences x
    KV heads, the programs when each walks all its splits (no merge kernel, no partials written);
    ``programs``: one split each. Not measured on an H200 yet (same 132 multiprocessors, more bandwidth).
      * One split (<= 512 keys) is always walked. Head dim 128 with at most one program a multiprocessor:
        8 warps (a program's time is its chain of 64-key chunks, and 8 warps shorten each step). From
        three walkers a multiprocessor (head dim 128: up to eight), 3 stages under a 128-register cap, so
        more programs are resident.
      * Head dim <= 64: from three walkers a multiprocessor, walked at 3 stages / 128 registers; with
        fewer walkers but over 8 programs a multiprocessor, four splits a program at 3 stages / 128
        registers; otherwise the earlier rule below.
      * Head dim 128: over 8 programs a multiprocessor and at least 64 walkers, walked; else, with more
        programs than multiprocessors, one split a program at 2 stages under 128 registers; with half to
        one program a multiprocessor and pages under 64 keys, 8 warps (more gather addresses per chunk);
        otherwise the earlier rule.
    Over the earlier rule, on the 136 decode cells x 4 page sizes of bench/family_sweep.py (one H100, K/V
    rotated out of L2): the changed branches 1.01-1.21x faster (medians per branch; 0.95-1.29x per cell;
    bench/results/h100-2026-12-06-decode-rule/).
    The launch search's own times are L2-resident for small caches and misled two branches there (2 stages
    at <= 64 programs, 16% slower from HBM; capped one-split walks at 16 walkers a multiprocessor): those
    keep the earlier rule.
    The earlier rule (H200, sessions 3-7; head dims over 128 keep it): one split a program, 5 stages, no
    cap; two splits a program in the partial-wave band (3-4 programs a multiprocessor: 1.17-1.27x) and over
    16 a multiprocessor (a vLLM decode step of 256 sequences: 142.5 against 156.4 us).

    FP8 caches read as f16 operands (bf16-fp8-v2; ``kv_fp8`` False, ``f16_operands`` True): the bf16 rule, since
    the chunk loop is the bf16 loop's size, except where it walks the splits with at most one walker a
    multiprocessor: the bf16 kernel walks at the HBM's speed there (3.1 TB/s on an H100), the f16-operand one
    reaches about 2 TB/s and needs more programs: four parallel splits a program, 1.32x the walk at B = 16 x 16k
    keys (32/8 heads, 64-key pages) and B = 16 x 8k (40/8, 32-key pages) on an H100, bitwise equal
    (bench/results/h100-2026-12-07-fp8kv-v2/, measured as explicit launches; the rule itself not re-run).

    FP8 caches, once the programs fill the GPU (more one-split programs than multiprocessors): one split,
    at most 128 registers a thread and 3 stages, so that four programs (16 warps) share a multiprocessor
    instead of two. The dequantisation makes this kernel issue-bound, not read-bound (1.8x the bf16
    kernel's instructions, DRAM 35 % busy: bench/results/h200-2026-12-04-session18, call 5), and more warps
    hide its latency: 1.08-1.16x faster than the bf16 rule's launch at B = 1 x 32k to 256 x 4k keys, GQA
    2-5, head dims 64 / 128, pages 16-64, though ptxas spills 2-54 registers (H100,
    bench/results/h100-2026-12-06-fp8kv/, bench/decode_launch_gpu.py). Fewer programs: the bf16 rule.

    ``maxnreg`` 0: no cap."""
    if sms == 0:  # the launch policy knows no multiprocessor count (not a CUDA GPU): the plain shape
        return dict(splits_per_program=1, num_stages=5, maxnreg=0)
    walkers = programs // max_splits
    walk = dict(split_parallel=False, splits_per_program=1, num_warps=4, head_split=1)
    parallel = dict(walk, split_parallel=True)
    capped = dict(num_stages=3, maxnreg=128)
    if kv_fp8 and programs > sms:
        return dict(parallel if max_splits > 1 else walk, splits_per_program=1, **capped)
    if max_splits == 1:
        if kv_fp8 or head_dim > 128:
            return dict(walk, num_stages=5, maxnreg=0)
        if head_dim > 64 and programs <= sms:
            return dict(walk, num_warps=8, num_stages=5, maxnreg=0)
        many = walkers >= 3 * sms and (head_dim <= 64 or walkers < 8 * sms)
        return dict(walk, **(capped if many else dict(num_stages=5, maxnreg=0)))
    if not kv_fp8 and head_dim <= 64:
        if walkers >= 3 * sms:
            return dict(walk, **capped)
        if programs > 8 * sms:
            return dict(parallel, splits_per_program=4, **capped)
    elif not kv_fp8 and head_dim <= 128:
        if programs > 8 * sms and walkers >= 64:
            if f16_operands and walkers <= sms:
                return dict(parallel, splits_per_program=4, num_stages=5, maxnreg=0)
            return dict(walk, num_stages=5, maxnreg=0)
        if programs > sms:
            return dict(parallel, num_stages=2, maxnreg=128)
        if programs > sms // 2 and page < 64:
            return dict(parallel, num_warps=8, num_stages=5, maxnreg=0)
    two = programs > 16 * sms or 3 * sms < programs <= 4 * sms
    return dict(parallel, splits_per_program=2 if two else 1, num_stages=5, maxnreg=0)


# The decode launches ``hal tune`` times (hal/kernels/tuning.py ``tune_decode``; issue #20): every choice
# ``_decode_launch`` makes by rule, and a few it never makes (8 warps, a GQA group over two programs,
# one program walking all its splits with no merge kernel). Launch choices only: each must give the rule's
# bits, and the tuner checks that bit for bit before it times one.
_DECODE_STAGES_REGISTERS = ((5, 0), (3, 0), (5, 168), (3, 128), (2, 128))


def decode_candidates(max_splits: int, group_pad: int) -> list[dict]:
    """``paged_attention`` overrides for a decode call whose block table holds ``max_splits`` splits and
    whose GQA group pads to ``group_pad`` query heads; none repeats another's launch."""
    walk = [dict(split_parallel=False, num_warps=4, num_stages=stages, maxnreg=registers)
            for stages, registers in _DECODE_STAGES_REGISTERS[:1] + _DECODE_STAGES_REGISTERS[3:]]
    walk.append(dict(walk[0], num_warps=8))
    if max_splits == 1:     # one split: parallel splits would only add the merge kernel
        return walk + ([dict(walk[0], head_split=2)] if group_pad >= 2 else [])
    out = [dict(split_parallel=True, splits_per_program=spp, num_warps=4, num_stages=stages, maxnreg=registers)
           for spp in (1, 2, 4) if spp == 1 or spp < 2 * max_splits        # more than all splits: the same launch
           for stages, registers in _DECODE_STAGES_REGISTERS]
    out += [dict(split_parallel=True, splits_per_program=spp, num_warps=8, num_stages=5, maxnreg=0) for spp in (1, 2)]
    if group_pad >= 2:
        out += [dict(split_parallel=True, splits_per_program=spp, head_split=2, num_warps=4, num_stages=5, maxnreg=0)
                for spp in (1, 2)]
    return out + walk


def decode_launch_key(config: dict, max_splits: int) -> tuple:
    """A decode launch override with ``paged_attention``'s defaults filled in: (walked, splits per program,
    warps, stages, register cap, programs per KV head). Overrides with one key are one launch (a walked
    launch has no splits per program)."""
    walked = not config.get("split_parallel", max_splits > 1)
    return (walked, 1 if walked else config.get("splits_per_program", 1), config.get("num_warps", 4),
            config.get("num_stages", 5), config.get("maxnreg") or 0, config.get("head_split", 1))


# Prefill launch shapes ``hal tune`` times (query rows a program, warps, stages): the shapes of
# bench/prefill_launch_gpu.py that won a cell on the H100 (bench/results/h100-2026-12-07-session12/), the rule's
# own (64 rows / 4 warps / 2 stages, 128 / 8 / 2) among them.
_PREFILL_SHAPES = ((32, 4, 2), (32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 8, 2), (128, 8, 2), (128, 8, 3))


def prefill_candidates(group: int) -> list[dict]:
    """``paged_attention`` overrides for a prefill call whose GQA group is ``group`` query heads a KV head
    (prefill lays a group out whole, packed where it is not a power of two): tokens a program (``block_q``),
    warps and stages; none repeats another's launch."""
    out = []
    for rows, warps, stages in _PREFILL_SHAPES:
        config = dict(block_q=max(1, rows // group), num_warps=warps, num_stages=stages)
        if config not in out:
            out.append(config)
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float, spec: Attention, *,
                    policy: LaunchPolicy, split_parallel: bool | None = None, block_q: int | None = None,
                    num_warps: int | None = None, num_stages: int | None = None, head_split: int | None = None,
                    heads_fastest: bool | None = None, splits_per_program: int | None = None,
                    tma: bool | None = None, maxnreg: int | None = None, nested_splits: bool | None = None,
                    packed_heads: bool | None = None, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None, f16_operands: bool = False) -> torch.Tensor:
    """q (T, Hq, D); caches (pages, P, Hkv, D); metadata as in hal.backend.AttentionMetadata; the
    reduction structure from ``spec`` ([attention]); vendor launch choices from ``policy``.
    ``split_parallel``, ``block_q``, ``num_warps``, ``num_stages``, ``head_split`` (programs per KV
    head, each taking a slice of its query heads; a power of two up to the padded group),
    ``heads_fastest`` (program numbering), ``splits_per_program`` (with parallel splits), ``tma``
    (K/V by tensor descriptor where ``_tma_ok``), ``maxnreg`` (the register cap per thread, 0 for
    none: more programs per multiprocessor), ``nested_splits`` (the kernel's loop structure: a loop over
    splits with the chunk loops inside, or one flat chunk loop) and ``packed_heads`` (a GQA group that is not a
    power of two laid out unpadded in the tile's rows; one program per KV head) override the launch shape (tests
    and tuning); they never change the bits. ``k_scale`` / ``v_scale``: fp8 caches' scales ([fp8]: (pages, P, Hkv) fp32 per
    token-head, or 0-dim fixed), required exactly when the caches are fp8 (``hal.fp8.Fp8KVCache``); ``f16_operands``:
    read them by [fp8].kv_dequant = "f16_operands" (fixed scales only; the module docstring)."""
    tokens, q_heads, head_dim = q.shape
    kv_fp8 = k_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    if kv_fp8 != (k_scale is not None and v_scale is not None):
        raise ValueError("paged_attention: fp8 caches need k_scale and v_scale, and only fp8 caches take them")
    per_token_scale = kv_fp8 and k_scale.dim() == 3
    if f16_operands and (not kv_fp8 or k_scale.dim() or v_scale.dim()):
        raise ValueError("paged_attention: f16_operands reads fp8 caches with one fixed (0-dim) k_scale and v_scale")
    if per_token_scale and k_scale.stride() != v_scale.stride():
        raise ValueError("paged_attention: k_scale and v_scale must have the same strides")
    page, kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    group = q_heads // kv_heads
    out = torch.empty_like(q)
    if tokens == 0:
        return out
    group_pad = next_power_of_2(group)
    shape = _launch_shape(tokens, num_seqs, group_pad)
    context = block_table.shape[1] * page  # keys the block table can hold: an upper bound on every context
    split = spec.split_size(context)
    max_splits = spec.split_count(context)
    # Decode: the rule's launch (``_decode_launch``, from the sequences' one-split, one-group programs), over
    # which a launch measured for this call's shape class (``hal tune``, ``decode_candidates``) is laid; the
    # call's own overrides replace both. No launch choice changes the bits.
    decode = {}
    if shape["decode"]:
        # f16 operands make the FP8 cache's loop the bf16 cache's size: the bf16 launch rule
        decode = {**_decode_launch(num_seqs * kv_heads * max_splits, policy.multiprocessors(q.device),
                                   kv_fp8 and not f16_operands,
                                   max_splits=max_splits, head_dim=head_dim, page=page, f16_operands=f16_operands),
                  **(policy.decode_launch(tokens, num_seqs, context, q_heads, kv_heads, head_dim, page, q.dtype,
                                          k_cache.dtype, spec) or {})}
    # Prefill: the kernel's rule (``_launch_shape``, ``_prefill_wide_tile``), or a launch ``hal tune`` measured for
    # this call's shape class (``prefill_candidates``); the call's own overrides replace both.
    prefill = {} if shape["decode"] else (
        policy.prefill_launch(tokens, num_seqs, q_heads, kv_heads, head_dim, page, q.dtype, k_cache.dtype, spec)
        or {})
    head_split = head_split or decode.get("head_split") or shape["head_split"]
    if head_split > group_pad or group_pad % head_split:
        raise ValueError(f"head_split {head_split} must be a power of two dividing the padded GQA group {group_pad}")
    if packed_heads is None:
        # Prefill tiles are MMA bound, and padding wastes their rows: a group of 5 fills 40 of 64 rows padded
        # to 8 heads, 60 packed (12 tokens). Decode-like tiles hold one sequence's few tokens: the same either way.
        packed_heads = not shape["decode"] and head_split == 1 and group != group_pad
    if packed_heads:
        if head_split != 1:
            raise ValueError("packed_heads lays out a KV head's whole GQA group in one program: head_split must be 1")
        group_pad = group  # the group as the rows lay it out
    heads = group_pad // head_split  # query heads per program
    block_q = block_q or prefill.get("block_q") or policy.attention_block_q(q, k_cache, query_start_loc, spec)
    if block_q is None and not INTERPRET:   # the kernel's own tile: 64 rows, or 128 where they fit one wave
        shape = _prefill_wide_tile(shape, tokens, num_seqs, heads, head_dim, kv_heads * head_split,
                                   policy.multiprocessors(q.device))
    block_q = block_q or max(1, shape["rows"] // heads)  # tokens per program
    tile_rows = next_power_of_2(block_q * heads)  # the MMA tile's M
    # Upper bounds from shapes alone: sum_b cdiv(q_len_b, block_q) tiles, keys <= the block table.
    num_tiles = _tile_count(tokens, num_seqs, block_q)
    heads_fastest = shape["heads_fastest"] if heads_fastest is None else heads_fastest
    heads_fastest = heads_fastest and num_tiles <= 65535  # grid axis 2 holds at most 65535 programs
    kv_chunk = spec.kv_chunk
    if splits_per_program is None:
        splits_per_program = decode.get("splits_per_program", shape["splits_per_program"])
    if maxnreg is None:
        maxnreg = decode.get("maxnreg", 0)
    if splits_per_program < 1:
        raise ValueError(f"splits_per_program must be >= 1, got {splits_per_program}")
    if split_parallel is None:
        split_parallel = decode.get("split_parallel")
    if split_parallel is None:
        # Parallel splits fill the GPU for few tiles and balance it for decode (measured faster
        # up to batch 64 x 32k keys); prefill merges in-kernel (no partials to write).
        split_parallel = (max_splits > 1 and (shape["decode"] or num_tiles * kv_heads * head_split < 264)
                          and not INTERPRET)
    if tma is None:  # descriptors cost the host ~40 us a call; below 1024 query tokens they save < 1 us
        tma = shape["tma"] and tokens >= 1024
    tma = tma and _tma_ok(k_cache, v_cache, kv_chunk)    # bf16 caches only (fp8 tiles are dequantised in registers)
    scale_log2e = spec.score_factor(scale)  # fl32(scale * log2 e), or fl32(scale) with the natural exp
    is_bf16 = q.dtype == torch.bfloat16
    num_stages = num_stages or decode.get("num_stages") or prefill.get("num_stages") or shape["num_stages"]
    if kv_chunk > 64 and not INTERPRET:
        # The stage counts were measured at 64-key chunks. A wider chunk (128 keys: bf16-ascend-v1)
        # holds twice the K/V per stage and ran out of shared memory on the H200 (fp32, head dim 128,
        # 5 stages: 352 KB of 227 KB): keep the K and V tiles of all stages within ~200 KB.
        per_stage = 2 * kv_chunk * head_dim * q.element_size()
        num_stages = max(1, min(num_stages, (200 * 1024) // per_stage))
    per_program = min(splits_per_program, max_splits) if split_parallel else 1
    if nested_splits is None:
        # The nested loops are what a wgmma tile (prefill) needs for ptxas not to serialise its wgmmas
        # (``_attention_kernel``): 1.01-1.44x faster prefill on the H100 (L = 512..16384, GQA 4 and 7, head dim
        # 64 and 128, batched and chunked prefill), bits identical. Decode's 16-row tiles keep the flat loop
        # (its K/V loads stream across split boundaries): 1.2x slower nested at 32k keys.
        # bench/results/h100-2026-12-07-attention-ab.
        nested_splits = not shape["decode"]
    meta = dict(PAGE_SIZE=page, KV_SPLIT=split, GROUP_PAD=group_pad, ROWS=tile_rows, HEAD_SPLIT=head_split,
                SPLITS_PER_PROGRAM=per_program, HEADS_FASTEST=heads_fastest, BLOCK_Q=block_q, HEAD_DIM=head_dim,
                IS_BF16=is_bf16, UPCAST=INTERPRET and (is_bf16 or f16_operands), KV_CHUNK=kv_chunk, BLOCK_B=BLOCK_B, TMA=tma,
                EXP2=spec.exp == "exp2", ROUNDED_SUM=spec.row_sum == "sum_of_rounded_p", KV_FP8=kv_fp8,
                PER_TOKEN_SCALE=per_token_scale, OPERAND_BARRIER=kv_fp8 and not INTERPRET, NESTED_SPLITS=nested_splits,
                F16_OPERANDS=f16_operands,
                num_warps=num_warps or decode.get("num_warps") or prefill.get("num_warps") or shape["num_warps"],
                num_stages=num_stages, **LAUNCH)
    if maxnreg and not INTERPRET:
        meta["maxnreg"] = maxnreg
    scales = (k_scale, v_scale, *(k_scale.stride() if per_token_scale else (0, 0, 0))) if kv_fp8 else (q, q, 0, 0, 0)
    strides = (q.stride(0), q.stride(1), block_table.stride(0), k_cache.stride(0), k_cache.stride(1),
               k_cache.stride(2), out.stride(0), out.stride(1))
    head_programs = kv_heads * head_split
    if tma:
        k_arg, v_arg = _token_rows_descriptor(k_cache, kv_chunk), _token_rows_descriptor(v_cache, kv_chunk)
    else:
        k_arg, v_arg = k_cache, v_cache

    def grid(splits):
        return (head_programs, splits, num_tiles) if heads_fastest else (num_tiles, head_programs, splits)
    if split_parallel:
        rows = tokens * q_heads * max_splits
        # One allocation: the split partials (fp32) and each owned row's position (int32, the last `tokens` words)
        parts = torch.empty((2 + head_dim) * rows + tokens, device=q.device, dtype=torch.float32)
        part_m, part_l, part_a, part_pos = parts.split([rows, rows, head_dim * rows, tokens])
        part_pos = part_pos.view(torch.int32)
        launch(_attention_kernel, grid(cdiv(max_splits, per_program)),
               q, k_arg, v_arg, out, part_m, part_l, part_a, part_pos, query_start_loc, seq_lens, block_table,
               num_seqs, num_tiles, *strides, q_heads, max_splits, scale_log2e, group, *scales, SPLIT_PARALLEL=True,
               **meta)
        launch(_merge_kernel, (tokens, q_heads),
               part_m, part_l, part_a, part_pos, out, query_start_loc, num_seqs, out.stride(0), out.stride(1),
               q_heads, max_splits, v_scale if f16_operands else out, KV_SPLIT=split, HEAD_DIM=head_dim,
               IS_BF16=is_bf16, EXP2=spec.exp == "exp2", F16_OPERANDS=f16_operands, **LAUNCH)
    else:
        launch(_attention_kernel, grid(1),
               q, k_arg, v_arg, out, out, out, out, out, query_start_loc, seq_lens, block_table, num_seqs, num_tiles,
               *strides, q_heads, 1, scale_log2e, group, *scales, SPLIT_PARALLEL=False, **meta)
    return out
