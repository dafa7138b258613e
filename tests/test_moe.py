"""Mixture-of-experts under bf16-moe-v1 (``hal/moe.py``): routing, expert GEMMs, combine, training.

Properties, on ``reference`` and on ``cuda`` (its routing kernel under Triton's interpreter):
routing agrees with an fp64 oracle and breaks ties to the lower expert (and group) index; a token's
MoE output does not depend on its batch-mates, on where the experts are stored or on how they are
spread over expert-parallel ranks; a tiny Qwen3-MoE and a DeepSeek-style MoE model give the
rollout's logprobs bitwise in training. Negative controls (fp32 activations, so a reordered sum is
visible in the output; no BLAS involved): a planted expert GEMM whose K chunk follows the expert's
token count, a per-rank partial combine, and the stock torch MoE (combine in expert order).
"""

from __future__ import annotations

import dataclasses
from importlib import resources

import pytest
import torch
from conftest import assert_schedules_and_trainer_agree, backend_for_tests
from test_rollout import PACKINGS, SCHEDULES, make_requests

from hal import moe
from hal.api import create_backend
from hal.backends.reference import ReferenceBackend
from hal.backends.reference.exact import matmul_fp32
from hal.backends.stock import TorchBackend
from hal.conformance.bounds import oracle_route
from hal.contract import load_contract, parse_contract
from hal.errors import ContractError, UnsupportedError
from hal.model import DecoderLM, tiny_config
from hal.model import autograd as ag
from hal.model.checkpoint import load_pretrained, save_pretrained
from hal.model.config import ModelConfig
from hal.moe import Routing
from hal.rollout import RolloutHarness, recompute_logprobs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MOE = load_contract("bf16-moe-v1")
DENSE = load_contract("bf16-dense-v1")
REF = ReferenceBackend(MOE)
# Sizes cross every chunk boundary an MoE layer has: H = 640 and I = 520 both exceed [gemm].k_chunk
# (512), so both expert GEMMs reduce two K chunks. Under Triton's interpreter (every expert GEMM a
# few hundred interpreted tiles) the cuda tests cross it in the gate/up GEMM only (H = 576, I = 64);
# the GEMM kernel's own chunk crossings are tested in test_cuda_interpreter.py.
T, H, I, E = 12, 640, 520, 8
CUDA_H, CUDA_I = 576, 64

SCHEMES = {
    "qwen3": (Routing(E, 2, renormalize=True), False),
    "softmax-raw": (Routing(E, 3, renormalize=False), False),
    "deepseek": (Routing(E, 3, scoring="sigmoid", renormalize=True, num_groups=4, topk_groups=2, scaling=2.5), True),
}


@pytest.fixture(scope="module")
def cuda():
    backend_for_tests("cuda")          # skips unless the interpreter runs the kernels
    return create_backend("cuda", MOE)


@pytest.fixture(params=["reference", "cuda"])
def backend(request):
    return REF if request.param == "reference" else request.getfixturevalue("cuda")


def layer_weights(dtype, seed=0, experts=E, hidden=H, inter=I):
    g = torch.Generator().manual_seed(seed)
    return dict(router=(torch.randn(experts, hidden, generator=g) * hidden ** -0.5).to(dtype),
                bias=torch.randn(experts, generator=g) * 0.05,
                w13=(torch.randn(experts, 2 * inter, hidden, generator=g) * hidden ** -0.5).to(dtype),
                w2=(torch.randn(experts, hidden, inter, generator=g) * inter ** -0.5).to(dtype))


def tokens(dtype, seed=1, count=T, hidden=H):
    return torch.randn(count, hidden, generator=torch.Generator().manual_seed(seed)).to(dtype)


def sizes(backend):
    return (CUDA_H, CUDA_I) if backend.name == "cuda" else (H, I)


def moe_layer(backend, x, w, routing, use_bias):
    logits = backend.linear(x, w["router"], out_dtype=torch.float32)
    weights, ids = backend.moe_route(logits, routing, w["bias"] if use_bias else None)
    return backend.moe_experts(x, w["w13"], w["w2"], weights, ids), (weights, ids)


# ---------------------------------------------------------------------------------------------
# The contract
# ---------------------------------------------------------------------------------------------

def test_moe_contract_adds_moe_to_the_dense_sections_and_leaves_dense_fingerprints_alone():
    for section in ("gemm", "attention", "rms_norm", "silu_mul", "rope", "logprobs", "reduce", "topk"):
        assert getattr(MOE, section) == getattr(DENSE, section), section
    assert MOE.moe is not None and DENSE.moe is None
    assert "moe" in MOE.to_dict() and "moe" not in DENSE.to_dict()   # an absent section is not hashed
    assert MOE.fingerprint != DENSE.fingerprint
    assert '"combine":"fp32_by_rank_round_once"' in MOE.canonical_json()
    raw = resources.files("hal.contracts").joinpath("bf16-moe-v1.toml").read_text()
    with pytest.raises(ContractError, match=r"\[moe\]\.combine"):
        parse_contract(raw.replace('combine = "fp32_by_rank_round_once"', 'combine = "any_order"'))
    with pytest.raises(ContractError, match=r"\[moe\]\.tie_break"):
        parse_contract(raw.replace("[moe]\n", '[moe]\ntie_break = "higher"\n'))


def test_a_dense_contract_and_a_backend_without_moe_refuse_moe_layers():
    dense = ReferenceBackend(DENSE)
    logits = torch.zeros(2, E)
    with pytest.raises(UnsupportedError, match=r"no \[moe\] section.*bf16-moe-v1"):
        dense.moe_route(logits, Routing(E, 2))
    with pytest.raises(UnsupportedError, match="does not realise mixture-of-experts"):
        from hal.backend import Backend
        Backend.moe_route(REF, logits, Routing(E, 2))


def test_the_ascend_backend_refuses_moe_with_the_reason():
    from hal.backends.ascend import AscendBackend

    assert "bf16-moe-v1" not in AscendBackend.contracts        # binding an MoE contract is refused first
    with pytest.raises(UnsupportedError, match=r"ascend' does not realise mixture-of-experts.*\[moe\]"):
        AscendBackend.moe_experts.__wrapped__(AscendBackend, None, None, None, None, None)


@pytest.mark.parametrize("bad, match", [
    (dict(top_k=9), "top_k must be in 1..num_experts"), (dict(num_groups=3), "must divide"),
    (dict(num_groups=4, topk_groups=5), "topk_groups"), (dict(num_groups=4, topk_groups=1, top_k=3), "exceeds"),
    (dict(scoring="tanh"), "scoring"), (dict(num_groups=8, topk_groups=2), ">= 2 experts"),
])
def test_impossible_routing_is_refused_with_the_reason(bad, match):
    with pytest.raises(UnsupportedError, match=match):
        Routing(**{"num_experts": E, "top_k": 2, **bad})


def test_moe_inputs_are_checked(backend):
    h, i = sizes(backend)
    x, w = tokens(torch.bfloat16, hidden=h), layer_weights(torch.bfloat16, hidden=h, inter=i)
    with pytest.raises(UnsupportedError, match="must be fp32"):
        backend.moe_route(torch.zeros(2, E, dtype=torch.bfloat16), Routing(E, 2))
    with pytest.raises(UnsupportedError, match="logits per token"):
        backend.moe_route(torch.zeros(2, E + 1), Routing(E, 2))
    ids = torch.zeros(T, 2, dtype=torch.int32)
    with pytest.raises(UnsupportedError, match="shapes do not fit"):
        backend.moe_experts(x, w["w13"], w["w2"][:, :, :-1], torch.ones(T, 2), ids)
    with pytest.raises(UnsupportedError, match="expert ids must be in"):
        backend.moe_experts(x, w["w13"], w["w2"], torch.ones(T, 2), ids + E)
    empty_w, empty_ids = backend.moe_route(torch.zeros(0, E), Routing(E, 2))
    assert empty_w.shape == (0, 2) and empty_ids.dtype == torch.int32
    assert backend.moe_experts(x[:0], w["w13"], w["w2"], empty_w, empty_ids).shape == (0, h)


# ---------------------------------------------------------------------------------------------
# Routing
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("scheme", SCHEMES)
def test_routing_matches_the_fp64_oracle(backend, scheme):
    routing, use_bias = SCHEMES[scheme]
    routing = routing.replace(num_experts=64, num_groups=routing.num_groups * 2) if routing.num_groups > 1 \
        else routing.replace(num_experts=64)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(40, 64, generator=g) * 2
    bias = torch.randn(64, generator=g) * 0.05 if use_bias else None
    weights, ids = backend.moe_route(logits, routing, bias)
    want_w, want_ids, gap = oracle_route(logits, routing, bias)
    clear = gap > 1e-5                           # rows without a near-tie at the k-th choice
    assert clear.sum() >= 30
    assert torch.equal(ids[clear].long(), want_ids[clear])
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    rel = ((weights[clear].double() - want_w[clear]).abs() / want_w[clear].abs()).max()
    assert rel < 2e-6, rel


def test_router_ties_go_to_the_lower_expert_and_group_index(backend):
    logits = torch.zeros(3, E)
    logits[0, [6, 2, 5]] = 1.0                  # three equal best experts, k = 2: 2 and 5
    logits[1] = 0.5                              # every expert equal: 0, 1
    logits[2, [1, 7]] = 2.0                      # groups {0,1},{2,3},{4,5},{6,7}: groups 0 and 3 tie
    softmax = backend.moe_route(logits, Routing(E, 2))[1]
    assert softmax[:2].tolist() == [[2, 5], [0, 1]]
    grouped = Routing(E, 2, scoring="sigmoid", num_groups=4, topk_groups=1)
    assert backend.moe_route(logits[2:], grouped)[1].tolist() == [[1, 0]]      # group 0 kept, not 3
    assert backend.moe_route(logits[2:], grouped.replace(topk_groups=2))[1].tolist() == [[1, 7]]


# ---------------------------------------------------------------------------------------------
# Batch composition and expert placement
# ---------------------------------------------------------------------------------------------

def batch_variants(x):
    """(rows of the full batch, the same tokens as another batch) pairs: a slice, a reversal, one token."""
    order = torch.arange(x.shape[0]).flip(0)
    return [(slice(3, 7), x[3:7]), (order, x[order]), (slice(5, 6), x[5:6])]


# (each backend, each scheme, each dtype) on reference; on the interpreted cuda kernels one dtype per
# scheme (each case there costs ~10 s)
BATCH_CASES = [("reference", s, d) for s in ("qwen3", "deepseek") for d in (torch.bfloat16, torch.float32)] + \
    [("cuda", "qwen3", torch.float32), ("cuda", "deepseek", torch.bfloat16)]


@pytest.mark.parametrize("backend_name, scheme, dtype", BATCH_CASES)
def test_a_tokens_moe_output_does_not_depend_on_its_batch_mates(request, backend_name, scheme, dtype):
    backend = REF if backend_name == "reference" else request.getfixturevalue("cuda")
    routing, use_bias = SCHEMES[scheme]
    h, i = sizes(backend)
    x, w = tokens(dtype, hidden=h), layer_weights(dtype, hidden=h, inter=i)
    full, (weights, ids) = moe_layer(backend, x, w, routing, use_bias)
    assert len(ids.unique()) >= 6               # most experts are shared by several tokens
    for rows, batch in batch_variants(x):
        out, (sub_w, sub_ids) = moe_layer(backend, batch, w, routing, use_bias)
        assert torch.equal(sub_ids, ids[rows]) and torch.equal(sub_w, weights[rows])
        assert torch.equal(out, full[rows])


class ExpertLoadDependentBackend(ReferenceBackend):
    """Negative control: an expert GEMM whose K chunk follows how many tokens the expert got (as a
    GEMM library's split-K heuristic does), so a token's bits depend on its batch-mates."""

    def moe_experts(self, x, w13, w2, topk_weights, topk_ids, shared=None):
        t, k = topk_ids.shape
        outputs = torch.zeros(t * k, x.shape[1])
        for expert, slots in moe.slots_by_expert(topk_ids, w13.shape[0]):
            chunk = 128 if len(slots) > 2 else 512
            rows = x[slots // k]

            def gemm(a, b, out_dtype):
                acc = sum(matmul_fp32(a[:, s:s + chunk], b[:, s:s + chunk].T) for s in range(0, a.shape[1], chunk))
                return acc.to(out_dtype)

            act = self.silu_mul(gemm(rows, w13[expert], x.dtype))
            outputs[slots] = gemm(act, w2[expert], torch.float32)
        return moe.combine(outputs.view(t, k, -1), topk_weights, shared, x.dtype)


def test_negative_control_an_expert_gemm_that_follows_the_expert_load_changes_the_bits():
    planted = ExpertLoadDependentBackend(MOE)
    routing, _ = SCHEMES["qwen3"]
    x, w = tokens(torch.float32), layer_weights(torch.float32)
    full, _ = moe_layer(planted, x, w, routing, False)
    changed = [not torch.equal(moe_layer(planted, batch, w, routing, False)[0], full[rows])
               for rows, batch in batch_variants(x)]
    assert any(changed)


def test_the_conformance_kit_checks_moe_ops_and_catches_a_load_dependent_expert_gemm():
    """The kit's MoE row ops (``hal.conformance.checks``; levels 1-2 under a contract with [moe]): they
    pass on reference, and batch invariance fails on the planted load-dependent expert GEMM."""
    from hal.conformance.runner import CHECKS

    params = dict(width=640, out_features=96, dtype="float32", seed=3)
    for row_op in ("moe_route", "moe_route grouped", "moe layer"):
        assert CHECKS["batch_invariance"](REF, row_op=row_op, **params) == [], row_op
    assert CHECKS["batch_invariance"](ExpertLoadDependentBackend(MOE), row_op="moe layer", **params)
    dense = ReferenceBackend(DENSE)
    with pytest.raises(ValueError, match="not defined"):   # a dense contract has no MoE row ops
        CHECKS["batch_invariance"](dense, row_op="moe layer", **params)


def place(w, ids, placement):
    """The same experts stored in other slots: expert e lives at slot placement[e]."""
    slots = torch.empty_like(placement)
    slots[placement] = torch.arange(len(placement))
    return w["w13"][slots], w["w2"][slots], placement[ids.long()].to(ids.dtype)


def expert_parallel(backend, x, w13, w2, weights, ids, ranks):
    """Expert parallelism on one device: rank r owns experts e with e % ranks == r and computes only
    their slots; each slot's output comes back to its token (the all-to-all), which combines."""
    outputs = torch.zeros(*ids.shape, x.shape[1])   # (T, k, H) fp32
    for r in range(ranks):
        mine = [e for e in range(w13.shape[0]) if e % ranks == r]
        computed = moe.expert_outputs(backend, x, w13, w2, ids, experts=mine)
        owned = torch.isin(ids, torch.tensor(mine, dtype=ids.dtype))
        outputs[owned] = computed[owned]
    return moe.combine(outputs, weights, None, x.dtype), outputs


@pytest.mark.parametrize("backend_name, dtype", [("reference", torch.bfloat16), ("reference", torch.float32),
                                                 ("cuda", torch.bfloat16)])
def test_expert_placement_and_expert_parallel_ranks_do_not_change_the_bits(request, backend_name, dtype):
    backend = REF if backend_name == "reference" else request.getfixturevalue("cuda")
    routing = Routing(E, 4, renormalize=True)
    h, i = sizes(backend)
    x, w = tokens(dtype, hidden=h), layer_weights(dtype, hidden=h, inter=i)
    full, (weights, ids) = moe_layer(backend, x, w, routing, False)
    placement = torch.randperm(E, generator=torch.Generator().manual_seed(5))
    w13, w2, placed_ids = place(w, ids, placement)
    assert torch.equal(backend.moe_experts(x, w13, w2, weights, placed_ids), full)
    for ranks in (2, 3):
        out, _ = expert_parallel(backend, x, w["w13"], w["w2"], weights, ids, ranks)
        assert torch.equal(out, full)


def test_negative_controls_per_rank_partial_sums_and_the_stock_moe_change_the_bits():
    routing = Routing(E, 4, renormalize=True)
    x, w = tokens(torch.float32), layer_weights(torch.float32)
    full, (weights, ids) = moe_layer(REF, x, w, routing, False)
    _, outputs = expert_parallel(REF, x, w["w13"], w["w2"], weights, ids, 2)
    # a naive expert-parallel combine: each rank adds its own experts' weighted outputs, then the
    # ranks' partial sums are added (an all-reduce) -- not each token's rank order
    partial = []
    for r in range(2):
        mine = (ids % 2 == r).unsqueeze(-1)
        partial.append(moe.combine(outputs * mine, weights * mine.squeeze(-1), None, torch.float32))
    assert not torch.equal(partial[0] + partial[1], full)
    # the stock torch MoE adds outputs in expert order, so moving the experts moves its bits
    stock = TorchBackend(None, "cpu")
    stock_weights, stock_ids = stock.moe_route(REF.linear(x, w["router"], out_dtype=torch.float32), routing)
    stock_out = stock.moe_experts(x, w["w13"], w["w2"], stock_weights, stock_ids)
    w13, w2, placed_ids = place(w, stock_ids, torch.arange(E).flip(0))
    assert not torch.equal(stock.moe_experts(x, w13, w2, stock_weights, placed_ids), stock_out)


def test_cuda_grouped_expert_gemm_gives_each_slot_the_dense_gemms_bits(cuda):
    """The cuda backend's grouped GEMM over expert-sorted slots equals, bit for bit, each expert's
    rows through the dense GEMM kernel one expert at a time (``hal.moe.experts`` on the same backend)."""
    from hal.kernels.moe import sort_slots

    routing = Routing(E, 3, renormalize=True)
    for dtype in (torch.bfloat16, torch.float32):
        x, w = tokens(dtype, count=10, hidden=CUDA_H), layer_weights(dtype, hidden=CUDA_H, inter=CUDA_I)
        weights, ids = cuda.moe_route(cuda.linear(x, w["router"], out_dtype=torch.float32), routing)
        grouped = cuda.moe_experts(x, w["w13"], w["w2"], weights, ids)
        assert torch.equal(grouped, moe.experts(cuda, x, w["w13"], w["w2"], weights, ids))
    slots = sort_slots(ids, E, 16)
    token, position, tile_expert = slots.token.long(), slots.position, slots.tile_expert.long()
    assert sorted(position.flatten().tolist()) == sorted(set(position.flatten().tolist()))   # one place per slot
    assert torch.equal(token[position], torch.arange(10).unsqueeze(-1).expand(10, 3))
    assert torch.equal(tile_expert[position // 16], ids.long())      # every slot sits in its expert's tile
    assert (token >= 0).sum() == ids.numel()


@pytest.mark.parametrize("experts, top_k, count, block_m",
                         [(96, 8, 1100, 16), (8, 3, 5, 64), (256, 2, 1, 16), (128, 8, 16, 16), (128, 8, 17, 64)])
def test_cuda_slot_sort_is_the_stable_counting_sort(cuda, experts, top_k, count, block_m):
    """``sort_slots`` against torch's stable sort: its one-program path (the slots fill one chunk: 128 at
    128 experts) and its three kernels (chunk counts, runs, scatter) on routings that cross its chunk,
    chunk-block (128 chunks at 96 experts) and tile-block boundaries, with empty experts first, in the
    middle and last, one heavy expert spanning many tiles, and an expert count that is not a power of two."""
    from hal.kernels.moe import sort_slots

    g = torch.Generator().manual_seed(count)
    ids = torch.randint(1, max(2, experts - 1), (count, top_k), generator=g)
    if count * top_k > 1000:
        ids = ids.repeat(14, 1)                                  # > 128 chunks of 128 slots
    ids[: count // 3, 0] = experts // 2                       # one heavy expert
    ids[ids == experts // 3] = experts // 3 + 1               # and an empty one in the middle
    ids = ids.to(torch.int32)
    slots = sort_slots(ids.to(cuda.device), experts, block_m, slot_tiles=False)
    token, position, tile_expert = slots.token.cpu().long(), slots.position.cpu(), slots.tile_expert.cpu().long()

    flat = ids.flatten().long()
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=experts)
    padded = (counts + block_m - 1) // block_m * block_m
    run_start = torch.cumsum(padded, 0) - padded
    first = torch.cumsum(counts, 0) - counts                  # each expert's first index in sorted order
    expected = torch.empty_like(flat)
    expected[order] = run_start[flat[order]] + torch.arange(flat.numel()) - first[flat[order]]
    assert torch.equal(position.flatten(), expected)
    total = -(-(flat.numel() + experts * (block_m - 1)) // block_m) * block_m
    expected_token = torch.full((total,), -1, dtype=torch.long)
    expected_token[expected] = torch.arange(flat.numel()) // top_k
    assert torch.equal(token, expected_token)
    tiles = torch.arange(0, total, block_m)
    expected_tiles = torch.searchsorted(torch.cumsum(padded, 0), tiles, right=True)
    assert torch.equal(tile_expert, torch.where(expected_tiles < experts, expected_tiles, -1))


def test_cuda_slot_tiles_give_the_sorted_layouts_bits(cuda):
    """``sort_slots``' slot tiles (decode batches: tile j is slot j alone, no sort) put each slot at its tile's
    first row with its expert from ``ids`` itself, and ``experts`` gives the bits of the sorted layout at every
    slot, with experts shared by several slots (10 tokens, top-3 over 8 experts), a shared-expert input and
    the hidden size across the 512 K chunk. Negative control: the same slot tiles under half the K chunk give
    other bits (fp32), so the comparison sees a reduction change."""
    import dataclasses

    from hal.kernels import moe as kernels

    spec = cuda.contract.gemm
    x, w = tokens(torch.bfloat16, count=10, hidden=CUDA_H), layer_weights(torch.bfloat16, hidden=CUDA_H, inter=CUDA_I)
    weights, ids = cuda.moe_route(cuda.linear(x, w["router"], out_dtype=torch.float32), Routing(E, 3))
    slots = kernels.sort_slots(ids, E, 16, slot_tiles=True)
    assert slots.positions == 30 * 16 and torch.equal(slots.position.flatten(), torch.arange(30) * 16)
    assert torch.equal(slots.tile_expert, ids.flatten()) and (slots.token >= 0).sum() == 30
    assert torch.equal(slots.token[slots.position].long(), torch.arange(10).unsqueeze(-1).expand(10, 3))
    shared = tokens(torch.bfloat16, seed=5, count=10, hidden=CUDA_H)
    run = lambda tiles, xs=x, ws=w, s=spec: kernels.experts(xs, ws["w13"], ws["w2"], weights, ids, shared.to(xs.dtype),
                                                            s, slot_tiles=tiles)
    assert torch.equal(run(True), run(False))
    # the default: slot tiles up to SLOT_TILES_MAX_PER_EXPERT slots per expert (2 of 8 here), sorted above
    assert kernels.sort_slots(ids[:1, :2], E, 16).positions == 2 * 16
    assert kernels.sort_slots(ids, E, 16).positions == -(-(30 + E * 15) // 16) * 16
    assert torch.equal(run(None), run(False))
    x32, w32 = x.float(), {name: t.float() for name, t in w.items()}
    assert torch.equal(run(True, x32, w32), run(False, x32, w32))
    half = dataclasses.replace(spec, k_chunk=spec.k_chunk // 2)
    assert not torch.equal(run(True, x32, w32, half), run(True, x32, w32))


def test_cuda_gather_rows_puts_each_token_row_at_its_sorted_positions(cuda):
    """``gather_rows`` (the gate/up GEMM's sorted copy of its input) holds at every sorted position of a
    slot exactly its token's row, across its 16-row programs and a K that is not a whole column block;
    with ``gather`` the gated GEMM runs from that copy (the candidate test checks its bits)."""
    from hal.kernels import moe as kernels

    x = tokens(torch.bfloat16, count=11, hidden=700)
    ids = torch.randint(0, E, (11, 3), generator=torch.Generator().manual_seed(3)).to(torch.int32)
    slots = kernels.sort_slots(ids, E, 16)
    copied = kernels.gather_rows(x, slots)
    assert copied.shape == (slots.positions, 700)
    token = slots.token.long()
    assert torch.equal(copied[token >= 0], x[token[token >= 0]])
    assert torch.equal(copied[slots.position.flatten()], x.repeat_interleave(3, dim=0))
    assert any(c.get("gather") for c in kernels.candidates(64, True))


def _grouped_outputs(cuda, x, w, ids, gate, down, spec=None):
    """(act, down rows) of the two grouped GEMMs at these launches, per (token, rank) slot."""
    from hal.kernels import moe as kernels

    spec = spec or cuda.contract.gemm
    slots = kernels.sort_slots(ids, E, gate["BLOCK_M"])
    act = kernels.gate_up(x, w["w13"], slots, spec, gate)
    rows = kernels.grouped_linear(act, w["w2"], slots.token, slots, torch.float32, spec, down, x_sorted=True)
    return act[slots.position], rows[slots.position]


def test_every_moe_tuner_candidate_gives_the_same_bits(cuda):
    """The MoE tuner's whole candidate set (``moe.candidates`` at every tile-row count of ``moe.TILE_ROWS``,
    gated gate/up and down; the tile shapes, and the gate/up GEMM with its rows gathered into sorted order
    first and as one MMA over gate and up rows (``wide``); warps, stages and descriptor loads do nothing
    under the interpreter, bench/moe_gpu.py --sweep checks the same list on the GPU) gives every slot the
    bits of the kernel's own launch, with the hidden size across the 512 K chunk. Negative control: the same launch
    under a contract with half the K chunk gives other gate/up bits, so the comparison sees a reduction
    change."""
    import dataclasses

    from hal.kernels import moe as kernels

    x, w = tokens(torch.bfloat16, count=7, hidden=CUDA_H), layer_weights(torch.bfloat16, hidden=CUDA_H, inter=CUDA_I)
    _, ids = cuda.moe_route(cuda.linear(x, w["router"], out_dtype=torch.float32), Routing(E, 2))
    own = _grouped_outputs(cuda, x, w, ids, *kernels.grouped_configs(ids.numel(), E))
    tried = 0
    for bm in kernels.TILE_ROWS:
        shapes = lambda gated: {(c["BLOCK_N"], c["BLOCK_K"], c.get("gather"), c.get("wide")): c
                                for c in kernels.candidates(bm, gated)}.values()
        down = kernels.candidates(bm, False)[0]
        for gate in shapes(True):
            assert torch.equal(_grouped_outputs(cuda, x, w, ids, gate, down)[0], own[0]), gate
            tried += 1
        gate = kernels.candidates(bm, True)[0]
        for down in shapes(False):
            assert torch.equal(_grouped_outputs(cuda, x, w, ids, gate, down)[1], own[1]), down
            tried += 1
    assert tried >= 20
    # in fp32 (no bf16 rounding of the gate/up results to hide it) the gate/up GEMM's chunk sums change
    x32, w32 = x.float(), {name: t.float() for name, t in w.items()}
    half = dataclasses.replace(cuda.contract.gemm, k_chunk=cuda.contract.gemm.k_chunk // 2)
    configs = kernels.grouped_configs(ids.numel(), E)
    assert not torch.equal(_grouped_outputs(cuda, x32, w32, ids, *configs, spec=half)[0],
                           _grouped_outputs(cuda, x32, w32, ids, *configs)[0])


def test_moe_tuner_keeps_the_fastest_pair_and_the_backend_takes_the_policys_launch(cuda, monkeypatch):
    """``tune_moe`` (stand-in timer, each timing faster than the one before) keeps the last tile-row count's
    last gate/up and down launches under the layer's MoE shape class; ``moe.experts`` with a policy that
    returns them launches those tiles and gives the kernel's own bits; a launch that changes a bit stops the
    tuning with an error naming it."""
    from hal.errors import HalError
    from hal.kernels import moe as kernels
    from hal.kernels import tuning
    from hal.kernels.policy import LaunchPolicy

    small = {True: [dict(BLOCK_N=32, BLOCK_K=64), dict(BLOCK_N=64, BLOCK_K=128)],
             False: [dict(BLOCK_N=64, BLOCK_K=64), dict(BLOCK_N=128, BLOCK_K=128)]}
    monkeypatch.setattr(kernels, "TILE_ROWS", (16, 32))
    monkeypatch.setattr(kernels, "candidates", lambda bm, gated: [dict(c, BLOCK_M=bm, num_warps=4, num_stages=1)
                                                                for c in small[gated]])
    spec = cuda.contract.gemm
    timings = iter(range(1000, 0, -1))
    cache = tuning.TuneCache("cpu (interpreter)", "x")
    layer = (5, E, 2, CUDA_H, CUDA_I)
    tuning.tune_moe([layer], spec, device="cpu", cache=cache, timer=lambda fn: (fn(), next(timings))[1], progress=None)
    key = tuning.moe_shape_class(10, E, CUDA_H, CUDA_I, torch.bfloat16, spec.k_chunk)
    chosen = cache.config(key)
    assert chosen == {"gate_up": kernels.candidates(32, True)[-1], "down": kernels.candidates(32, False)[-1]}
    assert cache.entries[key]["candidates"] == 8

    class Tuned(LaunchPolicy):
        def moe_tiles(self, slots, num_experts, hidden, inter, spec, dtype):
            return chosen["gate_up"], chosen["down"]
    seen = []
    real_launch = kernels.launch
    monkeypatch.setattr(kernels, "launch",
                        lambda kernel, grid, *a, **kw: (seen.append(kw), real_launch(kernel, grid, *a, **kw))[1])
    x, w = tokens(torch.bfloat16, count=5, hidden=CUDA_H), layer_weights(torch.bfloat16, hidden=CUDA_H, inter=CUDA_I)
    weights, ids = cuda.moe_route(cuda.linear(x, w["router"], out_dtype=torch.float32), Routing(E, 2))
    own = kernels.experts(x, w["w13"], w["w2"], weights, ids, None, spec, policy=LaunchPolicy())
    seen.clear()
    tuned = kernels.experts(x, w["w13"], w["w2"], weights, ids, None, spec, policy=Tuned())
    assert torch.equal(tuned, own)
    gemms = [(kw["BLOCK_M"], kw["BLOCK_N"], kw["GATED"]) for kw in seen if "GATED" in kw]
    assert gemms == [(32, 64, True), (32, 128, False)]

    real_grouped = kernels.grouped_linear

    def planted(x, weight, rows, slots, out_dtype, spec, cfg, **kw):
        out = real_grouped(x, weight, rows, slots, out_dtype, spec, cfg, **kw)
        if cfg["BLOCK_N"] == 128:                 # one down launch flips a bit of every row
            out.view(torch.int32)[:, 0] ^= 1
        return out
    monkeypatch.setattr(kernels, "grouped_linear", planted)
    with pytest.raises(HalError, match="other bits than the kernel's own"):
        tuning.tune_moe([layer], spec, device="cpu", cache=cache, timer=lambda fn: (fn(), 1.0)[1], progress=None)


def test_hal_tune_covers_an_moe_models_router_and_expert_gemms():
    """``hal tune --model`` of an MoE model: its router GEMM (fp32 logits) among the linears, and one
    ``tune_moe`` layer per batch size; a dense model has none."""
    from hal.kernels.tuning import model_gemm_shapes, model_moe_layers

    config = tiny_config("qwen3_moe", "bfloat16")
    shapes, out_dtypes = model_gemm_shapes(config, [1, 8])
    router = (config.num_experts, config.hidden_size)
    assert (8, *router) in shapes and out_dtypes[router] == torch.float32
    assert model_moe_layers(config, [1, 8]) == [(m, config.num_experts, config.num_experts_per_tok, config.hidden_size,
                                                 config.moe_intermediate_size) for m in (1, 8)]
    assert model_moe_layers(tiny_config("qwen3", "bfloat16"), [1, 8]) == []


# ---------------------------------------------------------------------------------------------
# The model: training equals rollout, gradients, checkpoints
# ---------------------------------------------------------------------------------------------

MODELS = {
    "qwen3_moe": dict(),
    # DeepSeek-style block: sigmoid scores, a correction bias, 4 groups of 2 keeping 2, scaled
    # weights, a shared expert; layer 1 keeps a dense MLP
    "deepseek_style": dict(scoring_func="sigmoid", e_score_correction_bias=True, n_group=4, topk_group=2,
                           num_experts_per_tok=3, routed_scaling_factor=2.5, n_shared_experts=1,
                           moe_dense_layers=(1,)),
}


def rollout_and_train(backend, dtype, extra, schedules=SCHEDULES, packings=PACKINGS, requests=None):
    if backend.name == "cuda":
        extra = {**extra, "head_dim": 64}    # the attention kernel's head dims: 64, 128
    model = DecoderLM.random(tiny_config("qwen3_moe", dtype, **extra), seed=11, backend=backend)
    requests = requests or make_requests(seed=9)
    runs = [RolloutHarness(model, cfg).generate(requests) for cfg in schedules]
    with torch.no_grad():
        trains = [recompute_logprobs(model, runs[0], **packing) for packing in packings]
    return runs, trains


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", MODELS)
def test_moe_model_training_logprobs_equal_rollout_logprobs_bitwise(variant, dtype):
    runs, trains = rollout_and_train(REF, dtype, MODELS[variant])
    assert sum(len(c.tokens) for c in runs[0]) >= 40
    assert_schedules_and_trainer_agree(runs, trains)


def test_moe_model_on_the_cuda_kernels_training_equals_rollout(cuda):
    # one schedule that cuts prefills into chunks and mixes phases, one training packing
    requests = [dataclasses.replace(r, max_new_tokens=6) for r in make_requests(seed=4, count=2)]
    schedule = dataclasses.replace(SCHEDULES[2], preempt_prob=0.0)
    runs, trains = rollout_and_train(cuda, "bfloat16", MODELS["deepseek_style"], [schedule], PACKINGS[1:], requests)
    assert sum(len(c.tokens) for c in runs[0]) >= 12
    for c, lp in zip(runs[0], trains[0]):
        assert torch.equal(lp, c.logprobs)


def test_moe_gradients_match_fp64_autograd():
    routing = Routing(E, 3, renormalize=True, scaling=1.5)
    x, w = tokens(torch.float32, count=6, hidden=48), layer_weights(torch.float32, experts=E, hidden=48, inter=24)
    leaves = {name: t.clone().requires_grad_(name != "bias") for name, t in {"x": x, **w}.items()}
    logits = ag.linear(REF, leaves["x"], leaves["router"], out_dtype=torch.float32)
    weights, ids = ag.moe_route(REF, logits, routing, None)
    out = ag.moe_experts(REF, leaves["x"], leaves["w13"], leaves["w2"], weights, ids, None)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(8))
    (out * probe).sum().backward()
    # the same function in fp64 with the same expert choice
    d = {name: t.detach().double().requires_grad_(name != "bias") for name, t in {"x": x, **w}.items()}
    scores = torch.softmax(d["x"] @ d["router"].T, -1).gather(-1, ids.long())
    scores = scores / scores.sum(-1, keepdim=True) * 1.5
    ref = torch.zeros(6, 48, dtype=torch.float64)
    for t in range(6):
        for r in range(3):
            e = int(ids[t, r])
            gate, up = (d["w13"][e] @ d["x"][t]).chunk(2)
            ref = ref.index_add(0, torch.tensor([t]), (scores[t, r] * (d["w2"][e] @ (torch.nn.functional.silu(gate) * up)))[None])
    (ref * probe.double()).sum().backward()
    for name in ("x", "router", "w13", "w2"):
        got, want = leaves[name].grad.double(), d[name].grad
        assert (got - want).abs().max() <= 1e-5 * want.abs().max() + 1e-12, name
    assert leaves["router"].grad.abs().sum() > 0


def test_qwen3_moe_checkpoints_round_trip_with_hf_expert_names(tmp_path):
    config = tiny_config("qwen3_moe", "bfloat16", **MODELS["deepseek_style"])
    model = DecoderLM.random(config, seed=2, backend=REF)
    save_pretrained(model, tmp_path)
    import safetensors.torch
    names = set(safetensors.torch.load_file(str(tmp_path / "model.safetensors")))
    assert {"model.layers.0.mlp.experts.7.down_proj.weight", "model.layers.0.mlp.gate.e_score_correction_bias",
            "model.layers.0.mlp.shared_experts.up_proj.weight", "model.layers.1.mlp.gate_proj.weight"} <= names
    loaded = load_pretrained(tmp_path, backend=REF)
    assert loaded.config == config
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name


def test_qwen3_moe_config_reads_hf_keys_and_refuses_what_it_cannot_honour():
    hf = tiny_config("qwen3_moe", "bfloat16").to_hf()
    hf.update(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3])
    config = ModelConfig.from_hf(hf)
    assert [config.moe_layer(i) for i in range(4)] == [False, True, False, False]
    assert config.routing == Routing(8, 2, renormalize=True)
    with pytest.raises(UnsupportedError, match="top_k must be in"):
        ModelConfig.from_hf({**hf, "num_experts_per_tok": 9})
    with pytest.raises(UnsupportedError, match="shared_expert_intermediate_size"):
        ModelConfig.from_hf({**hf, "shared_expert_intermediate_size": 64})
    with pytest.raises(UnsupportedError, match="topk_method"):
        ModelConfig.from_hf({**hf, "topk_method": "group_limited_greedy"})
    with pytest.raises(UnsupportedError, match="needs architecture 'qwen3_moe'"):
        tiny_config("qwen3", num_experts=4)


class SwappedGateUpBackend(ReferenceBackend):
    """Planted bug for the kit's level 5: the expert GEMM reads [up | gate] as [gate | up]."""

    name = "swapped-gate-up"

    def moe_experts(self, x, w13, w2, topk_weights, topk_ids, shared=None):
        half = w13.shape[1] // 2
        return super().moe_experts(x, torch.cat([w13[:, half:], w13[:, :half]], 1), w2, topk_weights, topk_ids, shared)


class OffByOneRouterBackend(ReferenceBackend):
    """Planted bug for the kit's level 5: the last chosen expert is the next one."""

    name = "off-by-one-router"

    def moe_route(self, router_logits, routing, correction_bias=None):
        weights, ids = super().moe_route(router_logits, routing, correction_bias)
        ids = ids.clone()
        ids[:, -1] = (ids[:, -1] + 1) % routing.num_experts
        return weights, ids


@pytest.mark.parametrize("backend_name", ["reference", "cuda"])
def test_the_kits_moe_accuracy_level_passes_and_catches_planted_bugs(request, backend_name):
    """Level 5 for the MoE ops (``hal.conformance.bounds``): routing equals the fp64 oracle's choice on
    rows without near-ties (softmax top-4; group-limited sigmoid top-3 with a correction bias) and its
    weights are within 64 fp32 ulps; a whole layer of 8 experts is within the bound propagated through
    [moe]'s rounding points, across the 512 K chunk (hidden 600), in bf16 and fp32. Negative controls:
    swapped gate/up halves, and an off-by-one expert choice, each fail."""
    from hal.conformance.runner import CHECKS

    backend = REF if backend_name == "reference" else request.getfixturevalue("cuda")
    cases = [(17, 600), (3, 17)] if backend_name == "reference" else [(5, 600)]
    for op in ("moe_route", "moe_experts"):
        for size, width in cases:
            for dtype in ("bfloat16", "float32"):
                assert CHECKS["accuracy"](backend, op=op, size=size, width=width, dtype=dtype, seed=5) == [], \
                    (op, size, width, dtype)
    assert CHECKS["accuracy"](SwappedGateUpBackend(MOE), op="moe_experts", size=17, width=64, dtype="bfloat16", seed=5)
    assert CHECKS["accuracy"](OffByOneRouterBackend(MOE), op="moe_route", size=17, width=64, dtype="bfloat16", seed=5)


class BatchDependentExpertsBackend(ReferenceBackend):
    """Planted bug for the kit's level 4: a token's expert output moves with its batch-mates (a batch of
    one is exact, a larger batch adds a share of the batch mean), as an unsorted, batch-order combine would."""

    name = "batch-dependent-experts"

    def moe_experts(self, x, w13, w2, topk_weights, topk_ids, shared=None):
        out = super().moe_experts(x, w13, w2, topk_weights, topk_ids, shared)
        return out if x.shape[0] == 1 else (out.float() + 0.05 * x.float().mean(0)).to(out.dtype)


@pytest.mark.parametrize("backend_name", ["reference", "cuda"])
def test_the_kits_moe_train_equals_infer_level_passes_and_catches_planted_bugs(request, backend_name, monkeypatch):
    """Level 4 for the MoE ops (``hal.conformance.training``): the autograd-wrapped moe_route / moe_experts
    return the bits of the backend's own kernels run token by token on copies, and their gradients
    (router logits; x, both expert weights, the routing weights, the shared output) are within the bf16 / fp32
    bound of fp64 autograd; across the 512 K chunk (hidden 600). Negative controls: a batch-dependent expert
    output fails the bits, and a wrong derivative in the training graph fails the gradient."""
    from hal.conformance.runner import CHECKS

    backend = REF if backend_name == "reference" else request.getfixturevalue("cuda")
    cases = [(17, 600), (3, 17), (1, 1)] if backend_name == "reference" else [(3, 576)]
    for op in ("moe_route", "moe_experts"):
        for size, width in cases:
            for dtype in ("bfloat16", "float32"):
                assert CHECKS["train_equals_infer"](backend, op=op, size=size, width=width, dtype=dtype, seed=7) == [], \
                    (op, size, width, dtype)
    bits = CHECKS["train_equals_infer"](BatchDependentExpertsBackend(MOE), op="moe_experts", size=17, width=64,
                                        dtype="bfloat16", seed=7)
    assert any("differs from the inference kernel's bits" in p for p in bits), bits
    # a training graph whose SiLU has the wrong derivative: the forward bits still match, the gradient does not
    monkeypatch.setattr(ag.F, "silu", lambda t: t * torch.sigmoid(2 * t))
    grads = CHECKS["train_equals_infer"](REF, op="moe_experts", size=17, width=64, dtype="float32", seed=7)
    assert grads and all("gradient" in p for p in grads), grads


class FixedChunkExpertsBackend(ReferenceBackend):
    """Planted bug for the kit's level 6: the expert GEMMs always use bf16-moe-v1's K chunk, whatever
    contract the backend is bound to."""

    name = "fixed-chunk-experts"

    def moe_experts(self, x, w13, w2, topk_weights, topk_ids, shared=None):
        return ReferenceBackend(MOE, self.device).moe_experts(x, w13, w2, topk_weights, topk_ids, shared)


def test_the_kits_moe_binding_level_passes_and_catches_a_fixed_chunk():
    """Level 6 for moe_experts: bound to a variant contract with half the K chunk, the reference backend's
    expert GEMMs give other bits (it reads [gemm].k_chunk); an expert GEMM with a fixed chunk fails the check."""
    from hal.conformance.test_level6_binding import _moe_experts, _refused_or_followed

    _refused_or_followed(REF, "gemm.k_chunk", _moe_experts)
    with pytest.raises(pytest.fail.Exception, match="ignores its contract's gemm.k_chunk"):
        _refused_or_followed(FixedChunkExpertsBackend(MOE), "gemm.k_chunk", _moe_experts)
