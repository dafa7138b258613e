"""Block-FP8 mixture-of-experts under bf16-moe-fp8-v1 (``hal.moe.fp8_experts``, ``Fp8Experts``).

Properties:
* the contract: bf16-moe-fp8-v1 is bf16-moe-v1 plus bf16-fp8-v1's [fp8], every shared section equal;
* a token's FP8 MoE output does not depend on its batch-mates (a slice, a reversal, one token alone),
  on reference and on the cuda backend (its FP8 kernels under Triton's interpreter, which also give the
  reference's bits there). Negative control (no BLAS involved: the exact block GEMM of the reference):
  vLLM's per-tensor dynamic activation scale makes a token's bits follow a louder token that shares its
  experts;
* train == rollout bitwise for tiny block-FP8 Qwen3-MoE and DeepSeek-style models (shared experts, a
  dense layer, grouped sigmoid routing) across rollout schedules and training packings;
* training: the experts' gradient is the straight-through one (the bf16 experts' graph on the master
  weights) against an fp64 oracle; after an optimiser step the requantised expert stacks are what a
  weight sync hands the rollout model, and a stale forward is refused;
* checkpoints: a DeepSeek-style checkpoint's per-expert fp8 weights and scales are used as stored and
  written back bit for bit (negative control: requantising the master weights gives other bits);
* clear errors: a contract without [moe] or [fp8], misshapen scales, the ascend backend.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import assert_schedules_and_trainer_agree, backend_for_tests
from test_fp8_model import (assert_the_sync_reaches_a_rollout_model, assert_written_back_bit_for_bit, bits,
                            deepseek_checkpoint, mismatches, rollout_and_train)
from test_rollout import PACKINGS, SCHEDULES, make_requests

from hal import fp8, moe
from hal.api import create_backend
from hal.backends.reference import ReferenceBackend
from hal import contract as contract_module
from hal.contract import load_contract
from hal.errors import UnsupportedError
from hal.model import DecoderLM, load_pretrained, tiny_fp8_config
from hal.model import autograd as ag
from hal.model.fp8 import StaleFp8WeightsError, fp8_weights, quantise_master_weights
from hal.moe import Routing
from hal.rollout import RolloutHarness, recompute_logprobs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MOE_FP8 = load_contract("bf16-moe-fp8-v1")
SPEC = MOE_FP8.fp8
REF = ReferenceBackend(MOE_FP8)
# Both expert GEMMs reduce two FP8 K blocks (H = I = 256 > the 128 block) and w13's 2I = 512 rows span
# four weight blocks; under the interpreter the gate/up GEMM crosses a K block (H = 256), the down one not.
T, H, I, E = 12, 256, 256, 8
CUDA_H, CUDA_I = 256, 128
QWEN3 = Routing(E, 2, renormalize=True)
DEEPSEEK = Routing(E, 3, scoring="sigmoid", renormalize=True, num_groups=4, topk_groups=2, scaling=2.5)


def fp8_layer(dtype, seed=0, hidden=H, inter=I):
    """A router (model dtype) and block-FP8 expert stacks quantised by the contract's weight rule."""
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * inter, hidden, generator=g) * hidden ** -0.5
    w2 = torch.randn(E, hidden, inter, generator=g) * inter ** -0.5
    w13q, w13s = fp8.quantise_weight_blocks(w13, SPEC)
    w2q, w2s = fp8.quantise_weight_blocks(w2, SPEC)
    return dict(router=(torch.randn(E, hidden, generator=g) * hidden ** -0.5).to(dtype),
                bias=torch.randn(E, generator=g) * 0.05,
                w13=w13q, w13_scale_inv=w13s, w2=w2q, w2_scale_inv=w2s)


def fp8_moe_layer(backend, x, w, routing, use_bias=False):
    logits = backend.linear(x, w["router"], out_dtype=torch.float32)
    weights, ids = backend.moe_route(logits, routing, w["bias"] if use_bias else None)
    out = backend.fp8_moe_experts(x, w["w13"], w["w13_scale_inv"], w["w2"], w["w2_scale_inv"], weights, ids)
    return out, (weights, ids)


def tokens(dtype, seed=1, count=T, hidden=H):
    return torch.randn(count, hidden, generator=torch.Generator().manual_seed(seed)).to(dtype)


def batch_variants(x):
    order = torch.arange(x.shape[0]).flip(0)
    return [(slice(3, 7), x[3:7]), (order, x[order]), (slice(5, 6), x[5:6])]


class PerTensorActivationBackend(ReferenceBackend):
    """Negative control: vLLM's per-tensor dynamic activation scale (one scale from the amax of all the
    rows an FP8 linear gets: here all of one expert's tokens), then the reference's exact block GEMM."""

    name = "per-tensor-fp8"

    def fp8_linear(self, x, weight, weight_scale_inv, bias=None, *, out_dtype=None):
        scale = fp8.scale_of(x.float().abs().amax().reshape(1), SPEC, "e4m3")
        xq = fp8.quantise(x.float(), scale, SPEC, "e4m3")
        x_scale = scale.expand(x.shape[0], x.shape[1] // SPEC.activation_group)
        return fp8.block_gemm(xq, x_scale, weight, weight_scale_inv, bias, out_dtype or x.dtype, SPEC)


# -- the contract -----------------------------------------------------------------------------------

def test_the_moe_fp8_contract_is_the_moe_contract_plus_the_fp8_section():
    moe_contract, fp8_contract = load_contract("bf16-moe-v1"), load_contract("bf16-fp8-v1")
    for section in contract_module.SECTIONS:
        if section not in ("contract", "fp8"):
            assert getattr(MOE_FP8, section) == getattr(moe_contract, section), section
    assert MOE_FP8.fp8 == fp8_contract.fp8
    assert MOE_FP8.header.activation_dtypes == moe_contract.header.activation_dtypes
    assert len({MOE_FP8.fingerprint, moe_contract.fingerprint, fp8_contract.fingerprint}) == 3


# -- batch invariance -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cuda():
    backend_for_tests("cuda")          # the interpreter runs the kernels (conftest)
    return create_backend("cuda", MOE_FP8)


@pytest.mark.parametrize("routing, use_bias, dtype", [(QWEN3, False, torch.bfloat16), (DEEPSEEK, True, torch.float32)])
def test_a_tokens_fp8_moe_output_does_not_depend_on_its_batch_mates(routing, use_bias, dtype):
    x, w = tokens(dtype), fp8_layer(dtype)
    full, (weights, ids) = fp8_moe_layer(REF, x, w, routing, use_bias)
    assert len(ids.unique()) >= 6 and ids.shape[1] == routing.top_k
    for rows, batch in batch_variants(x):
        out, (sub_w, sub_ids) = fp8_moe_layer(REF, batch, w, routing, use_bias)
        assert torch.equal(sub_ids, ids[rows]) and torch.equal(sub_w, weights[rows])
        assert torch.equal(out, full[rows])
    # and each slot's MLP is the contract's FP8 linears of that token's row alone, combined by [moe]
    t, k = ids.shape
    slots = torch.zeros(t, k, H)
    for token in range(t):
        for rank in range(k):
            e = int(ids[token, rank])
            act = REF.silu_mul(REF.fp8_linear(x[token:token + 1], w["w13"][e], w["w13_scale_inv"][e]))
            slots[token, rank] = REF.fp8_linear(act, w["w2"][e], w["w2_scale_inv"][e], out_dtype=torch.float32)[0]
    assert torch.equal(moe.combine(slots, weights, None, dtype), full)


def test_negative_control_a_per_tensor_activation_scale_makes_a_token_follow_its_expert_mates():
    """A louder copy of token 0 (the same routing: the logits only scale) joins the batch; with one
    activation scale per expert call, token 0's bits change; with the contract's groups they do not."""
    x, w = tokens(torch.float32), fp8_layer(torch.float32)
    loud = torch.cat([x, 40 * x[:1]])
    for backend, same in ((REF, True), (PerTensorActivationBackend(MOE_FP8), False)):
        alone, (_, ids) = fp8_moe_layer(backend, x, w, QWEN3)
        batched, (_, loud_ids) = fp8_moe_layer(backend, loud, w, QWEN3)
        assert torch.equal(loud_ids[-1], ids[0])           # it shares token 0's experts
        assert torch.equal(batched[:T], alone) == same, backend.name


def test_cuda_fp8_moe_experts_are_batch_invariant_and_give_the_reference_bits(cuda):
    """The cuda grouped FP8 expert GEMMs (hal/kernels/fp8_moe.py) under the interpreter, where the FP8 block
    partial is exact (test_cuda_fp8.py): every slot gets the reference's bits (fp8_linear / silu_mul /
    fp8_linear of its token's row alone), in the sorted layout and with slot tiles, at other tiles, and
    a token alone gets its row of the batch. Negative control: the same kernels fed per-tensor scales."""
    from hal.kernels import fp8_gemm, fp8_moe

    x, w = tokens(torch.bfloat16, hidden=CUDA_H, count=6), fp8_layer(torch.bfloat16, hidden=CUDA_H, inter=CUDA_I)
    full, (weights, ids) = fp8_moe_layer(cuda, x, w, QWEN3)
    experts = (w["w13"], w["w13_scale_inv"], w["w2"], w["w2_scale_inv"], weights, ids)
    assert len(ids.unique()) >= 5
    assert torch.equal(full, REF.fp8_moe_experts(x, *experts))    # the same routing: the router is the backend's
    for slot_tiles in (True, False):
        for config in (None, dict(BLOCK_M=32, GATE_BLOCK_N=64, DOWN_BLOCK_N=128)):
            got = fp8_moe.experts(x, *experts, None, SPEC, config, slot_tiles=slot_tiles)
            assert torch.equal(got, full), (slot_tiles, config)
    alone, _ = fp8_moe_layer(cuda, x[4:5], w, QWEN3)
    assert torch.equal(alone, full[4:5])
    # with a shared-expert input, fp32 activations
    shared = tokens(torch.float32, seed=7, count=6, hidden=CUDA_H)
    assert torch.equal(cuda.fp8_moe_experts(x.float(), *experts, shared), REF.fp8_moe_experts(x.float(), *experts, shared))

    # negative control: one activation scale for the whole batch (per-tensor) through the same grouped GEMM
    loud = torch.cat([x, 40 * x[:1]])
    loud_w, loud_ids = cuda.moe_route(cuda.linear(loud, w["router"], out_dtype=torch.float32), QWEN3)

    def per_tensor(batch, ws, slot_ids):
        scale = fp8.scale_of(batch.float().abs().amax().reshape(1), SPEC, "e4m3")
        xq = fp8.quantise(batch.float(), scale, SPEC, "e4m3")
        xs = scale.expand(batch.shape[0], batch.shape[1] // 128).contiguous()
        slots = fp8_moe.moe.sort_slots(slot_ids, E, 16)
        act = fp8_moe.grouped_linear(xq, xs, w["w13"], w["w13_scale_inv"], slots.token, slots, batch.dtype, SPEC,
                                     32, 4, 1, gated=True)
        aq, as_ = fp8_gemm.quantise_activations(act, SPEC)
        down = fp8_moe.grouped_linear(aq, as_, w["w2"], w["w2_scale_inv"], slots.token, slots, torch.float32, SPEC,
                                      64, 4, 1, x_sorted=True)
        return fp8_moe.moe.combine(down, slots.position, ws, None, batch.dtype)

    assert not torch.equal(per_tensor(loud, loud_w, loud_ids)[:6], per_tensor(x, weights, ids))


# -- errors -----------------------------------------------------------------------------------------

def test_fp8_moe_inputs_and_contracts_are_checked_with_the_reason():
    x, w = tokens(torch.bfloat16), fp8_layer(torch.bfloat16)
    weights, ids = REF.moe_route(REF.linear(x, w["router"], out_dtype=torch.float32), QWEN3)
    args = (w["w13"], w["w13_scale_inv"], w["w2"], w["w2_scale_inv"], weights, ids)
    for name in ("bf16-moe-v1", "bf16-fp8-v1"):
        with pytest.raises(UnsupportedError, match=r"\[fp8\]|\[moe\]|fp8|moe"):
            ReferenceBackend(load_contract(name)).fp8_moe_experts(x, *args)
    with pytest.raises(UnsupportedError, match=r"w13_scale_inv must be \(E = 8, rows/B, K/B\)"):
        REF.fp8_moe_experts(x, w["w13"], w["w13_scale_inv"][0], *args[2:])
    with pytest.raises(UnsupportedError, match="shapes do not fit"):
        REF.fp8_moe_experts(x[:, :128], *args)
    with pytest.raises(UnsupportedError, match=r"topk_ids"):
        REF.fp8_moe_experts(x, *args[:4], weights[:3], ids)
    from hal.backends.ascend import AscendBackend

    assert MOE_FP8.name not in AscendBackend.contracts        # binding the contract is refused first
    with pytest.raises(UnsupportedError, match=r"ascend' does not realise FP8"):
        AscendBackend.fp8_moe_experts.__wrapped__(AscendBackend, x, *args)


# -- models: train == rollout -----------------------------------------------------------------------

DEEPSEEK_STYLE = dict(scoring_func="sigmoid", e_score_correction_bias=True, n_group=4, topk_group=2,
                      num_experts_per_tok=3, routed_scaling_factor=2.5, n_shared_experts=1, moe_dense_layers=(1,))


@pytest.mark.parametrize("extra, dtype", [({}, "bfloat16"), (DEEPSEEK_STYLE, "float32")], ids=["qwen3", "deepseek"])
def test_fp8_moe_model_training_logprobs_equal_rollout_logprobs_bitwise(extra, dtype):
    model = DecoderLM.random(tiny_fp8_config("qwen3_moe", dtype, **extra), seed=11, backend=REF)
    names = [w.name for w in fp8_weights(model)]
    assert "model.layers.0.mlp.experts.w13_weight" in names and "model.layers.0.mlp.experts.w2_weight" in names
    assert model.model.layers[0].mlp.gate.weight.dtype == model.dtype          # the router stays unquantised
    runs, stats, trains = rollout_and_train(model, make_requests(seed=9), SCHEDULES[:2], PACKINGS[:2])
    assert sum(len(c.tokens) for c in runs[0]) >= 40 and all(s.mixed_steps > 0 for s in stats)
    assert_schedules_and_trainer_agree(runs, trains)
    assert mismatches(runs, trains) == 0


def test_negative_control_per_tensor_fp8_experts_break_train_equals_rollout():
    model = DecoderLM.random(tiny_fp8_config("qwen3_moe", "bfloat16"), seed=11,
                             backend=PerTensorActivationBackend(MOE_FP8))
    runs, _, trains = rollout_and_train(model, make_requests(seed=9), SCHEDULES[:2], PACKINGS[:2])
    assert mismatches(runs, trains) > 10


# -- training ---------------------------------------------------------------------------------------

def test_fp8_experts_gradient_is_the_straight_through_bf16_experts_graph():
    model = DecoderLM.random(tiny_fp8_config("qwen3_moe", "float32"), seed=3, backend=REF)
    experts = model.model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 128, generator=g, requires_grad=True)
    weights, ids = REF.moe_route(torch.randn(6, E, generator=g), QWEN3)
    out = ag.fp8_moe_experts(REF, x, experts, weights, ids, None)
    with torch.no_grad():                            # forward: the kernel's bits, from the fp8 buffers
        assert torch.equal(out, REF.fp8_moe_experts(x, experts.w13_weight_fp8, experts.w13_weight_scale_inv,
                                                    experts.w2_weight_fp8, experts.w2_weight_scale_inv, weights, ids))
    probe = torch.randn(out.shape, generator=g)
    (out * probe).sum().backward()
    d = {"x": x.detach().double().requires_grad_(), "w13": experts.w13_weight.detach().double().requires_grad_(),
         "w2": experts.w2_weight.detach().double().requires_grad_()}
    ref = torch.zeros(6, 128, dtype=torch.float64)
    for t in range(6):
        for r in range(2):
            e = int(ids[t, r])
            gate, up = (d["w13"][e] @ d["x"][t]).chunk(2)
            y = float(weights[t, r]) * (d["w2"][e] @ (torch.nn.functional.silu(gate) * up))
            ref = ref.index_add(0, torch.tensor([t]), y[None])
    (ref * probe.double()).sum().backward()
    for got, want in ((x.grad, d["x"].grad), (experts.w13_weight.grad, d["w13"].grad),
                      (experts.w2_weight.grad, d["w2"].grad)):
        assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    assert experts.w13_weight.grad.abs().sum() > 0 and not experts.w13_weight_fp8.requires_grad


def test_after_an_optimizer_step_the_fp8_experts_are_the_synced_ones():
    config = tiny_fp8_config("qwen3_moe", "float32", **DEEPSEEK_STYLE)
    trainer = DecoderLM.random(config, seed=11, backend=REF)
    requests = [dataclasses.replace(r, max_new_tokens=6) for r in make_requests(seed=5, count=3)]
    completions = RolloutHarness(trainer, SCHEDULES[1]).generate(requests)
    before = {w.name: bits(w.fp8).clone() for w in fp8_weights(trainer)}
    optimizer = torch.optim.SGD(trainer.parameters(), lr=0.5)
    (-torch.cat(recompute_logprobs(trainer, completions)).mean()).backward()
    experts = trainer.model.layers[0].mlp.experts
    assert experts.w13_weight.grad.abs().sum() > 0 and experts.w2_weight.grad.abs().sum() > 0
    optimizer.step()
    with pytest.raises(StaleFp8WeightsError, match=r"experts\.w13_weight.*refresh_fp8_weights"), torch.no_grad():
        trainer.forward_train(torch.tensor([1, 2, 3]), [3])
    trainer.refresh_fp8_weights()
    names = assert_the_sync_reaches_a_rollout_model(trainer, before, requests)
    assert names["model.layers.0.mlp.experts.7.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert names["model.layers.0.mlp.experts.7.up_proj.weight_scale_inv"].shape == (1, 1)
    assert names["model.layers.0.mlp.shared_experts.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert names["model.layers.0.mlp.gate.weight"].dtype == torch.float32


# -- checkpoints ------------------------------------------------------------------------------------

def test_deepseek_style_fp8_moe_checkpoint_is_used_as_stored_and_round_trips(tmp_path):
    config = tiny_fp8_config("qwen3_moe", "bfloat16", **DEEPSEEK_STYLE)
    stored = deepseek_checkpoint(tmp_path / "ds", config)
    assert stored["model.layers.0.mlp.experts.5.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert stored["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16
    model = load_pretrained(tmp_path / "ds", backend=REF)
    assert model.config == config
    experts = model.model.layers[0].mlp.experts
    i = config.moe_intermediate_size
    assert torch.equal(bits(experts.w13_weight_fp8[5, i:]), bits(stored["model.layers.0.mlp.experts.5.up_proj.weight"]))
    assert torch.equal(experts.w2_weight_scale_inv[5], stored["model.layers.0.mlp.experts.5.down_proj.weight_scale_inv"])
    assert_written_back_bit_for_bit(model, stored, tmp_path / "again")
    # negative control: requantising the master weights (what "as stored" avoids) gives other bits
    requantised = quantise_master_weights(model)["model.layers.0.mlp.experts.w2_weight"]
    assert not torch.equal(requantised[1], experts.w2_weight_scale_inv)


# -- the conformance kit ----------------------------------------------------------------------------

def test_the_kits_fp8_moe_layer_passes_reference_and_catches_per_tensor_scaling():
    """The kit's ``fp8 moe layer`` row op (levels 1-2 under a contract with [moe] and [fp8]): it passes on
    reference and batch invariance fails with one activation scale per expert call; under a contract
    without both sections it is not defined (the kit reports the op as not in the contract)."""
    from hal.conformance.runner import CHECKS

    params = dict(width=200, out_features=33, dtype="bfloat16", seed=3, batches="1,2,7,17,33")
    assert CHECKS["determinism"](REF, row_op="fp8 moe layer", **{k: v for k, v in params.items() if k != "batches"}) == []
    assert CHECKS["batch_invariance"](REF, row_op="fp8 moe layer", **params) == []
    assert CHECKS["batch_invariance"](PerTensorActivationBackend(MOE_FP8), row_op="fp8 moe layer", **params)
    for name in ("bf16-moe-v1", "bf16-fp8-v1"):
        with pytest.raises(ValueError, match="not defined"):
            CHECKS["batch_invariance"](ReferenceBackend(load_contract(name)), row_op="fp8 moe layer", **params)
