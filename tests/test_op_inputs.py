"""What every op does with unusual input: masked keys holding NaN/Inf, empty, meta, mismatched or
out-of-range arguments.

Masking ([attention].mask): a key a query may not see contributes exactly nothing, whatever its K
and V hold. The tests plant NaN and Inf in every kind of masked key (causally later keys, keys past
seq_len in the last page, never-written page slots) and require the bits of the clean run
(``torch.equal``); the negative control is a planted attention that masks by multiplying by zero.

Bad input: every op refuses it with ``UnsupportedError`` naming the op (the checks live once, in
``hal.backend.Backend``), and an empty batch returns the empty result as torch does.
Backends: ``reference``, ``cuda`` (Triton kernels under the CPU interpreter when no GPU is present,
tests/conftest.py) and the stock ``torch`` baseline where a check applies to it.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from hal.errors import UnsupportedError

HEAD_DIM = 64  # the smallest head dim the cuda kernels take


def _backend(name):
    from hal.api import create_backend

    if name == "cuda":
        pytest.importorskip("triton")
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("a GPU is present: the cuda kernels are tested on it with bench/h200.sh, not interpreted")
    return create_backend(name)


@pytest.fixture(scope="module", params=["reference", "cuda"])
def contract_backend(request):
    return _backend(request.param)


@pytest.fixture(scope="module", params=["reference", "cuda", "torch"])
def any_backend(request):
    return _backend(request.param)


# ---------------------------------------------------------------------------------------------
# Masked keys contribute nothing, also when they hold NaN or Inf.
# ---------------------------------------------------------------------------------------------

def _prefill(seq_len: int, page: int, hq: int, hkv: int, dtype, seed: int):
    """One sequence's full prefill: q (L, Hq, D), caches with every key written, and the metadata.
    The block table has one spare page id more than the sequence needs (its slots never written)."""
    from hal.conformance.checks import random_tensor
    from hal.kvcache import PagedKVCache, build_metadata

    g = torch.Generator().manual_seed(seed)
    pages_used = -(-seq_len // page)
    cache = PagedKVCache.allocate(pages_used + 3, page, hkv, HEAD_DIM, dtype)  # NaN-filled: never-written
    pages = list(range(pages_used + 2, 1, -1))[: pages_used + 1]             # scrambled, one spare
    k = random_tensor((seq_len, hkv, HEAD_DIM), dtype, g)
    v = random_tensor((seq_len, hkv, HEAD_DIM), dtype, g)
    for j in range(seq_len):
        cache.k[pages[j // page], j % page] = k[j]
        cache.v[pages[j // page], j % page] = v[j]
    q = random_tensor((seq_len, hq, HEAD_DIM), dtype, g)
    meta = build_metadata([seq_len], [seq_len], [pages])
    return q, cache, pages, meta


def _slot(cache, pages, j):
    page = cache.k.shape[1]
    return pages[j // page], j % page


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_masked_keys_contribute_nothing_even_when_nan_or_inf(contract_backend, dtype):
    """A prefill of 70 tokens (two KV chunks of 64; pages of 16, the last page part-filled): NaN in V
    and Inf in K of key 40 must not reach queries 0..39 (they may not see it), and NaN/Inf in the
    slots past seq_len and in a never-written spare page must reach no query at all."""
    backend = contract_backend
    seq_len, bad = 70, 40
    q, cache, pages, meta = _prefill(seq_len, 16, 4, 2, dtype, seed=1)
    scale = HEAD_DIM ** -0.5
    # The clean run: every slot past seq_len zero (allocate fills NaN, which is already a plant).
    clean_k, clean_v = cache.k.nan_to_num(0.0), cache.v.nan_to_num(0.0)
    clean = backend.attention(q, clean_k, clean_v, meta, scale=scale)
    assert torch.isfinite(clean.float()).all()

    k, v = clean_k.clone(), clean_v.clone()
    k[_slot(cache, pages, bad)] = float("inf")
    v[_slot(cache, pages, bad)] = float("nan")
    v[_slot(cache, pages, bad)][0, 3] = float("-inf")
    last_page, row = _slot(cache, pages, seq_len - 1)
    k[last_page, row + 1:] = float("nan")                     # past seq_len in the last page
    v[last_page, row + 1:] = float("inf")
    k[pages[-1]] = float("-inf")                               # the spare page, never written
    v[pages[-1]] = float("nan")
    planted = backend.attention(q, k, v, meta, scale=scale)
    assert torch.equal(planted[:bad], clean[:bad])
    # A query that sees the bad key is not finite: the NaN is not silently dropped.
    assert not torch.isfinite(planted[bad:].float()).any(dim=-1).all()

    # Only the keys past seq_len and the spare page planted: every query has the clean bits.
    k, v = clean_k.clone(), clean_v.clone()
    k[last_page, row + 1:], v[last_page, row + 1:] = float("nan"), float("nan")
    k[pages[-1]], v[pages[-1]] = float("inf"), float("-inf")
    assert torch.equal(backend.attention(q, k, v, meta, scale=scale), clean)


def test_decode_and_prefill_agree_on_a_prefix_when_a_later_key_is_nan(contract_backend):
    """The trainer's symptom: one NaN V at a later position must not make earlier tokens' outputs
    differ from decode (where that key did not exist yet)."""
    from hal.kvcache import build_metadata

    backend = contract_backend
    seq_len, bad = 24, 20
    q, cache, pages, meta = _prefill(seq_len, 16, 2, 1, torch.bfloat16, seed=2)
    cache.v[_slot(cache, pages, bad)] = float("nan")
    scale = HEAD_DIM ** -0.5
    prefill = backend.attention(q, cache.k, cache.v, meta, scale=scale)
    for pos in (0, 17, bad - 1):
        decode = backend.attention(q[pos:pos + 1], cache.k, cache.v, build_metadata([1], [pos + 1], [pages]),
                                   scale=scale)
        assert torch.equal(decode, prefill[pos:pos + 1])


def _attention_masking_by_multiplying(q, k, v, scale):
    """A planted non-conforming attention (one sequence, fp32, no GQA): masks the probabilities by
    multiplying by zero, as a kernel that forgets to select V rows does inside its P @ V."""
    seq_len = q.shape[0]
    s = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    visible = torch.ones(seq_len, seq_len).tril().bool()
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1) * visible   # exact zeros where masked
    return torch.einsum("hqk,khd->qhd", p, v.float())


def test_negative_control_masking_by_multiplying_by_zero_leaks_nan():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(8, 2, 16, generator=g) for _ in range(3))
    clean = _attention_masking_by_multiplying(q, k, v, 0.25)
    assert torch.isfinite(clean).all()
    v[6] = float("nan")                                        # visible only to queries 6 and 7
    planted = _attention_masking_by_multiplying(q, k, v, 0.25)
    assert torch.isnan(planted[:6]).all()                      # 0 * NaN = NaN reached the earlier queries
