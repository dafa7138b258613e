"""Prefill's wide-tile rule (``attention._prefill_wide_tile``): 128 query rows on 8 warps where those programs fit
one wave on the multiprocessors and 64-row programs do not. Launch shapes never change the bits (the GPU check is
bench/prefill_launch_gpu.py, every variant against the default; the interpreter's is test_cuda_interpreter.py's
query-tile sizes), so this checks only which shape the rule picks, on the cells it was fitted to (an H100, 132
multiprocessors) and on the cases it must leave alone."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from hal.contract import load_contract  # noqa: E402
from hal.kernels import attention  # noqa: E402
from hal.kernels.policy import LaunchPolicy  # noqa: E402

PREFILL = dict(head_split=1, heads_fastest=True, splits_per_program=1, tma=True, rows=64, num_warps=4,
               num_stages=2, decode=False)
SMS = 132


def _rows(tokens, q_heads, kv_heads, head_dim, num_seqs=1, sms=SMS, shape=PREFILL):
    heads = q_heads // kv_heads   # prefill lays a group out whole: packed, or a power of two with no padding
    return attention._prefill_wide_tile(shape, tokens, num_seqs, heads, head_dim, kv_heads, sms)["rows"]


@pytest.mark.parametrize("tokens, q_heads, kv_heads", [(384, 32, 8), (512, 32, 8), (512, 32, 4), (1024, 16, 8),
                                                      (512, 24, 8)])
def test_wide_tiles_where_they_fit_one_wave_and_64_rows_do_not(tokens, q_heads, kv_heads):
    assert _rows(tokens, q_heads, kv_heads, 128) == 128


@pytest.mark.parametrize("tokens, q_heads, kv_heads, head_dim", [
    (640, 32, 8, 128), (1024, 32, 8, 128), (8192, 32, 8, 128),   # 128-row programs need a second wave
    (256, 32, 8, 128), (512, 16, 2, 128), (512, 16, 8, 128),     # 64-row programs already fit one wave
    (512, 32, 8, 64),                                            # head dim 64: lost 0.91x
    (512, 32, 32, 128)])                                         # one query head a KV head: lost 0.92x
def test_64_rows_elsewhere(tokens, q_heads, kv_heads, head_dim):
    assert _rows(tokens, q_heads, kv_heads, head_dim) == 64


def test_the_rule_counts_the_programs_of_every_sequence():
    """Two 512-token prompts at 32/8 heads: 256 programs of 128 rows, a second wave: 64 rows stay."""
    assert _rows(512, 32, 8, 128) == 128
    assert _rows(1024, 32, 8, 128, num_seqs=2) == 64


def test_the_rule_leaves_decode_other_tiles_and_cpu_tensors_alone():
    decode = dict(PREFILL, rows=16, num_stages=5, decode=True)
    assert attention._prefill_wide_tile(decode, 512, 1, 4, 128, 8, SMS) is decode
    short_prompts = dict(PREFILL, rows=32)                      # the 32-row rule for short prompts, GQA 2
    assert attention._prefill_wide_tile(short_prompts, 512, 1, 4, 128, 8, SMS) is short_prompts
    assert _rows(512, 32, 8, 128, sms=0) == 64                  # no multiprocessors: CPU tensors
    wide = attention._prefill_wide_tile(PREFILL, 512, 1, 4, 128, 8, SMS)
    assert (wide["rows"], wide["num_warps"], wide["num_stages"]) == (128, 8, 2)
    assert PREFILL["rows"] == 64, "the rule must not change the shape it was given"


class _Policy(LaunchPolicy):
    """132 multiprocessors (an H100 or H200), and optionally a query tile of its own (as the ascend policy sets)."""

    def __init__(self, block_q=None):
        self.block_q = block_q

    def multiprocessors(self, device):
        return SMS

    def attention_block_q(self, q, k_cache, query_start_loc, spec):
        return self.block_q


def _launched_tile(monkeypatch, policy, tokens=512, q_heads=32, kv_heads=8, head_dim=128, **overrides):
    """(ROWS, num_warps) of the attention kernel launch that ``paged_attention`` makes for one causal prompt, with
    the GPU path's launch choices (INTERPRET off) and the launch captured instead of run."""
    launches = []
    monkeypatch.setattr(attention, "INTERPRET", False)
    monkeypatch.setattr(attention, "_tma_ok", lambda *args: False)
    monkeypatch.setattr(attention, "launch", lambda kernel, grid, *args, **meta: launches.append(meta))
    page = 16
    pages = -(-tokens // page)
    q = torch.zeros(tokens, q_heads, head_dim, dtype=torch.bfloat16)
    cache = torch.zeros(pages, page, kv_heads, head_dim, dtype=torch.bfloat16)
    attention.paged_attention(q, cache, cache, torch.tensor([0, tokens], dtype=torch.int32),
                              torch.tensor([tokens], dtype=torch.int32),
                              torch.arange(pages, dtype=torch.int32).view(1, pages), head_dim ** -0.5,
                              load_contract("bf16-dense-v1").attention, policy=policy, **overrides)
    (meta,) = launches
    return meta["ROWS"], meta["num_warps"]


def test_paged_attention_takes_the_rule_for_its_own_tile_only(monkeypatch):
    assert _launched_tile(monkeypatch, _Policy()) == (128, 8)
    assert _launched_tile(monkeypatch, _Policy(), tokens=1024) == (64, 4)        # a second wave: 64 rows
    assert _launched_tile(monkeypatch, _Policy(block_q=16)) == (64, 4)           # the policy's tile
    assert _launched_tile(monkeypatch, _Policy(), block_q=16) == (64, 4)         # the caller's tile
