"""Bitwise invariants of the reference backend on CPU, each with a negative control that fails.

Negative controls fail for a reason this project controls, on every host: ``broken-threshold``
(examples/broken_backend: reference numerics that switch chunk sizes above 64 rows and in decode)
and planted implementations below (a decode whose KV split differs from prefill's). Whether the
host's *stock* kernels (oneDNN / MKL GEMM, SDPA) are invariant depends on the CPU and its BLAS (on
some AMD EPYC hosts oneDNN's bf16 GEMM is batch-invariant): that is reported as a host fact in the
warnings summary, never asserted.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from hal_broken_backend import BrokenThresholdBackend

from hal.backends.reference import ReferenceBackend
from hal.backends.stock import TorchBackend
from hal.conformance.checks import AttentionCase, attention_phases, op_row_functions, random_tensor, row_invariance
from hal.contract import load_contract

from conftest import HostFact

BATCHES = [1, 2, 7, 16, 17, 33, 64, 65, 129, 1000]
CONTRACT = load_contract()


def row_failures(backend, width, out_features, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    fns = op_row_functions(backend, width, out_features, dtype, g)
    rows = random_tensor((400, width), dtype, g)
    return {op: row_invariance(op, fn, rows, BATCHES, g) for op, fn in fns.items()}


# (width, out_features): odd and power-of-two K and N, straddling k_chunk 512 and row blocks
SHAPES = [(64, 16), (129, 33), (512, 64), (513, 65), (1000, 128)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("width, out_features", SHAPES)
def test_reference_rows_are_batch_invariant(dtype, width, out_features):
    failures = row_failures(ReferenceBackend(CONTRACT), width, out_features, dtype, seed=width)
    bad = [str(m) for ms in failures.values() for m in ms]
    assert not bad, "\n".join(bad)


def test_host_fact_stock_gemm_batch_invariance():
    """Informational: whether this host's stock GEMM changes a row's bits with its batch. The
    project's own negative control for GEMM is the threshold backend below."""
    for dtype, width in ((torch.bfloat16, 4096), (torch.float32, 512)):
        failures = row_failures(TorchBackend(None), width, 1024, dtype)
        verdict = "changes bits with the batch" if failures["linear"] else "happens to be batch-invariant"
        warnings.warn(HostFact(f"stock F.linear {dtype} K={width} on this host {verdict}"))


def test_negative_control_threshold_backend_is_caught_for_every_reduction_op():
    failures = {}
    for dtype in (torch.bfloat16, torch.float32):  # a 1-ulp fp32 change often hides under bf16 rounding
        for op, ms in row_failures(BrokenThresholdBackend(CONTRACT), 1000, 128, dtype).items():
            failures.setdefault(op, []).extend(ms)
    caught = {op for op, ms in failures.items() if ms}
    # rotary is pointwise: there is no reduction structure to switch, the broken backend keeps it
    expected = set(failures) - {"rotary"}
    assert caught == expected, f"not caught: {sorted(expected - caught)}"
    # and the failure names the batch size past the threshold
    assert all(m.params["batch"] > 64 for ms in failures.values() for m in ms)


# -- phase consistency ----------------------------------------------------------------------------

PHASE_CASES = [
    # (seq_len, q_heads, kv_heads, head_dim, dtype): crossing kv_chunk (64) and kv_split (512)
    (150, 4, 2, 64, torch.bfloat16),
    (530, 4, 1, 128, torch.bfloat16),
    (100, 2, 2, 64, torch.float32),
]


@pytest.mark.parametrize("seq_len, q_heads, kv_heads, head_dim, dtype", PHASE_CASES)
def test_reference_attention_is_phase_consistent(seq_len, q_heads, kv_heads, head_dim, dtype):
    case = AttentionCase(seq_len, q_heads, kv_heads, head_dim, dtype, seed=seq_len)
    cuts = [c for c in (1, 63, 64, 65, 511, 512, 513) if c < seq_len]
    failures = attention_phases(ReferenceBackend(CONTRACT), case, cuts, page_sizes=[16, 64, 5],
                                decode_from=max(1, seq_len - 24))
    assert not failures, "\n".join(map(str, failures))


def test_host_fact_stock_sdpa_phase_consistency():
    """Informational: whether this host's stock SDPA gives a token other bits in decode than in
    prefill. The project's own negative controls are the planted backends below."""
    for dtype in (torch.bfloat16, torch.float32):
        case = AttentionCase(300, 4, 2, 64, dtype, seed=3)
        failures = attention_phases(TorchBackend(None), case, [100], page_sizes=[16], decode_from=200, mates=0)
        verdict = "differs between prefill and decode" if failures else "happens to be phase-consistent"
        warnings.warn(HostFact(f"stock SDPA {dtype} on this host {verdict}"))


class DecodeSplitBackend(ReferenceBackend):
    """Planted bug: decode-only calls split the keys at half the contract's kv_split (as a split-KV
    decode kernel that picks its own split does); prefill follows the contract."""

    def __init__(self, contract, device=None):
        super().__init__(contract, device)
        half = dataclasses.replace(contract.attention, kv_split=contract.attention.kv_split // 2)
        self._decode = ReferenceBackend(dataclasses.replace(contract, attention=half), device)

    def attention(self, q, k_cache, v_cache, meta, *, scale):
        if bool((meta.query_start_loc.diff() == 1).all()):
            return self._decode.attention(q, k_cache, v_cache, meta, scale=scale)
        return super().attention(q, k_cache, v_cache, meta, scale=scale)


def test_negative_control_decode_with_another_kv_split_is_caught():
    # decode tokens at positions 520..529: past the second split start of the half split (256, 512)
    case = AttentionCase(530, 4, 1, 64, torch.bfloat16, seed=530)
    failures = attention_phases(DecodeSplitBackend(CONTRACT), case, [], page_sizes=[16], decode_from=520, mates=0)
    assert [m.what for m in failures] == ["attention: prefill 520 then decode token by token vs full prefill"]


def test_negative_control_threshold_backend_decode_is_caught():
    case = AttentionCase(150, 4, 2, 64, torch.bfloat16, seed=150)
    failures = attention_phases(BrokenThresholdBackend(CONTRACT), case, [64], page_sizes=[16],
                                decode_from=120, mates=0)
    assert [m.what for m in failures] == ["attention: prefill 120 then decode token by token vs full prefill"]
