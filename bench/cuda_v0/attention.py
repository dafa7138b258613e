"""Unified paged attention (prefill, chunked prefill, decode, training) for the cuda backend.

Reduction structure (contract [attention], read from ``kv_chunk`` and ``kv_split``):
  s = fl32(q.k * fl32(scale * log2 e)); keys in splits of KV_SPLIT at absolute positions 0, S, ...;
  inside a split, chunks of KV_CHUNK keys at absolute positions (BLOCK_N == KV_CHUNK), ascending:
      masked keys are selected out (-inf) before the row max; a row with no visible key in the
      chunk keeps its state untouched
      m' = max(m, rowmax s); alpha = exp2(m - m'); p = exp2(s - m') (0 where masked)
      p_r = round_act(p); rowsum = p_r @ ones (the MMA sums the same rounded P that multiplies V:
      a generic tl.sum over the MMA-layout P changes bits with the tile shape)
      l = fl(fl(l * alpha) + rowsum); acc = fl(fl(acc * alpha) + p_r @ v)
  splits are merged in ascending order into (M, L, A), starting from (-inf, 0, 0):
      M' = max(M, m); a = exp2(M - M'); b = exp2(m - M'); L = fl(L*a) + fl(l*b); A = fl(A*a) + fl(acc*b)
  out = round_act(div_rn(A, L)).

A program owns BLOCK_Q query tokens of one sequence times the GROUP query heads that share one KV
head (rows = token x head). Which queries share a tile, and whether splits run in one program
(``SPLIT_PARALLEL`` off: prefill) or in parallel programs merged by ``_merge_kernel`` (decode,
few tiles), is chosen per call for speed; every row's bits are the same either way.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from hal.backends.cuda.common import INTERPRET, LAUNCH, next_power_of_2, round_to_bf16, to_activation, zero_scalar


@triton.jit
def _split_state(q, q_row_ok, positions, seq_len, split_start, split_end, b, kvh,
                 k_cache_ptr, v_cache_ptr, block_table_ptr, stride_bt, stride_kp, stride_kr, stride_kh,
                 scale_log2e, offs_d, page_size,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                 IS_BF16: tl.constexpr, UPCAST: tl.constexpr):
    """(m, l, acc) of one KV split for the rows of this tile, by the chunk recurrence above."""
    m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    if IS_BF16 and not UPCAST:
        ones = tl.full((BLOCK_N, 16), 1.0, dtype=tl.bfloat16)
    else:
        ones = tl.full((BLOCK_N, 16), 1.0, dtype=tl.float32)
    last_key = tl.minimum(split_end, tl.max(tl.where(q_row_ok, positions, -1)) + 1)
    for n0 in range(split_start, last_key, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        key_ok = keys < seq_len
        page = tl.load(block_table_ptr + b * stride_bt + keys // page_size, mask=key_ok, other=0).to(tl.int64)
        kv_off = page[:, None] * stride_kp + (keys % page_size)[:, None] * stride_kr + kvh * stride_kh + offs_d[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=key_ok[:, None], other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=key_ok[:, None], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if IS_BF16 and not UPCAST:
            s = tl.dot(q, tl.trans(k))
        else:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        s = s * scale_log2e
        visible = (keys[None, :] <= positions[:, None]) & key_ok[None, :] & q_row_ok[:, None]
        s = tl.where(visible, s, float("-inf"))
        row_visits = tl.max(visible.to(tl.int32), axis=1) > 0
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(row_visits, m_new, 0.0)
        alpha = tl.exp2(m - m_safe)
        p = tl.where(visible, tl.exp2(s - m_safe[:, None]), 0.0)
        if IS_BF16:
            p = round_to_bf16(p)
            if not UPCAST:
                p = p.to(tl.bfloat16)
        if IS_BF16 and not UPCAST:
            row_sum = tl.max(tl.dot(p, ones), axis=1)
            pv = tl.dot(p, v)
        else:
            row_sum = tl.max(tl.dot(p, ones, input_precision="ieee"), axis=1)
            pv = tl.dot(p, v, input_precision="ieee")
        l_new = l * alpha + row_sum
        acc_new = acc * alpha[:, None] + pv
        m = tl.where(row_visits, m_new, m)
        l = tl.where(row_visits, l_new, l)
        acc = tl.where(row_visits[:, None], acc_new, acc)
    return m, l, acc


@triton.jit
def _attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_m_ptr, part_l_ptr, part_a_ptr,
                      tiles_ptr, query_start_ptr, seq_lens_ptr, block_table_ptr,
                      stride_qt, stride_qh, stride_bt, stride_kp, stride_kr, stride_kh, stride_ot, stride_oh,
                      num_q_heads, max_splits, scale_log2e, group, page_size, kv_split,
                      GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
                      SPLIT_PARALLEL: tl.constexpr, IS_BF16: tl.constexpr, UPCAST: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.load(tiles_ptr + 2 * tile)
    q_first = tl.load(tiles_ptr + 2 * tile + 1)
    q_begin = tl.load(query_start_ptr + b)
    q_len = tl.load(query_start_ptr + b + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + b)

    rows = tl.arange(0, BLOCK_M)
    tok = q_first + rows // GROUP_PAD            # query index inside the sequence
    head_in_group = rows % GROUP_PAD
    q_row_ok = (tok < q_len) & (head_in_group < group)
    positions = seq_len - q_len + tok            # absolute position of each row's query
    token = q_begin + tok
    head = kvh * group + head_in_group
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + token.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=q_row_ok[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    if SPLIT_PARALLEL:
        split = tl.program_id(2)
        split_start = split * kv_split
        m, l, acc = _split_state(q, q_row_ok, positions, seq_len, split_start, split_start + kv_split, b, kvh,
                                 k_cache_ptr, v_cache_ptr, block_table_ptr, stride_bt, stride_kp, stride_kr,
                                 stride_kh, scale_log2e, offs_d, page_size, BLOCK_M, BLOCK_N, HEAD_DIM, IS_BF16,
                                 UPCAST)
        store_ok = q_row_ok & (positions >= split_start)
        part = (token.to(tl.int64) * num_q_heads + head) * max_splits + split
        tl.store(part_m_ptr + part, m, mask=store_ok)
        tl.store(part_l_ptr + part, l, mask=store_ok)
        tl.store(part_a_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=store_ok[:, None])
    else:
        big_m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        big_l = tl.zeros((BLOCK_M,), dtype=tl.float32)
        big_a = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
        last_key = tl.max(tl.where(q_row_ok, positions, -1)) + 1
        for split_start in range(0, last_key, kv_split):
            m, l, acc = _split_state(q, q_row_ok, positions, seq_len, split_start, split_start + kv_split, b, kvh,
                                     k_cache_ptr, v_cache_ptr, block_table_ptr, stride_bt, stride_kp, stride_kr,
                                     stride_kh, scale_log2e, offs_d, page_size, BLOCK_M, BLOCK_N, HEAD_DIM,
                                     IS_BF16, UPCAST)
            merging = q_row_ok & (positions >= split_start)
            m_merged = tl.maximum(big_m, m)
            m_ref = tl.where(merging, m_merged, 0.0)
            a = tl.exp2(big_m - m_ref)
            bb = tl.exp2(m - m_ref)
            l_merged = big_l * a + l * bb
            a_merged = big_a * a[:, None] + acc * bb[:, None]
            big_m = tl.where(merging, m_merged, big_m)
            big_l = tl.where(merging, l_merged, big_l)
            big_a = tl.where(merging[:, None], a_merged, big_a)
        out = tl.div_rn(big_a, tl.where(q_row_ok, big_l, 1.0)[:, None])
        tl.store(out_ptr + token.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 to_activation(out, IS_BF16), mask=q_row_ok[:, None])


@triton.jit
def _merge_kernel(part_m_ptr, part_l_ptr, part_a_ptr, out_ptr, positions_ptr, stride_ot, stride_oh,
                  num_q_heads, max_splits, kv_split, HEAD_DIM: tl.constexpr, IS_BF16: tl.constexpr):
    """Merge the splits of one (token, head) in ascending order; the same formula as in-kernel."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    offs_d = tl.arange(0, HEAD_DIM)
    position = tl.load(positions_ptr + token)
    big_m = zero_scalar() + float("-inf")
    big_l = zero_scalar()
    big_a = tl.zeros((HEAD_DIM,), dtype=tl.float32)
    base = (token.to(tl.int64) * num_q_heads + head) * max_splits
    for split in range(0, position // kv_split + 1):
        m = tl.load(part_m_ptr + base + split)
        l = tl.load(part_l_ptr + base + split)
        acc = tl.load(part_a_ptr + (base + split) * HEAD_DIM + offs_d)
        m_merged = tl.maximum(big_m, m)
        a = tl.exp2(big_m - m_merged)
        bb = tl.exp2(m - m_merged)
        big_l = big_l * a + l * bb
        big_a = big_a * a + acc * bb
        big_m = m_merged
    out = tl.div_rn(big_a, big_l)
    tl.store(out_ptr + token.to(tl.int64) * stride_ot + head * stride_oh + offs_d, to_activation(out, IS_BF16))


def _tiles(q_lens: list[int], block_q: int) -> list[int]:
    flat = []
    for b, q_len in enumerate(q_lens):
        for start in range(0, q_len, block_q):
            flat += [b, start]
    return flat


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float, kv_chunk: int, kv_split: int,
                    split_parallel: bool | None = None, block_q: int | None = None,
                    num_warps: int = 4) -> torch.Tensor:
    """q (T, Hq, D); caches (pages, P, Hkv, D); metadata as in hal.backend.AttentionMetadata.
    ``split_parallel``, ``block_q`` and ``num_warps`` override the launch shape (tests and tuning);
    they never change the bits."""
    tokens, q_heads, head_dim = q.shape
    page, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q_heads // kv_heads
    out = torch.empty_like(q)
    if tokens == 0:
        return out
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [starts[i + 1] - starts[i] for i in range(len(lens))]
    group_pad = next_power_of_2(group)
    if block_q is None:
        block_q = max(1, (16 if max(q_lens) <= 16 else 64) // group_pad)
    tiles = _tiles(q_lens, block_q)
    num_tiles = len(tiles) // 2
    split = kv_split or max(lens)
    split = triton.cdiv(split, kv_chunk) * kv_chunk
    max_splits = triton.cdiv(max(lens), split)
    if split_parallel is None:
        split_parallel = max_splits > 1 and num_tiles * kv_heads < 264
    tiles_t = torch.tensor(tiles, dtype=torch.int32, device=q.device)
    scale_log2e = float(torch.tensor(scale / math.log(2.0), dtype=torch.float64).float())
    is_bf16 = q.dtype == torch.bfloat16
    meta = dict(GROUP_PAD=group_pad, BLOCK_M=block_q * group_pad, HEAD_DIM=head_dim, IS_BF16=is_bf16, UPCAST=INTERPRET and is_bf16, BLOCK_N=kv_chunk,
                num_warps=num_warps, num_stages=1 if INTERPRET else 2, **LAUNCH)
    strides = (q.stride(0), q.stride(1), block_table.stride(0), k_cache.stride(0), k_cache.stride(1),
               k_cache.stride(2), out.stride(0), out.stride(1))
    if split_parallel:
        part_m = torch.empty((tokens, q_heads, max_splits), device=q.device, dtype=torch.float32)
        part_l = torch.empty_like(part_m)
        part_a = torch.empty((tokens, q_heads, max_splits, head_dim), device=q.device, dtype=torch.float32)
        _attention_kernel[(num_tiles, kv_heads, max_splits)](
            q, k_cache, v_cache, out, part_m, part_l, part_a, tiles_t, query_start_loc, seq_lens, block_table,
            *strides, q_heads, max_splits, scale_log2e, group, page, split, SPLIT_PARALLEL=True, **meta)
        positions = torch.cat([torch.arange(lens[i] - q_lens[i], lens[i]) for i in range(len(lens))])
        _merge_kernel[(tokens, q_heads)](part_m, part_l, part_a, out, positions.to(q.device, torch.int32),
                                         out.stride(0), out.stride(1), q_heads, max_splits, split,
                                         HEAD_DIM=head_dim, IS_BF16=is_bf16, **LAUNCH)
    else:
        _attention_kernel[(num_tiles, kv_heads, 1)](
            q, k_cache, v_cache, out, out, out, out, tiles_t, query_start_loc, seq_lens, block_table,
            *strides, q_heads, 1, scale_log2e, group, page, split, SPLIT_PARALLEL=False, **meta)
    return out
