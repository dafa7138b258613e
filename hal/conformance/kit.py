"""Helpers shared by the kit's test modules: run a named check, turn problems into a failure with a repro,
and the awkward sizes hypothesis draws from."""

from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st

# A skip reason that starts with DECLARED is a capability the backend declared missing (``Backend.unsupported``):
# the report shows it as "unsupported", which does not break conformance. Any other skip does.
from hal.conformance.report import DECLARED, NOT_IN_CONTRACT
from hal.conformance.runner import CHECKS, FP8_MOE_OPS, FP8_OPS, MOE_OPS, OP_OF, ROW_OPS, repro_command
from hal.errors import UnsupportedError

# Sizes that straddle tiles and thresholds: 1, primes, powers of two and their neighbours.
# "tiny" is for kernels run by an interpreter on the CPU (CI): small shapes, the same edges.
AWKWARD = {
    "tiny": [1, 2, 7, 16, 17, 31, 63, 64, 65, 129],
    "quick": [1, 2, 7, 16, 17, 31, 63, 64, 65, 127, 128, 129, 257, 511, 512, 513, 1000, 1024],
}
AWKWARD["full"] = AWKWARD["quick"] + [2047, 2048, 2049, 4095, 4096, 4097, 5000]
OUT_FEATURES = {"tiny": [1, 7, 16, 33], "quick": [1, 7, 16, 33, 64, 129, 256]}
OUT_FEATURES["full"] = OUT_FEATURES["quick"]


def widths(depth: str):
    return st.sampled_from(AWKWARD[depth])


def out_features(depth: str):
    return st.sampled_from(OUT_FEATURES[depth])


def skip_unless_in_contract(backend, op: str) -> None:
    """An MoE op under a contract without [moe], an FP8 op under one without [fp8]: the report's "not in
    the contract" (not a failure)."""
    needs = ((MOE_OPS, ("moe",), "bf16-moe-v1"), (FP8_OPS, ("fp8",), "bf16-fp8-v1"),
             (FP8_MOE_OPS, ("moe", "fp8"), "bf16-moe-fp8-v1"))
    for ops, sections, contract in needs:
        missing = [s for s in sections if backend.contract is None or getattr(backend.contract, s) is None]
        if op in ops and missing:
            pytest.skip(f"{NOT_IN_CONTRACT}{op}: contract {backend.contract} has no "
                        f"{' or '.join(f'[{s}]' for s in missing)} section (run the kit with --contract {contract} "
                        f"for these ops)")


def kv_cache_of(op: str) -> str:
    """The KV cache an attention op of the kit writes and reads (``checks.AttentionCase.kv_cache``)."""
    return "fp8" if op == "fp8_attention" else "auto"


def row_op_cases(backend, depth: str, op: str) -> dict:
    """Hypothesis strategies for the row functions of ``op`` (``checks.op_row_functions``): which
    variant, row width, output features (GEMM), dtype and seed."""
    skip_unless_in_contract(backend, op)
    variants = [v for v in ROW_OPS if OP_OF[v] == op]
    return dict(row_op=st.sampled_from(variants), width=widths(depth), out=out_features(depth),
                dtype=st.sampled_from(dtypes_for(backend, op)), seed=st.integers(0, 2 ** 16))


def fit_width(row_op: str, width: int) -> int:
    """SiLU*up ([g | u]) and rotary (pairs) need an even width; group-limited routing four groups of at
    least two experts (the width is the expert count)."""
    if row_op == "moe_route grouped":
        return max(8, -(-width // 4) * 4)
    return width + 1 if row_op in ("silu_mul", "rotary") and width % 2 else width



# Examples the backend refused (UnsupportedError) in the running test; ``run_examples`` fails the test on them.
_refused: list[str] = []


def declared_unsupported(backend, op: str, dtype: str) -> bool:
    return any(o == op and str(d).replace("torch.", "") == dtype for o, d in getattr(backend, "unsupported", ()))


def dtypes_of(backend, op: str | None = None) -> list[str]:
    """The dtypes the kit tests ``op`` with: realised by the backend, covered by its contract and not
    declared unsupported for ``op``."""
    realised = {str(d).replace("torch.", "") for d in backend.dtypes}
    contract = set(backend.contract.header.activation_dtypes) if backend.contract else {"bfloat16", "float32"}
    return sorted(d for d in realised & contract if op is None or not declared_unsupported(backend, op, d))


def dtypes_for(backend, op: str) -> list[str]:
    """``dtypes_of(backend, op)``; skip the test (as declared) when the backend declared every one missing."""
    dtypes = dtypes_of(backend, op)
    if not dtypes:
        pytest.skip(f"{DECLARED}{op} for every dtype ({backend.name}.unsupported = {backend.unsupported!r})")
    return dtypes


def run_examples(backend, test) -> None:
    """Run a hypothesis-decorated ``test``; then fail if the backend refused any example.

    A refusal (UnsupportedError) is not a pass and must not skip the whole test: each refused example
    is recorded and the run goes on, so the failure lists what was refused. A capability that is
    really missing is declared in ``Backend.unsupported`` and then never drawn."""
    _refused.clear()
    test()
    if _refused:
        listed = "\n".join(f"  - {r}" for r in _refused[:5])
        more = f"\n  ... and {len(_refused) - 5} more" if len(_refused) > 5 else ""
        pytest.fail(f"backend {backend.name!r} refused {len(_refused)} example(s) with UnsupportedError without "
                    f"declaring the capability missing:\n{listed}{more}\nA refusal is not conformance: realise "
                    f"these cases, or declare a missing (op, dtype) in {type(backend).__name__}.unsupported.",
                    pytrace=False)


def run_check(check: str, backend, **params) -> None:
    """Run one check; record an UnsupportedError as a refused example; fail with the problems and a repro."""
    try:
        problems = CHECKS[check](backend, **params)
    except UnsupportedError as exc:
        _refused.append(f"{check} {params}: {exc}")
        return
    except torch.cuda.OutOfMemoryError as exc:  # never a skip
        pytest.fail(f"out of memory in {check} {params}: {exc}")
    if problems:
        listed = "\n".join(f"  - {p}" for p in problems[:8])
        more = f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else ""
        pytest.fail(f"{check} failed on backend {backend.name!r} ({len(problems)} problems):\n{listed}{more}\n"
                    f"repro: {repro_command(check, backend, params)}", pytrace=False)
