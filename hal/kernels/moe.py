"""Mixture-of-experts routing kernel ([moe]; the steps are written out in ``hal/moe.py``).

One program per token row: the whole row of E router logits is one tile of E_PAD lanes, so nothing
about a row's bits depends on the other rows or on the batch size.

Reduction structure:
  softmax: max over the row (exact), e = exp(fl32(x - max)), S = one ``tl.sum`` over the E_PAD lanes
  (masked lanes hold 0; the tree is fixed by E_PAD: the [reduce] row block when E <= row_block, which
  is the only case launched), p = div_rn(e, S). Sigmoid: div_rn(1, fl32(1 + exp(-x))).
  top-k: TOP_K rounds of (row max, lowest index holding it, remove it): ties to the lower index,
  ranks in value-descending order; group-limited routing the same over group scores fl32(a + b) of
  each group's two best. The renormalising sum adds the chosen weights in rank order (rank 0 first).
No FMA: every launch passes ``enable_fp_fusion=False``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hal.contract import Reduce
from hal.errors import UnsupportedError
from hal.kernels.common import LAUNCH, next_power_of_2


@triton.jit
def _best(values, offs, BIG: tl.constexpr):
    """(max of ``values``, the lowest lane holding it)."""
    best = tl.max(values, axis=0)
    return best, tl.min(tl.where(values == best, offs, BIG), axis=0)


@triton.jit(do_not_specialize=["num_experts", "scaling"])
def _route_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_experts, stride_l, scaling,
                  SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr, SCALE: tl.constexpr,
                  TOP_K: tl.constexpr, K_PAD: tl.constexpr, GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr,
                  GROUP_SIZE: tl.constexpr, G_PAD: tl.constexpr, E_PAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, E_PAD)
    valid = offs < num_experts
    x = tl.load(logits_ptr + row * stride_l + offs, mask=valid, other=float("-inf"))
    if SOFTMAX:
        e = tl.where(valid, tl.exp(x - tl.max(x, axis=0)), 0.0)
        scores = tl.div_rn(e, tl.sum(e, axis=0))
    else:
        scores = tl.div_rn(1.0, 1.0 + tl.exp(-x))
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + offs, mask=valid, other=0.0)
    choice = tl.where(valid, choice, float("-inf"))

    if GROUPS > 1:
        group_offs = tl.arange(0, G_PAD)
        group_scores = tl.full((G_PAD,), float("-inf"), tl.float32)
        for g in tl.static_range(GROUPS):
            in_group = (offs >= g * GROUP_SIZE) & (offs < (g + 1) * GROUP_SIZE)
            first, at = _best(tl.where(in_group, choice, float("-inf")), offs, E_PAD)
            second = tl.max(tl.where(in_group & (offs != at), choice, float("-inf")), axis=0)
            group_scores = tl.where(group_offs == g, first + second, group_scores)
        kept = offs < 0                                   # all False
        for _ in tl.static_range(TOPK_GROUPS):
            _, g = _best(group_scores, group_offs, G_PAD)
            kept = kept | ((offs >= g * GROUP_SIZE) & (offs < (g + 1) * GROUP_SIZE))
            group_scores = tl.where(group_offs == g, float("-inf"), group_scores)
        choice = tl.where(kept, choice, float("-inf"))    # selected out: never chosen

    rank_offs = tl.arange(0, K_PAD)
    weights = tl.zeros((K_PAD,), tl.float32)
    ids = tl.zeros((K_PAD,), tl.int32)
    for r in tl.static_range(TOP_K):
        _, at = _best(choice, offs, E_PAD)
        weight = tl.sum(tl.where(offs == at, scores, 0.0), axis=0)   # the one chosen lane: exact
        weights = tl.where(rank_offs == r, weight, weights)
        ids = tl.where(rank_offs == r, at, ids)
        choice = tl.where(offs == at, float("-inf"), choice)
    if RENORMALIZE:
        total = tl.sum(tl.where(rank_offs == 0, weights, 0.0), axis=0)
        for r in tl.static_range(1, TOP_K):
            total = total + tl.sum(tl.where(rank_offs == r, weights, 0.0), axis=0)
        weights = tl.div_rn(weights, total)
    if SCALE:
        weights = weights * scaling
    keep = rank_offs < TOP_K
    tl.store(weights_ptr + row * TOP_K + rank_offs, weights, mask=keep)
    tl.store(ids_ptr + row * TOP_K + rank_offs, ids, mask=keep)


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
        _route_kernel[(t,)](
            logits, bias, weights, ids, num_experts, logits.stride(0), float(routing.scaling),
            SOFTMAX=routing.scoring == "softmax", HAS_BIAS=correction_bias is not None,
            RENORMALIZE=routing.renormalize, SCALE=routing.scaling != 1.0, TOP_K=routing.top_k,
            K_PAD=next_power_of_2(routing.top_k), GROUPS=routing.num_groups, TOPK_GROUPS=routing.topk_groups,
            GROUP_SIZE=num_experts // routing.num_groups, G_PAD=next_power_of_2(routing.num_groups),
            E_PAD=next_power_of_2(num_experts), num_warps=4, **LAUNCH)
    return weights, ids
