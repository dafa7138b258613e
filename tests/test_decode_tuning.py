"""Decode attention's launch search (issue #20) under Triton's CPU interpreter: the tuner's candidate set
keeps the bits, the tuner keeps the fastest bit-equal launch per shape class and refuses one that changes
bits, and the launch policy hands a tuned launch to the kernel (the call's own overrides still win).

The interpreter ignores warps, stages and register caps, so here only the launch choices that change the
program structure can differ (parallel or walked splits, splits per program, a GQA group over two
programs); the GPU side, every candidate bit-checked and timed, is ``hal tune`` / bench/decode_tune_gpu.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import backend_for_tests, plant_bit_change, spy_launches

from hal.contract import load_contract
from hal.kvcache import build_metadata

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

DENSE = load_contract("bf16-dense-v1")
FP8 = load_contract("bf16-fp8-v1")


@pytest.fixture(scope="module")
def cuda():
    return backend_for_tests("cuda")


def _decode_call(seq_lens, hq, hkv, d, page, seed=0):
    """Random bf16 K/V for sequences of ``seq_lens`` keys (pages in a shuffled order) and one query each."""
    g = torch.Generator().manual_seed(seed)
    per_seq = max(-(-n // page) for n in seq_lens)
    pages = len(seq_lens) * per_seq
    k = torch.randn(pages, page, hkv, d, generator=g).bfloat16()
    v = torch.randn(pages, page, hkv, d, generator=g).bfloat16()
    order = torch.randperm(pages, generator=g).view(len(seq_lens), per_seq).tolist()
    meta = build_metadata([1] * len(seq_lens), list(seq_lens), order)
    q = torch.randn(len(seq_lens), hq, d, generator=g).bfloat16()
    return q, k, v, meta


def _structure(config):
    """The part of a launch the interpreter runs differently (warps, stages, registers: the GPU's)."""
    return (config.get("split_parallel"), config.get("splits_per_program", 1), config.get("head_split", 1))


def test_every_decode_candidate_gives_the_same_bits(cuda):
    """``attention.decode_candidates`` for sequences crossing the contract's KV chunk (64) and split (512):
    every structurally distinct candidate gives the bits of the kernel's own launch. Negative control: a
    halved kv_split reaches the bits."""
    from hal.backends.cuda.launch import CUDA_LAUNCH
    from hal.kernels import attention

    spec = DENSE.attention
    q, k, v, meta = _decode_call([1100, 70, 530], hq=4, hkv=2, d=16, page=16)
    args = (q, k, v, meta.query_start_loc, meta.seq_lens, meta.block_table, 16 ** -0.5)
    own = attention.paged_attention(*args, spec, policy=CUDA_LAUNCH)
    max_splits = spec.split_count(meta.block_table.shape[1] * 16)
    assert max_splits == 3
    candidates = attention.decode_candidates(max_splits, group_pad=2)
    distinct = {_structure(c): c for c in candidates}
    assert set(distinct) == {(True, spp, hs) for spp in (1, 2, 4) for hs in (1, 2) if hs == 1 or spp < 4} | {
        (False, 1, 1)}
    for config in distinct.values():
        out = attention.paged_attention(*args, spec, policy=CUDA_LAUNCH, **config)
        assert torch.equal(out, own), config
    half_split = dataclasses.replace(spec, kv_split=spec.kv_split // 2)
    assert not torch.equal(attention.paged_attention(*args, half_split, policy=CUDA_LAUNCH), own)
    # one split: no parallel-split candidate (it would only add the merge kernel)
    one_split = attention.decode_candidates(1, group_pad=4)
    assert all(c["split_parallel"] is False for c in one_split) and any(c.get("head_split") for c in one_split)
    assert not any("head_split" in c for c in attention.decode_candidates(8, group_pad=1))


def test_decode_tuner_keeps_the_fastest_bit_equal_launch_and_refuses_one_that_changes_bits(cuda, tmp_path,
                                                                                           monkeypatch):
    """``tune_decode`` with a stand-in timer (each timing faster than the one before): the cache holds the last
    candidate under the cell's shape class, which every batch and context of the class shares; a cell too
    large for ``max_cache_bytes`` is skipped and reported; a candidate whose output differs stops tuning."""
    from hal.errors import HalError
    from hal.kernels import attention, tuning

    spec = DENSE.attention
    timings = iter(range(10**6, 0, -1))
    cache, report = tuning.TuneCache("cpu (interpreter)", "x"), []
    cell = (2, 600, 4, 2, 16, 16, "bf16")
    tuning.tune_decode([cell, (64, 32768, 4, 2, 16, 16, "bf16")], spec, dtype=torch.bfloat16, device="cpu",
                       cache=cache, timer=lambda fn: (fn(), next(timings))[1], progress=None, report=report,
                       max_cache_bytes=1 << 20)
    key = tuning.decode_shape_class(2, 2, 608, 4, 2, 16, 16, torch.bfloat16, torch.bfloat16, spec)
    assert key == tuning.decode_shape_class(2, 2, 1024, 4, 2, 16, 16, torch.bfloat16, torch.bfloat16, spec)
    assert key != tuning.decode_shape_class(3, 3, 608, 4, 2, 16, 16, torch.bfloat16, torch.bfloat16, spec)
    assert key != tuning.decode_shape_class(2, 2, 608, 4, 2, 16, 16, torch.bfloat16, torch.float8_e4m3fn, spec)
    candidates = attention.decode_candidates(2, 2)
    assert cache.config(key) == candidates[-1] and cache.entries[key]["candidates"] == len(candidates)
    assert len(cache.entries) == 1 and isinstance(report[-1]["skipped"], str) and report[0]["config"] == candidates[-1]
    assert [config for config, _ in report[0]["timings"]] == candidates     # every candidate's time, for rule fits

    plant_bit_change(monkeypatch, attention, "paged_attention", lambda kw: kw.get("head_split") == 2)
    with pytest.raises(HalError, match="gives other bits than the kernel's own"):
        tuning.tune_decode([cell], spec, device="cpu", cache=tuning.TuneCache("c", "x"), timer=lambda fn: 1.0,
                           progress=None)
    with pytest.raises(HalError, match="needs a contract whose"):
        tuning.tune_decode([(1, 64, 2, 1, 16, 16, "e4m3")], spec, device="cpu", cache=cache, progress=None)


def test_decode_tuner_times_the_stock_kernels_it_is_given_not_their_set_up(cuda):
    """``baseline`` is built once per cell (with the cell's paged cache) and what it returns is what is timed:
    each named stock kernel's time is reported and the fastest is ``baseline_ms``; one that raises is reported
    with its error. Negative control: the timer is handed the stock call itself, so a baseline whose set-up
    ran inside the timed call (a previous version's bug: new random K/V per timed call) would be seen here."""
    from hal.kernels import tuning

    builds, runs = [], []

    def baseline(q, batch, context, kv_heads, paged):
        builds.append((batch, context, kv_heads, paged["page"], tuple(paged["block_table"].shape)))

        def broken():
            raise RuntimeError("page size not supported")
        return {"fast": lambda: runs.append("fast"), "slow": lambda: runs.append("slow"), "broken": broken}

    def timer(fn):
        before = len(runs)
        fn()
        ran = runs[before:]
        return {("fast",): 1.0, ("slow",): 3.0}.get(tuple(ran), 2.0)   # our own launches: 2.0

    report = []
    tuning.tune_decode([(2, 600, 4, 2, 16, 16, "bf16")], DENSE.attention, device="cpu",
                       cache=tuning.TuneCache("cpu (interpreter)", "x"), timer=timer, progress=None, report=report,
                       baseline=baseline)
    assert builds == [(2, 600, 2, 16, (2, 38))]                 # once, with the cell's own paged cache
    row = report[0]
    assert row["baselines_ms"] == {"fast": 1.0, "slow": 3.0} and row["baseline_ms"] == 1.0
    assert "page size not supported" in row["baseline_errors"]["broken"]


def test_decode_tuner_reads_copies_of_a_small_cache_in_turn(cuda, monkeypatch):
    """A cache smaller than twice the L2 is timed over copies read in turn (as a decode step reads each layer's
    K/V from memory, not from the L2), ours and the stock kernel's alike; the bit checks use copy 0 only."""
    from hal.kernels import attention, tuning

    real, seen, untimed, in_timer = attention.paged_attention, [], [], [False]

    def spy(q, *a, **kw):
        (seen if in_timer[0] else untimed).append(q.data_ptr())
        return real(q, *a, **kw)
    monkeypatch.setattr(attention, "paged_attention", spy)
    cell = (1, 100, 2, 1, 16, 16, "bf16")
    cache_bytes = 2 * 7 * 16 * 1 * 16 * 2                        # 7 pages of 16 keys, one KV head of 16, K and V
    assert tuning._copies_beyond_l2(cache_bytes, "cpu") == 1 and tuning._copies_beyond_l2(10, "cpu", 15) == 3
    stock_calls, built = [], []

    def baseline(q, batch, context, kv_heads, paged):
        built.append(q.data_ptr())
        return lambda: stock_calls.append(q.data_ptr())

    def timer(fn):
        start, in_timer[0] = len(seen), True
        for _ in range(4):
            fn()
        in_timer[0] = False
        timed.append(seen[start:] if len(seen) > start else stock_calls[-4:])
        return 1.0
    timed = []
    tuning.tune_decode([cell], DENSE.attention, device="cpu", cache=tuning.TuneCache("c", "x"), timer=timer,
                       progress=None, baseline=baseline, l2_bytes=cache_bytes)      # 2 L2s of cache: 2 copies
    assert len(built) == 2 and built[0] != built[1]
    for calls in timed:                                         # ours and the stock's: copy 0, 1, 0, 1
        assert calls[0] == calls[2] != calls[1] == calls[3]
    assert len(timed) == len(attention.decode_candidates(1, 2)) + 2        # the rule, each candidate, the stock
    assert untimed and set(untimed) == {built[0]}                 # the bit checks (untimed runs) read copy 0


def test_decode_tuner_times_fp8_caches_by_the_contract_write_rule(cuda):
    """An FP8 cell's cache is written by [fp8]'s rule (per token-head scales), its candidates bit-checked
    against the kernel's own launch over that cache."""
    from hal.kernels import attention, tuning

    cache = tuning.TuneCache("cpu (interpreter)", "x")
    timings = iter(range(10**6, 0, -1))
    tuning.tune_decode([(1, 600, 2, 1, 16, 16, "e4m3")], FP8.attention, fp8=FP8.fp8, device="cpu", cache=cache,
                       timer=lambda fn: (fn(), next(timings))[1], progress=None)
    key = tuning.decode_shape_class(1, 1, 608, 2, 1, 16, 16, torch.bfloat16, torch.float8_e4m3fn, FP8.attention)
    assert cache.config(key) == attention.decode_candidates(2, 2)[-1]


@pytest.mark.parametrize("contract, f16_operands", [("bf16-fp8-v1", False), ("bf16-fp8-v2", True)])
def test_decode_tuner_reads_fp8_caches_by_the_contract_read_rule(cuda, monkeypatch, contract, f16_operands):
    """Every launch the tuner times or bit-checks reads the FP8 cache by the contract's [fp8].kv_dequant:
    bf16-fp8-v2's f16 operands (other bits than v1's read), v1's dequantised tiles (the control)."""
    from hal.kernels import attention, tuning

    spec = load_contract(contract)
    seen = []
    real = attention.paged_attention

    def recording(*args, **kwargs):
        seen.append(kwargs.get("f16_operands", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "paged_attention", recording)
    tuning.tune_decode([(1, 600, 2, 1, 16, 16, "e4m3")], spec.attention, fp8=spec.fp8, device="cpu",
                       cache=tuning.TuneCache("cpu (interpreter)", "x"), timer=lambda fn: (fn(), 1.0)[1], progress=None)
    assert seen and set(seen) == {f16_operands}


def test_the_launch_policy_hands_a_tuned_decode_launch_to_the_kernel(cuda, monkeypatch):
    """A tuning cache entry for the call's shape class reaches the kernel's launch (grid and meta-parameters);
    the call's own overrides replace it; a prefill-shaped call never asks. The bits stay the rule's."""
    from hal.backends.cuda import launch as cuda_launch
    from hal.kernels import attention, tuning

    spec = DENSE.attention
    q, k, v, meta = _decode_call([1100, 70], hq=4, hkv=2, d=16, page=16)
    args = (q, k, v, meta.query_start_loc, meta.seq_lens, meta.block_table, 16 ** -0.5, spec)
    own = attention.paged_attention(*args, policy=cuda_launch.CUDA_LAUNCH)
    key = tuning.decode_shape_class(2, 2, meta.block_table.shape[1] * 16, 4, 2, 16, 16, torch.bfloat16,
                                    torch.bfloat16, spec)
    tuned = dict(split_parallel=True, splits_per_program=2, head_split=2, num_warps=8, num_stages=3)
    cache = tuning.TuneCache("cpu (interpreter)", "x", {key: {"config": tuned}})
    monkeypatch.setattr(cuda_launch, "_tuning_cache", lambda: cache)
    cuda_launch._decode_config.cache_clear()
    launches = spy_launches(monkeypatch, attention)
    try:
        out = attention.paged_attention(*args, policy=cuda_launch.CUDA_LAUNCH)
        assert torch.equal(out, own)
        (kernel, grid, meta_args), merge = launches[0], launches[1]
        assert kernel is attention._attention_kernel and merge[0] is attention._merge_kernel
        assert meta_args["HEAD_SPLIT"] == 2 and meta_args["SPLITS_PER_PROGRAM"] == 2
        assert meta_args["num_warps"] == 8 and meta_args["num_stages"] == 3
        assert grid == (2 * 2, 2, 2)                         # (kv heads x head split, split programs, tiles)
        launches.clear()
        attention.paged_attention(*args, policy=cuda_launch.CUDA_LAUNCH, split_parallel=False, num_warps=4)
        assert len(launches) == 1 and launches[0][2]["num_warps"] == 4 and launches[0][2]["HEAD_SPLIT"] == 2
        launches.clear()
        attention.paged_attention(*args, policy=cuda_launch.CUDA_LAUNCH_UNTUNED)
        assert launches[0][2]["HEAD_SPLIT"] == 1                  # the tuner's baseline never reads the cache
    finally:
        cuda_launch._decode_config.cache_clear()


def test_the_decode_rule_always_picks_a_launch_the_tuner_bit_checks():
    """``attention._decode_launch`` chooses among ``decode_candidates`` (whose bits the tuner and the test
    above check against each other) for every program count, split count, head dim, page and cache format
    the rule distinguishes (FP8 caches read either way); so the rule's choices need no bit check of their own.
    The negative control: a launch outside the set (16 warps) is recognised as outside it."""
    from hal.kernels import attention

    def normal(config, max_splits=4):
        return attention.decode_launch_key(config, max_splits)

    sms, picked = 132, set()
    for max_splits in (1, 2, 3, 4, 16, 64):
        for walkers in (1, 8, 32, 64, 66, 128, 256, 396, 512, 2048):
            for head_dim in (32, 64, 96, 128, 256):
                for page in (16, 32, 64, 128):
                    for kv_fp8, f16_operands in ((False, False), (True, False), (False, True)):
                        pick = attention._decode_launch(walkers * max_splits, sms, kv_fp8, max_splits=max_splits,
                                                        head_dim=head_dim, page=page, f16_operands=f16_operands)
                        allowed = {normal(c, max_splits) for c in attention.decode_candidates(max_splits, 4)}
                        assert normal(pick, max_splits) in allowed, (walkers, max_splits, head_dim, page, kv_fp8,
                                                                     pick)
                        picked.add(normal(pick, max_splits))
    assert len(picked) >= 8                                   # the rule does use the search's launches
    assert normal(dict(split_parallel=True, num_warps=16)) not in {normal(c) for c in attention.decode_candidates(4, 4)}


def test_graph_timing_waits_for_queued_input_writes(monkeypatch):
    """The tuner's timer (and every benchmark's) synchronises before triton's do_bench_cudagraph, whose new
    stream does not wait for the current one: hal tune read a block table before randperm had written it
    (an illegal memory access on an H100, bench/results/h100-2026-12-07-gemm-split/)."""
    import triton.testing

    from hal.kernels import tuning

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append("synchronize"))
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", lambda fn, **kw: calls.append("bench") or 0.5)
    assert tuning._device_ms(lambda: None) == 0.5
    assert calls == ["synchronize", "bench"]
