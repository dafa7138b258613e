"""The conformance kit, run as users run it (``hal conformance`` in a subprocess), on three backends:
``reference`` must conform; ``torch`` (stock kernels) must fail levels 2 and 3; the deliberately
broken example backend must be caught at the right levels, with a repro that reproduces."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def hal_cli(*args: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAL_")}
    env["CI"] = "1"  # derandomised
    if pythonpath:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([sys.executable, "-m", "hal.cli", *args], env=env, capture_output=True, text=True,
                          timeout=900)


def run_kit(backend: str, tmp_path: Path, pythonpath: Path | None = None) -> tuple[int, dict, str]:
    report = tmp_path / f"{backend}.json"
    out = hal_cli("conformance", "--backend", backend, "--json", str(report), pythonpath=pythonpath)
    assert report.exists(), out.stdout[-3000:] + out.stderr[-3000:]
    return out.returncode, json.loads(report.read_text()), out.stdout


def statuses(data: dict, level: int) -> dict[str, str]:
    return {op: cells[str(level)]["status"] for op, cells in data["results"].items() if str(level) in cells}


def test_kit_passes_on_reference_and_writes_both_reports(tmp_path):
    rc, data, stdout = run_kit("reference", tmp_path)
    assert rc == 0, stdout[-4000:]
    assert data["summary"]["ok"] and data["summary"]["fail"] == 0
    header = data["header"]
    assert header["backend"] == "reference" and header["contract"] == "bf16-dense-v1"
    assert re.fullmatch(r"[0-9a-f]{64}", header["contract_fingerprint"])
    for level in (1, 2, 5):
        assert {"linear", "rms_norm", "log_softmax", "topk"} <= set(statuses(data, level)), level
    assert statuses(data, 3) == {"attention": "pass", "decoder block": "pass"}
    assert statuses(data, 6) == {"contract": "pass"}
    markdown = (tmp_path / "reference.md").read_text()
    assert "| op | 1. determinism | 2. batch invariance |" in markdown and "**CONFORMS**" in markdown


def test_negative_control_kit_fails_torch_at_levels_2_and_3(tmp_path):
    rc, data, stdout = run_kit("torch", tmp_path)
    assert rc == 1
    assert statuses(data, 2)["linear"] == "fail"
    assert statuses(data, 3) == {"attention": "fail", "decoder block": "fail"}
    assert statuses(data, 6) == {"contract": "fail"}  # a baseline binds no contract
    assert "repro: " in stdout


@pytest.fixture(scope="module")
def broken_backend_path(tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("broken")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(ROOT / "examples" / "broken_backend")], check=True)
    return target


def test_broken_example_is_caught_at_the_right_levels_with_a_working_repro(tmp_path, broken_backend_path):
    rc, data, stdout = run_kit("broken-threshold", tmp_path, pythonpath=broken_backend_path)
    assert rc == 1
    # Every single call is deterministic and accurate: the invariances break. (Its large-batch top-k
    # also breaks ties toward the higher index, which the accuracy level checks against the contract.)
    assert set(statuses(data, 1).values()) == {"pass"}
    assert {op for op, s in statuses(data, 5).items() if s != "pass"} == {"topk"}
    assert statuses(data, 6) == {"contract": "pass"}
    level2 = statuses(data, 2)
    assert {op for op, s in level2.items() if s == "fail"} >= {"linear", "log_softmax", "sum"}, level2
    assert level2["attention"] == "pass" and level2["rotary"] == "pass"  # untouched by the threshold
    assert statuses(data, 3)["attention"] == "fail"  # the decode-only KV chunk
    # The printed repro re-runs the failing check on its own and fails the same way.
    failure = data["results"]["linear"]["2"]["failures"][0]["message"]
    command = failure[failure.index("repro: ") + len("repro: "):].splitlines()[0]
    argv = shlex.split(command)
    assert argv[1:3] == ["-m", "hal.conformance.runner"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAL_")}
    env["PYTHONPATH"] = str(broken_backend_path)
    rerun = subprocess.run([sys.executable, *argv[1:]], env=env, capture_output=True, text=True)
    assert rerun.returncode == 1 and "FAIL linear" in rerun.stdout, rerun.stdout + rerun.stderr


def test_without_a_backend_the_kit_stops_at_once_and_says_how_to_choose():
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAL_")}
    out = subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "hal.conformance", "-p", "no:cacheprovider"],
                         env=env, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 4
    text = out.stdout + out.stderr
    assert "needs a backend: pass --hal-backend NAME" in text and "reference  available" in text
