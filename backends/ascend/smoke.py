"""A two-minute NPU smoke run, before the conformance kit: ``python -m hal.backends.ascend.smoke``.

For each op the backend calls it prints the vendored schema (api_facts.toml, with source and
version) and the schema the installed op reports, calls it once on tiny inputs with exactly the
arguments the backend passes (through the same schema check), and then applies and reads back every
pinned setting. Exit status 0 only if every step passed. Nothing of this has run on an NPU yet: the
CPU tests run it against a fake stack (``run(stack)``), which proves the wiring, not the NPU.
"""

from __future__ import annotations

import sys
from typing import Callable

import torch

from hal.backends.ascend import api_facts


def _installed_schema(fn) -> str:
    """What the installed op says about itself: a torch op's schema, else its docstring's first line."""
    for attr in ("_schema", "default"):
        target = getattr(fn, attr, None)
        if target is not None:
            return str(getattr(target, "_schema", target))
    doc = (getattr(fn, "__doc__", None) or "").strip().splitlines()
    return doc[0] if doc else "(no schema reported)"


def steps(ops, torch_npu, device) -> list[tuple[str, Callable[[], object]]]:
    """(op name, call) for every op the cann path calls, with the backend's own arguments."""
    from hal.backends.ascend.cann_ops import CannOps
    from hal.contract import load_contract
    from hal.kvcache import build_metadata

    cann = CannOps(load_contract("bf16-ascend-v1"), "fia_batch_invariant", ops=ops, torch_npu=torch_npu)
    x = torch.randn(3, 1100, device=device).bfloat16()
    w = torch.randn(5, 1100, device=device).bfloat16()
    cache = torch.randn(2, 128, 2, 64, device=device).bfloat16()
    q = torch.randn(1, 4, 64, device=device).bfloat16()
    meta = build_metadata([1], [130], [[1, 0]], device)
    return [
        ("npu_mm_batch_invariant", lambda: cann.linear(x, w, None, torch.float32)),
        ("npu_reduce_sum_batch_invariant", lambda: cann.sum(x)),
        ("npu_rms_norm", lambda: cann.rms_norm(x, torch.ones(1100, device=device).bfloat16(), 1e-6, None)),
        ("npu_fused_infer_attention_score_batch_invariant", lambda: cann.attention(q, cache, cache, meta, 0.125)),
    ]


def run(ops, torch_npu, surface, device="npu", out=print) -> bool:
    from hal.backends.ascend import settings

    ok = True
    for name, call in steps(ops, torch_npu, device):
        entry = api_facts.op(name)
        out(f"== {name}\n   vendored ({entry['version']}; {entry['source']}; confirmed={entry['confirmed']}): "
            f"positional {entry.get('positional')}, keywords {len(entry.get('keywords', []))}")
        fn = getattr(ops, name, None) or getattr(torch_npu, name, None)
        out(f"   installed: {_installed_schema(fn)}")
        try:
            result = call()
            first = result[0] if isinstance(result, tuple) else result
            out(f"   called once: ok, {tuple(first.shape)} {first.dtype}, finite={bool(torch.isfinite(first).all())}")
        except Exception as exc:  # report every step, then fail
            ok = False
            out(f"   called once: FAILED {type(exc).__name__}: {exc}")
    try:
        readback = settings.apply_and_verify(surface)
        for key, value in readback.items():
            out(f"== setting {key} = {value!r}")
    except Exception as exc:
        ok = False
        out(f"== settings: FAILED {exc}")
    return ok


def main() -> int:  # pragma: no cover - needs an NPU
    import batch_invariant_ops  # noqa: F401
    import torch_npu

    from hal.backends.ascend import settings

    return 0 if run(torch.ops.batch_invariant_ops, torch_npu, settings.real_surface()) else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
