"""Reference paged attention: the contract's [attention] section, step by step.

Reduction structure (bf16-dense-v1: kv_chunk = 64, kv_split = 512):
  score[i, j] = correctly rounded fp32 of q_i . k_j            (head-dim dot, order-free)
  s[i, j]     = fl32(score * fl32(scale * log2 e))   (scale = "multiply": fl32(score * fl32(scale)))
  keys are visited in splits of S = split_size(seq_len) at absolute positions 0, S, 2S, ...
  (kv_split; one split over the whole context when it is 0);
  inside a split, KV chunks of kv_chunk keys at absolute positions c*C, in ascending order:
      masked keys (j > position of query i) are selected out before the max
      m'    = max(m, max_j s)                                  (exact)
      alpha = exp2(m - m')                                     (exp = "exp": exp, here and below)
      p     = exp2(s - m'), exact 0 where masked; p_r = round_act(p)
      masked keys contribute nothing even when their K or V is NaN/Inf (selected, never
      multiplied by 0); an output element whose query sees a non-finite V entry is NaN
      l     = fl(fl(l * alpha) + rowsum(p_r))                  (rowsum correctly rounded; of the
                                                                fp32 p for row_sum = "sum_of_fp32_p")
      acc   = fl(fl(acc * alpha) + p_r @ v)                    (each dot correctly rounded)
  splits are merged into the running (M, L, A) in ascending order:
      M' = max(M, m); a = exp2(M - M'); b = exp2(m - M')
      L  = fl(fl(L * a) + fl(l * b));  A = fl(fl(A * a) + fl(acc * b))
  out = round_act(fl32(A / L))

[fp8].kv_dequant = "f16_operands" (``fixed_scales``: an FP8 cache with one K and one V scale per layer):
  q is rounded to f16 and the caches' e4m3 / e5m2 values enter as f16 (exact); the scores take
  fl32(score * fl32(fl32(scale * log2 e) * k_scale)); p_r = rne_f16(p); out = round_act(fl32(fl32(A / L) * v_scale)).

A query only visits chunks that hold at least one key it may see, so its bits cannot depend on
how many queries share the call, where the prefill was cut, or how the pages are scattered.
"""

from __future__ import annotations

import torch

from hal.backend import AttentionMetadata
from hal.backends.reference.exact import MANTISSA_BITS, exp2_fp32, exp_fp32, matmul_fp32, sum_fp32
from hal.contract import Attention
from hal.errors import UnsupportedError

_NEG_INF = float("-inf")


def gather_pages(cache: torch.Tensor, pages: list[int], length: int) -> torch.Tensor:
    """Keys 0..length-1 of one sequence from a paged cache (num_pages, P, H, D) -> (length, H, D)."""
    index = torch.tensor(pages, dtype=torch.long, device=cache.device)
    return cache.index_select(0, index).flatten(0, 1)[:length]


def check_attention_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: AttentionMetadata) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise UnsupportedError(
            f"attention expects q (T, Hq, D) and k_cache == v_cache shape (pages, P, Hkv, D); got "
            f"q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    if k_cache.shape[3] != d or hq % hkv:
        raise UnsupportedError(f"attention: head dim {d} vs cache {k_cache.shape[3]}, or {hq} query heads "
                               f"not a multiple of {hkv} KV heads")
    if meta.query_start_loc.shape[0] != meta.num_seqs + 1:
        raise UnsupportedError("attention: query_start_loc must have num_seqs + 1 entries")


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, spec: Attention,
                    fixed_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``fixed_scales``: (k_scale, v_scale), 0-dim fp32, for an FP8 cache read by [fp8].kv_dequant = "f16_operands"
    (the module docstring); the caches are then fp8 and q any activation dtype."""
    check_attention_inputs(q, k_cache, v_cache, meta)
    hq, hkv, page = q.shape[1], k_cache.shape[2], k_cache.shape[1]
    head_map = torch.arange(hq, device=q.device) // (hq // hkv)          # [attention].gqa
    scale_log2e = torch.tensor(spec.score_factor(scale), dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    v_scale = None
    if fixed_scales is not None:
        k_scale, v_scale = fixed_scales
        scale_log2e = scale_log2e * k_scale.to(q.device)                    # fp32 product, rounded once
        q = q.to(torch.float16)                                              # nearest even
        k_cache, v_cache = k_cache.to(torch.float16), v_cache.to(torch.float16)     # exact
    starts, seq_lens, table = meta.host_lists()
    for b, seq_len in enumerate(seq_lens):
        q0, q1 = starts[b], starts[b + 1]
        q_len = q1 - q0
        if q_len == 0:
            continue
        if q_len > seq_len:
            raise UnsupportedError(f"attention: sequence {b} has {q_len} queries but seq_len {seq_len}")
        pages = table[b][: -(-seq_len // page)]
        k = gather_pages(k_cache, pages, seq_len)                          # (L, Hkv, D)
        v = gather_pages(v_cache, pages, seq_len)
        qh = q[q0:q1].transpose(0, 1)                                      # (Hq, ql, D)
        kh = k.permute(1, 2, 0).index_select(0, head_map)                  # (Hq, D, L)
        vh = v.transpose(0, 1).index_select(0, head_map)                   # (Hq, L, D)
        s = matmul_fp32(qh, kh) * scale_log2e                              # (Hq, ql, L)
        positions = torch.arange(seq_len - q_len, seq_len, device=q.device)
        out[q0:q1] = _online_softmax(s, vh, positions, spec, v_scale).transpose(0, 1).to(out.dtype)
    return out


def _online_softmax(s: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, spec: Attention,
                    v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 outputs (Hq, ql, D) of the recurrence; P is rounded to V's dtype (the activation dtype, or f16)."""
    heads, q_len, seq_len = s.shape
    dtype = v.dtype
    exp = exp2_fp32 if spec.exp == "exp2" else exp_fp32       # [attention].exp (validated with its scale)
    rounded_sum = spec.row_sum == "sum_of_rounded_p"
    chunk = spec.kv_chunk
    split = spec.split_size(seq_len)
    keys = torch.arange(seq_len, device=s.device)
    big_m = torch.full((heads, q_len), _NEG_INF, device=s.device)
    big_l = torch.zeros((heads, q_len), device=s.device)
    big_a = torch.zeros((heads, q_len, v.shape[-1]), device=s.device)
    for split_start in range(0, seq_len, split):
        m = torch.full_like(big_m, _NEG_INF)
        l = torch.zeros_like(big_l)
        acc = torch.zeros_like(big_a)
        for c0 in range(split_start, min(split_start + split, seq_len), chunk):
            c1 = min(c0 + chunk, seq_len)
            visits = positions >= c0                                       # (ql,)
            valid = keys[c0:c1].unsqueeze(0) <= positions.unsqueeze(1)     # (ql, C)
            sc = torch.where(valid, s[:, :, c0:c1], _NEG_INF)
            m_new = torch.maximum(m, sc.amax(-1))
            alpha = exp(m - m_new)
            p = torch.where(valid, exp(sc - m_new.unsqueeze(-1)), 0.0)
            p_r = p.to(dtype)
            # [attention].row_sum: the rounded P that multiplies V, or the fp32 P before the rounding
            row_sum = sum_fp32(p_r.double(), MANTISSA_BITS[dtype]) if rounded_sum else sum_fp32(p.double(), 24)
            # [attention].mask: a masked key contributes nothing whatever its V holds. p_r is 0 there,
            # but 0 * NaN (or Inf) is NaN inside p_r @ v, so non-finite V entries are selected to 0
            # (exact: finite values pass unchanged) and the (query, dim) outputs whose query sees
            # one are set to NaN by a select: only visible keys can make an output non-finite.
            vc = v[:, c0:c1, :]
            finite = torch.isfinite(vc)
            pv = matmul_fp32(p_r, torch.where(finite, vc, 0.0))
            sees_non_finite = torch.matmul(valid.double(), (~finite).double()) > 0    # (Hq, ql, D)
            pv = torch.where(sees_non_finite, float("nan"), pv)
            l_new = l * alpha + row_sum
            acc_new = acc * alpha.unsqueeze(-1) + pv
            m = torch.where(visits, m_new, m)
            l = torch.where(visits, l_new, l)
            acc = torch.where(visits.view(1, -1, 1), acc_new, acc)
        merging = positions >= split_start
        m_merged = torch.maximum(big_m, m)
        a = exp(big_m - m_merged)
        b = exp(m - m_merged)
        l_merged = big_l * a + l * b
        a_merged = big_a * a.unsqueeze(-1) + acc * b.unsqueeze(-1)
        big_m = torch.where(merging, m_merged, big_m)
        big_l = torch.where(merging, l_merged, big_l)
        big_a = torch.where(merging.view(1, -1, 1), a_merged, big_a)
    # fp64 quotient rounded once to fp32: the correctly rounded fp32 quotient on any host (see _fdiv); a non-finite
    # element is NaN, one NaN ([attention].mask: the row saw a non-finite K or V)
    out = torch.div(big_a.double(), big_l.unsqueeze(-1).double()).float()
    if v_scale is not None:
        out = out * v_scale.to(out.device)                                   # fl32, after the quotient
    return torch.where(torch.isfinite(out), out, torch.tensor(float("nan")))
