"""A block-FP8 decoder model (hal.model.fp8) under the contract's [fp8], on the reference backend.

Properties:
* train == rollout: the trainer's forward logprobs equal the harness rollout's, bitwise, for every
  sampled token, under schedules that cut prefills, mix phases and preempt, and packings of several
  sizes. Negative control: the same model with a per-tensor dynamic activation scale (vLLM's default
  FP8 activation scheme, one scale from the amax of the whole batch) breaks it.
* checkpoints: a DeepSeek-style checkpoint's fp8 weights and scales are what the forward uses, bit for
  bit (scales our own rule would not compute included), and save_pretrained writes them back unchanged.
  Negative control: requantising the loaded master weights gives other bits.
* training: gradients reach the master weights (straight through the quantisers, equal to an fp64
  oracle of the unquantised linear); after an optimiser step the trainer's requantised weights equal
  those a weight sync hands the rollout model, and train == rollout holds after the step. Negative
  controls: a forward with stale FP8 weights is refused; the pre-step weights differ from the synced ones.
* clear errors: a contract without [fp8], another block size, a missing or misshapen scale, a bf16
  weight where an FP8 one is expected, shapes that are not whole blocks, FP8 MoE.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import assert_schedules_and_trainer_agree
from test_rollout import PACKINGS, SCHEDULES, make_requests

from hal import fp8
from hal.backends.reference import ReferenceBackend
from hal.contract import load_contract
from hal.errors import CheckpointError, UnsupportedError
from hal.model import DecoderLM, ModelConfig, load_pretrained, save_pretrained, tiny_config, tiny_fp8_config
from hal.model import autograd as ag
from hal.model.fp8 import (StaleFp8WeightsError, fp8_weights, load_weight_sync,
                           quantise_master_weights, weight_sync_tensors)
from hal.rollout import RolloutHarness, recompute_logprobs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FP8 = load_contract("bf16-fp8-v1")
SPEC = FP8.fp8
REF = ReferenceBackend(FP8)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor (fp8 values compared bit for bit, -0 and NaN included)."""
    return t.detach().contiguous().view(torch.uint8)


class PerTensorActivationBackend(ReferenceBackend):
    """Negative control: vLLM's per-tensor dynamic activation scale (one fp32 scale from the amax of the
    whole batch, every group quantised with it), then the same exact block GEMM as the reference. Only
    the activation scale differs from the contract."""

    name = "per-tensor-fp8"

    def fp8_linear(self, x, weight, weight_scale_inv, bias=None, *, out_dtype=None):
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        scale = fp8.scale_of(x2.float().abs().amax().reshape(1), SPEC, "e4m3")
        xq = fp8.quantise(x2.float(), scale, SPEC, "e4m3")
        x_scale = scale.expand(x2.shape[0], k // SPEC.activation_group)
        out = fp8.block_gemm(xq, x_scale, weight, weight_scale_inv, bias, out_dtype or x.dtype, SPEC)
        return out.reshape(*x.shape[:-1], weight.shape[0])


def rollout_and_train(model, requests, schedules=SCHEDULES, packings=PACKINGS):
    runs, stats = [], []
    for cfg in schedules:
        harness = RolloutHarness(model, cfg)
        runs.append(harness.generate(requests))
        stats.append(harness.stats)
    with torch.no_grad():
        trains = [recompute_logprobs(model, runs[0], **packing) for packing in packings]
    return runs, stats, trains


def mismatches(runs, trains) -> int:
    """Tokens whose logprob differs between the first schedule and another schedule or a training packing."""
    count = 0
    first = runs[0]
    for run in runs[1:]:
        count += sum(int(not torch.equal(a.logprobs, b.logprobs)) if a.tokens == b.tokens else len(a.tokens)
                     for a, b in zip(first, run))
    for train in trains:
        count += sum(int((lp != c.logprobs).sum()) for c, lp in zip(first, train))
    return count


# -- train == rollout -------------------------------------------------------------------------------

@pytest.mark.parametrize("arch, dtype", [("llama", "bfloat16"), ("qwen2", "float32")])
def test_fp8_model_training_logprobs_equal_rollout_logprobs_bitwise(arch, dtype):
    model = DecoderLM.random(tiny_fp8_config(arch, dtype), seed=11, backend=REF)
    assert len(fp8_weights(model)) == 8          # qkv, o, gate_up, down in both layers; not embed/lm_head
    assert isinstance(model.lm_head.weight, torch.nn.Parameter) and model.lm_head.weight.dtype == model.dtype
    requests = make_requests(seed=3)
    schedules, packings = (SCHEDULES, PACKINGS) if arch == "llama" else (SCHEDULES[:2], PACKINGS[1:])
    runs, stats, trains = rollout_and_train(model, requests, schedules, packings)
    assert stats[0].preemptions > 0 and all(s.cut_prefills > 0 and s.mixed_steps > 0 for s in stats)
    assert sum(len(c.tokens) for c in runs[0]) >= 40
    assert_schedules_and_trainer_agree(runs, trains)
    assert mismatches(runs, trains) == 0


def test_negative_control_a_per_tensor_activation_scale_breaks_train_equals_rollout():
    """The same weights and requests, the activation scale taken over the whole batch: a token's FP8
    activations follow its batch-mates, so rollout steps and training packings give other bits."""
    model = DecoderLM.random(tiny_fp8_config("llama", "bfloat16"), seed=11, backend=PerTensorActivationBackend(FP8))
    requests = make_requests(seed=3)
    runs, _, trains = rollout_and_train(model, requests, SCHEDULES[:2], PACKINGS)
    assert mismatches(runs, trains) > 10
    # and a token alone vs in a batch with a louder mate: the hidden state itself changes
    layer = model.model.layers[0].mlp.down_proj
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(0)).bfloat16()
    loud = torch.cat([x, 50 * x[:1]])
    for backend, same in ((REF, True), (model.backend, False)):
        alone = backend.fp8_linear(x, layer.weight_fp8, layer.weight_scale_inv)
        batched = backend.fp8_linear(loud, layer.weight_fp8, layer.weight_scale_inv)[:3]
        assert torch.equal(alone, batched) == same


# -- checkpoints ------------------------------------------------------------------------------------

def deepseek_checkpoint(path, config, seed=0):
    """A DeepSeek-style block-FP8 checkpoint written by hand (not by save_pretrained): fp8 weights whose
    scales are powers of two with the block's |q| well below 448 (UE8M0-like, as DeepSeek-V3.1 ships),
    scales the contract's scale rule would not compute from the dequantised weights."""
    import safetensors.torch

    from hal.model.checkpoint import hf_slices

    bf16 = DecoderLM.random(config.replace(fp8=None), seed=seed, backend=REF)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (param, rows) in hf_slices(bf16).items():
        w = param[rows].detach()
        if name.endswith("proj.weight"):
            n, k = w.shape
            exponent = torch.randint(-12, -8, fp8.weight_scale_shape(n, k, SPEC), generator=g)
            scale_inv = torch.pow(2.0, exponent.float())
            full = scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
            out[name] = (w.float() / full).clamp(-448, 448).to(torch.float8_e4m3fn)
            out[name + "_scale_inv"] = scale_inv
        else:
            out[name] = w.contiguous()
    path.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config.to_hf()))
    return out


def test_deepseek_style_checkpoint_is_used_as_stored_and_round_trips(tmp_path):
    config = tiny_fp8_config("qwen2", "bfloat16")
    stored = deepseek_checkpoint(tmp_path / "ds", config)
    hf = json.loads((tmp_path / "ds" / "config.json").read_text())
    assert hf["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                         "activation_scheme": "dynamic"}
    model = load_pretrained(tmp_path / "ds", backend=REF)
    assert model.config == config
    # the forward's fp8 weights and scales are the stored ones, bit for bit
    qkv = model.model.layers[1].self_attn.qkv_proj
    q, kv = config.q_size, config.kv_size
    assert torch.equal(bits(qkv.weight_fp8[q:q + kv]), bits(stored["model.layers.1.self_attn.k_proj.weight"]))
    assert torch.equal(qkv.weight_scale_inv[q // 128:(q + kv) // 128],
                       stored["model.layers.1.self_attn.k_proj.weight_scale_inv"])
    # the master weight is their dequantisation
    assert torch.equal(qkv.weight, fp8.dequantise_weight_blocks(qkv.weight_fp8, qkv.weight_scale_inv, SPEC)
                       .to(torch.bfloat16))
    assert_written_back_bit_for_bit(model, stored, tmp_path / "again")
    # negative control: requantising the master weights (what "as stored" avoids) gives other bits
    requantised = quantise_master_weights(model)["model.layers.1.self_attn.qkv_proj.weight"]
    assert not torch.equal(requantised[1], qkv.weight_scale_inv)
    assert not torch.equal(bits(requantised[0]), bits(qkv.weight_fp8))


def assert_written_back_bit_for_bit(model, stored: dict, path) -> None:
    """save_pretrained writes a loaded checkpoint's format back, every tensor bit for bit, and loading that
    gives the same forward."""
    import safetensors.torch

    save_pretrained(model, path)
    written = safetensors.torch.load_file(str(path / "model.safetensors"))
    assert set(written) == set(stored)
    for name, tensor in stored.items():
        assert written[name].dtype == tensor.dtype and torch.equal(bits(written[name]), bits(tensor)), name
    again = load_pretrained(path, backend=model.backend)
    tokens = torch.tensor([5, 9, 1, 7, 3])
    with torch.no_grad():
        assert torch.equal(model.forward_train(tokens, [5]), again.forward_train(tokens, [5]))


def write_variant(tmp_path, stored, config, drop=(), replace=None, hf_changes=None):
    import safetensors.torch

    path = tmp_path / f"variant{len(list(tmp_path.iterdir()))}"
    path.mkdir()
    tensors = {k: v for k, v in stored.items() if k not in drop}
    tensors.update(replace or {})
    safetensors.torch.save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({**config.to_hf(), **(hf_changes or {})}))
    return path


def test_fp8_checkpoint_errors_name_the_tensor_and_the_fix(tmp_path):
    config = tiny_fp8_config("llama", "bfloat16")
    stored = deepseek_checkpoint(tmp_path / "ds", config)
    name = "model.layers.0.mlp.down_proj.weight"
    with pytest.raises(CheckpointError, match=r"missing FP8 tensors.*down_proj.weight_scale_inv.*needs its block scales"):
        load_pretrained(write_variant(tmp_path, stored, config, drop=[name + "_scale_inv"]), backend=REF)
    with pytest.raises(CheckpointError, match=r"down_proj.weight_scale_inv has shape \(2, 1\), expected "
                                              r"\(ceil\(N/128\), ceil\(K/128\)\) = \(1, 1\)"):
        load_pretrained(write_variant(tmp_path, stored, config, replace={name + "_scale_inv": torch.ones(2, 1)}),
                        backend=REF)
    with pytest.raises(CheckpointError, match=r"down_proj.weight is torch.bfloat16.*float8_e4m3fn"):
        load_pretrained(write_variant(tmp_path, stored, config, replace={name: torch.zeros(128, 128).bfloat16()}),
                        backend=REF)
    block64 = {"quantization_config": {**config.fp8.to_hf(), "weight_block_size": [64, 64]}}
    with pytest.raises(UnsupportedError, match=r"weight_block_size \[64, 64\] is not the contract's"):
        load_pretrained(write_variant(tmp_path, stored, config, hf_changes=block64), backend=REF)
    # an fp8 checkpoint whose config.json says nothing about FP8: refused, not cast without its scales
    plain = write_variant(tmp_path, stored, config, drop=[k for k in stored if k.endswith("_scale_inv")],
                          hf_changes={"quantization_config": None})
    with pytest.raises(CheckpointError, match=r"stored as torch.float8_e4m3fn.*quantization_config"):
        load_pretrained(plain, backend=REF)
    # per-tensor FP8 and other methods are refused by the config
    with pytest.raises(CheckpointError, match="weight_block_size"):
        ModelConfig.from_hf({**config.to_hf(), "quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(UnsupportedError, match="quant_method 'awq'"):
        ModelConfig.from_hf({**config.to_hf(), "quantization_config": {"quant_method": "awq"}})
    with pytest.raises(UnsupportedError, match="activation_scheme 'static'"):
        ModelConfig.from_hf({**config.to_hf(), "quantization_config": {**config.fp8.to_hf(),
                                                                         "activation_scheme": "static"}})


def test_fp8_models_need_the_contracts_fp8_section_and_whole_blocks():
    dense = ReferenceBackend(load_contract("bf16-dense-v1"))
    with pytest.raises(UnsupportedError, match=r"no \[fp8\] section.*bf16-fp8-v1"):
        DecoderLM.random(tiny_fp8_config("llama"), backend=dense)
    model = DecoderLM.random(tiny_fp8_config("llama"), backend=REF)
    with pytest.raises(UnsupportedError, match=r"no \[fp8\] section"), torch.no_grad(), model.using(dense):
        model.forward_train(torch.tensor([1, 2, 3]), [3])
    with pytest.raises(UnsupportedError, match=r"num_key_value_heads \* head_dim \(rows of k_proj, v_proj\) = 64"):
        tiny_config("llama", hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=128,
                    fp8=tiny_fp8_config().fp8)
    with pytest.raises(UnsupportedError, match=r"hidden_size .* = 64 is not a multiple"):
        tiny_fp8_config("llama", hidden_size=64)
    with pytest.raises(UnsupportedError, match=r"moe_intermediate_size \(K of each expert's down_proj\) = 96"):
        tiny_fp8_config("qwen3_moe", moe_intermediate_size=96)
    assert ModelConfig.from_hf(tiny_fp8_config("qwen3").to_hf()) == tiny_fp8_config("qwen3")


# -- training ---------------------------------------------------------------------------------------

def test_fp8_linear_gradient_is_the_straight_through_linears():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 256, generator=g, requires_grad=True)
    w = (torch.randn(130, 256, generator=g) / 16).requires_grad_(True)
    b = torch.randn(130, generator=g, requires_grad=True)
    wq, s = fp8.quantise_weight_blocks(w.detach(), SPEC)
    out = ag.fp8_linear(REF, x, w, wq, s, b)
    assert torch.equal(out, REF.fp8_linear(x.detach(), wq, s, b.detach()))         # forward: the kernel's bits
    probe = torch.randn(out.shape, generator=g)
    (out * probe).sum().backward()
    x64, w64 = x.detach().double(), w.detach().double()
    assert torch.allclose(x.grad.double(), probe.double() @ w64, rtol=0, atol=1e-5)
    assert torch.allclose(w.grad.double(), probe.double().T @ x64, rtol=0, atol=1e-5)
    assert torch.allclose(b.grad.double(), probe.double().sum(0), rtol=0, atol=1e-5)


def test_after_an_optimizer_step_the_trainers_fp8_weights_are_the_synced_ones():
    config = tiny_fp8_config("llama", "float32")
    trainer = DecoderLM.random(config, seed=11, backend=REF)
    requests = [dataclasses.replace(r, max_new_tokens=6) for r in make_requests(seed=5, count=3)]
    completions = RolloutHarness(trainer, SCHEDULES[1]).generate(requests)
    before = {w.name: bits(w.fp8).clone() for w in fp8_weights(trainer)}
    optimizer = torch.optim.SGD(trainer.parameters(), lr=0.5)
    logprobs = recompute_logprobs(trainer, completions)
    loss = -torch.cat(logprobs).mean()
    loss.backward()
    for w in fp8_weights(trainer):
        assert w.master.grad is not None and w.master.grad.abs().sum() > 0, w.name
        assert not w.fp8.requires_grad and not w.scale_inv.requires_grad
    optimizer.step()
    # negative control: the forward refuses the stale FP8 weights instead of using them
    with pytest.raises(StaleFp8WeightsError, match="refresh_fp8_weights"), torch.no_grad():
        trainer.forward_train(torch.tensor([1, 2, 3]), [3])
    trainer.refresh_fp8_weights()
    # the weight sync: the rollout model gets the trainer's payload (HF names, DeepSeek's format)
    names = assert_the_sync_reaches_a_rollout_model(trainer, before, requests)
    assert names["model.layers.0.self_attn.k_proj.weight"].dtype == torch.float8_e4m3fn
    assert names["model.layers.0.self_attn.k_proj.weight_scale_inv"].shape == (1, 1)


def assert_the_sync_reaches_a_rollout_model(trainer, before: dict, requests) -> dict:
    """After ``refresh_fp8_weights``: a fresh rollout model loaded with the weight sync's payload holds the
    trainer's fp8 bytes and scales for every quantised weight, which are the contract's rule on its master
    weight; every weight's fp8 bits changed since ``before`` (name -> bits; the negative control: the step
    reached them); and train == rollout with that model, holding only the synced tensors. The payload by name."""
    payload = weight_sync_tensors(trainer)
    rollout = DecoderLM(trainer.config, backend=trainer.backend)
    assert load_weight_sync(rollout, payload) == len(payload)
    changed = 0
    for t, r in zip(fp8_weights(trainer), fp8_weights(rollout)):
        assert t.name == r.name and torch.equal(bits(t.fp8), bits(r.fp8)), t.name
        assert torch.equal(t.scale_inv, r.scale_inv), t.name
        wq, s = fp8.quantise_weight_blocks(t.master.detach(), SPEC)        # = the contract's rule on the master
        assert torch.equal(bits(t.fp8), bits(wq)) and torch.equal(t.scale_inv, s), t.name
        changed += int(not torch.equal(before[t.name], bits(r.fp8)))
    assert changed == len(before)
    runs = RolloutHarness(rollout, SCHEDULES[0]).generate(requests)
    with torch.no_grad():
        train = recompute_logprobs(trainer, runs, **PACKINGS[1])
    for c, lp in zip(runs, train):
        assert torch.equal(lp, c.logprobs)
    return dict(payload)
