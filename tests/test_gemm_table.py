"""The GEMM launch table's wave rule (hal/kernels/gemm.py ``_config`` above 64 rows): launch choices never
change the bits (tests/test_cuda_interpreter.py checks the candidate set), so this checks only the choice."""

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
