"""HAL ops: each call runs on the current backend (see ``hal.api``). Docs are on ``hal.backend.Backend``."""

from __future__ import annotations

from hal.api import current


def linear(x, weight, bias=None, *, out_dtype=None):
    return current().linear(x, weight, bias, out_dtype=out_dtype)


def attention(q, k_cache, v_cache, meta, *, scale):
    return current().attention(q, k_cache, v_cache, meta, scale=scale)


def write_kv(k, v, k_cache, v_cache, slot_mapping):
    return current().write_kv(k, v, k_cache, v_cache, slot_mapping)


def rms_norm(x, weight, eps, residual=None):
    return current().rms_norm(x, weight, eps, residual)


def silu_mul(gate_up):
    return current().silu_mul(gate_up)


def rotary(positions, q, k, cos_sin_cache):
    return current().rotary(positions, q, k, cos_sin_cache)


def log_softmax(logits, temperature=1.0):
    return current().log_softmax(logits, temperature)


def token_logprobs(logits, token_ids, temperature=1.0):
    return current().token_logprobs(logits, token_ids, temperature)


def sum(x, dim=-1):  # noqa: A001 - mirrors torch.sum
    return current().sum(x, dim)


def mean(x, dim=-1):
    return current().mean(x, dim)


def topk(x, k):
    return current().topk(x, k)
