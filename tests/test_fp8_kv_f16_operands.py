"""The FP8 KV cache read as f16 MMA operands (bf16-fp8-v2: [fp8].kv_dequant = "f16_operands", fixed scales).

The rule (contracts/bf16-fp8-v2.toml): K and V enter the dots as f16 (exact), q is rounded to f16, the K scale
is folded into the score factor, P is rounded to f16, the V scale multiplies the output after the split merge.

Properties, on the reference backend and on the cuda kernels under Triton's interpreter:
  * one token's bits in full prefill, chunked prefill with a batch-mate and token-by-token decode across the
    512-key split, on pages that hold a 64-key chunk and pages that do not;
  * every launch path of the cuda kernel (in-kernel and parallel splits, query tiles, head splits, splits per
    program, the packed GQA layout) gives the default launch's bits;
  * accuracy against an fp64 oracle over the cache's exact values (fp8 x scale);
  * a model with ``kv_cache_dtype "fp8"`` trains on the rollout's bits.
Negative controls: a K or a V scale 1/64 larger gives other bits (both scales reach the output); v1's read
rule over the same cache gives other bits (the f16 rule is the one taken); scales calibrated from the first
write call make a token's bits depend on where its prompt was cut (why the contract's scales are fixed). The
dots involved are the interpreter's numpy sums over exact f16 values and the reference's correctly rounded
ones: no host BLAS decides a control. The GPU side (bits and speed): bench/fp8_kv_f16_gpu.py
(bench/results/h100-2026-12-07-fp8kv-v2/).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import backend_for_tests

from hal import fp8
from hal.api import create_backend
from hal.contract import ContractError, load_contract, parse_contract
from hal.kvcache import PageAllocator, build_metadata, pages_needed, slot_mapping

pytestmark = pytest.mark.usefixtures("one_torch_thread")

V2 = load_contract("bf16-fp8-v2")
HQ, HKV, D = 6, 2, 64           # GQA 3: the prefill tile packs the group (12 of 16 interpreter rows)
SEQ = 530                       # crosses kv_chunk 64 and kv_split 512
TAIL = 40                       # the tokens whose attention is computed (positions 490..529)
SCALES = (0.05, 0.0625)         # the layer's fixed K and V scales


@pytest.fixture(scope="module")
def cuda():
    backend_for_tests("cuda")          # the interpreter runs the kernels (conftest)
    return create_backend("cuda", V2)


@pytest.fixture(scope="module")
def reference():
    return create_backend("reference", V2)


def rows(tokens: int, seed: int):
    """q (T, HQ, D), k, v (T, HKV, D) bf16: ordinary rows, some loud K and quiet V rows, one all-zero."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(tokens, h, D, generator=g) for h in (HQ, HKV, HKV))
    k[3::7] *= 8.0
    v[5::11] *= 1e-2
    k[4], v[4] = 0.0, 0.0
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


def run(backend, steps, page_size, *, mates=0, scales=SCALES, seed=0):
    """Outputs (TAIL, HQ, D) of the last TAIL tokens of one SEQ-token sequence fed in ``steps`` after its first
    SEQ - TAIL tokens' K/V were written; ``mates``: 24-token sequences sharing each call (8 queries each)."""
    q, k, v = rows(SEQ, seed=7)
    mq, mk, mv = rows(24, seed=8)
    alloc = PageAllocator(128, torch.Generator().manual_seed(seed + page_size))
    pages = alloc.take(pages_needed(SEQ, page_size))
    mate_pages = [alloc.take(pages_needed(24, page_size)) for _ in range(mates)]
    cache = fp8.Fp8KVCache(128, page_size, HKV, D, V2.fp8, fixed_scales=scales)
    for j in range(mates):
        cache.write(mk, mv, slot_mapping(mate_pages[j], range(24), page_size))
    done = SEQ - TAIL
    cache.write(k[:done], v[:done], slot_mapping(pages, range(done), page_size))
    outs = []
    for q_len in steps:
        cache.write(k[done:done + q_len], v[done:done + q_len], slot_mapping(pages, range(done, done + q_len),
                                                                              page_size), backend=backend)
        meta = build_metadata([8] * mates + [q_len], [24] * mates + [done + q_len], mate_pages + [pages])
        qs = torch.cat([mq[-8:]] * mates + [q[done:done + q_len]])
        outs.append(cache.attention(backend, qs, meta, scale=D ** -0.5)[8 * mates:])
        done += q_len
    return torch.cat(outs), cache, pages


def oracle(cache: fp8.Fp8KVCache, pages) -> torch.Tensor:
    """fp64 causal attention of the tail's queries over the cache's exact values (fp8 x fixed scale)."""
    slots = slot_mapping(pages, range(SEQ), cache.page_size)
    k = cache.k.flatten(0, 1)[slots].double() * float(cache.k_scale)
    v = cache.v.flatten(0, 1)[slots].double() * float(cache.v_scale)
    q = rows(SEQ, seed=7)[0][-TAIL:].double()
    group = HQ // HKV
    scores = torch.einsum("thd,shd->hts", q, k.repeat_interleave(group, 1)) * D ** -0.5
    causal = torch.arange(SEQ)[None, :] > torch.arange(SEQ - TAIL, SEQ)[:, None]
    probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
    return torch.einsum("hts,shd->thd", probs, v.repeat_interleave(group, 1))


SCHEDULES = ((64, [13, 27], 1), (5, [20] + [1] * 20, 1), (16, [20, 1, 19], 0))


@pytest.mark.parametrize("name", ["reference", "cuda"])
def test_one_set_of_bits_in_every_phase_accurate_against_the_fp64_oracle(cuda, reference, name):
    backend = {"reference": reference, "cuda": cuda}[name]
    full, cache, pages = run(backend, [TAIL], 64)
    assert torch.isfinite(full.float()).all()
    for page_size, steps, mates in SCHEDULES:
        assert torch.equal(run(backend, steps, page_size, mates=mates)[0], full), (page_size, steps, mates)
    want = oracle(cache, pages)
    err = (full.double() - want).abs()
    # bf16 attention's tolerance: the output's rounding and the f16 P (11 bits) well inside it
    assert bool((err <= 2 ** -8 * (1 + want.abs())).all()), float(err.max())


class FirstCallScaleCache(fp8.Fp8KVCache):
    """Negative control: the layer's scales calibrated from the first write call's amax (as an engine that
    computes its KV scales from the first batch does), so they depend on where the prompt was cut."""

    def write(self, k, v, slot_mapping, backend=None):
        if not getattr(self, "calibrated", False):
            self.k_scale = fp8.scale_of(k.float().abs().amax(), self.spec, self.spec.kv_format)
            self.v_scale = fp8.scale_of(v.float().abs().amax(), self.spec, self.spec.kv_format)
            self.calibrated = True
        super().write(k, v, slot_mapping, backend)


def test_negative_control_scales_from_the_first_write_make_the_phases_differ(reference):
    q, k, v = rows(48, seed=3)
    k[20:] *= 50
    v[20:] *= 50
    outs = []
    for steps in ([48], [20, 28]):
        cache, pages, done, out = FirstCallScaleCache(8, 16, HKV, D, V2.fp8), [5, 1, 3], 0, []
        for q_len in steps:
            cache.write(k[done:done + q_len], v[done:done + q_len], slot_mapping(pages, range(done, done + q_len), 16))
            meta = build_metadata([q_len], [done + q_len], [pages])
            out.append(cache.attention(reference, q[done:done + q_len], meta, scale=D ** -0.5))
            done += q_len
        outs.append(torch.cat(out))
    assert not torch.equal(outs[0][:20], outs[1][:20])


def test_every_launch_path_gives_the_default_bits_and_both_scales_reach_them(cuda, reference):
    from hal.backends.cuda.launch import CUDA_LAUNCH
    from hal.kernels import attention

    _, cache, pages = run(cuda, [TAIL], 16)
    q = rows(SEQ, seed=7)[0][-TAIL:].contiguous()
    meta = build_metadata([TAIL], [SEQ], [pages])
    common = (meta.query_start_loc, meta.seq_lens, meta.block_table, D ** -0.5, V2.attention)

    def attend(k_scale=cache.k_scale, v_scale=cache.v_scale, **launch):
        return attention.paged_attention(q, cache.k, cache.v, *common, policy=CUDA_LAUNCH, k_scale=k_scale,
                                         v_scale=v_scale, f16_operands=True, **launch)

    default = attend()
    launches = [dict(split_parallel=sp, block_q=bq, head_split=hs, splits_per_program=g, packed_heads=pk)
                for sp, bq, hs, g, pk in ((False, 32, 1, 1, False), (True, 1, 1, 1, False), (True, 4, 2, 2, False),
                                          (False, 8, 4, 1, False), (False, 5, 1, 1, True), (True, 2, 1, 2, True))]
    for launch in launches:
        assert torch.equal(attend(**launch), default), launch
    # Negative controls: each scale 1/64 larger (a bf16 output step: an ulp of the scale can round away in the
    # score factor or the output); v1's read rule (dequantised bf16 operands) over the same cache.
    def nudged(scale):
        return scale * (1 + 2 ** -6)
    assert not torch.equal(attend(k_scale=nudged(cache.k_scale)), default)
    assert not torch.equal(attend(v_scale=nudged(cache.v_scale)), default)
    v1_read = attention.paged_attention(q, cache.k, cache.v, *common, policy=CUDA_LAUNCH, k_scale=cache.k_scale,
                                        v_scale=cache.v_scale)
    assert not torch.equal(v1_read, default)
    # the reference's negative controls: its own bits move with either scale too
    ref_meta = build_metadata([TAIL], [SEQ], [pages])
    ref = reference.fp8_attention(q, cache.k, cache.v, cache.k_scale, cache.v_scale, ref_meta, scale=D ** -0.5)
    for k_scale, v_scale in ((nudged(cache.k_scale), cache.v_scale), (cache.k_scale, nudged(cache.v_scale))):
        assert not torch.equal(reference.fp8_attention(q, cache.k, cache.v, k_scale, v_scale, ref_meta,
                                                       scale=D ** -0.5), ref)


def test_the_rule_takes_fixed_scales_only():
    text = open(fp8.__file__.replace("hal/fp8.py", "contracts/bf16-fp8-v2.toml")).read()
    with pytest.raises(ContractError, match="'f16_operands' with kv_scale = 'fixed'"):
        parse_contract(text.replace('kv_scale = "fixed"', 'kv_scale = "per_token_head"'))
    from hal.backends.cuda.launch import CUDA_LAUNCH
    from hal.kernels import attention

    per_token = fp8.Fp8KVCache(4, 16, HKV, D, dataclasses.replace(V2.fp8, kv_scale="per_token_head"))
    meta = build_metadata([2], [2], [[0]])
    with pytest.raises(ValueError, match="one fixed"):
        attention.paged_attention(torch.zeros(2, HQ, D, dtype=torch.bfloat16), per_token.k, per_token.v,
                                  meta.query_start_loc, meta.seq_lens, meta.block_table, 1.0, V2.attention,
                                  policy=CUDA_LAUNCH, k_scale=per_token.k_scale, v_scale=per_token.v_scale,
                                  f16_operands=True)


@pytest.mark.parametrize("name", ["reference", "cuda"])
def test_model_with_an_f16_operand_fp8_cache_trains_on_the_rollouts_bits(name):
    """kv_cache_dtype "fp8" under bf16-fp8-v2: the harness (two schedules: chunked prefill, preemption) and
    the trainer (its own fresh FP8 caches) give the same tokens and bitwise the same logprobs. Negative
    control: the same weights under bf16-fp8-v1's read rule give other logprobs."""
    from conftest import assert_schedules_and_trainer_agree
    from test_rollout import PACKINGS, SCHEDULES as HARNESS, make_requests

    from hal.model import DecoderLM, tiny_config
    from hal.rollout import RolloutHarness, recompute_logprobs

    if name == "cuda":
        backend_for_tests("cuda")
    backend = create_backend(name, V2)
    model = DecoderLM.random(tiny_config("qwen3", "bfloat16", kv_cache_dtype="fp8", head_dim=64), seed=11,
                             backend=backend)
    requests = make_requests(seed=9, count=2)
    runs = [RolloutHarness(model, cfg).generate(requests) for cfg in HARNESS[:2]]
    with torch.no_grad():
        trains = [recompute_logprobs(model, runs[0], **PACKINGS[1])]
    assert_schedules_and_trainer_agree(runs, trains)

    v1 = type(model)(model.config, backend=create_backend(name, "bf16-fp8-v1"))
    v1.load_state_dict(model.state_dict())
    with torch.no_grad():
        other = recompute_logprobs(v1, runs[0], **PACKINGS[1])
    assert not all(torch.equal(a, c.logprobs) for a, c in zip(other, runs[0]))
