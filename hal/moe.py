"""Mixture-of-experts layers under the contract's ``[moe]`` section: routing, expert GEMMs, combine.

An MoE layer is three steps, each written here once for every backend that composes it from its own
primitives (``reference``, ``cuda``):

1. **route** (``route``): fp32 router logits (T, E) -> per token the ``top_k`` expert ids and fp32
   weights. Scores are a softmax (Qwen3-MoE) or a sigmoid (DeepSeek-V3) of the logits; a correction
   bias (DeepSeek-V3) shifts only the *choice*; group-limited routing keeps the ``topk_groups`` best
   expert groups (a group's score: its two best choice scores added); top-k takes ties to the lower
   expert index; weights are the unbiased scores, optionally renormalised (their sum added in rank
   order, one division) and scaled. Each step is elementwise, a row max, a [reduce] sum or the
   backend's top-k, so a token's routing cannot depend on its batch-mates.
2. **expert outputs** (``expert_outputs``): every (token, rank) slot's expert MLP, computed as the
   backend's own ``linear`` / ``silu_mul`` / ``linear`` of that token's row (``fp8_expert_outputs``: its
   ``fp8_linear`` / ``silu_mul`` / ``fp8_linear``, for block-FP8 experts under [fp8]). Those are
   batch-invariant under [gemm] (and [fp8]), so a slot's bits do not depend on which tokens share the
   expert, their order, or which device (``experts``) computes it: that is what lets expert
   parallelism keep the bits.
3. **combine** (``combine``): out = round(sum over ranks 0..k-1 of fl32(w_r * y_r), in rank order, in
   fp32, then + the shared experts' output), rounded once to the activation dtype.

``Routing`` is the model's part (its config.json says softmax or sigmoid, how many experts, ...);
the contract says how each step is computed. The routing math takes the backend's exp and division
as arguments because those are where backends differ (the reference's are correctly rounded, a
GPU's are its hardware's): everything else is comparison or a single IEEE add/multiply.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from hal.errors import UnsupportedError

SCORING = ("softmax", "sigmoid")


@dataclass(frozen=True)
class Routing:
    """How a model routes tokens to experts (from its config.json; see ``hal.model.config``)."""

    num_experts: int
    top_k: int
    scoring: str = "softmax"      # "softmax" (Qwen3-MoE) or "sigmoid" (DeepSeek-V3)
    renormalize: bool = True      # HF norm_topk_prob: weights divided by their sum
    num_groups: int = 1           # HF n_group: experts split into this many groups (1: no group limit)
    topk_groups: int = 1          # HF topk_group: experts are chosen from this many best groups
    scaling: float = 1.0          # HF routed_scaling_factor: multiplies the weights last

    def __post_init__(self):
        if self.scoring not in SCORING:
            raise UnsupportedError(f"MoE routing: scoring {self.scoring!r} is not supported; supported: "
                                   f"{', '.join(SCORING)}")
        if self.num_experts < 1 or not 1 <= self.top_k <= self.num_experts:
            raise UnsupportedError(f"MoE routing: top_k must be in 1..num_experts ({self.num_experts}), "
                                   f"got {self.top_k}")
        if self.num_groups < 1 or self.num_experts % self.num_groups:
            raise UnsupportedError(f"MoE routing: num_groups {self.num_groups} must divide num_experts "
                                   f"{self.num_experts}")
        if self.num_groups > 1:
            per_group = self.num_experts // self.num_groups
            if per_group < 2:
                raise UnsupportedError(f"MoE routing: a group's score is its two best experts' sum, so a group "
                                       f"needs >= 2 experts; {self.num_experts} experts in {self.num_groups} "
                                       f"groups have {per_group}")
            if not 1 <= self.topk_groups <= self.num_groups:
                raise UnsupportedError(f"MoE routing: topk_groups must be in 1..num_groups ({self.num_groups}), "
                                       f"got {self.topk_groups}")
            if self.top_k > self.topk_groups * per_group:
                raise UnsupportedError(f"MoE routing: top_k {self.top_k} exceeds the {self.topk_groups * per_group} "
                                       f"experts of the {self.topk_groups} kept groups")
        if not self.scaling > 0:
            raise UnsupportedError(f"MoE routing: scaling must be > 0, got {self.scaling}")

    def replace(self, **changes) -> "Routing":
        return dataclasses.replace(self, **changes)


def check_contract(backend) -> None:
    """Refuse an MoE op on a backend bound to a contract without [moe] (a dense-only contract)."""
    contract = backend.contract
    if contract is not None and contract.moe is None:
        raise UnsupportedError(f"{backend.name}: contract {contract} has no [moe] section, so it does not say how "
                               f"an MoE layer's bits are decided; use a contract that has one (bf16-moe-v1)")


# ---------------------------------------------------------------------------------------------
# 1. Routing
# ---------------------------------------------------------------------------------------------

def route(router_logits: torch.Tensor, routing: Routing, correction_bias: torch.Tensor | None, *,
          exp: Callable[[torch.Tensor], torch.Tensor], div: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
          row_sum: Callable[[torch.Tensor], torch.Tensor],
          topk: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (T, k) fp32, ids (T, k) int32) of fp32 router logits (T, E), as [moe] says.

    ``exp``/``div``: the backend's fp32 exp and division; ``row_sum``: its [reduce] sum over the last
    dim; ``topk``: its [topk] (value descending, ties to the lower index)."""
    x = router_logits.float()
    if routing.scoring == "softmax":
        shifted = x - x.amax(-1, keepdim=True)
        e = exp(shifted)
        scores = div(e, row_sum(e).unsqueeze(-1))
    else:
        scores = div(torch.ones_like(x), 1.0 + exp(-x))
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if routing.num_groups > 1:
        t, e_count = choice.shape
        grouped = choice.view(t, routing.num_groups, e_count // routing.num_groups)
        best2, _ = topk(grouped, 2)
        group_scores = best2[..., 0] + best2[..., 1]
        _, kept = topk(group_scores, routing.topk_groups)
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(-1, kept, True)
        # Selected out, never scored low: no expert of a dropped group can be chosen, whatever its score.
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(t, e_count)
    _, ids = topk(choice, routing.top_k)
    weights = scores.gather(-1, ids)
    if routing.renormalize:
        total = weights[:, 0]
        for r in range(1, routing.top_k):        # rank order, one fp32 add at a time
            total = total + weights[:, r]
        weights = div(weights, total.unsqueeze(-1).expand_as(weights).contiguous())
    if routing.scaling != 1.0:
        weights = weights * torch.tensor(routing.scaling, dtype=torch.float32, device=weights.device)
    return weights, ids.to(torch.int32)


# ---------------------------------------------------------------------------------------------
# 2. Expert outputs
# ---------------------------------------------------------------------------------------------

def slots_by_expert(ids: torch.Tensor, num_experts: int) -> list[tuple[int, torch.Tensor]]:
    """(expert, flat slot indices ``token * k + rank`` routed to it) for every expert with a slot, in
    expert order; ids in 0..num_experts-1 (``Backend.moe_experts`` checks them). Synchronises with the
    host once (the per-expert counts)."""
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    out, start = [], 0
    for expert, n in enumerate(counts):
        if n:
            out.append((expert, order[start:start + n]))
            start += n
    return out


def expert_outputs(backend, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
                   experts: Iterable[int] | None = None) -> torch.Tensor:
    """fp32 (T, k, H) down-projection outputs of every (token, rank) slot, each computed as
    ``linear(silu_mul(linear(x_t, w13[e])), w2[e], fp32)`` on ``backend``.

    ``experts``: compute only these experts' slots (the others stay zero): what one expert-parallel
    rank computes. x: (T, H); w13: (E, 2I, H) rows [gate | up];
    w2: (E, H, I); ids: (T, k)."""
    def mlp(rows, e):
        act = backend.silu_mul(backend.linear(rows, w13[e]))
        return backend.linear(act, w2[e], out_dtype=torch.float32)

    return _slot_outputs(mlp, x, ids, w13.shape[0], experts)


def fp8_expert_outputs(backend, x: torch.Tensor, w13: torch.Tensor, w13_scale_inv: torch.Tensor,
                       w2: torch.Tensor, w2_scale_inv: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``expert_outputs`` of block-FP8 experts: each slot's MLP is ``fp8_linear(silu_mul(fp8_linear(x_t,
    w13[e])), w2[e], fp32)`` on ``backend`` ([fp8]: each row's activations quantised per 1 x 128 group
    from that row alone, so a slot's bits do not depend on the expert's other tokens either).
    w13 (E, 2I, H) / w2 (E, H, I) e4m3 with their per-expert block scales (E, 2I/B, H/B) / (E, H/B, I/B)."""
    def mlp(rows, e):
        act = backend.silu_mul(backend.fp8_linear(rows, w13[e], w13_scale_inv[e]))
        return backend.fp8_linear(act, w2[e], w2_scale_inv[e], out_dtype=torch.float32)

    return _slot_outputs(mlp, x, ids, w13.shape[0], None)


def _slot_outputs(mlp: Callable[[torch.Tensor, int], torch.Tensor], x: torch.Tensor, ids: torch.Tensor,
                  num_experts: int, experts: Iterable[int] | None) -> torch.Tensor:
    """fp32 (T, k, H): ``mlp(rows of the expert's slots, expert)`` for every expert with a slot."""
    t, k = ids.shape
    out = torch.zeros(t * k, x.shape[-1], dtype=torch.float32, device=x.device)
    wanted = None if experts is None else set(int(e) for e in experts)
    for expert, slots in slots_by_expert(ids, num_experts):
        if wanted is not None and expert not in wanted:
            continue
        out[slots] = mlp(x[slots // k], expert)
    return out.view(t, k, x.shape[-1])


# ---------------------------------------------------------------------------------------------
# 3. Combine
# ---------------------------------------------------------------------------------------------

def combine(outputs: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None,
            dtype: torch.dtype) -> torch.Tensor:
    """round_act(fl32 sum over ranks 0..k-1 of fl32(w_r * y_r), then + shared): (T, H) in ``dtype``.

    outputs: (T, k, H) fp32; weights: (T, k) fp32; shared: (T, H) or None. Separate multiplies and
    adds (eager elementwise ops: each rounds once, none is contracted into an FMA)."""
    acc = weights[:, 0:1] * outputs[:, 0]
    for r in range(1, outputs.shape[1]):
        acc = acc + weights[:, r:r + 1] * outputs[:, r]
    if shared is not None:
        acc = acc + shared.float()
    return acc.to(dtype)


def experts(backend, x, w13, w2, weights, ids, shared=None) -> torch.Tensor:
    """The whole expert half of an MoE layer on ``backend``'s primitives: expert outputs, then combine."""
    return combine(expert_outputs(backend, x, w13, w2, ids), weights, shared, x.dtype)


def fp8_experts(backend, x, w13, w13_scale_inv, w2, w2_scale_inv, weights, ids, shared=None) -> torch.Tensor:
    """``experts`` with block-FP8 expert weights: ``fp8_expert_outputs``, then the same combine."""
    return combine(fp8_expert_outputs(backend, x, w13, w13_scale_inv, w2, w2_scale_inv, ids), weights, shared,
                   x.dtype)
