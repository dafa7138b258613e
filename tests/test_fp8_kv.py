"""The FP8 KV cache under bf16-fp8-v1 (``hal.fp8.Fp8KVCache``) with the reference attention.

Properties: attention over an FP8 cache gives a token the same bits in full prefill, chunked prefill
(two cuts) and token-by-token decode, with scrambled pages of two sizes, for e4m3 and e5m2 with
per-(token, head) scales and for a fixed scale; the dequantised cache is within half an fp8 step of
what was written. Negative control: a scale from each write call's amax (per-tensor dynamic KV
scaling) gives the early tokens other bits when a louder chunk is written with them, so the phases
differ. The cuda kernels (fused write and read): tests/test_cuda_fp8_kv.py.
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
