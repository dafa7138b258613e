"""Prefill attention's launch search (issue #20) under Triton's CPU interpreter: every candidate of
``attention.prefill_candidates`` keeps the bits, the tuner keeps the fastest bit-equal launch per shape class and
refuses one that changes bits, and the launch policy hands a tuned launch to the kernel (the call's own overrides
still win). The interpreter ignores warps and stages, so here the candidates differ in tokens a program (the
query tile); the GPU side, every candidate bit-checked and timed, is ``hal tune --ops prefill``."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import backend_for_tests, plant_bit_change, spy_launches

from hal.contract import load_contract

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

DENSE = load_contract("bf16-dense-v1")


@pytest.fixture(scope="module")
def cuda():
    return backend_for_tests("cuda")


def _prefill_call(lengths, hq, hkv, d, page, seed=0):
    """Causal prompts of ``lengths`` tokens from position 0 over a paged bf16 cache (pages shuffled), as
    ``paged_attention``'s positional arguments (the scale last)."""
    g = torch.Generator().manual_seed(seed)
    per_seq = max(-(-n // page) for n in lengths)
    pages = len(lengths) * per_seq
    k = torch.randn(pages, page, hkv, d, generator=g).bfloat16()
    v = torch.randn(pages, page, hkv, d, generator=g).bfloat16()
    table = torch.randperm(pages, generator=g).to(torch.int32).view(len(lengths), per_seq)
    starts = torch.tensor([0] + list(lengths), dtype=torch.int32).cumsum(0).to(torch.int32)
    q = torch.randn(sum(lengths), hq, d, generator=g).bfloat16()
    return q, k, v, starts, torch.tensor(lengths, dtype=torch.int32), table, d ** -0.5


def test_every_prefill_candidate_gives_the_same_bits(cuda):
    """Prompts crossing the contract's KV chunk (64) and split (512), GQA groups of 2 and 3 (packed): every
    candidate's query tile gives the bits of the kernel's own launch (the interpreter runs warps and stages
    alike: one candidate per tile). Negative control: a halved kv_chunk reaches the bits."""
    from hal.backends.cuda.launch import CUDA_LAUNCH
    from hal.kernels import attention

    spec = DENSE.attention
    for hq, hkv, lengths in ((4, 2, [530, 70]), (6, 2, [150, 30])):
        args = _prefill_call(lengths, hq=hq, hkv=hkv, d=16, page=16)
        own = attention.paged_attention(*args, spec, policy=CUDA_LAUNCH)
        candidates = attention.prefill_candidates(hq // hkv)
        by_tile = {c["block_q"]: c for c in candidates}
        assert len(by_tile) >= 3, by_tile                   # tiles of several sizes, each crossing chunk edges
        for config in by_tile.values():
            out = attention.paged_attention(*args, spec, policy=CUDA_LAUNCH, **config)
            assert torch.equal(out, own), config
        half_chunk = dataclasses.replace(spec, kv_chunk=spec.kv_chunk // 2)
        assert not torch.equal(attention.paged_attention(*args, half_chunk, policy=CUDA_LAUNCH), own)


def test_prefill_candidates_are_distinct_launches():
    from hal.kernels import attention

    for group in range(1, 9):
        candidates = attention.prefill_candidates(group)
        assert len(candidates) == len({tuple(sorted(c.items())) for c in candidates})
        assert all(c["block_q"] >= 1 and set(c) == {"block_q", "num_warps", "num_stages"} for c in candidates)
    assert {c["block_q"] for c in attention.prefill_candidates(4)} == {8, 16, 32}     # 32, 64, 128 rows


def test_prefill_tuner_keeps_the_fastest_bit_equal_launch_and_refuses_one_that_changes_bits(cuda, monkeypatch):
    """``tune_prefill`` with a stand-in timer (each timing faster than the one before): the cache holds the last
    candidate under the cell's shape class, which prompt lengths of one power-of-two class share; a candidate
    whose output differs stops tuning."""
    from hal.errors import HalError
    from hal.kernels import attention, tuning

    spec = DENSE.attention
    timings = iter(range(10**6, 0, -1))
    cache, report = tuning.TuneCache("cpu (interpreter)", "x"), []
    cell = (1, 130, 4, 2, 16, 16)
    tuning.tune_prefill([cell], spec, device="cpu", cache=cache, timer=lambda fn: (fn(), next(timings))[1],
                        progress=None, report=report)
    key = tuning.prefill_shape_class(130, 1, 4, 2, 16, 16, torch.bfloat16, torch.bfloat16, spec)
    assert key == tuning.prefill_shape_class(250, 1, 4, 2, 16, 16, torch.bfloat16, torch.bfloat16, spec)
    assert key != tuning.prefill_shape_class(260, 2, 4, 2, 16, 16, torch.bfloat16, torch.bfloat16, spec)
    assert key != tuning.decode_shape_class(1, 1, 1024, 4, 2, 16, 16, torch.bfloat16, torch.bfloat16, spec)
    candidates = attention.prefill_candidates(2)
    assert cache.config(key) == candidates[-1] and cache.entries[key]["candidates"] == len(candidates)
    assert [config for config, _ in report[0]["timings"]] == candidates and report[0]["op"] == "prefill"

    plant_bit_change(monkeypatch, attention, "paged_attention", lambda kw: kw.get("num_stages") == 3)
    with pytest.raises(HalError, match="gives other bits than the kernel's own"):
        tuning.tune_prefill([cell], spec, device="cpu", cache=tuning.TuneCache("c", "x"), timer=lambda fn: 1.0,
                            progress=None)
    with pytest.raises(HalError, match="not a multiple"):
        tuning.tune_prefill([(1, 64, 5, 2, 16, 16)], spec, device="cpu", cache=cache, progress=None)


def test_the_launch_policy_hands_a_tuned_prefill_launch_to_the_kernel(cuda, monkeypatch):
    """A tuning cache entry for the call's shape class reaches the kernel's launch (its tile and meta-parameters);
    the call's own overrides replace it; a decode-shaped call never asks; the tuner's baseline never reads the
    cache. The bits stay the rule's."""
    from hal.backends.cuda import launch as cuda_launch
    from hal.kernels import attention, tuning

    spec = DENSE.attention
    args = _prefill_call([130, 40], hq=4, hkv=2, d=16, page=16)
    own = attention.paged_attention(*args, spec, policy=cuda_launch.CUDA_LAUNCH)
    key = tuning.prefill_shape_class(170, 2, 4, 2, 16, 16, torch.bfloat16, torch.bfloat16, spec)
    tuned = dict(block_q=32, num_warps=8, num_stages=3)
    cache = tuning.TuneCache("cpu (interpreter)", "x", {key: {"config": tuned}})
    monkeypatch.setattr(cuda_launch, "_tuning_cache", lambda: cache)
    cuda_launch._prefill_config.cache_clear()
    launches = spy_launches(monkeypatch, attention)

    def tile():   # (tokens a program, warps, stages) of the first launch recorded
        meta = launches[0][2]
        return meta["BLOCK_Q"], meta["num_warps"], meta["num_stages"]
    try:
        assert torch.equal(attention.paged_attention(*args, spec, policy=cuda_launch.CUDA_LAUNCH), own)
        assert tile() == (32, 8, 3)
        launches.clear()
        attention.paged_attention(*args, spec, policy=cuda_launch.CUDA_LAUNCH, block_q=4, num_warps=4)
        assert tile() == (4, 4, 3)
        launches.clear()
        attention.paged_attention(*args, spec, policy=cuda_launch.CUDA_LAUNCH_UNTUNED)
        assert tile()[0] != 32                               # the rule's tile: the untuned policy never reads it
        launches.clear()
        decode = _prefill_call([1, 1], hq=4, hkv=2, d=16, page=16)   # one token a sequence: decode-shaped
        attention.paged_attention(*decode, spec, policy=cuda_launch.CUDA_LAUNCH)
        assert tile()[0] != 32
    finally:
        cuda_launch._prefill_config.cache_clear()
