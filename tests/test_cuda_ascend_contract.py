"""The cuda backend's kernels realising bf16-ascend-v1 (exp, fp32 row sum, 128-key KV chunks, RMSNorm's
reciprocal mean) under Triton's CPU interpreter: invariances within the backend, closeness to the
reference, and controls that the new switches change bits. Small shapes: seconds, not minutes.
The bitwise GPU run of the conformance kit on this contract is a separate H200 step (docs/ascend-backend.md).
"""

from __future__ import annotations

import os

import pytest
import torch

from hal.contract import load_contract

pytest.importorskip("triton")
ASCEND = load_contract("bf16-ascend-v1")
DENSE = load_contract("bf16-dense-v1")


@pytest.fixture(scope="module")
def backends():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("a GPU is present: the kernels are checked there with the conformance kit, not interpreted")
    from hal.api import create_backend

    return create_backend("cuda", ASCEND), create_backend("cuda", DENSE), create_backend("reference", ASCEND)


def test_attention_is_phase_consistent_across_a_128_key_chunk(backends):
    from hal.conformance.checks import AttentionCase, attention_phases

    cuda, _, _ = backends
    # 131 keys: the prefill crosses the first 128-key chunk; a cut at 129 and decode from 129 on both sides
    case = AttentionCase(131, 2, 1, 64, torch.bfloat16, seed=3)
    assert attention_phases(cuda, case, cuts=[129], page_sizes=[16], decode_from=129, mates=1) == []


def test_attention_follows_the_exp_rule_and_stays_close_to_the_reference(backends):
    from hal.conformance.checks import AttentionCase
    from hal.kvcache import PagedKVCache, build_metadata, pages_needed, slot_mapping

    cuda, dense, reference = backends
    n, page = 131, 16
    case = AttentionCase(n, 2, 1, 64, torch.float32, seed=4)
    q, k, v = case.tensors("cpu")
    pages = list(range(pages_needed(n, page)))[::-1]
    cache = PagedKVCache.allocate(len(pages), page, 1, 64, torch.float32, "cpu")
    cuda.write_kv(k, v, cache.k, cache.v, slot_mapping(pages, range(n), page, "cpu"))
    meta = build_metadata([3], [n], [pages], "cpu")
    out = {name: b.attention(q[-3:], cache.k, cache.v, meta, scale=0.125)
           for name, b in (("cuda", cuda), ("dense", dense), ("reference", reference))}
    torch.testing.assert_close(out["cuda"], out["reference"], rtol=1e-5, atol=1e-6)
    assert not torch.equal(out["cuda"], out["dense"])  # control: exp / 128-key chunks change the bits


def test_rms_norm_reciprocal_mean_is_batch_invariant_and_differs_from_div(backends):
    from hal.conformance.checks import random_tensor, row_invariance

    cuda, dense, _ = backends
    g = torch.Generator().manual_seed(5)
    rows = random_tensor((12, 1000), torch.float32, g, spread=4)
    w = torch.ones(1000)
    assert row_invariance("rms_norm", lambda x: cuda.rms_norm(x, w, 1e-6), rows, [1, 5, 12], g) == []
    # control: the reciprocal mean and div_rn's mean differ on some row (fp32, width 1000 is not a power of 2)
    assert not torch.equal(cuda.rms_norm(rows, w, 1e-6), dense.rms_norm(rows, w, 1e-6))
