"""Level 4: train equals infer.

The autograd-wrapped ops that training uses (``hal.model.autograd``) must return exactly the bits
of the backend's inference kernels, computed through a separate path as a rollout engine would (row by
row, or prefill then token-by-token decode from its own paged cache, on copies of the inputs), and their gradients must be correct: within a stated bound of
fp64 autograd of the same function (norm-wise relative error <= 1e-2 for bf16, where every
gradient is rounded to bf16; <= 1e-5 for fp32).
"""

from __future__ import annotations

import torch

from hal.backend import Backend
from hal.conformance import oracle
from hal.conformance.checks import random_tensor
from hal.rope import cos_sin_cache

GRAD_TOLERANCE = {torch.bfloat16: 1e-2, torch.float32: 1e-5}


def _leaf(shape, dtype, g, device, scale=1.0):
    return random_tensor(shape, dtype, g, scale=scale, device=device).requires_grad_(True)


def _fp64(*tensors):
    return [t.detach().cpu().double().requires_grad_(True) for t in tensors]


def _grad_problems(what, leaves, leaves64, dtype) -> list[str]:
    problems = []
    for i, (t, t64) in enumerate(zip(leaves, leaves64)):
        if t.grad is None:
            problems.append(f"{what}: input {i} got no gradient")
            continue
        ref = t64.grad
        err = float((t.grad.detach().cpu().double() - ref).norm() / ref.norm().clamp_min(1e-300))
        if not err <= GRAD_TOLERANCE[dtype]:
            problems.append(f"{what}: gradient of input {i} {tuple(t.shape)} has relative error {err:.3g} > "
                            f"{GRAD_TOLERANCE[dtype]:g} against fp64 autograd")
    return problems


def fresh(t: torch.Tensor | None) -> torch.Tensor | None:
    """A detached copy in its own memory: the inference side shares no tensor with the training side."""
    return None if t is None else t.detach().clone()


def rows_alone(fn, *tensors: torch.Tensor):
    """The inference path of the rollout engine's decode: ``fn`` on one row (token) at a time of fresh
    copies of ``tensors``, outputs concatenated. Batch invariance makes this the bits of the whole batch."""
    outs = [fn(*(fresh(t[i:i + 1]) for t in tensors)) for i in range(tensors[0].shape[0])]
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(parts) for parts in zip(*outs))
    return torch.cat(outs)


def decode_path(backend: Backend, q, k, v, seq_lens: list[int], scale: float, g: torch.Generator) -> torch.Tensor:
    """Attention as a rollout engine runs it: per sequence, a prefill of its first half, then token by token
    decode, from a paged cache (page size 5, scrambled pages) that this function writes itself."""
    from hal.kvcache import PageAllocator, PagedKVCache, build_metadata, pages_needed, slot_mapping

    page = 5
    outs, start = [], 0
    for n in seq_lens:
        count = pages_needed(n, page)
        cache = PagedKVCache.allocate(count + 3, page, k.shape[1], k.shape[2], k.dtype, k.device)
        pages = PageAllocator(count + 3, g).take(count)
        done = 0
        for step in [max(1, n // 2)] + [1] * (n - max(1, n // 2)):
            lo, hi = start + done, start + done + step
            backend.write_kv(k[lo:hi], v[lo:hi], cache.k, cache.v,
                             slot_mapping(pages, range(done, done + step), page, k.device))
            outs.append(backend.attention(q[lo:hi], cache.k, cache.v,
                                          build_metadata([step], [done + step], [pages], k.device), scale=scale))
            done += step
        start += n
    return torch.cat(outs)


def train_equals_infer(backend: Backend, op: str, size: int, width: int, dtype: torch.dtype, seed: int) -> list[str]:
    from hal.model import autograd as ag

    g = torch.Generator().manual_seed(seed)
    dev = backend.device
    problems: list[str] = []

    def same_bits(name, trained, inferred):
        for t, i in zip(trained if isinstance(trained, tuple) else (trained,),
                        inferred if isinstance(inferred, tuple) else (inferred,)):
            if not torch.equal(t.detach(), i):
                problems.append(f"{name}: the autograd forward differs from the inference kernel's bits")
                return

    def backprop(out, out64):
        weights = random_tensor(tuple(out.shape), torch.float32, g, device=dev)
        (out.float() * weights).sum().backward()
        (out64 * weights.cpu().double()).sum().backward()

    if op == "linear":
        x, w, b = _leaf((size, width), dtype, g, dev), _leaf((33, width), dtype, g, dev, width ** -0.5), \
            _leaf((33,), dtype, g, dev)
        out = ag.linear(backend, x, w, b)
        same_bits(op, out, rows_alone(lambda r: backend.linear(r, fresh(w), fresh(b)), x))
        x64, w64, b64 = _fp64(x, w, b)
        backprop(out, oracle.linear(x64, w64, b64))
        problems += _grad_problems(op, (x, w, b), (x64, w64, b64), dtype)
    elif op == "rms_norm":
        x, w, r = _leaf((size, width), dtype, g, dev), _leaf((width,), dtype, g, dev), _leaf((size, width), dtype, g, dev)
        out, res_out = ag.rms_norm(backend, x, w, 1e-6, r)
        same_bits(op, (out, res_out), rows_alone(lambda xi, ri: backend.rms_norm(xi, fresh(w), 1e-6, ri), x, r))
        x64, w64, r64 = _fp64(x, w, r)
        s64 = x64 + r64
        backprop(out, s64 * torch.rsqrt(s64.square().mean(-1, keepdim=True) + 1e-6) * w64)
        problems += _grad_problems(op, (x, w, r), (x64, w64, r64), dtype)
    elif op == "silu_mul":
        x = _leaf((size, 2 * width), dtype, g, dev)
        out = ag.silu_mul(backend, x)
        same_bits(op, out, rows_alone(backend.silu_mul, x))
        (x64,) = _fp64(x)
        backprop(out, oracle.silu_mul(x64))
        problems += _grad_problems(op, (x,), (x64,), dtype)
    elif op == "rotary":
        head_dim = 2 * max(1, width // 2)
        table = cos_sin_cache(head_dim, 97, device=dev)
        pos = torch.randint(0, 97, (size,), generator=g).to(dev)
        q, k = _leaf((size, 4, head_dim), dtype, g, dev), _leaf((size, 2, head_dim), dtype, g, dev)
        out_q, out_k = ag.rotary(backend, pos, q, k, table)
        same_bits(op, (out_q, out_k), rows_alone(lambda p, qi, ki: backend.rotary(p, qi, ki, table.clone()), pos, q, k))
        q64, k64 = _fp64(q, k)
        weights_q = random_tensor(tuple(out_q.shape), torch.float32, g, device=dev)
        weights_k = random_tensor(tuple(out_k.shape), torch.float32, g, device=dev)
        ((out_q.float() * weights_q).sum() + (out_k.float() * weights_k).sum()).backward()
        ((oracle.rotary(pos.cpu(), q64, table.cpu()) * weights_q.cpu().double()).sum()
         + (oracle.rotary(pos.cpu(), k64, table.cpu()) * weights_k.cpu().double()).sum()).backward()
        problems += _grad_problems(op, (q, k), (q64, k64), dtype)
    elif op == "token_logprobs":
        logits = _leaf((size, width), torch.float32, g, dev, scale=4.0)
        ids = torch.randint(0, width, (size,), generator=g).to(dev)
        out = ag.token_logprobs(backend, logits, ids, 0.7)
        same_bits(op, out, rows_alone(lambda li, ii: backend.token_logprobs(li, ii, 0.7), logits, ids))
        (l64,) = _fp64(logits)
        backprop(out, oracle.log_softmax(l64, 0.7).gather(-1, ids.cpu().view(-1, 1)).squeeze(-1))
        problems += _grad_problems(op, (logits,), (l64,), torch.float32)
    elif op == "attention":
        seq_lens = [max(1, size), max(1, size // 2 + 1)]
        tokens = sum(seq_lens)
        q, k, v = (_leaf((tokens, h, width), dtype, g, dev) for h in (4, 2, 2))
        layout = ag.PackedLayout.build(seq_lens, 16, dev)
        out = ag.train_attention(backend, q, k, v, layout, width ** -0.5)
        same_bits(op, out, decode_path(backend, fresh(q), fresh(k), fresh(v), seq_lens, width ** -0.5, g))
        q64, k64, v64 = _fp64(q, k, v)
        start, outs = 0, []
        for n in seq_lens:
            outs.append(oracle.attention(q64[start:start + n], k64[start:start + n], v64[start:start + n],
                                         width ** -0.5))
            start += n
        backprop(out, torch.cat(outs))
        problems += _grad_problems(op, (q, k, v), (q64, k64, v64), dtype)
    elif op == "moe_route":
        from hal.moe import Routing

        experts = 16
        bias = random_tensor((experts,), torch.float32, g, scale=0.05, device=dev)
        for label, routing, b in (("softmax top-4", Routing(experts, 4), None),
                                  ("sigmoid group-limited top-3 + bias",
                                   Routing(experts, 3, scoring="sigmoid", num_groups=4, topk_groups=2, scaling=2.5),
                                   bias)):
            logits = _leaf((size, experts), torch.float32, g, dev, scale=2.0)
            weights, ids = ag.moe_route(backend, logits, routing, b)
            same_bits(f"{op} {label}", (weights, ids),
                      rows_alone(lambda li: backend.moe_route(li, routing, fresh(b)), logits))
            # the gradient of the chosen experts' weights (the choice itself has none): fp64 scores of the
            # forward's ids, renormalised and scaled as [moe] says
            (l64,) = _fp64(logits)
            scores = torch.softmax(l64, -1) if routing.scoring == "softmax" else torch.sigmoid(l64)
            chosen = scores.gather(-1, ids.cpu().long())
            if routing.renormalize:
                chosen = chosen / chosen.sum(-1, keepdim=True)
            backprop(weights, chosen * routing.scaling)
            problems += _grad_problems(f"{op} {label}", (logits,), (l64,), torch.float32)
    elif op == "moe_experts":
        from hal.moe import Routing

        hidden, inter, experts, k = max(2, width), 40, 8, 2
        x = _leaf((size, hidden), dtype, g, dev)
        w13 = _leaf((experts, 2 * inter, hidden), dtype, g, dev, hidden ** -0.5)
        w2 = _leaf((experts, hidden, inter), dtype, g, dev, inter ** -0.5)
        shared = _leaf((size, hidden), dtype, g, dev)
        route_w, ids = backend.moe_route(random_tensor((size, experts), torch.float32, g, device=dev),
                                         Routing(experts, k))
        weights = route_w.detach().clone().requires_grad_(True)
        out = ag.moe_experts(backend, x, w13, w2, weights, ids, shared)
        same_bits(op, out, rows_alone(lambda xi, wi, ii, si: backend.moe_experts(xi, fresh(w13), fresh(w2), wi, ii, si),
                                      x, weights, ids, shared))
        x64, w13_64, w2_64, wt64, s64 = _fp64(x, w13, w2, weights, shared)
        expert = ids.cpu().long()
        out64 = s64
        for rank in range(k):
            gate, up = torch.einsum("th,tnh->tn", x64, w13_64[expert[:, rank]]).chunk(2, -1)
            y = torch.einsum("ti,thi->th", gate * torch.sigmoid(gate) * up, w2_64[expert[:, rank]])
            out64 = out64 + wt64[:, rank:rank + 1] * y
        backprop(out, out64)
        problems += _grad_problems(op, (x, w13, w2, weights, shared), (x64, w13_64, w2_64, wt64, s64), dtype)
    else:
        raise ValueError(f"no train-equals-infer check for op {op!r}")
    return problems
