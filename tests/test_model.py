"""The model definition: HF checkpoint round trip, train = infer bits, gradients against fp64.

The gradient oracle is a plain fp64 PyTorch implementation written here, independently of
``hal.model``: the Hugging Face formulation (unfused residual adds, rotate_half RoPE with its own
fp64 cos/sin, softmax attention with repeated KV heads, log_softmax), one sequence at a time.
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys

import pytest
import torch

from hal.backends.reference import ReferenceBackend
from hal.backends.stock import TorchBackend
from hal.contract import load_contract
from hal.errors import HalError, UnsupportedError
from hal.kvcache import PagedKVCache
from hal.model import DecoderLM, InferenceBatch, ModelConfig, WeightsChangedError, straight_through, tiny_config
from hal.model import autograd as ag
from hal.model.autograd import PackedLayout

REF = ReferenceBackend(load_contract())


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def random_sequences(seed: int, lengths=(13, 7, 20), vocab: int = 128) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


# -- the fp64 oracle --------------------------------------------------------------------------------

def _rms(x, w, eps):
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w


def _rope(x, positions, theta):
    d = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions.double()[:, None] * inv_freq[None]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def plain_logprobs(params: dict, c: ModelConfig, seq: list[int], start: int, temperature: float) -> torch.Tensor:
    """fp64 logprobs of seq[j], j = max(1, start)..len-1, from ``params`` (vLLM names, fp64 tensors)."""
    ids = torch.tensor(seq)
    n = len(seq)
    positions = torch.arange(n)
    h = params["model.embed_tokens.weight"][ids]
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        residual = h
        x = _rms(h, params[p + "input_layernorm.weight"], c.rms_norm_eps)
        qkv = x @ params[p + "self_attn.qkv_proj.weight"].T
        if c.qkv_bias:
            qkv = qkv + params[p + "self_attn.qkv_proj.bias"]
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], -1)
        q = q.reshape(n, c.num_heads, c.head_dim)
        k = k.reshape(n, c.num_kv_heads, c.head_dim)
        v = v.reshape(n, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q = _rms(q, params[p + "self_attn.q_norm.weight"], c.rms_norm_eps)
            k = _rms(k, params[p + "self_attn.k_norm.weight"], c.rms_norm_eps)
        q, k = _rope(q, positions, c.rope_theta), _rope(k, positions, c.rope_theta)
        group = c.num_heads // c.num_kv_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(c.head_dim)
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), -math.inf)
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)
        h = residual + attn @ params[p + "self_attn.o_proj.weight"].T
        residual = h
        x = _rms(h, params[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
        gate, up = (x @ params[p + "mlp.gate_up_proj.weight"].T).chunk(2, -1)
        h = residual + (torch.nn.functional.silu(gate) * up) @ params[p + "mlp.down_proj.weight"].T
    h = _rms(h, params["model.norm.weight"], c.rms_norm_eps)
    head = params["model.embed_tokens.weight"] if c.tie_word_embeddings else params["lm_head.weight"]
    logprobs = torch.log_softmax((h @ head.T) / temperature, -1)
    js = torch.arange(max(1, start), n)
    return logprobs[js - 1, ids[js]]


# -- gradients against fp64 -------------------------------------------------------------------------

# Norm-wise relative error ||g - g64|| / ||g64|| of every parameter's gradient, against fp64 autograd
# of the oracle on the same (dtype-rounded) weights. fp32: forward values are correctly rounded fp32
# kernels and the backward is fp32 math; observed <= 1.2e-6 over 3 seeds x 3 families, bound 1e-5.
# bf16: every op's output and every activation gradient is rounded to bf16 (2**-9 relative each,
# ~25 ops deep), which the fp64 oracle does not do; observed <= 3.1e-2, bound 0.1.
# The forward logprobs are checked too: fp32 within 1e-5 absolute (observed 3e-6), bf16 within 0.25
# (observed 9e-2: bf16 activations through 2 layers and a 128-way softmax).
GRAD_BOUND = {"float32": 1e-5, "bfloat16": 0.1}
FWD_BOUND = {"float32": 1e-5, "bfloat16": 0.25}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gradients_match_fp64_autograd_of_a_plain_model(arch, dtype):
    model = DecoderLM.random(tiny_config(arch, dtype), seed=1, backend=REF)
    seqs, starts, temperature = random_sequences(1), [5, 1, 9], 0.8
    g = torch.Generator().manual_seed(2)
    coef = [torch.randn(len(s) - max(1, st), generator=g, dtype=torch.float64) for s, st in zip(seqs, starts)]

    logprobs = model.sequence_logprobs(seqs, starts, temperature=temperature, page_size=4)
    sum((lp.double() * c).sum() for lp, c in zip(logprobs, coef)).backward()

    params = {n: p.detach().double().requires_grad_() for n, p in model.named_parameters()}
    oracle = [plain_logprobs(params, model.config, s, st, temperature) for s, st in zip(seqs, starts)]
    sum((lp * c).sum() for lp, c in zip(oracle, coef)).backward()

    fwd_err = max(float((a.detach().double() - b.detach()).abs().max()) for a, b in zip(logprobs, oracle))
    assert fwd_err <= FWD_BOUND[dtype], f"forward logprobs off by {fwd_err:.3g}"
    names = [n for n, _ in model.named_parameters()]
    assert (arch == "qwen2") == any(n.endswith("qkv_proj.bias") for n in names)
    assert (arch == "qwen3") == any(n.endswith("q_norm.weight") for n in names)
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == p.dtype, name
        err = float((p.grad.double() - params[name].grad).norm() / params[name].grad.norm())
        assert err <= GRAD_BOUND[dtype], f"{name}: relative gradient error {err:.3g} > {GRAD_BOUND[dtype]}"


def test_backward_refuses_weights_changed_since_the_forward():
    model = DecoderLM.random(tiny_config("llama"), seed=0, backend=REF)
    logprobs = model.sequence_logprobs(random_sequences(0, (9,)))
    with torch.no_grad():
        model.lm_head.weight.add_(0.01)          # as optimizer.step() would
    with pytest.raises(WeightsChangedError, match=r"lm_head\.weight"):
        torch.cat(logprobs).sum().backward()
    # the whole-model check runs before any gradient is accumulated
    assert all(p.grad is None for p in model.parameters())


def test_each_op_checks_its_saved_inputs():
    x = torch.randn(3, 8, requires_grad=True)
    w = torch.randn(5, 8, requires_grad=True)
    y = ag.linear(REF, x, w, name="probe")
    with torch.no_grad():
        w.mul_(2)
    with pytest.raises(WeightsChangedError, match=r"probe: input 'weight'"):
        y.sum().backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_autograd_ops_return_kernel_bits_and_reference_gradients(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 32, generator=g).to(dtype).requires_grad_()
    w = torch.randn(48, 32, generator=g).to(dtype).requires_grad_()
    nw = (1 + 0.1 * torch.randn(32, generator=g)).to(dtype).requires_grad_()
    res = torch.randn(6, 32, generator=g).to(dtype).requires_grad_()
    assert torch.equal(ag.linear(REF, x, w), REF.linear(x, w))
    assert torch.equal(ag.linear(REF, x, w, out_dtype=torch.float32), REF.linear(x, w, out_dtype=torch.float32))
    for got, want in zip(ag.rms_norm(REF, x, nw, 1e-6, res), REF.rms_norm(x, nw, 1e-6, res)):
        assert torch.equal(got, want)
    assert torch.equal(ag.silu_mul(REF, x), REF.silu_mul(x))
    logits = torch.randn(6, 40, generator=g, requires_grad=True)
    ids = torch.randint(0, 40, (6,), generator=g)
    got = ag.token_logprobs(REF, logits, ids, 0.7)
    assert torch.equal(got, REF.token_logprobs(logits, ids, 0.7))
    got.sum().backward()
    want = torch.autograd.grad(torch.log_softmax(logits / 0.7, -1).gather(-1, ids[:, None]).sum(), logits)[0]
    torch.testing.assert_close(logits.grad, want)


def test_training_attention_gradient_with_repeated_lengths():
    """train_attention's gradient (its graph batches the sequences of one length together) against fp64
    causal attention of each sequence alone, for lengths that repeat out of order; and its forward is
    the kernel's."""
    g = torch.Generator().manual_seed(4)
    lens, hq, hkv, d, scale = [3, 5, 3, 1, 5, 5, 2], 4, 2, 8, 0.35
    t = sum(lens)
    q, k, v = (torch.randn(t, h, d, generator=g, requires_grad=True) for h in (hq, hkv, hkv))
    layout = PackedLayout.build(lens, page_size=4)
    out = ag.train_attention(REF, q, k, v, layout, scale)
    cache = PagedKVCache.allocate(layout.num_pages, 4, hkv, d, torch.float32, "cpu")
    assert torch.equal(out, ag.write_and_attend(REF, q, k, v, cache, layout.slot_mapping, layout.meta, scale))
    coef = torch.randn(t, hq, d, generator=g, dtype=torch.float64)
    (out.double() * coef).sum().backward()

    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    start, total = 0, 0
    for n in lens:
        qs = q64[start:start + n].transpose(0, 1)
        ks = k64[start:start + n].transpose(0, 1).repeat_interleave(hq // hkv, 0)
        vs = v64[start:start + n].transpose(0, 1).repeat_interleave(hq // hkv, 0)
        scores = (qs @ ks.transpose(-1, -2) * scale).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), -math.inf)
        total = total + ((torch.softmax(scores, -1) @ vs).transpose(0, 1) * coef[start:start + n]).sum()
        start += n
    total.backward()
    for got, want in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        err = float((got.double() - want).norm() / want.norm())
        assert err <= 1e-5, f"relative gradient error {err:.3g}"
    # negative control: the gradient of attention over the whole packed batch (no per-sequence mask) is far off
    mixed = torch.softmax((q64.transpose(0, 1) @ k64.transpose(0, 1).repeat_interleave(2, 0).transpose(-1, -2)
                           * scale).masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), -math.inf), -1)
    q_wrong = torch.autograd.grad(((mixed @ v64.transpose(0, 1).repeat_interleave(2, 0)).transpose(0, 1)
                                   * coef).sum(), q64)[0]
    assert float((q.grad.double() - q_wrong).norm() / q_wrong.norm()) > 1e-2


def test_straight_through_has_visible_value_and_graph_gradient():
    x = torch.randn(5, requires_grad=True)
    visible = (x.detach() * 3).round()           # a kernel without derivative
    y = straight_through(visible, x * 3)
    assert torch.equal(y, visible)
    y.sum().backward()
    assert torch.equal(x.grad, torch.full((5,), 3.0))


# -- the training forward is the inference forward ----------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_training_forward_runs_the_inference_path_on_any_backend(arch):
    """On the stock ``torch`` backend (not invariant) too: training calls the same kernels with the
    same arguments as an engine prefill of the same packed batch on contiguous pages, so the bits match."""
    stock = TorchBackend(None, "cpu")
    model = DecoderLM.random(tiny_config(arch, "float32"), seed=3, backend=stock)
    seqs = random_sequences(3)
    ids = torch.tensor([t for s in seqs for t in s])
    seq_lens = [len(s) for s in seqs]
    train = model.forward_train(ids, seq_lens, page_size=8)
    layout = PackedLayout.build(seq_lens, 8)
    caches = [PagedKVCache.allocate(layout.num_pages, 8, 2, 16, torch.float32) for _ in range(2)]
    positions = torch.cat([torch.arange(n) for n in seq_lens])
    batch = InferenceBatch(ids, positions, layout.slot_mapping, layout.meta, torch.arange(ids.numel()))
    infer = model.forward_infer(batch, caches)
    assert train.requires_grad and not infer.requires_grad
    assert torch.equal(train.detach(), infer)


# -- checkpoints --------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_hf_checkpoint_round_trip_merges_qkv_and_gate_up(arch, tmp_path):
    pytest.importorskip("safetensors", reason="safetensors is not installed")
    from safetensors.torch import load_file

    from hal.model import load_pretrained, save_pretrained

    model = DecoderLM.random(tiny_config(arch, "bfloat16"), seed=4, backend=REF)
    save_pretrained(model, tmp_path)
    hf = load_file(str(tmp_path / "model.safetensors"))
    c = model.config
    assert hf["model.layers.1.self_attn.q_proj.weight"].shape == (c.q_size, c.hidden_size)
    assert hf["model.layers.1.self_attn.k_proj.weight"].shape == (c.kv_size, c.hidden_size)
    assert hf["model.layers.0.mlp.up_proj.weight"].shape == (c.intermediate_size, c.hidden_size)
    assert ("lm_head.weight" in hf) == (not c.tie_word_embeddings)
    assert not any("qkv_proj" in n or "gate_up" in n for n in hf)
    merged = model.model.layers[1].self_attn.qkv_proj.weight
    assert torch.equal(merged[c.q_size:c.q_size + c.kv_size], hf["model.layers.1.self_attn.k_proj.weight"])

    loaded = load_pretrained(tmp_path, backend=REF)
    assert loaded.config == c
    for (n1, p1), (n2, p2) in zip(model.named_parameters(), loaded.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    seqs = random_sequences(4, (11,))
    with torch.no_grad():
        assert torch.equal(model.sequence_logprobs(seqs)[0], loaded.sequence_logprobs(seqs)[0])

    # fp32 on request, and missing tensors are named
    assert load_pretrained(tmp_path, dtype="float32", backend=REF).dtype == torch.float32
    from safetensors.torch import save_file

    del hf["model.norm.weight"]
    save_file(hf, str(tmp_path / "model.safetensors"))
    with pytest.raises(HalError, match=r"missing tensors \['model\.norm\.weight'\]"):
        load_pretrained(tmp_path, backend=REF)


def test_hf_config_refuses_what_the_model_cannot_honour():
    base = tiny_config("llama").to_hf()
    assert ModelConfig.from_hf(json.loads(json.dumps(base))) == tiny_config("llama")
    for key, value, match in (("rope_scaling", {"rope_type": "llama3", "factor": 8.0}, "llama3"),
                              ("hidden_act", "gelu", "gelu"), ("model_type", "gpt2", "gpt2"),
                              ("use_sliding_window", True, "sliding")):
        bad = dict(base, **{key: value})
        if key == "model_type":
            bad["architectures"] = ["GPT2LMHeadModel"]
        with pytest.raises(UnsupportedError, match=match):
            ModelConfig.from_hf(bad)
    with pytest.raises(UnsupportedError, match="multiple"):
        tiny_config("llama", num_kv_heads=3)


# -- unreadable checkpoints: one CheckpointError naming the file, never a raw library exception -----

@pytest.fixture
def saved_checkpoint(tmp_path):
    pytest.importorskip("safetensors", reason="safetensors is not installed")
    from hal.model import save_pretrained

    return save_pretrained(DecoderLM.random(tiny_config("llama"), seed=0, backend=REF), tmp_path / "ckpt")


@pytest.mark.parametrize("damage, match", [
    (lambda data: data[: len(data) // 2], "not a complete safetensors file"),
    (lambda data: data[:8], "not a complete safetensors file"),
    (lambda data: b"", "an empty file"),
    (lambda data: bytes(random.Random(0).randrange(256) for _ in range(4000)), "not a complete safetensors file"),
])
def test_damaged_safetensors_file_is_a_checkpoint_error(saved_checkpoint, damage, match):
    from hal.model import CheckpointError, load_pretrained

    file = saved_checkpoint / "model.safetensors"
    file.write_bytes(damage(file.read_bytes()))
    with pytest.raises(CheckpointError, match=match) as info:
        load_pretrained(saved_checkpoint, backend=REF)
    assert "model.safetensors" in str(info.value) and "expected a safetensors file" in str(info.value)


def _without(hf: dict, key: str) -> dict:
    return {k: v for k, v in hf.items() if k != key}


HF = tiny_config("llama").to_hf()


@pytest.mark.parametrize("text, match", [
    (b"", "an empty file"),
    (b"{\"vocab_size\": 128,", "invalid JSON"),
    (b"\xff\xfe{}", "not UTF-8"),
    (b"[1, 2]", "a JSON list; expected a JSON object"),
    (json.dumps(_without(HF, "hidden_size")).encode(), "'hidden_size' is missing; expected an integer"),
    (json.dumps(dict(HF, hidden_size="64")).encode(), 'hidden_size = "64": expected an integer'),
    (json.dumps(dict(HF, num_hidden_layers=2.5)).encode(), "num_hidden_layers = 2.5: expected an integer"),
    (json.dumps(dict(HF, vocab_size=True)).encode(), "vocab_size = true: expected an integer"),
    (json.dumps(dict(HF, tie_word_embeddings="no")).encode(), 'tie_word_embeddings = "no": expected true or false'),
    (json.dumps(dict(HF, rms_norm_eps="1e-6")).encode(), "rms_norm_eps = \"1e-6\": expected a number"),
    (json.dumps(dict(HF, rope_scaling=[1])).encode(), r"rope_scaling = \[1\]: expected an object"),
])
def test_invalid_config_json_is_a_checkpoint_error(saved_checkpoint, text, match):
    from hal.model import CheckpointError, load_pretrained

    (saved_checkpoint / "config.json").write_bytes(text)
    with pytest.raises(CheckpointError, match=match) as info:
        load_pretrained(saved_checkpoint, backend=REF)
    assert "config.json" in str(info.value)


def test_unsupported_architecture_in_config_json_is_named(saved_checkpoint):
    from hal.model import load_pretrained

    hf = dict(HF, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (saved_checkpoint / "config.json").write_text(json.dumps(hf))
    with pytest.raises(UnsupportedError, match="'gpt2'.*not one of llama, qwen2, qwen3"):
        load_pretrained(saved_checkpoint, backend=REF)


def test_cli_reports_a_damaged_checkpoint_in_one_line(saved_checkpoint):
    (saved_checkpoint / "model.safetensors").write_bytes(b"\x00" * 5)
    run = subprocess.run([sys.executable, "-m", "hal.cli", "diff", "--backend", "reference", "--model",
                          str(saved_checkpoint)], capture_output=True, text=True)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.startswith("hal: error:") and len(run.stderr.strip().splitlines()) == 1
    assert "model.safetensors" in run.stderr
