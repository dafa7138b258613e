"""The conformance kit at tiny depth on the cuda backend under Triton's CPU interpreter (CI).

Its own file (the suite's slowest test, ~5 min on 2 cores): pytest-xdist's ``--dist loadfile`` then runs it
on one worker beside the other interpreter tests on the other."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def test_conformance_kit_tiny_passes_on_cuda_under_the_interpreter(tmp_path):
    report = tmp_path / "cuda.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAL_")}
    env.update(TRITON_INTERPRET="1", CI="1")
    out = subprocess.run([sys.executable, "-m", "hal.cli", "conformance", "--backend", "cuda", "--tiny",
                          "--json", str(report)], env=env, capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-3000:]
    data = json.loads(report.read_text())
    assert data["summary"]["ok"] and data["header"]["device"] == "cpu (triton interpreter)"
    levels = {level for cells in data["results"].values() for level in cells}
    assert levels == {"1", "2", "3", "4", "5", "6"}
