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

import pytest
import torch
from test_contract_structure import (add32, attention, backend_attention, blocked, div32, f32, mul32, randn, sqrt32,
                                     to_tensor)

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
    assert torch.equal(got, attention(q[n - queries:], k, v, positions, spec))
    # Controls: each rule of the ascend contract decides bits on this input. The two row sums differ
    # only where P is rounded (bf16); the others are checked on fp32, whose output rounding hides less.
    if dtype == torch.bfloat16:
        others = [dataclasses.replace(spec, row_sum="sum_of_rounded_p")]
    else:
        others = [dataclasses.replace(spec, scale="folded_log2e", exp="exp2"), dataclasses.replace(spec, kv_chunk=64)]
    for other in others:
        assert not torch.equal(got, attention(q[n - queries:], k, v, positions, other)), other


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
