"""Discovery through real installed entry points, and the backend selection order.

The plugin packages under tests/plugins/ are pip-installed into temporary target folders; each
check runs in a subprocess whose PYTHONPATH includes them, exactly as an installed vendor package.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PLUGINS = Path(__file__).parent / "plugins"


def _pip_install(source: Path, target: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(source)], check=True, capture_output=True, text=True)
    return target


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    root = tmp_path_factory.mktemp("plugins")
    dummy = _pip_install(PLUGINS / "dummy", root / "dummy")
    conflict = _pip_install(PLUGINS / "conflict", root / "conflict")
    return dummy, conflict


def run(code: str, *paths: Path, **env: str) -> subprocess.CompletedProcess:
    # Without TRITON_INTERPRET (which conftest sets for the interpreter tests) the cuda backend
    # must report itself unavailable on a machine without a GPU.
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HAL_") and k != "TRITON_INTERPRET"}
    environ.update(env)
    environ["PYTHONPATH"] = os.pathsep.join(str(p) for p in paths)
    return subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True)


def selected(*paths, explicit: str | None = None, **env) -> str:
    out = run(f"import hal.api as a; print(a.create_backend({explicit!r}).name)", *paths, **env)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_builtin_backends_are_discovered_and_accelerators_are_not_claimed_available():
    out = run("import json; from hal.registry import discover\n"
              "print(json.dumps({n: [i.package, i.probe().available] for n, i in discover().items()}))")
    found = json.loads(out.stdout)
    assert found["reference"] == ["hal-numerics", True]
    assert found["torch"] == ["hal-numerics", True]
    # No GPU or NPU here (and no TRITON_INTERPRET): the accelerator backends must say unavailable.
    assert found["cuda"][1] is False and found["ascend"][1] is False


def test_installed_plugin_is_listed_by_doctor_with_package_version_and_import_error(installed):
    dummy, _ = installed
    out = run("from hal.cli import main; raise SystemExit(main(['doctor']))", dummy)
    lines = {line.split()[0]: line for line in out.stdout.splitlines() if line.strip()}
    assert "hal-dummy-backend 1.2.3" in lines["dummy"] and "available" in lines["dummy"]
    assert "unavailable: import of hal_dummy_backend.broken:BrokenBackend failed: ImportError: " \
           "libdummy_runtime.so" in lines["broken-import"]
    assert out.returncode == 1  # a broken plugin is a problem worth a non-zero exit


def test_selecting_a_plugin_whose_import_fails_reports_the_exception(installed):
    dummy, _ = installed
    out = run("import hal.api as a; a.create_backend('broken-import')", dummy)
    assert out.returncode != 0
    assert "BackendLoadError" in out.stderr and "libdummy_runtime.so" in out.stderr


def test_two_packages_claiming_one_name_is_an_error_naming_both(installed):
    dummy, conflict = installed
    out = run("import hal.api as a; a.create_backend('dummy')", dummy, conflict)
    assert out.returncode != 0
    assert "BackendConflictError" in out.stderr
    assert "hal-dummy-backend" in out.stderr and "hal-conflict-backend" in out.stderr


def test_unknown_name_lists_installed_backends_with_availability(installed):
    dummy, _ = installed
    out = run("import hal.api as a; a.create_backend('tpu')", dummy)
    assert "BackendNotFoundError: no backend named 'tpu'" in out.stderr
    assert "dummy" in out.stderr and "available" in out.stderr and "reference" in out.stderr


def test_selection_order_explicit_over_env_over_automatic(installed):
    dummy, _ = installed
    assert selected() == "reference"                           # no accelerator: reference
    assert selected(dummy) == "dummy"                          # the one available accelerator
    assert selected(dummy, HAL_BACKEND="torch") == "torch"     # HAL_BACKEND beats automatic
    assert selected(dummy, explicit="reference", HAL_BACKEND="torch") == "reference"  # argument beats all


def test_recipe_choice_sits_between_argument_and_environment():
    from hal.api import resolve_backend_name

    os.environ.pop("HAL_BACKEND", None)
    assert resolve_backend_name("torch", "reference")[0] == "torch"
    assert resolve_backend_name(None, "reference")[0] == "reference"
    os.environ["HAL_BACKEND"] = "torch"
    try:
        assert resolve_backend_name(None, "reference")[0] == "reference"
        assert resolve_backend_name(None, None) == ("torch", "HAL_BACKEND")
    finally:
        del os.environ["HAL_BACKEND"]


def test_unavailable_backend_says_why_and_how_to_choose():
    from hal.api import create_backend
    from hal.errors import BackendUnavailableError

    with pytest.raises(BackendUnavailableError, match=r"backend 'ascend' \(chosen by the explicit argument\) "
                                                      r"is not available here: torch_npu is not importable"):
        create_backend("ascend")


def test_doctor_with_an_unknown_hal_backend_says_it_is_not_installed_and_fails():
    out = run("from hal.cli import main; raise SystemExit(main(['doctor']))", HAL_BACKEND="nonsense")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("hal: error: HAL_BACKEND names backend 'nonsense', which is not installed")
    assert "reference (available)" in line and "torch (available)" in line and "cuda (unavailable)" in line
    assert "reference" in out.stdout      # the table of installed backends is still printed
    ok = run("from hal.cli import main; raise SystemExit(main(['doctor']))", HAL_BACKEND="torch")
    assert ok.returncode == 0 and "default backend here: torch (HAL_BACKEND)" in ok.stdout
