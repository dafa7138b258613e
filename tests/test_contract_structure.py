"""The reference backend realises the contract's numbers, not only a self-consistent structure.

Each op is rebuilt here from the contract's text alone, in plain Python on exact values (no call into the
backend or its helpers): every reduction chunk the contract names (a 512-wide K chunk, a 4096-wide row
block or vocabulary chunk, a 64-key KV chunk, a head-dim dot) is summed exactly with integers and rounded
once to fp32 (what the reference promises inside a chunk, hal/backends/reference/exact.py); every other
step is one IEEE fp32 operation, rounded as the contract says. The backend must give the same bits
(``torch.equal``) at sizes that cross every boundary. Negative control, in each test: the same rebuild
with the number halved differs from the backend on the same inputs, so each test can fail.

exp, exp2 and log are implementation-defined to a few ulp; the rebuild uses Python's fp64 math library
rounded once to fp32, as the reference promises (fp64 evaluation, one rounding): these agree except
within ~2**-29 of an fp32 rounding midpoint, which the fixed inputs here do not hit.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from fractions import Fraction

import pytest
import torch

from hal.api import create_backend
from hal.contract import load_contract
from hal.kvcache import PagedKVCache, build_metadata, pages_needed, slot_mapping

CONTRACT = load_contract("bf16-dense-v1")


@pytest.fixture(scope="module")
def backend():
    return create_backend("reference", "bf16-dense-v1")


# ---------------------------------------------------------------------------------------------
# Exact arithmetic and IEEE rounding, independent of torch's kernels.
# ---------------------------------------------------------------------------------------------

def _f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def _from_bits(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def rn32(q: Fraction | float) -> float:
    """The fp32 value nearest to the exact value ``q`` (ties to even), as a Python float."""
    q = Fraction(q)
    if q == 0:
        return 0.0
    sign = -1.0 if q < 0 else 1.0
    q = abs(q)
    guess = _f32_bits(float(q))  # float(q) is correctly rounded to fp64: RN32(q) is this or a neighbour
    candidates = [b for b in (guess - 1, guess, guess + 1) if 0 <= b < 0x7F800000]
    best = min(candidates, key=lambda b: (abs(Fraction(_from_bits(b)) - q), b & 1))
    return sign * _from_bits(best)


def exact_sum_rn32(terms: list[float]) -> float:
    """RN32 of the exact sum of fp64 values (each held exactly): integers over a common power of two."""
    if not terms:
        return 0.0
    ratios = [t.as_integer_ratio() for t in terms]
    den = max(d for _, d in ratios)
    return rn32(Fraction(sum(n * (den // d) for n, d in ratios), den)) + 0.0  # an exact zero sum is +0


def f32(x: float) -> float:
    """fp64 -> fp32, round to nearest even (a C cast)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


# One IEEE fp32 operation on fp32 operands: computed in fp64, then rounded to fp32. Double rounding is
# innocuous for +, -, *, / and sqrt when the wider format has >= 2 * 24 + 2 bits (fp64 has 53), so this
# is the correctly rounded fp32 result.
def add32(a: float, b: float) -> float:
    return f32(a + b)


def mul32(a: float, b: float) -> float:
    return f32(a * b)


def div32(a: float, b: float) -> float:
    return f32(a / b)


def sqrt32(a: float) -> float:
    return f32(math.sqrt(a))


def exp2_32(x: float) -> float:
    return 0.0 if x == -math.inf else rn32(2.0 ** x)


def exp32(x: float) -> float:
    return rn32(math.exp(x))


def to_tensor(values, dtype) -> torch.Tensor:
    """fp32 values (exact in fp32) -> a tensor rounded once to ``dtype`` (RN, a plain dtype conversion)."""
    return torch.tensor(values, dtype=torch.float32).to(dtype)


def randn(shape, dtype, seed: int, spread: int = 6) -> torch.Tensor:
    """Random values over a wide exponent range, so that sums are rarely exact and chunking shows."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-spread, spread + 1, shape, generator=g).float())
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def blocked(values: list[float], block: int) -> float:
    """[reduce]/[rms_norm]/[logprobs]: RN32 of each block's exact sum, block sums added ascending in fp32."""
    total = None
    for start in range(0, len(values), block):
        part = exact_sum_rn32(values[start:start + block])
        total = part if total is None else add32(total, part)
    return total


# ---------------------------------------------------------------------------------------------
# GEMM: K in chunks of k_chunk, each RN32 of its exact sum, chunks added ascending in fp32, bias, one rounding.
# ---------------------------------------------------------------------------------------------

def gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, k_chunk: int, out_dtype) -> torch.Tensor:
    xs, ws = x.double().tolist(), w.double().tolist()
    out = []
    for row in xs:
        out.append([])
        for col, wrow in enumerate(ws):
            acc = None
            for start in range(0, len(row), k_chunk):
                part = exact_sum_rn32([a * b for a, b in zip(row[start:start + k_chunk], wrow[start:start + k_chunk])])
                acc = part if acc is None else add32(acc, part)
            if bias is not None:
                acc = add32(acc, float(bias[col]))
            out[-1].append(acc)
    return to_tensor(out, out_dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemm_is_the_contracts_k_chunked_sum(backend, dtype):
    k_chunk = CONTRACT.gemm.k_chunk
    k = 2 * k_chunk + 76                     # three chunks, the last one partial: crosses 512 and 1024
    x, w, b = randn((3, k), dtype, 1), randn((4, k), dtype, 2), randn((4,), dtype, 3)
    for bias, out_dtype in ((None, torch.float32), (b, torch.float32), (b, dtype)):
        got = backend.linear(x, w, bias, out_dtype=out_dtype)
        assert torch.equal(got, gemm(x, w, bias, k_chunk, out_dtype)), (bias is not None, out_dtype)
    # Negative control: the structure with half the chunk is not what the backend computes.
    assert not torch.equal(backend.linear(x, w, out_dtype=torch.float32),
                           gemm(x, w, None, k_chunk // 2, torch.float32))


# ---------------------------------------------------------------------------------------------
# RMSNorm, sum, mean: blocks of row_block at absolute offsets.
# ---------------------------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, residual: torch.Tensor | None, row_block: int):
    dtype = x.dtype
    if residual is not None:   # residual_out = round_act(fl32(x + residual))
        r = (to_tensor([[add32(a, b) for a, b in zip(xr, rr)] for xr, rr in zip(x.double().tolist(),
                                                                             residual.double().tolist())], dtype))
        x = r
    xs, ws = x.double().tolist(), w.double().tolist()
    eps32, n = f32(eps), x.shape[-1]
    out = []
    for row in xs:
        sum_sq = blocked([v * v for v in row], row_block)                 # squares of fp32 values: exact in fp64
        inv = div32(1.0, sqrt32(add32(div32(sum_sq, n), eps32)))
        out.append([mul32(mul32(v, inv), wv) for v, wv in zip(row, ws)])
    out = to_tensor(out, dtype)
    return out if residual is None else (out, x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_uses_the_contracts_row_blocks(backend, dtype):
    block = CONTRACT.rms_norm.row_block
    width = 2 * block + 9                       # three blocks: crosses 4096 and 8192
    x, w, r = randn((2, width), dtype, 4), randn((width,), dtype, 5), randn((2, width), dtype, 6)
    assert torch.equal(backend.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6, None, block))
    got, got_res = backend.rms_norm(x, w, 1e-6, r)
    want, want_res = rms_norm(x, w, 1e-6, r, block)
    assert torch.equal(got, want) and torch.equal(got_res, want_res)
    # Negative control on eight fp32 rows (a bf16 output hides one ulp of the norm, and a correctly rounded
    # sum of two half blocks often equals that of the whole block): some rows show the halved blocks.
    x32, w32 = randn((8, width), torch.float32, 4), torch.ones(width)
    got = backend.rms_norm(x32, w32, 1e-6)
    assert torch.equal(got, rms_norm(x32, w32, 1e-6, None, block))
    assert not torch.equal(got, rms_norm(x32, w32, 1e-6, None, block // 2))


def test_sum_and_mean_use_the_contracts_row_blocks(backend):
    block = CONTRACT.reduce.row_block
    for dtype in (torch.bfloat16, torch.float32):
        x = randn((8, 2 * block + 9), dtype, 7)   # eight rows: some show a halved block (one ulp)
        rows = x.double().tolist()
        sums = [blocked(row, block) for row in rows]
        assert torch.equal(backend.sum(x), torch.tensor(sums, dtype=torch.float32)), dtype
        means = [div32(s, x.shape[-1]) for s in sums]
        assert torch.equal(backend.mean(x), torch.tensor(means, dtype=torch.float32)), dtype
        halved = [blocked(row, block // 2) for row in rows]
        assert not torch.equal(backend.sum(x), torch.tensor(halved, dtype=torch.float32)), dtype


# ---------------------------------------------------------------------------------------------
# log-softmax / token logprobs: x = fl32(logit / T); fl32(x - max); exp; vocab chunks; log; one subtract.
# ---------------------------------------------------------------------------------------------

def log_softmax(logits: torch.Tensor, temperature: float, vocab_chunk: int) -> torch.Tensor:
    out = []
    for row in logits.double().tolist():
        x = row if temperature == 1.0 else [div32(v, f32(temperature)) for v in row]
        top = max(x)
        shifted = [add32(v, -top) for v in x]
        log_sum = rn32(math.log(blocked([exp32(s) for s in shifted], vocab_chunk)))
        out.append([add32(s, -log_sum) for s in shifted])
    return torch.tensor(out, dtype=torch.float32)


def peaked_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """One logit at 0 per row, the rest near -12: the sum of exp is 1 + a few percent, so one ulp of the
    chunked sum moves log(sum) visibly (the log-probability of the largest logit is -log(sum))."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) - 12.0
    logits[:, 5] = 0.0
    return logits


def test_log_softmax_and_token_logprobs_use_the_contracts_vocab_chunks(backend):
    chunk = CONTRACT.logprobs.vocab_chunk
    vocab = 2 * chunk + 9                        # three chunks: crosses 4096 and 8192
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(2, vocab, generator=g) * 4.0
    ids = torch.tensor([5, vocab - 1])
    for temperature in (1.0, 0.7):
        want = log_softmax(logits, temperature, chunk)
        assert torch.equal(backend.log_softmax(logits, temperature), want), temperature
        assert torch.equal(backend.token_logprobs(logits, ids, temperature),
                           want.gather(-1, ids.view(-1, 1)).squeeze(-1)), temperature
    peaked = peaked_logits(4, vocab, 9)
    assert torch.equal(backend.log_softmax(peaked), log_softmax(peaked, 1.0, chunk))
    assert not torch.equal(backend.log_softmax(peaked), log_softmax(peaked, 1.0, chunk // 2))


# ---------------------------------------------------------------------------------------------
# Attention: exp2 online softmax over KV chunks at absolute positions, fixed-size splits merged ascending.
# ---------------------------------------------------------------------------------------------

def attention_row(q: list[float], keys: list[list[float]], values: list[list[float]], position: int,
                  scale: float, spec, p_dtype: torch.dtype) -> list[float]:
    """One query at ``position`` over keys 0..position, as the [attention] section ``spec`` says (see
    hal/contract.py docs): the exp2 rule with log2(e) folded into the scale, or the natural exp with the
    scale multiplied (bf16-ascend-v1); the row sum of the rounded P or of the fp32 P."""
    if spec.scale == "multiply":
        factor, exp = f32(scale), exp32
    else:
        factor, exp = rn32(scale * (1.0 / math.log(2.0))), exp2_32     # fl32(scale * log2 e)
    s = [mul32(exact_sum_rn32([a * b for a, b in zip(q, k)]), factor) for k in keys[:position + 1]]
    dim, split = len(values[0]), spec.kv_split or position + 1
    big_m, big_l, big_a = -math.inf, 0.0, [0.0] * dim
    for split_start in range(0, position + 1, split):
        m, l, acc = -math.inf, 0.0, [0.0] * dim
        for c0 in range(split_start, min(split_start + split, position + 1), spec.kv_chunk):
            visible = range(c0, min(c0 + spec.kv_chunk, position + 1))   # masked keys are selected out
            m_new = max(m, max(s[j] for j in visible))
            alpha = exp(add32(m, -m_new)) if m != -math.inf else 0.0
            p32 = [exp(add32(s[j], -m_new)) for j in visible]
            p = to_tensor(p32, p_dtype).double().tolist()
            row_sum = exact_sum_rn32(p if spec.row_sum == "sum_of_rounded_p" else p32)
            pv = [exact_sum_rn32([pj * values[j][d] for pj, j in zip(p, visible)]) for d in range(dim)]
            l = add32(mul32(l, alpha), row_sum)
            acc = [add32(mul32(a, alpha), b) for a, b in zip(acc, pv)]
            m = m_new
        merged = max(big_m, m)
        a = exp(add32(big_m, -merged)) if big_m != -math.inf else 0.0
        b = exp(add32(m, -merged))
        big_l = add32(mul32(big_l, a), mul32(l, b))
        big_a = [add32(mul32(x, a), mul32(y, b)) for x, y in zip(big_a, acc)]
        big_m = merged
    return [div32(x, big_l) for x in big_a]


def attention(q, k, v, positions, spec) -> torch.Tensor:
    """q (n, Hq, D) at ``positions``, k/v (L, Hkv, D): rebuilt row by row; GQA head h reads h // group."""
    group = q.shape[1] // k.shape[1]
    out = []
    for i, pos in enumerate(positions):
        out.append([attention_row(q[i, h].double().tolist(), k[:, h // group].double().tolist(),
                                  v[:, h // group].double().tolist(), pos, q.shape[-1] ** -0.5, spec, q.dtype)
                    for h in range(q.shape[1])])
    return to_tensor(out, q.dtype)


def backend_attention(backend, q, k, v, queries: int) -> torch.Tensor:
    """The last ``queries`` tokens of the sequence as one chunked-prefill call over a paged cache."""
    n, page = k.shape[0], 16
    pages = list(range(pages_needed(n, page)))[::-1]    # reversed pages: the cache order is free
    cache = PagedKVCache.allocate(len(pages), page, k.shape[1], k.shape[2], k.dtype, "cpu")
    backend.write_kv(k, v, cache.k, cache.v, slot_mapping(pages, range(n), page, "cpu"))
    meta = build_metadata([queries], [n], [pages], "cpu")
    return backend.attention(q[n - queries:], cache.k, cache.v, meta, scale=k.shape[-1] ** -0.5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_is_the_contracts_chunked_split_online_softmax(backend, dtype):
    spec = CONTRACT.attention
    n = 2 * spec.kv_split + spec.kv_chunk + 13           # three splits, the last one partial; crosses 1024
    q, k, v = randn((n, 2, 16), dtype, 10, 1), randn((n, 1, 16), dtype, 11, 1), randn((n, 1, 16), dtype, 12, 1)
    queries = 2
    positions = list(range(n - queries, n))
    got = backend_attention(backend, q, k, v, queries)
    assert torch.equal(got, attention(q[n - queries:], k, v, positions, spec))
    if dtype == torch.float32:  # bf16 output rounding may hide a different merge: controls on fp32
        half_chunk = dataclasses.replace(spec, kv_chunk=spec.kv_chunk // 2)
        half_split = dataclasses.replace(spec, kv_split=spec.kv_split // 2)
        assert not torch.equal(got, attention(q[n - queries:], k, v, positions, half_chunk))
        assert not torch.equal(got, attention(q[n - queries:], k, v, positions, half_split))
