"""Block FP8 under bf16-fp8-v1 (``hal/fp8.py``): the contract section, quantisation, the reference GEMM.

Properties: the [fp8] section is validated and hashed, and adding it to the schema changed no other
contract's fingerprint; torch's fp32 -> fp8 cast (which the reference relies on) rounds to nearest even;
the reference's quantisation and GEMM equal a scalar rebuild from the contract's text (exact rationals,
one IEEE operation at a time), with negative controls (a multiply by the reciprocal, the other scale
order) that differ on the same inputs; a token's FP8 values and outputs depend on that token alone (batch
composition, zero padding rows, the group's position) while per-tensor dynamic scaling (the negative
control, computed with the same exact GEMM, so no BLAS is involved) changes them; accuracy against an
fp64 oracle; every bad input is refused with the reason. The cuda kernels are in test_cuda_fp8.py.
"""

from __future__ import annotations

from fractions import Fraction
from importlib import resources

import pytest
import torch
from test_contract_structure import add32, exact_sum_rn32, f32, mul32, rn32

from hal import contract as contract_module
from hal import fp8
from hal.api import create_backend
from hal.backend import Backend
from hal.contract import load_contract, parse_contract
from hal.errors import ContractError, UnsupportedError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FP8 = load_contract("bf16-fp8-v1")
DENSE = load_contract("bf16-dense-v1")
SPEC = FP8.fp8
REF = create_backend("reference", FP8)
RAW = resources.files("hal.contracts").joinpath("bf16-fp8-v1.toml").read_text()


def fp8_grid(fmt: str) -> list[float]:
    """Every finite value of an FP8 format, ascending (from its 256 bit patterns)."""
    values = torch.arange(256, dtype=torch.uint8).view(fp8.FORMATS[fmt]).float()
    return sorted(set(values[torch.isfinite(values)].tolist()))


def rne_fp8(v: float, fmt: str, grid: list[float]) -> float:
    """The nearest value of the format's grid (ties: the one with an even bit pattern), |v| <= FMAX."""
    best = min(grid, key=lambda g: abs(g - v))
    ties = [g for g in grid if abs(g - v) == abs(best - v)]
    if len(ties) > 1:
        codes = {g: int(torch.tensor(g).to(fp8.FORMATS[fmt]).view(torch.uint8)) for g in ties}
        best = next(g for g in ties if codes[g] % 2 == 0)
    return best


def scale_rebuild(amax: float, fmt: str = "e4m3") -> float:
    """scale = fl32(max(amax, fl32(amax_floor)) / FMAX), the division correctly rounded."""
    return rn32(Fraction(max(amax, f32(SPEC.amax_floor))) / Fraction(SPEC.fmax(fmt)))


def quantise_rebuild(piece: list[float], fmt: str = "e4m3", reciprocal: bool = False) -> tuple[list[float], float]:
    """[fp8] scale and quantise rules from the contract's text, one scalar at a time."""
    fmax = SPEC.fmax(fmt)
    scale = scale_rebuild(max(abs(v) for v in piece), fmt)
    grid = fp8_grid(fmt)
    inv = rn32(1 / Fraction(scale))
    out = []
    for v in piece:
        y = mul32(v, inv) if reciprocal else rn32(Fraction(v) / Fraction(scale))
        out.append(rne_fp8(min(max(y, -fmax), fmax), fmt, grid))
    return out, scale


def wide(shape, seed, spread=6):
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-spread, spread + 1, shape, generator=g).float())
    return torch.randn(*shape, generator=g) * scale


# ---------------------------------------------------------------------------------------------
# The contract
# ---------------------------------------------------------------------------------------------

def test_fp8_contract_adds_fp8_to_the_dense_sections_and_leaves_other_fingerprints_alone(monkeypatch):
    for section in ("gemm", "attention", "rms_norm", "silu_mul", "rope", "logprobs", "reduce", "topk"):
        assert getattr(FP8, section) == getattr(DENSE, section), section
    assert FP8.moe is None and FP8.fp8.activation_group == FP8.fp8.weight_block == 128
    assert '"amax_floor":1e-10' in FP8.canonical_json()
    # Every shipped contract without [fp8] hashes exactly what it hashed before [fp8] joined the schema
    # (bf16-moe-fp8-v1 has one: tests/test_fp8_moe.py checks its sections).
    others = {name: load_contract(name) for name in contract_module.available_contracts()
              if load_contract(name).fp8 is None}
    assert set(others) >= {"bf16-dense-v1", "bf16-moe-v1", "bf16-ascend-v1"}
    before = {name: c.fingerprint for name, c in others.items()}
    monkeypatch.setattr(contract_module, "SECTIONS", {k: v for k, v in contract_module.SECTIONS.items() if k != "fp8"})
    assert all(c.fp8 is None and "fp8" not in c.to_dict() for c in others.values())
    assert {name: c.fingerprint for name, c in others.items()} == before
    assert FP8.fingerprint != DENSE.fingerprint


@pytest.mark.parametrize("old, new, key, expected", [
    ('kv_format = "e4m3"', 'kv_format = "e3m4"', "[fp8].kv_format", "'e4m3' or 'e5m2'"),
    ("amax_floor = 1e-10", "amax_floor = 0.0", "[fp8].amax_floor", "a float in (0, 1)"),
    ("amax_floor = 1e-10", "amax_floor = 1", "[fp8].amax_floor", "a float"),
    ("activation_group = 128", "activation_group = 64", "[fp8].activation_group", "128"),
    ('quantise = "div_rn_clamp_rne"', 'quantise = "mul_reciprocal"', "[fp8].quantise", "'div_rn_clamp_rne'"),
    ("[fp8]\n", '[fp8]\nper_tensor = "dynamic"\n', "[fp8].per_tensor", "no such key"),
])
def test_fp8_section_values_are_validated(old, new, key, expected):
    assert old in RAW
    with pytest.raises(ContractError, match=r"^contracts/x\.toml: " + key.replace("[", r"\[").replace("]", r"\]")) as info:
        parse_contract(RAW.replace(old, new, 1), source="contracts/x.toml")
    assert expected in str(info.value)


# ---------------------------------------------------------------------------------------------
# Quantisation
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_torchs_cast_rounds_to_nearest_even_with_subnormals(fmt):
    """The reference's last step is torch's fp32 -> fp8 cast: every rounding midpoint of the format
    goes to the even neighbour, and the next fp32 value above it to the upper one."""
    grid = torch.tensor(fp8_grid(fmt), dtype=torch.float64)
    lo, hi = grid[:-1], grid[1:]
    mid = ((lo + hi) / 2).float()                                    # exact in fp32
    code = lambda v: v.to(fp8.FORMATS[fmt]).view(torch.uint8).int()  # noqa: E731
    even = torch.where(code(lo.float()) % 2 == 0, lo, hi)
    assert torch.equal(mid.to(fp8.FORMATS[fmt]).double(), even)
    above = torch.nextafter(mid, torch.tensor(float("inf")))
    assert torch.equal(above.to(fp8.FORMATS[fmt]).double(), hi)


def test_quantisation_equals_the_contract_rebuild_and_a_reciprocal_multiply_does_not():
    # Groups of values on and next to fp8 rounding midpoints of their own scale, where the last bit of
    # fl32(x / scale) decides the cast; plus an all-zero group (the floor) and a subnormal-heavy one.
    g = torch.Generator().manual_seed(3)
    grid = torch.tensor(fp8_grid("e4m3"))
    rows = []
    for r in range(6):
        amax = float(torch.rand(1, generator=g)) * 10 + 0.1
        scale = f32(amax / 448)
        mids = (grid[1:] + grid[:-1]) / 2
        pick = mids[torch.randint(0, len(mids), (127,), generator=g)]
        jitter = torch.randint(-2, 3, (127,), generator=g).float() * 2 ** -22
        rows.append(torch.cat([torch.tensor([amax]), (pick * scale) * (1 + jitter)]).clamp(-amax, amax))
    rows.append(torch.zeros(128))
    rows.append(wide((128,), 4, spread=12) * 1e-3)
    x = torch.stack(rows)
    q, scale = fp8.quantise_activations(x, SPEC)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (len(rows), 1)
    differs = 0
    for i, row in enumerate(x.tolist()):
        want, want_scale = quantise_rebuild(row)
        assert scale[i, 0].item() == want_scale and q[i].float().tolist() == want, i
        differs += quantise_rebuild(row, reciprocal=True)[0] != want
    assert differs > 0, "negative control: a multiply by fl32(1 / scale) should change some group's bits"
    assert q[6].float().abs().sum() == 0 and torch.isfinite(scale).all()


def test_a_groups_fp8_values_depend_on_that_group_alone_and_per_tensor_scaling_does_not():
    x = wide((4, 384), 5)
    alone_q, alone_s = fp8.quantise_activations(x[1:2], SPEC)
    loud = wide((3, 384), 6) * 1000                               # batch-mates with a far larger amax
    padded = torch.cat([loud[:1], x[1:2], torch.zeros(2, 384), loud[1:]])
    q, s = fp8.quantise_activations(padded, SPEC)
    assert torch.equal(q[1].view(torch.uint8), alone_q[0].view(torch.uint8)) and torch.equal(s[1], alone_s[0])
    # position: the same 128 values as another group of the row quantise the same way
    moved = torch.roll(x[1:2], 128, dims=1)
    mq, ms = fp8.quantise_activations(moved, SPEC)
    assert torch.equal(mq.roll(-128, 1).view(torch.uint8), alone_q.view(torch.uint8))
    assert torch.equal(ms.roll(-1, 1), alone_s)
    # negative control: one scale from the whole batch's amax (vLLM's per-tensor dynamic quantisation)
    per_tensor = lambda t: fp8.quantise(t, fp8.scale_of(t.abs().amax(), SPEC, "e4m3"), SPEC, "e4m3")  # noqa: E731
    assert not torch.equal(per_tensor(padded)[1].view(torch.uint8), per_tensor(x[1:2])[0].view(torch.uint8))


def test_weight_blocks_quantise_per_block_and_dequantise_within_half_an_fp8_step():
    w = wide((200, 256), 7, spread=3) * 0.02                     # N = 200: a short last block row
    w[128:, 128:] = 0.0                                           # an all-zero block
    q, s = fp8.quantise_weight_blocks(w, SPEC)
    assert q.shape == w.shape and s.shape == (2, 2) and s.dtype == torch.float32
    for bn in range(2):
        for bk in range(2):
            block = w[bn * 128:(bn + 1) * 128, bk * 128:(bk + 1) * 128]
            assert s[bn, bk].item() == scale_rebuild(block.abs().max().item())
    assert q[128:, 128:].float().abs().sum() == 0
    deq = fp8.dequantise_weight_blocks(q, s, SPEC).double()
    full = s.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:200]
    # e4m3: a relative step of 2**-3 for normals (half of it by rounding), 2**-9 absolute below 2**-6
    bound = full * torch.maximum((w.double() / full).abs() * 2 ** -4, torch.tensor(2.0 ** -10)) * (1 + 2 ** -20)
    assert ((deq - w.double()).abs() <= bound).all()


# ---------------------------------------------------------------------------------------------
# The GEMM
# ---------------------------------------------------------------------------------------------

def quantised_layer(m, n, k, seed, dtype=torch.bfloat16):
    x = wide((m, k), seed, spread=4).to(dtype)
    w = wide((n, k), seed + 1, spread=2) * k ** -0.5
    wq, ws = fp8.quantise_weight_blocks(w, SPEC)
    return x, wq, ws


def gemm_rebuild(xq, xs, wq, ws, i, j, scale_order="product"):
    """One output element by [fp8]'s GEMM rule, from the contract's text: RN32 of each block's exact
    dot, then fl32(acc + fl32(partial * fl32(a_s * w_s))) per block, ascending from +0."""
    acc = 0.0
    for b, (start, end) in enumerate(SPEC.group_ranges(xq.shape[1])):
        a = xq[i, start:end].double().tolist()
        w = wq[j, start:end].double().tolist()
        partial = exact_sum_rn32([p * r for p, r in zip(a, w)])
        a_s, w_s = xs[i, b].item(), ws[j // 128, b].item()
        if scale_order == "product":
            acc = add32(acc, mul32(partial, mul32(a_s, w_s)))
        else:                                         # vLLM's Triton block kernel: (partial * a_s) * w_s
            acc = add32(acc, mul32(mul32(partial, a_s), w_s))
    return acc


def test_reference_gemm_equals_the_contract_rebuild_and_the_other_scale_order_does_not():
    x, wq, ws = quantised_layer(3, 140, 384, 8, torch.float32)
    xq, xs = fp8.quantise_activations(x, SPEC)
    out = fp8.block_gemm(xq, xs, wq, ws, None, torch.float32, SPEC)
    assert torch.equal(out, REF.fp8_linear(x, wq, ws, out_dtype=torch.float32))
    differs = 0
    for i in range(3):
        for j in (0, 1, 63, 127, 128, 139):
            assert out[i, j].item() == gemm_rebuild(xq, xs, wq, ws, i, j), (i, j)
            differs += gemm_rebuild(xq, xs, wq, ws, i, j, "a_then_w") != out[i, j].item()
    assert differs > 0, "negative control: multiplying the scales in the other order should change some bits"


def test_fp8_linear_is_close_to_an_fp64_oracle_of_the_quantised_values():
    x, wq, ws = quantised_layer(7, 130, 640, 9)
    bias = torch.randn(130).bfloat16()
    out = REF.fp8_linear(x, wq, ws, bias, out_dtype=torch.float32)
    xq, xs = fp8.quantise_activations(x, SPEC)
    xd = fp8.dequantise_activations(xq, xs, SPEC).double()    # products rounded once: within 2**-24 each
    wd = fp8.dequantise_weight_blocks(wq, ws, SPEC).double()
    oracle = xd @ wd.T + bias.double()
    magnitude = xd.abs() @ wd.abs().T + bias.double().abs()
    # 5 blocks: one rounding per partial, scale product, scaled partial, add; the bias add: ~25 ulps
    assert ((out.double() - oracle).abs() <= 32 * 2 ** -24 * magnitude).all()
    bf16 = REF.fp8_linear(x, wq, ws, bias)
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, out.to(torch.bfloat16))


def test_a_tokens_fp8_linear_output_depends_on_that_token_alone():
    x, wq, ws = quantised_layer(33, 200, 384, 10)
    x[5:] *= 64                                          # batch-mates with a larger amax
    alone = REF.fp8_linear(x[3:4], wq, ws)
    for batch in (x, x.flip(0), torch.cat([torch.zeros(4, 384, dtype=x.dtype), x[:6]])):
        row = (batch == x[3]).all(-1).nonzero()[0, 0]
        assert torch.equal(REF.fp8_linear(batch, wq, ws)[row], alone[0])
    assert torch.equal(REF.fp8_linear(x.view(3, 11, 384), wq, ws).view(33, 200)[3], alone[0])
    # negative control: per-tensor dynamic scaling through the same exact GEMM (no BLAS involved)
    def per_tensor(t):
        s = fp8.scale_of(t.float().abs().amax(), SPEC, "e4m3")
        xs = s.expand(t.shape[0], t.shape[1] // 128).contiguous()
        return fp8.block_gemm(fp8.quantise(t, s, SPEC, "e4m3"), xs, wq, ws, None, torch.bfloat16, SPEC)
    assert not torch.equal(per_tensor(x)[3], per_tensor(x[3:4])[0])


# ---------------------------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------------------------

def test_fp8_linear_inputs_are_checked_with_the_reason():
    x, wq, ws = quantised_layer(2, 130, 256, 11)
    cases = [
        ((x, wq.float(), ws), "must be \\(N, K = 256\\) torch.float8_e4m3fn"),
        ((x[:, :200], wq[:, :200], ws), "K = 200 is not a multiple of \\[fp8\\].activation_group = 128"),
        ((x, wq, ws[:1]), "weight_scale_inv must be fp32 \\(2, 2\\)"),
        ((x, wq, ws.double()), "weight_scale_inv must be fp32"),
        ((x, wq, ws, torch.zeros(3, dtype=x.dtype)), "bias must be \\(130,\\)"),
    ]
    for args, match in cases:
        with pytest.raises(UnsupportedError, match=match):
            REF.fp8_linear(*args)
    with pytest.raises(UnsupportedError, match="out_dtype"):
        REF.fp8_linear(x, wq, ws, out_dtype=torch.float16)
    assert REF.fp8_linear(x[:0], wq, ws).shape == (0, 130)


def test_contracts_and_backends_without_fp8_refuse_fp8_linears():
    x, wq, ws = quantised_layer(2, 128, 128, 12)
    with pytest.raises(UnsupportedError, match=r"no \[fp8\] section.*bf16-fp8-v1"):
        create_backend("reference", DENSE).fp8_linear(x, wq, ws)
    with pytest.raises(UnsupportedError, match="does not realise FP8 linears"):
        Backend.fp8_linear(REF, x, wq, ws)
    from hal.backends.ascend import AscendBackend

    assert "bf16-fp8-v1" not in AscendBackend.contracts          # binding an FP8 contract is refused first
    with pytest.raises(UnsupportedError, match=r"ascend' does not realise FP8 linears.*\[fp8\]"):
        AscendBackend.fp8_linear.__wrapped__(AscendBackend, x, wq, ws)
    # the stock baseline computes it (per-tensor dynamic scaling; no invariance claim)
    stock = create_backend("torch")
    assert stock.fp8_linear(x, wq, ws).shape == (2, 128)


# -- the conformance kit's FP8 cells ----------------------------------------------------------

class PerTensorScaledBackend(type(REF)):
    """fp8_linear with one dynamic activation scale for the whole batch (what the contract forbids)."""

    def fp8_linear(self, x, weight, weight_scale_inv, bias=None, *, out_dtype=None):
        s = fp8.scale_of(x.float().abs().amax(), SPEC, "e4m3")
        xs = s.expand(x.shape[0], x.shape[1] // SPEC.activation_group).contiguous()
        return fp8.block_gemm(fp8.quantise(x, s, SPEC, "e4m3"), xs, weight, weight_scale_inv, bias,
                              out_dtype or x.dtype, SPEC)


class ShiftedScaleBackend(type(REF)):
    """fp8_linear reading each weight block's scale from the next block row (a scale-layout bug): batch
    invariant and deterministic, but not the contract's product."""

    def fp8_linear(self, x, weight, weight_scale_inv, bias=None, *, out_dtype=None):
        return super().fp8_linear(x, weight, weight_scale_inv.roll(1, 0), bias, out_dtype=out_dtype)


@pytest.mark.parametrize("width, out_features", [(130, 129), (1, 7), (256, 33)])
def test_the_conformance_kit_checks_fp8_linear_and_catches_per_tensor_scaling(width, out_features):
    """The kit's FP8 row ops (levels 1-2 under a contract with [fp8]; K = the row repeated to one group more
    than it needs, so every K crosses a block boundary; N = 129 crosses a weight block) pass on reference;
    batch invariance fails on a backend with one per-tensor activation scale (negative control), and a dense
    contract has no FP8 row ops."""
    from hal.conformance.runner import CHECKS

    for row_op in ("fp8_linear", "fp8_linear+bias", "fp8_linear->fp32"):
        for dtype in ("bfloat16", "float32"):
            params = dict(row_op=row_op, width=width, out_features=out_features, dtype=dtype, seed=3)
            assert CHECKS["determinism"](REF, **params) == [], params
            assert CHECKS["batch_invariance"](REF, **params) == [], params
    assert CHECKS["batch_invariance"](PerTensorScaledBackend(FP8), row_op="fp8_linear", width=width,
                                      out_features=out_features, dtype="bfloat16", seed=3)
    with pytest.raises(ValueError, match="not defined"):
        CHECKS["batch_invariance"](create_backend("reference", DENSE), row_op="fp8_linear", width=width,
                                   out_features=out_features, dtype="bfloat16", seed=3)


def test_the_conformance_kits_fp8_accuracy_level_passes_reference_and_catches_a_slipped_scale():
    """Level 5 for fp8_linear (``hal.conformance.bounds``): against the fp64 product of the contract's quantised
    operands within 2**-10 of sum |x| |w| (Hopper's FP8 MMA) - the exact reference passes at K of one and of
    several blocks; weight scales read from the wrong block row fail."""
    from hal.conformance.runner import CHECKS

    for size, width, dtype in ((1, 128, "bfloat16"), (17, 300, "float32"), (3, 1000, "bfloat16")):
        assert CHECKS["accuracy"](REF, op="fp8_linear", size=size, width=width, dtype=dtype, seed=5) == []
    problems = CHECKS["accuracy"](ShiftedScaleBackend(FP8), op="fp8_linear", size=17, width=300, dtype="float32", seed=5)
    assert problems and "outside the bound" in problems[0]
