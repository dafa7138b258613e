"""fp64 oracles: the exact-math versions of each op, with no rounding but the final comparison."""

from __future__ import annotations

import torch


def linear(x, w, bias=None):
    out = x.double() @ w.double().T
    return out if bias is None else out + bias.double()


def rms_norm(x, w, eps, residual=None):
    x = x.double() if residual is None else (x.float() + residual.float()).to(x.dtype).double()
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w.double()


def silu_mul(gate_up):
    g, u = gate_up.double().chunk(2, -1)
    return g * torch.sigmoid(g) * u


def log_softmax(logits, temperature=1.0):
    return torch.log_softmax(logits.double() / temperature, -1)


def attention(q, k, v, scale):
    """Causal attention of one sequence, q/k/v (L, H, D) with GQA, in fp64."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, 1)
    v = v.double().repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    L = q.shape[0]
    s = s.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)


def rotary(positions, x, cos_sin):
    rot = cos_sin.shape[-1]
    cos, sin = cos_sin[positions].double().chunk(2, -1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x = x.double()
    x1, x2 = x[..., : rot // 2], x[..., rot // 2: rot]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rot:]], -1)


def rotary_magnitude(positions, x, cos_sin):
    """|x1 c| + |x2 s| (and |x2 c| + |x1 s|): the scale of the rounding errors of ``rotary``."""
    rot = cos_sin.shape[-1]
    cos, sin = cos_sin[positions].double().abs().chunk(2, -1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x = x.double().abs()
    x1, x2 = x[..., : rot // 2], x[..., rot // 2: rot]
    return torch.cat([x1 * cos + x2 * sin, x2 * cos + x1 * sin, x[..., rot:]], -1)
