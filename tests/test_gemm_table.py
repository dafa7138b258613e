"""The GEMM launch table's rules (hal/kernels/gemm.py ``_config``: the wave rule above 64 rows, split-K for narrow
weight-read-bound GEMMs up to 64 rows): launch choices never change the bits (tests/test_cuda_interpreter.py checks
the candidate set and the split launches), so this checks only the choice."""

from __future__ import annotations

import pytest

from hal.api import create_backend
from hal.kernels import gemm

H200_SMS = 132


@pytest.fixture
def spec():
    return create_backend("reference", "bf16-dense-v1").contract.gemm


def _tile(spec, m, n, monkeypatch, sms=H200_SMS):
    monkeypatch.setattr(gemm, "INTERPRET", False)      # the GPU's table, not the interpreter's one tile
    cfg = gemm._config(m, n, 4096, spec, True, sms)
    return cfg["BLOCK_M"], cfg["BLOCK_N"]


def test_a_tile_that_spills_into_a_nearly_empty_wave_is_not_chosen(spec, monkeypatch):
    # 160 tiles of 128 x 256 on 132 multiprocessors need two waves, the second a fifth full (0.55x cuBLAS on
    # the H200); 128 x 128 takes three fuller waves of half-size tiles.
    assert _tile(spec, 1024, 5120, monkeypatch) == (128, 128)
    # Negative control: the old rule ("the largest tile filling nine tenths of a wave") took 128 x 256 here.
    tiles = -(-1024 // 128) * -(-5120 // 256)
    assert 10 * tiles >= 9 * H200_SMS


def test_full_waves_keep_the_largest_tile_and_few_rows_the_smallest(spec, monkeypatch):
    assert _tile(spec, 8192, 8192, monkeypatch) == (128, 256)
    assert _tile(spec, 128, 1536, monkeypatch) == (64, 64)        # 6 tiles of 128 x 256: the most programs
    assert _tile(spec, 4096, 59136, monkeypatch) == (128, 256)


def test_the_choice_is_the_least_estimated_time(spec, monkeypatch):
    for m in (65, 128, 256, 512, 1000, 2048, 4096):
        for n in (896, 1536, 4608, 5120, 17920, 27648):
            chosen = _tile(spec, m, n, monkeypatch)
            costs = {(t[0]["BLOCK_M"], t[0]["BLOCK_N"]): gemm._wave_cost(t, m, n, H200_SMS) for t in gemm._WAVE_TILES}
            assert costs[chosen] == min(costs.values()), (m, n, chosen, costs)


def test_without_a_multiprocessor_count_the_largest_tile(spec, monkeypatch):
    assert _tile(spec, 1024, 5120, monkeypatch, sms=0) == (128, 256)


def _config(spec, m, n, k, monkeypatch, sms=H200_SMS):
    monkeypatch.setattr(gemm, "INTERPRET", False)
    return gemm._config(m, n, k, spec, True, sms)


def _programs(spec, cfg, m, n, k):
    splits = -(-spec.chunk_count(k) // cfg["chunks_per_program"]) if cfg["split"] else 1
    return -(-m // cfg["BLOCK_M"]) * -(-n // cfg["BLOCK_N"]) * splits


@pytest.mark.parametrize("m, n, k", [
    *[(m, n, k) for m in (1, 16, 32) for n, k in ((1536, 8960), (896, 4864), (2048, 11008), (2048, 6144), (1024, 3072),
                                                  (1024, 2048))],
    (64, 896, 4864), (64, 1024, 2048), (64, 1024, 3072)])
def test_narrow_deep_weight_streams_split_k_over_more_multiprocessors(spec, monkeypatch, m, n, k):
    cfg = _config(spec, m, n, k, monkeypatch)
    assert cfg["split"]
    assert cfg["tma"] == (m > 16)               # descriptor tiles from 17 rows, as the direct launch's
    direct_rows = 16 if m <= 16 else 32 if m <= 32 else 64
    direct = dict(cfg, split=False, chunks_per_program=1, BLOCK_M=direct_rows, BLOCK_N=32)
    # more programs than the direct grid, within one wave
    assert _programs(spec, direct, m, n, k) < _programs(spec, cfg, m, n, k) <= H200_SMS
    # the fewest chunks per program that stay within the wave
    if cfg["chunks_per_program"] > 1:
        fewer = dict(cfg, chunks_per_program=cfg["chunks_per_program"] - 1)
        assert _programs(spec, fewer, m, n, k) > H200_SMS


@pytest.mark.parametrize("m, n, k", [
    (1, 4096, 4096),      # 128 direct programs already fill the GPU
    (16, 3584, 18944),    # 112 of 132
    (1, 2560, 9728),      # 80 of 132: the split lost 7-8% on the H100
    (1, 2048, 2048),      # 64 of 132 over 4 chunks: lost 6%
    (16, 1536, 1536),     # 3 chunks: lost 13%
    (1, 896, 896),        # 2 chunks
    (64, 2048, 6144),     # 64 rows over 64 direct programs: lost 11%
    (1, 151936, 2048),    # the logits: thousands of tiles
])
def test_no_split_where_it_lost_or_cannot_gain(spec, monkeypatch, m, n, k):
    assert not _config(spec, m, n, k, monkeypatch)["split"]


def test_without_descriptor_loads_from_17_rows_no_split(spec, monkeypatch):
    monkeypatch.setattr(gemm, "INTERPRET", False)
    assert not gemm._config(32, 1536, 8960, spec, False, H200_SMS)["split"]   # the pointer table's own tile


def test_without_a_multiprocessor_count_no_split(spec, monkeypatch):
    assert not _config(spec, 1, 1536, 8960, monkeypatch, sms=0)["split"]
