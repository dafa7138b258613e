"""Autograd on top of inference kernels: forward bits from the backend, gradients from fp32 math.

Every differentiable HAL op used in training is a ``torch.autograd.Function`` whose forward calls
the backend's *inference* kernel (so training sees exactly the bits the rollout engine sees) and
whose backward differentiates a plain-PyTorch fp32 recomputation of the same function (the
kernels have no derivative of their own). The value is the same as
``visible + (graph - graph.detach())`` (see ``straight_through``) but the fp32 graph is built only
during backward, from the saved inputs, so the forward costs one kernel call and keeps no graph.

Rounding: the backward treats every rounding of the forward (activation dtype, fp32 logits) as the
identity; gradients are correct to fp32 reference accuracy, not bitwise. Gradients of bf16
tensors arrive in bf16 (autograd casts a gradient to its tensor's dtype at every op boundary).

Stale weights: backward recomputes from the saved inputs, so it must see the weights the forward
saw. Each op records its inputs' version counters and raises ``WeightsChangedError`` if one was
modified in place (``optimizer.step()``, an in-place weight sync) before its backward, and the
model guards its output so that the check of *all* parameters runs before any gradient is
computed. Writes through ``param.data`` bypass version counters and are not detected.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.nn.functional as F

from hal.backend import AttentionMetadata, Backend
from hal.errors import HalError, WeightsChangedError
from hal.fp8 import Fp8KVCache
from hal.kvcache import PagedKVCache, build_metadata, pages_needed
from hal.moe import slots_by_expert


# ---------------------------------------------------------------------------------------------
# The generic kernel-forward / reference-backward function.
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class KernelOp:
    """One op: ``visible`` runs the backend kernel, ``graph`` the fp32 reference of the same math.

    Both take the same positional inputs (tensors, or None for an absent bias). ``graph`` must be
    differentiable with plain torch ops and return a tensor or a tuple matching ``visible``.
    """

    name: str
    visible: Callable[..., Any]
    graph: Callable[..., Any]
    input_names: tuple[str, ...]


class _KernelFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op: KernelOp, *inputs):
        ctx.op = op
        # Kept on ctx (not save_for_backward) so that backward can read the version counters and
        # raise a clear error instead of autograd's generic one.
        ctx.inputs = inputs
        ctx.versions = tuple(t._version if isinstance(t, torch.Tensor) else None for t in inputs)
        return op.visible(*inputs)

    @staticmethod
    def backward(ctx, *grad_outputs):
        op: KernelOp = ctx.op
        for name, tensor, version in zip(op.input_names, ctx.inputs, ctx.versions):
            if isinstance(tensor, torch.Tensor) and tensor._version != version:
                raise WeightsChangedError(
                    f"{op.name}: input {name!r} {tuple(tensor.shape)} was modified in place between the "
                    f"forward and the backward (version {version} -> {tensor._version}); the gradient "
                    f"would belong to other values than the forward used. Call backward before "
                    f"optimizer.step() or a weight sync, or run the forward again.")
        needs = ctx.needs_input_grad[1:]
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(bool(n)) if isinstance(t, torch.Tensor) else t
                      for t, n in zip(ctx.inputs, needs)]
            outs = op.graph(*leaves)
            outs = outs if isinstance(outs, tuple) else (outs,)
            pairs = [(o, g) for o, g in zip(outs, grad_outputs) if g is not None and o.requires_grad]
            wrt = [leaf for leaf, n in zip(leaves, needs) if n]
            if pairs and wrt:
                got = torch.autograd.grad([o for o, _ in pairs], wrt, [g.to(o.dtype) for o, g in pairs],
                                          allow_unused=True)
            else:
                got = [None] * len(wrt)
        it = iter(got)
        return (None, *(next(it) if n else None for n in needs))


def apply(op: KernelOp, *inputs):
    """Run ``op`` with kernel forward values and reference gradients."""
    return _KernelFunction.apply(op, *inputs)


def straight_through(visible: torch.Tensor, graph: torch.Tensor) -> torch.Tensor:
    """``visible + (graph - graph.detach())``: the value of ``visible`` (bitwise, up to the sign of
    zero) with the derivative of ``graph``. The eager form of what ``apply`` does lazily; use it where
    a kernel without derivative (a quantiser, a fused op) sits inside a graph that is built anyway."""
    return visible.detach() + (graph - graph.detach()).to(visible.dtype)


# ---------------------------------------------------------------------------------------------
# The ops. ``backend`` computes the forward; the graph is fp32 PyTorch.
# ---------------------------------------------------------------------------------------------

def linear(backend: Backend, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           out_dtype: torch.dtype | None = None, name: str = "linear") -> torch.Tensor:
    """``backend.linear`` with the gradient of ``x.float() @ weight.float().T + bias``."""
    def visible(x, w, b):
        return backend.linear(x, w, b, out_dtype=out_dtype)

    def graph(x, w, b):
        return F.linear(x.float(), w.float(), None if b is None else b.float())

    return apply(KernelOp(name, visible, graph, ("x", "weight", "bias")), x, weight, bias)


def fp8_linear(backend: Backend, x: torch.Tensor, master_weight: torch.Tensor, weight_fp8: torch.Tensor,
               weight_scale_inv: torch.Tensor, bias: torch.Tensor | None = None, *,
               name: str = "fp8_linear") -> torch.Tensor:
    """``backend.fp8_linear(x, weight_fp8, weight_scale_inv, bias)`` (the contract's [fp8] bits: the
    rollout's) with a straight-through gradient: that of ``x.float() @ master_weight.float().T + bias``.
    The quantisers (activations per 1 x 128 group inside the op, the weight per block) count as the
    identity, so the master weight and the input get the gradient of the unquantised linear; the fp8
    weight and its scales are buffers and get none."""
    def visible(x, w, wq, s, b):
        return backend.fp8_linear(x, wq, s, b)

    def graph(x, w, wq, s, b):
        return F.linear(x.float(), w.float(), None if b is None else b.float())

    op = KernelOp(name, visible, graph, ("x", "weight", "weight_fp8", "weight_scale_inv", "bias"))
    return apply(op, x, master_weight, weight_fp8, weight_scale_inv, bias)


def _rms_graph(r: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return r * torch.rsqrt(r.square().mean(-1, keepdim=True) + eps) * w.float()


def rms_norm(backend: Backend, x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, *, name: str = "rms_norm"):
    """``backend.rms_norm`` (optionally fused with the residual add) with fp32 reference gradients."""
    if residual is None:
        op = KernelOp(name, lambda x, w: backend.rms_norm(x, w, eps),
                      lambda x, w: _rms_graph(x.float(), w, eps), ("x", "weight"))
        return apply(op, x, weight)

    def graph(x, w, res):
        r = x.float() + res.float()
        return _rms_graph(r, w, eps), r

    op = KernelOp(name, lambda x, w, res: backend.rms_norm(x, w, eps, res), graph, ("x", "weight", "residual"))
    return apply(op, x, weight, residual)


def silu_mul(backend: Backend, gate_up: torch.Tensor, *, name: str = "silu_mul") -> torch.Tensor:
    """``backend.silu_mul`` of ``[g | u]`` with the gradient of ``silu(g) * u`` in fp32."""
    def graph(gu):
        g, u = gu.float().chunk(2, dim=-1)
        return F.silu(g) * u

    return apply(KernelOp(name, backend.silu_mul, graph, ("gate_up",)), gate_up)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = cos.shape[-1] * 2
    x = x.float()
    x1, x2, rest = x[..., : rot // 2], x[..., rot // 2: rot], x[..., rot:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def rotary(backend: Backend, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
           cos_sin_cache: torch.Tensor, *, name: str = "rotary") -> tuple[torch.Tensor, torch.Tensor]:
    """``backend.rotary`` (neox) with the gradient of the same rotation in fp32 (the table is constant)."""
    def graph(q, k):
        cos, sin = cos_sin_cache[positions.long()].chunk(2, dim=-1)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    op = KernelOp(name, lambda q, k: backend.rotary(positions, q, k, cos_sin_cache), graph, ("q", "k"))
    return apply(op, q, k)


def token_logprobs(backend: Backend, logits: torch.Tensor, token_ids: torch.Tensor, temperature: float = 1.0,
                   *, name: str = "token_logprobs") -> torch.Tensor:
    """``backend.token_logprobs`` (fp32, (M,)) with the gradient of ``log_softmax(logits / T)[token]``."""
    ids = token_ids.long().view(-1, 1)

    def graph(logits):
        return torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, ids).squeeze(-1)

    op = KernelOp(name, lambda logits: backend.token_logprobs(logits, token_ids, temperature), graph, ("logits",))
    return apply(op, logits)


def moe_route(backend: Backend, logits: torch.Tensor, routing, correction_bias: torch.Tensor | None, *,
              name: str = "moe_route") -> tuple[torch.Tensor, torch.Tensor]:
    """``backend.moe_route`` with the gradient of the chosen experts' weights (their fp32 scores,
    renormalised and scaled) with respect to the router logits. The choice itself has no gradient:
    the graph reuses the forward's expert ids (a recomputed top-k could break a tie differently)."""
    chosen: dict[str, torch.Tensor] = {}

    def visible(logits, bias):
        weights, ids = backend.moe_route(logits, routing, bias)
        chosen["ids"] = ids
        return weights, ids

    def graph(logits, bias):
        x = logits.float()
        scores = torch.softmax(x, dim=-1) if routing.scoring == "softmax" else torch.sigmoid(x)
        weights = scores.gather(-1, chosen["ids"].long())
        if routing.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights * routing.scaling, chosen["ids"]

    return apply(KernelOp(name, visible, graph, ("router_logits", "correction_bias")), logits, correction_bias)


def moe_experts(backend: Backend, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                ids: torch.Tensor, shared: torch.Tensor | None, *, name: str = "moe_experts") -> torch.Tensor:
    """``backend.moe_experts`` with fp32 reference gradients for x, the expert weights, the routing
    weights (so the router learns) and the shared experts' output."""
    def visible(x, w13, w2, weights, shared):
        return backend.moe_experts(x, w13, w2, weights, ids, shared)

    def graph(x, w13, w2, weights, shared):
        return _experts_graph(x, w13, w2, weights, ids, shared)

    op = KernelOp(name, visible, graph, ("x", "w13", "w2", "topk_weights", "shared"))
    return apply(op, x, w13, w2, weights, shared)


def fp8_moe_experts(backend: Backend, x: torch.Tensor, experts, weights: torch.Tensor, ids: torch.Tensor,
                    shared: torch.Tensor | None, *, name: str = "fp8_moe_experts") -> torch.Tensor:
    """``backend.fp8_moe_experts`` on an ``Fp8Experts``' quantised buffers (the rollout's bits) with the
    straight-through gradient of ``fp8_linear``: that of the bf16 experts' graph on the master weights
    (``w13_weight``, ``w2_weight``), the quantisers counted as the identity; the buffers get none."""
    def visible(x, w13, w2, weights, shared):
        return backend.fp8_moe_experts(x, experts.w13_weight_fp8, experts.w13_weight_scale_inv,
                                       experts.w2_weight_fp8, experts.w2_weight_scale_inv, weights, ids, shared)

    def graph(x, w13, w2, weights, shared):
        return _experts_graph(x, w13, w2, weights, ids, shared)

    op = KernelOp(name, visible, graph, ("x", "w13", "w2", "topk_weights", "shared"))
    return apply(op, x, experts.w13_weight, experts.w2_weight, weights, shared)


def _experts_graph(x, w13, w2, weights, ids, shared) -> torch.Tensor:
    """fp32 sum over each token's routed experts of weight * expert MLP (+ shared): the experts' graph."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    if shared is not None:
        out = out + shared.float()
    k = ids.shape[1]
    for expert, slots in slots_by_expert(ids, w13.shape[0]):
        token, rank = slots // k, slots % k
        gate, up = F.linear(x[token].float(), w13[expert].float()).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert].float())
        out = out.index_add(0, token, weights[token, rank].unsqueeze(-1) * y)
    return out


# ---------------------------------------------------------------------------------------------
# Training attention: K/V go through write_kv into contiguous pages, then backend.attention.
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PackedLayout:
    """Packed variable-length sequences laid out as a paged KV cache: sequence b owns consecutive
    pages; its tokens are rows ``starts[b]:starts[b+1]`` of the packed batch and its queries are a
    full prefill (q_len == seq_len), which is what ``backend.attention`` sees in training."""

    seq_lens: tuple[int, ...]
    page_size: int
    num_pages: int
    slot_mapping: torch.Tensor     # (T,) int64
    meta: AttentionMetadata

    @classmethod
    def build(cls, seq_lens: Sequence[int], page_size: int, device: torch.device | str = "cpu") -> "PackedLayout":
        seq_lens = tuple(int(n) for n in seq_lens)
        if not seq_lens or min(seq_lens) <= 0:
            raise HalError(f"packed layout: every sequence needs at least one token, got lengths {list(seq_lens)}")
        if page_size <= 0:
            raise HalError(f"packed layout: page_size must be positive, got {page_size}")
        page_lists, slots, first = [], [], 0
        for n in seq_lens:
            pages = list(range(first, first + pages_needed(n, page_size)))
            first += len(pages)
            page_lists.append(pages)
            slots.append(torch.arange(n) + pages[0] * page_size)   # contiguous pages: slot = offset
        meta = build_metadata(list(seq_lens), list(seq_lens), page_lists, device)
        return cls(seq_lens, page_size, first, torch.cat(slots).to(device), meta)

    @property
    def num_tokens(self) -> int:
        return sum(self.seq_lens)

    def starts(self) -> list[int]:
        out = [0]
        for n in self.seq_lens:
            out.append(out[-1] + n)
        return out


def _attention_graph(q, k, v, seq_lens: Iterable[int], scale: float) -> torch.Tensor:
    """Causal GQA attention of packed sequences in fp32 plain PyTorch: (T, Hq, D) fp32.

    Sequences of one length are computed together, as one batch (a GRPO step's completions mostly share
    a length: one batched product per length instead of one small one per sequence, which made the
    backward host-bound); each sequence still attends to itself alone."""
    group = q.shape[1] // k.shape[1]
    by_len: dict[int, list[int]] = {}
    start = 0
    for n in seq_lens:
        by_len.setdefault(n, []).append(start)
        start += n
    rows, outs = [], []
    for n, starts in by_len.items():
        idx = (torch.tensor(starts, device=q.device)[:, None] + torch.arange(n, device=q.device)).reshape(-1)
        qs = q[idx].float().unflatten(0, (len(starts), n)).transpose(1, 2)        # (S, Hq, n, D)
        ks = k[idx].float().unflatten(0, (len(starts), n)).transpose(1, 2).repeat_interleave(group, dim=1)
        vs = v[idx].float().unflatten(0, (len(starts), n)).transpose(1, 2).repeat_interleave(group, dim=1)
        scores = (qs @ ks.transpose(-1, -2)) * scale
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        probs = torch.softmax(scores.masked_fill(~causal, -math.inf), dim=-1)
        outs.append((probs @ vs).transpose(1, 2).reshape(len(starts) * n, *q.shape[1:]))
        rows.append(idx)
    return torch.cat(outs)[torch.argsort(torch.cat(rows))]       # back to the packed order


def write_and_attend(backend: Backend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cache, slot_mapping: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The cache path shared by training and inference: ``write_kv`` then ``attention``; for an FP8 cache
    (``hal.fp8.Fp8KVCache``) the quantising ``fp8_write_kv`` and ``fp8_attention``, its one read path."""
    if isinstance(cache, Fp8KVCache):
        cache.write(k, v, slot_mapping, backend=backend)
        return cache.attention(backend, q, meta, scale=scale)
    backend.write_kv(k, v, cache.k, cache.v, slot_mapping)
    return backend.attention(q, cache.k, cache.v, meta, scale=scale)


def train_attention(backend: Backend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PackedLayout,
                    scale: float, *, kv_spec=None, name: str = "attention") -> torch.Tensor:
    """Training attention of packed sequences: K, V are written into a fresh contiguous paged cache
    with ``backend.write_kv`` and read back by ``backend.attention`` (the rollout path), or with
    ``kv_spec`` (a contract's [fp8]) into an FP8 cache the rollout's way; the gradient is that of fp32
    causal softmax attention (the cache's quantisation counts as the identity). q: (T, Hq, D), k, v:
    (T, Hkv, D); returns (T, Hq, D)."""
    def visible(q, k, v):
        if kv_spec is not None:
            cache = Fp8KVCache(layout.num_pages, layout.page_size, k.shape[1], k.shape[2], kv_spec, k.device)
        else:
            cache = PagedKVCache.allocate(layout.num_pages, layout.page_size, k.shape[1], k.shape[2], k.dtype,
                                          k.device)
        return write_and_attend(backend, q, k, v, cache, layout.slot_mapping, layout.meta, scale)

    def graph(q, k, v):
        return _attention_graph(q, k, v, layout.seq_lens, scale)

    return apply(KernelOp(name, visible, graph, ("q", "k", "v")), q, k, v)


# ---------------------------------------------------------------------------------------------
# The whole-model guard: all parameters checked before the first gradient is computed.
# ---------------------------------------------------------------------------------------------

class WeightSnapshot:
    """Version counters of named parameters at forward time."""

    def __init__(self, named_params: Iterable[tuple[str, torch.Tensor]]):
        self._entries = [(name, p, p._version) for name, p in named_params]

    def changed(self) -> list[tuple[str, int, int]]:
        return [(name, v, p._version) for name, p, v in self._entries if p._version != v]

    def check(self) -> None:
        changed = self.changed()
        if changed:
            shown = ", ".join(f"{n} (version {a} -> {b})" for n, a, b in changed[:4])
            more = f" and {len(changed) - 4} more" if len(changed) > 4 else ""
            raise WeightsChangedError(
                f"weights changed in place since the forward: {shown}{more}. The backward recomputes "
                f"from the weights, so it would differentiate another model than the one that produced "
                f"these outputs. Call backward before optimizer.step() / a weight sync, or run the "
                f"forward again.")


class _Guard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, snapshot: WeightSnapshot, x):
        ctx.snapshot = snapshot
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.snapshot.check()
        return None, grad


def guard_weights(x: torch.Tensor, snapshot: WeightSnapshot) -> torch.Tensor:
    """``x`` unchanged; its backward first checks that no parameter in ``snapshot`` changed."""
    return _Guard.apply(snapshot, x)
