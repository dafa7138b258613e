"""Reference ops against fp64 oracles, within bounds derived from the contract's rounding points.

u = 2**-24 (fp32 unit roundoff); an activation rounding costs at most 2**-9 relative in bf16 and
u in fp32 (the bounds use 2**-8 and 4u for margin). Each bound is written next to its test.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hal.conformance import oracle
from hal.backends.reference import ReferenceBackend
from hal.backends.reference.exact import _exact_sums_to_fp32, matmul_fp32, sum_fp32
from hal.conformance.checks import AttentionCase, random_tensor, run_schedule
from hal.contract import load_contract
from hal.rope import cos_sin_cache

U = 2.0 ** -24
DTYPES = [torch.bfloat16, torch.float32]


def act_rel(dtype) -> float:
    """Relative error of one rounding to the activation dtype, with a factor-2 margin."""
    return 2.0 ** -8 if dtype == torch.bfloat16 else 4 * U


@pytest.fixture(scope="module")
def ref():
    return ReferenceBackend(load_contract())


def assert_within(got, exact, bound, what):
    err = (got.double() - exact).abs()
    worst = int((err - bound).argmax())
    if not bool((err <= bound).all()):
        pytest.fail(f"{what}: error {err.flatten()[worst]:.3g} > bound {bound.flatten()[worst]:.3g} "
                    f"at flat index {worst}")


# -- correctly rounded sums: against exact rational arithmetic -----------------------------------

def test_exact_sums_match_rational_arithmetic_on_adversarial_terms():
    from fractions import Fraction

    rows = [
        [1.0, 2.0 ** -24, 2.0 ** -60],            # exact sum just above an fp32 midpoint
        [1.0, 2.0 ** -24, -(2.0 ** -60)],          # just below the same midpoint
        [1.0, 2.0 ** -24],                         # exactly on the midpoint: ties to even (1.0)
        [1.0 + 2.0 ** -23, 2.0 ** -24],            # on a midpoint whose even neighbour is above
        [1e30, 1.0, -1e30],                        # catastrophic cancellation
        [3.0, -3.0],                               # exact zero -> +0
    ]
    width = max(map(len, rows))
    terms = torch.tensor([r + [0.0] * (width - len(r)) for r in rows], dtype=torch.float64)
    got = _exact_sums_to_fp32(terms)
    for row, value in zip(rows, got.tolist()):
        exact = sum(map(Fraction, row))
        candidates = [torch.tensor(float(exact)).float()]
        candidates += [torch.nextafter(candidates[0], torch.tensor(s)) for s in (math.inf, -math.inf)]
        best = min(candidates, key=lambda c: (abs(Fraction(c.item()) - exact),
                                              c.view(torch.int32).item() & 1))  # nearest, then even
        assert value == best.item(), (row, value, best.item())
    assert math.copysign(1.0, got[-1].item()) == 1.0


def test_matmul_and_sum_are_correctly_rounded_against_fsum():
    g = torch.Generator().manual_seed(3)
    a = random_tensor((9, 700), torch.bfloat16, g)
    b = random_tensor((700, 11), torch.bfloat16, g)
    got = matmul_fp32(a, b)
    exact = _exact_sums_to_fp32((a.double().unsqueeze(-1) * b.double().unsqueeze(0)).permute(0, 2, 1).reshape(-1, 700))
    assert torch.equal(got.flatten(), exact)
    x = random_tensor((5, 3001), torch.float32, g) * torch.logspace(-20, 20, 3001)
    assert torch.equal(sum_fp32(x.double()), _exact_sums_to_fp32(x.double()))


# -- GEMM ---------------------------------------------------------------------------------------

@settings(max_examples=25, deadline=None, derandomize=True)
@given(m=st.sampled_from([1, 2, 7, 33]), n=st.sampled_from([1, 7, 64, 129]),
       k=st.sampled_from([1, 15, 16, 511, 512, 513, 1031]), bias=st.booleans(),
       dtype=st.sampled_from(DTYPES), logits=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_linear_within_bound(ref, m, n, k, bias, dtype, logits, seed):
    g = torch.Generator().manual_seed(seed)
    x, w = random_tensor((m, k), dtype, g), random_tensor((n, k), dtype, g)
    b = random_tensor((n,), dtype, g) if bias else None
    out_dtype = torch.float32 if logits else dtype
    got = ref.linear(x, w, b, out_dtype=out_dtype)
    exact = oracle.linear(x, w, b)
    chunks = math.ceil(k / ref.contract.gemm.k_chunk)
    magnitude = x.double().abs() @ w.double().abs().T + (b.double().abs() if bias else 0)
    # each chunk sum and each of the (chunks - 1) adds and the bias add: one fp32 rounding each
    bound = (2 * chunks + 1) * U * magnitude
    if out_dtype != torch.float32:
        bound = bound + act_rel(dtype) * exact.abs()
    assert got.dtype == out_dtype
    assert_within(got, exact, bound, f"linear m={m} n={n} k={k} {dtype}")


# -- attention ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq_len, q_heads, kv_heads, head_dim", [(1, 2, 1, 64), (130, 4, 2, 64),
                                                                  (600, 8, 2, 128)])
def test_attention_within_bound(ref, dtype, seq_len, q_heads, kv_heads, head_dim):
    case = AttentionCase(seq_len, q_heads, kv_heads, head_dim, dtype, seed=seq_len)
    q, k, v = case.tensors()
    got = run_schedule(ref, case, [seq_len], page_size=16)
    exact = oracle.attention(q, k, v, head_dim ** -0.5)
    # P is rounded to the activation dtype (rel r each) and the denominator sums the same rounded P,
    # so the output is a convex combination of V with weights off by <= 2r relative:
    # |err| <= 2r * 2 max|v| + one output rounding (+ fp32 score/exp errors, far smaller).
    r = act_rel(dtype) / 2
    bound = 4 * r * v.double().abs().max() + act_rel(dtype) * exact.abs() + 64 * U * v.double().abs().max()
    assert_within(got, exact, bound, f"attention L={seq_len} {dtype}")


# -- row ops ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1, 16, 17, 4096, 5000])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_within_bound(ref, dtype, width, residual):
    g = torch.Generator().manual_seed(width)
    x, w = random_tensor((6, width), dtype, g), random_tensor((width,), dtype, g)
    res = random_tensor((6, width), dtype, g) if residual else None
    got = ref.rms_norm(x, w, 1e-6, res)
    exact = oracle.rms_norm(x, w, 1e-6, res)
    if residual:
        got, res_out = got
        assert torch.equal(res_out, (x.float() + res.float()).to(dtype))
    # about 8 fp32 roundings (sum of squares blocks, mean, sqrt, div, two products) + the output rounding
    assert_within(got, exact, (act_rel(dtype) + 16 * U) * exact.abs(), f"rms_norm width={width} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_within_bound(ref, dtype):
    g = torch.Generator().manual_seed(0)
    x = random_tensor((7, 2 * 333), dtype, g, scale=4.0)
    exact = oracle.silu_mul(x)
    # exp (fp64, one rounding), 1 + e, the division, the product: 4 fp32 roundings + output rounding
    assert_within(ref.silu_mul(x), exact, (act_rel(dtype) + 8 * U) * exact.abs() + 1e-38, f"silu_mul {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_within_bound(ref, dtype):
    g = torch.Generator().manual_seed(1)
    table = cos_sin_cache(64, 300)
    positions = torch.randint(0, 300, (11,), generator=g)
    q, k = random_tensor((11, 4, 128), dtype, g), random_tensor((11, 2, 128), dtype, g)
    got_q, got_k = ref.rotary(positions, q, k, table)
    for got, x in ((got_q, q), (got_k, k)):
        exact = oracle.rotary(positions, x, table)
        magnitude = oracle.rotary_magnitude(positions, x, table)
        # two products and one add in fp32, then the output rounding
        assert_within(got, exact, act_rel(dtype) * exact.abs() + 4 * U * magnitude, f"rotary {dtype}")
        assert torch.equal(got[..., 64:], x[..., 64:])  # the unrotated tail passes through


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
@pytest.mark.parametrize("vocab", [1, 17, 4096, 10007])
def test_log_softmax_and_token_logprobs_within_bound(ref, temperature, vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = random_tensor((5, vocab), torch.float32, g, scale=6.0)
    got = ref.log_softmax(logits, temperature)
    exact = oracle.log_softmax(logits, temperature)
    scaled = logits.double().abs() / temperature
    bound = 2.0 ** -20 * (1 + scaled + scaled.amax(-1, keepdim=True) + exact.abs())
    assert_within(got, exact, bound, f"log_softmax V={vocab} T={temperature}")
    ids = torch.randint(0, vocab, (5,), generator=g)
    assert torch.equal(ref.token_logprobs(logits, ids, temperature), got.gather(-1, ids.view(-1, 1)).squeeze(-1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1, 31, 4096, 9000])
def test_sum_and_mean_within_bound(ref, dtype, width):
    g = torch.Generator().manual_seed(width)
    x = random_tensor((3, width, 2), dtype, g)
    blocks = math.ceil(width / ref.contract.reduce.row_block)
    exact = x.double().sum(1)
    bound = (blocks + 1) * U * x.double().abs().sum(1)
    assert_within(ref.sum(x, dim=1), exact, bound, f"sum width={width}")
    assert_within(ref.mean(x, dim=1), exact / width, bound / width + U * (exact / width).abs(), "mean")


def test_topk_ties_go_to_the_lower_index(ref):
    g = torch.Generator().manual_seed(5)
    x = torch.randint(-3, 4, (20, 50), generator=g).to(torch.bfloat16)  # many ties
    values, indices = ref.topk(x, 7)
    for row, vals, idx in zip(x.tolist(), values.tolist(), indices.tolist()):
        expected = sorted(range(len(row)), key=lambda i: (-row[i], i))[:7]
        assert idx == expected and vals == [row[i] for i in expected]
