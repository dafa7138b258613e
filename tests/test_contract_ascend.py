"""bf16-ascend-v1, the contract Ascend's native kernels can realise (issue #23), rebuilt from its text.

What it changes against bf16-dense-v1 (contracts/bf16-ascend-v1.toml): attention multiplies the
scores by the scale and uses the natural exp, sums the fp32 probabilities (not the rounded P) and
steps over KV chunks of 128 keys; RMSNorm's mean is fl32(ss * fl32(1/n)). The rebuild below is scalar
Python with exact sums (the helpers of test_contract_structure.py); the reference backend must give
the same bits, and the rules of bf16-dense-v1 must give other bits on the same input (the controls).
The cuda kernels' realisation runs under the interpreter in test_cuda_ascend_contract.py.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from test_contract_structure import (add32, backend_attention, blocked, div32, exact_sum_rn32, exp32, f32, mul32,
                                     randn, rn32, sqrt32, to_tensor)

from hal.contract import ContractError, load_contract, parse_contract
from hal.api import create_backend

ASCEND = load_contract("bf16-ascend-v1")
DENSE = load_contract("bf16-dense-v1")


def with_attention(contract, **values):
    return dataclasses.replace(contract, attention=dataclasses.replace(contract.attention, **values))


def test_the_ascend_contract_differs_from_dense_only_where_the_native_kernels_do():
    a, d = ASCEND.to_dict(), DENSE.to_dict()
    changed = {(s, k) for s in a if s not in ("contract", "schema") for k in a[s] if a[s][k] != d[s][k]}
    assert changed == {("attention", "scale"), ("attention", "exp"), ("attention", "kv_chunk"),
                       ("attention", "kv_split"), ("attention", "row_sum"), ("rms_norm", "inv_rms"),
                       ("rms_norm", "row_block")}
    # the fused-inference-attention op pages KV in multiples of 128 keys (128..512) for query length > 1
    assert ASCEND.attention.kv_chunk % 128 == 0 and 128 <= ASCEND.attention.kv_chunk <= 512
    assert ASCEND.fingerprint != DENSE.fingerprint


def test_exp_and_scale_go_together():
    text = (load_contract.__globals__["resources"].files("hal.contracts") / "bf16-ascend-v1.toml").read_text()
    with pytest.raises(ContractError, match=r"\[attention\]\.exp = 'exp'.*'exp2' with scale = 'folded_log2e'"):
        parse_contract(text.replace('scale = "multiply"', 'scale = "folded_log2e"'))
    with pytest.raises(ContractError, match=r"\[attention\]\.exp = 'exp2'"):
        parse_contract(text.replace('exp = "exp"\nkv_chunk', 'exp = "exp2"\nkv_chunk'))


def attention_row(q, keys, values, position, scale, spec, p_dtype):
    """One query over keys 0..position as [attention] says, for either exp rule and either row sum."""
    if spec.scale == "multiply":
        factor, exp = f32(scale), exp32
    else:
        factor, exp = rn32(scale * (1.0 / math.log(2.0))), (lambda x: rn32(2.0 ** x))
    s = [mul32(exact_sum_rn32([a * b for a, b in zip(q, k)]), factor) for k in keys[:position + 1]]
    dim, split = len(values[0]), spec.kv_split or position + 1
    big_m, big_l, big_a = -math.inf, 0.0, [0.0] * dim
    for split_start in range(0, position + 1, split):
        m, l, acc = -math.inf, 0.0, [0.0] * dim
        for c0 in range(split_start, min(split_start + split, position + 1), spec.kv_chunk):
            visible = range(c0, min(c0 + spec.kv_chunk, position + 1))
            m_new = max(m, max(s[j] for j in visible))
            alpha = exp(add32(m, -m_new)) if m != -math.inf else 0.0
            p32 = [exp(add32(s[j], -m_new)) for j in visible]
            p = to_tensor(p32, p_dtype).double().tolist()
            row_sum = exact_sum_rn32(p if spec.row_sum == "sum_of_rounded_p" else p32)
            pv = [exact_sum_rn32([pj * values[j][d] for pj, j in zip(p, visible)]) for d in range(dim)]
            l = add32(mul32(l, alpha), row_sum)
            acc = [add32(mul32(a_, alpha), b_) for a_, b_ in zip(acc, pv)]
            m = m_new
        merged = max(big_m, m)
        a = exp(add32(big_m, -merged)) if big_m != -math.inf else 0.0
        b = exp(add32(m, -merged))
        big_l = add32(mul32(big_l, a), mul32(l, b))
        big_a = [add32(mul32(x, a), mul32(y, b)) for x, y in zip(big_a, acc)]
        big_m = merged
    return [div32(x, big_l) for x in big_a]


def rebuilt_attention(q, k, v, positions, spec):
    group = q.shape[1] // k.shape[1]
    return to_tensor([[attention_row(q[i, h].double().tolist(), k[:, h // group].double().tolist(),
                                     v[:, h // group].double().tolist(), pos, q.shape[-1] ** -0.5, spec, q.dtype)
                       for h in range(q.shape[1])] for i, pos in enumerate(positions)], q.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_attention_is_the_ascend_rule(dtype):
    # kv_split shrunk to 256 so that a short sequence crosses KV chunks (128) and two split boundaries
    spec = dataclasses.replace(ASCEND.attention, kv_split=256)
    backend = create_backend("reference", with_attention(ASCEND, kv_split=256))
    n = 2 * spec.kv_split + spec.kv_chunk + 13
    q, k, v = randn((n, 2, 16), dtype, 10, 1), randn((n, 1, 16), dtype, 11, 1), randn((n, 1, 16), dtype, 12, 1)
    queries = 4
    positions = list(range(n - queries, n))
    got = backend_attention(backend, q, k, v, queries)
    assert torch.equal(got, rebuilt_attention(q[n - queries:], k, v, positions, spec))
    # Controls: each rule of the ascend contract decides bits on this input. The two row sums differ
    # only where P is rounded (bf16); the others are checked on fp32, whose output rounding hides less.
    if dtype == torch.bfloat16:
        others = [dataclasses.replace(spec, row_sum="sum_of_rounded_p")]
    else:
        others = [dataclasses.replace(spec, scale="folded_log2e", exp="exp2"), dataclasses.replace(spec, kv_chunk=64)]
    for other in others:
        assert not torch.equal(got, rebuilt_attention(q[n - queries:], k, v, positions, other)), other


def rebuilt_rms_norm(x, w, eps, block, mean_rule):
    xs, ws, eps32, n = x.double().tolist(), w.double().tolist(), f32(eps), x.shape[-1]
    out = []
    for row in xs:
        ss = blocked([t * t for t in row], block)
        mean = mul32(ss, div32(1.0, n)) if mean_rule == "mul_reciprocal" else div32(ss, n)
        inv = div32(1.0, sqrt32(add32(mean, eps32)))
        out.append([mul32(mul32(t, inv), wt) for t, wt in zip(row, ws)])
    return to_tensor(out, x.dtype)


def test_reference_rms_norm_mean_is_the_sum_times_the_reciprocal():
    backend = create_backend("reference", ASCEND)
    differs = 0
    # widths that cross no block and one block boundary (row_block 8192), odd and power-of-two
    for width in (96, 1000, 4096, 5120, 8192 + 9):
        x, w = randn((8, width), torch.float32, width, 4), torch.ones(width)
        got = backend.rms_norm(x, w, 1e-6)
        assert torch.equal(got, rebuilt_rms_norm(x, w, 1e-6, ASCEND.rms_norm.row_block, "mul_reciprocal")), width
        differs += not torch.equal(got, rebuilt_rms_norm(x, w, 1e-6, ASCEND.rms_norm.row_block, "div"))
    assert differs, "the control (div_rn mean) never differed: the test cannot tell the two rules apart"
