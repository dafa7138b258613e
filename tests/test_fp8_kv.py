"""The FP8 KV cache under bf16-fp8-v1 (``hal.fp8.Fp8KVCache``) with the reference attention.

Properties: attention over an FP8 cache gives a token the same bits in full prefill, chunked prefill
(two cuts) and token-by-token decode, with scrambled pages of two sizes, for e4m3 and e5m2 with
per-(token, head) scales and for a fixed scale; the dequantised cache is within half an fp8 step of
what was written. Negative control: a scale from each write call's amax (per-tensor dynamic KV
scaling) gives the early tokens other bits when a louder chunk is written with them, so the phases
differ. A model with kv_cache_dtype "fp8": rollout (the harness) == training bitwise, on reference and
the cuda kernels. The cuda kernels (fused write and read): tests/test_cuda_fp8_kv.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hal import fp8
from hal.api import create_backend
from hal.contract import load_contract
from hal.kvcache import PageAllocator, build_metadata, pages_needed, slot_mapping

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FP8 = load_contract("bf16-fp8-v1")
REF = create_backend("reference", FP8)
SEQ, HQ, HKV, D = 40, 4, 2, 64
LOUD_FROM = 13          # tokens from here on are 50x louder: a per-call scale must see them


def sequence(seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(SEQ, h, D, generator=g) for h in (HQ, HKV, HKV))
    k[LOUD_FROM:] *= 50
    v[LOUD_FROM:] *= 50
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


def run(steps, page_size, spec, cache_cls=fp8.Fp8KVCache, seed=0):
    """Attention outputs (SEQ, HQ, D) of one sequence fed in ``steps`` (query counts per call)."""
    q, k, v = sequence()
    pages = PageAllocator(64, torch.Generator().manual_seed(seed + page_size)).take(pages_needed(SEQ, page_size))
    cache = cache_cls(64, page_size, HKV, D, spec)
    outs, done = [], 0
    for q_len in steps:
        positions = range(done, done + q_len)
        cache.write(k[done:done + q_len], v[done:done + q_len], slot_mapping(pages, positions, page_size))
        meta = build_metadata([q_len], [done + q_len], [pages])
        outs.append(REF.attention(q[done:done + q_len], *cache.read(torch.bfloat16), meta, scale=D ** -0.5))
        done += q_len
    return torch.cat(outs), cache, pages


SCHEDULES = {"chunked 13 + 27": [13, 27], "chunked 7 + 20 + 13": [7, 20, 13], "decode from 10": [10] + [1] * 30}
SPECS = {"e4m3 per token-head": FP8.fp8, "e5m2 per token-head": dataclasses.replace(FP8.fp8, kv_format="e5m2"),
         "e4m3 fixed scale": dataclasses.replace(FP8.fp8, kv_scale="fixed")}


@pytest.mark.parametrize("name", SPECS)
def test_prefill_chunked_prefill_and_decode_give_the_same_bits(name):
    spec = SPECS[name]
    full, _, _ = run([SEQ], 16, spec)
    assert torch.isfinite(full.float()).all()
    for page_size in (16, 5):
        for label, steps in SCHEDULES.items():
            assert torch.equal(run(steps, page_size, spec, seed=len(steps))[0], full), (name, page_size, label)


def test_the_read_path_is_within_half_an_fp8_step_of_what_was_written():
    _, cache, pages = run([SEQ], 16, FP8.fp8)
    k_read, _ = cache.read(torch.float32)
    slots = slot_mapping(pages, range(SEQ), 16)
    got = k_read[slots // 16, slots % 16].double()
    k = sequence()[1].double()
    scale = k.abs().amax(-1, keepdim=True) / 448
    # e4m3: relative 2**-4 for normals, absolute 2**-10 * scale for subnormals; fp32 product rounding
    bound = torch.maximum(k.abs() * 2 ** -4, scale * 2 ** -10) * (1 + 2 ** -20)
    assert ((got - k).abs() <= bound).all()


class PerCallScaleCache(fp8.Fp8KVCache):
    """Negative control: one scale per write call from the amax of everything written in it."""

    def _quantise(self, x, fixed):
        scale = fp8.scale_of(x.float().abs().amax(), self.spec, self.spec.kv_format)
        return fp8.quantise(x, scale, self.spec, self.spec.kv_format), scale.expand(x.shape[:-1]).contiguous()


def test_negative_control_a_per_call_kv_scale_changes_the_bits_between_phases():
    full, _, _ = run([SEQ], 16, FP8.fp8, PerCallScaleCache)
    chunked, _, _ = run([LOUD_FROM, SEQ - LOUD_FROM], 16, FP8.fp8, PerCallScaleCache)
    assert not torch.equal(full[:LOUD_FROM], chunked[:LOUD_FROM])


def test_write_checks_shapes():
    cache = fp8.Fp8KVCache(4, 16, HKV, D, FP8.fp8)
    with pytest.raises(Exception, match="must be \\(T, Hkv=2, D=64\\)"):
        cache.write(torch.zeros(3, HKV, D), torch.zeros(3, HKV, D), torch.zeros(2, dtype=torch.long))


# -- a model's attention over the FP8 cache: rollout (the harness) == training ------------------------

def _fp8_kv_model(backend, dtype="bfloat16", **extra):
    from hal.model import DecoderLM, tiny_config

    return DecoderLM.random(tiny_config("qwen3", dtype, kv_cache_dtype="fp8", **extra), seed=11, backend=backend)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_model_with_an_fp8_kv_cache_trains_on_the_rollouts_bits(dtype):
    """kv_cache_dtype "fp8": the harness (three schedules: pages of 3, 16 and 5 keys, chunked prefill,
    preemption, batch-mates) and the trainer (two packings, its own fresh FP8 caches) write K/V through the
    contract's quantiser and read them through its one read path: the same tokens and bitwise the same
    logprobs everywhere. Negative control: the same weights with a bf16 cache give other logprobs (the FP8
    path is really taken)."""
    from conftest import assert_schedules_and_trainer_agree
    from test_rollout import PACKINGS, SCHEDULES, make_requests

    from hal.rollout import RolloutHarness, recompute_logprobs

    model = _fp8_kv_model(REF, dtype)
    assert type(model.allocate_kv_cache(2, 4)[0]) is fp8.Fp8KVCache
    requests = make_requests(seed=9)
    runs = [RolloutHarness(model, cfg).generate(requests) for cfg in SCHEDULES]
    with torch.no_grad():
        trains = [recompute_logprobs(model, runs[0], **packing) for packing in PACKINGS]
    assert sum(len(c.tokens) for c in runs[0]) >= 40
    assert_schedules_and_trainer_agree(runs, trains)

    bf16_cache = type(model)(model.config.replace(kv_cache_dtype="auto"), backend=REF)
    bf16_cache.load_state_dict(model.state_dict())
    with torch.no_grad():
        other = recompute_logprobs(bf16_cache, runs[0], **PACKINGS[0])
    assert not all(torch.equal(a, c.logprobs) for a, c in zip(other, runs[0]))


def test_an_fp8_kv_cache_needs_a_contract_with_fp8_and_is_refused_by_a_stock_vllm_engine(tmp_path):
    from hal.errors import UnsupportedError
    from hal.model import tiny_config
    from hal.rl.engines import VllmRolloutEngine

    dense = create_backend("reference")
    with pytest.raises(UnsupportedError, match=r"kv_cache_dtype 'fp8'.*no \[fp8\] section"):
        _fp8_kv_model(dense).allocate_kv_cache(2, 4)
    with pytest.raises(UnsupportedError, match="kv_cache_dtype must be one of auto, fp8"):
        tiny_config("qwen3", kv_cache_dtype="int8")
    # the rollout's caches must be the model's kind
    from hal.errors import HalError
    from hal.model import DecoderLM, InferenceBatch

    bf16_model = DecoderLM.random(tiny_config("qwen3", "bfloat16"), seed=1, backend=REF)
    one_token = InferenceBatch(token_ids=torch.tensor([1]), positions=torch.tensor([0]), slot_mapping=torch.tensor([0]),
                               meta=build_metadata([1], [1], [[0]]), logits_rows=torch.tensor([0]))
    with pytest.raises(HalError, match="kv_cache_dtype is 'fp8' but the caches given are"):
        _fp8_kv_model(REF).forward_infer(one_token, bf16_model.allocate_kv_cache(2, 4))
    assert _fp8_kv_model(REF).forward_infer(one_token, _fp8_kv_model(REF).allocate_kv_cache(2, 4)).shape[0] == 1
    # a stock (contract-less) vLLM engine would quantise with vLLM's own scales: refused before it reads the
    # recipe or writes a checkpoint (a HAL-bound one runs it: tests/test_vllm.py)
    from hal.backends.stock import TorchBackend

    with pytest.raises(UnsupportedError, match=r"FP8 KV cache \(kv_cache_dtype 'fp8'\) .* needs a contract backend"):
        VllmRolloutEngine(_fp8_kv_model(REF), None, TorchBackend(None, "cpu"), tmp_path)
    assert not any(tmp_path.iterdir())


def test_model_with_an_fp8_kv_cache_on_the_cuda_kernels():
    """The same property with the cuda backend's fused FP8 write and read (under Triton's interpreter):
    one schedule with chunked prefill and preemption, one training packing."""
    from conftest import assert_schedules_and_trainer_agree, backend_for_tests
    from test_rollout import PACKINGS, SCHEDULES, make_requests

    from hal.rollout import RolloutHarness, recompute_logprobs

    backend_for_tests("cuda")
    cuda = create_backend("cuda", FP8)
    model = _fp8_kv_model(cuda, head_dim=64)
    requests = make_requests(seed=9, count=2)
    runs = [RolloutHarness(model, cfg).generate(requests) for cfg in SCHEDULES[:2]]
    with torch.no_grad():
        trains = [recompute_logprobs(model, runs[0], **PACKINGS[1])]
    assert_schedules_and_trainer_agree(runs, trains)
