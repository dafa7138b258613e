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

import pytest
import torch

from conftest import backend_for_tests
from hal.errors import UnsupportedError

HEAD_DIM = 64  # the smallest head dim the cuda kernels take


@pytest.fixture(scope="module", params=["reference", "cuda"])
def contract_backend(request):
    return backend_for_tests(request.param)


@pytest.fixture(scope="module", params=["reference", "cuda", "torch"])
def any_backend(request):
    return backend_for_tests(request.param)


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


# ---------------------------------------------------------------------------------------------
# Bad input is refused clearly; an empty batch gives the empty result.
# ---------------------------------------------------------------------------------------------

def _op_calls(rows: int, device="cpu", dtype=torch.bfloat16):
    """(op name, arguments) of every Backend op with ``rows`` rows, small valid shapes otherwise."""
    from hal.kvcache import build_metadata
    from hal.rope import cos_sin_cache

    def t(*shape, dt=dtype):
        return torch.ones(*shape, dtype=dt, device=device)

    page, hkv, hq = 16, 1, 2
    k_cache, v_cache = t(2, page, hkv, HEAD_DIM), t(2, page, hkv, HEAD_DIM)
    meta = build_metadata([rows], [max(rows, 1)], [[0]], device=device)
    return [
        ("linear", (t(rows, 32), t(8, 32)), {}),
        ("attention", (t(rows, hq, HEAD_DIM), k_cache, v_cache, meta), {"scale": 0.125}),
        ("write_kv", (t(rows, hkv, HEAD_DIM), t(rows, hkv, HEAD_DIM), k_cache.clone(), v_cache.clone(),
                      torch.arange(rows, device=device)), {}),
        ("rms_norm", (t(rows, 32), t(32), 1e-6), {}),
        ("silu_mul", (t(rows, 32),), {}),
        ("rotary", (torch.arange(rows, device=device), t(rows, hq, HEAD_DIM), t(rows, hkv, HEAD_DIM),
                    cos_sin_cache(HEAD_DIM, 8, device=device)), {}),
        ("log_softmax", (t(rows, 40, dt=torch.float32),), {}),
        ("token_logprobs", (t(rows, 40, dt=torch.float32), torch.zeros(rows, dtype=torch.long, device=device)), {}),
        ("sum", (t(rows, 40),), {}),
        ("mean", (t(rows, 40),), {}),
        ("topk", (t(rows, 40), 3), {}),
    ]


def _shapes(result):
    if result is None:
        return None
    if isinstance(result, tuple):
        return tuple(_shapes(r) for r in result)
    return (tuple(result.shape), result.dtype)


@pytest.mark.parametrize("op", [c[0] for c in _op_calls(1)])
def test_an_empty_batch_gives_the_empty_result(any_backend, op):
    (name, args, kwargs), = [c for c in _op_calls(0) if c[0] == op]
    result = getattr(any_backend, name)(*args, **kwargs)
    full = getattr(any_backend, name)(*[c for c in _op_calls(2) if c[0] == op][0][1], **kwargs)
    if name == "write_kv":
        assert result is None
        return
    # The shape of the 2-row result with 0 rows, in its dtype (as torch gives it).
    expect = _shapes(full)
    expect = tuple((tuple([0] + list(s[0][1:])), s[1]) for s in expect) if isinstance(full, tuple) else \
        ((0, *expect[0][1:]), expect[1])
    assert _shapes(result) == expect


@pytest.mark.parametrize("op", [c[0] for c in _op_calls(1)])
def test_meta_tensors_are_refused_naming_the_op(any_backend, op):
    (name, args, kwargs), = [c for c in _op_calls(2, device="meta") if c[0] == op]
    with pytest.raises(UnsupportedError, match=rf"\.{name}: got a meta tensor"):
        getattr(any_backend, name)(*args, **kwargs)


def test_token_logprobs_refuses_a_row_count_mismatch(any_backend):
    logits = torch.randn(4, 40)
    for ids in (torch.zeros(3, dtype=torch.long), torch.zeros(5, dtype=torch.long), torch.zeros(4, 1, dtype=torch.long)):
        with pytest.raises(UnsupportedError, match=r"token_logprobs: token_ids must be \(4,\)"):
            any_backend.token_logprobs(logits, ids)


def test_rms_norm_refuses_a_weight_of_the_wrong_length(any_backend):
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    for weight in (torch.ones(31, dtype=torch.bfloat16), torch.ones(64, dtype=torch.bfloat16),
                   torch.ones(1, 32, dtype=torch.bfloat16)):
        with pytest.raises(UnsupportedError, match=r"rms_norm: weight must be \(32,\)"):
            any_backend.rms_norm(x, weight, 1e-6)
    with pytest.raises(UnsupportedError, match=r"rms_norm: residual must"):
        any_backend.rms_norm(x, torch.ones(32, dtype=torch.bfloat16), 1e-6, torch.ones(3, 16, dtype=torch.bfloat16))


def test_rotary_refuses_positions_outside_the_table(any_backend):
    from hal.rope import cos_sin_cache

    q = torch.randn(3, 2, HEAD_DIM, dtype=torch.bfloat16)
    k = torch.randn(3, 1, HEAD_DIM, dtype=torch.bfloat16)
    table = cos_sin_cache(HEAD_DIM, 8)
    for positions in (torch.tensor([0, -1, 2]), torch.tensor([0, 1, 8])):
        with pytest.raises(UnsupportedError, match=r"rotary: positions must be in 0\.\.7"):
            any_backend.rotary(positions, q, k, table)
    with pytest.raises(UnsupportedError, match=r"rotary: positions must be \(3,\)"):
        any_backend.rotary(torch.tensor([0, 1]), q, k, table)


def test_attention_refuses_a_block_table_shorter_than_seq_len(any_backend):
    """seq_len 40 with pages of 16 needs 3 pages; a block-table row of 2 would let a kernel read the
    next sequence's page ids (or past the table)."""
    from hal.kvcache import build_metadata

    q = torch.randn(1, 2, HEAD_DIM, dtype=torch.bfloat16)
    cache = torch.zeros(4, 16, 1, HEAD_DIM, dtype=torch.bfloat16)
    for meta in (build_metadata([1], [40], [[0, 1]]), build_metadata([1, 1], [40, 3], [[0, 1], [2]])):
        with pytest.raises(UnsupportedError, match=r"attention: sequence 0 has seq_len 40 .* holds 2 pages"):
            any_backend.attention(q.repeat(meta.num_seqs, 1, 1), cache, cache, meta, scale=0.125)
    with pytest.raises(UnsupportedError, match=r"attention: sequence 0 has seq_len 1 and 2 queries"):
        any_backend.attention(q.repeat(2, 1, 1), cache, cache, build_metadata([2], [1], [[0]]), scale=0.125)


def test_a_contract_without_a_dtype_refuses_ops_in_it(contract_backend):
    """A contract whose [contract].activation_dtypes leaves out float32 binds a backend that realises
    float32 in general: its ops refuse fp32 input (and still take bf16)."""
    from pathlib import Path

    from hal.contract import parse_contract

    shipped = Path(__file__).parent.parent / "contracts" / "bf16-dense-v1.toml"
    text = shipped.read_text().replace('activation_dtypes = ["bfloat16", "float32"]',
                                               'activation_dtypes = ["bfloat16"]')
    bf16_only = parse_contract(text, "bf16-only")
    assert bf16_only.header.activation_dtypes == ["bfloat16"]
    backend = type(contract_backend)(bf16_only, contract_backend.device)
    x, w = torch.randn(2, 32), torch.randn(8, 32)
    with pytest.raises(UnsupportedError, match=r"linear: dtype torch.float32 is not covered by contract"):
        backend.linear(x, w)
    with pytest.raises(UnsupportedError, match=r"rms_norm: dtype torch.float32 is not covered"):
        backend.rms_norm(x, torch.ones(32), 1e-6)
    assert backend.linear(x.bfloat16(), w.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("op", [c[0] for c in _op_calls(1)])
def test_the_shared_checks_run_once_per_call(any_backend, op, monkeypatch):
    """The input checks live in one place (the Backend wrapper): an op body that repeats them does the
    work twice per call on the hot path. Each check helper may run at most once per op call."""
    counts: dict[str, int] = {}
    for helper in ("check_dtype", "check_linear", "check_rotary", "check_rms_norm", "check_attention",
                   "check_logits", "check_topk", "check_head_dim", "check_token_ids", "check_positions"):
        original = getattr(type(any_backend), helper)

        def counted(self, *args, _name=helper, _original=original, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(type(any_backend), helper, counted)
    (name, args, kwargs), = [c for c in _op_calls(3) if c[0] == op]
    getattr(any_backend, name)(*args, **kwargs)
    # check_linear / check_rotary / check_rms_norm / check_attention call check_dtype once themselves.
    assert {k: v for k, v in counts.items() if v > 1} == {}


def test_inference_tensors_are_checked_at_every_call_since_they_have_no_version_counter():
    """vLLM runs its forward under ``torch.inference_mode``: a tensor made there (expert ids from
    moe_route) has no version counter, so marking it checked records nothing and it is checked again
    (GPU vLLM's MoE engine raised on ``_version`` before). A normal tensor keeps its stamp until written."""
    from hal.backend import _value_stamp, _values_checked, mark_values_checked

    normal = torch.zeros(4, device="meta")          # not the CPU, where every call checks anyway
    mark_values_checked(normal)
    assert _values_checked(normal)
    normal.add_(1)                                  # a write moves the version: checked again
    assert not _values_checked(normal)
    with torch.inference_mode():
        ids = torch.zeros(4, dtype=torch.int32, device="meta")
        mark_values_checked(ids)
    assert _value_stamp(ids) is None and not _values_checked(ids)
