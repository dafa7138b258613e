"""The conformance kit as a pytest plugin (registered through the ``pytest11`` entry point).

    pytest --pyargs hal.conformance --hal-backend NAME [--hal-contract NAME] [--hal-json FILE]
    hal conformance --backend NAME ...            (the same, through the CLI)

Options live under the "hal conformance" group of ``pytest --help``. The plugin is passive in any
test session that does not collect the kit's tests.
"""

from __future__ import annotations

import os

import pytest

from hal.conformance import report as report_mod

LEVELS = {1: "determinism", 2: "batch invariance", 3: "phase consistency", 4: "train equals infer",
          5: "accuracy", 6: "contract binding"}


def pytest_addoption(parser):
    group = parser.getgroup("hal conformance", "HAL conformance kit")
    group.addoption("--hal-backend", default=None, help="backend to test (or set HAL_BACKEND); see `hal doctor`")
    group.addoption("--hal-contract", default=None, help="contract name or .toml path (default: the backend's first)")
    group.addoption("--hal-json", default=None, help="write the JSON report here (Markdown next to it, .md)")
    group.addoption("--hal-depth", choices=["tiny", "quick", "full"], default="quick",
                    help="tiny: small shapes, for kernels run by an interpreter on the CPU; quick: a few examples "
                         "per test (CI); full: many examples and larger shapes")
    group.addoption("--hal-max-examples", type=int, default=None, help="hypothesis examples per test (overrides depth)")


def pytest_configure(config):
    config.addinivalue_line("markers", "hal(level, op): a HAL conformance test of `op` at `level` (1-6)")
    from hypothesis import HealthCheck, Phase, settings

    depth = config.getoption("hal_depth", "quick")
    examples = config.getoption("hal_max_examples", None) or {"tiny": 3, "quick": 8, "full": 50}[depth]
    # quick: derandomised and no shrinking (a failing backend is reported fast, with its repro);
    # full: random draws, shrunk to a minimal failing example. CI is always derandomised.
    phases = [Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if depth == "full" else [])
    settings.register_profile("hal-conformance", max_examples=examples, deadline=None, phases=phases,
                              derandomize=bool(os.environ.get("CI")) or depth != "full",
                              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
                              print_blob=True)
    config._hal_results = report_mod.Results()


def _kit_items(items):
    return [item for item in items if item.get_closest_marker("hal") is not None]


def pytest_collection_modifyitems(session, config, items):
    if not _kit_items(items):
        return
    if not (config.getoption("hal_backend") or os.environ.get("HAL_BACKEND")):
        from hal.registry import describe_installed

        pytest.exit("the HAL conformance kit needs a backend: pass --hal-backend NAME (or `hal conformance "
                    "--backend NAME`, or set HAL_BACKEND). Installed backends:\n" + describe_installed(),
                    returncode=4)
    from hypothesis import settings

    settings.load_profile("hal-conformance")


@pytest.fixture(scope="session")
def hal_backend(request):
    from hal.api import create_backend

    name = request.config.getoption("hal_backend") or os.environ.get("HAL_BACKEND")
    backend = create_backend(name, request.config.getoption("hal_contract"))
    request.config._hal_backend = backend
    return backend


@pytest.fixture(scope="session")
def hal_depth(request) -> str:
    return request.config.getoption("hal_depth")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    marker = item.get_closest_marker("hal")
    if marker is None:
        return
    rep = outcome.get_result()
    if rep.when == "call" or (rep.when == "setup" and rep.outcome != "passed"):
        params = getattr(item, "callspec", None)
        op = marker.kwargs.get("op") or (params.params.get("op") if params else None) or item.name
        item.config._hal_results.add(op, marker.kwargs["level"], rep, item.nodeid)


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    results = getattr(config, "_hal_results", None)
    backend = getattr(config, "_hal_backend", None)
    if results is None or not results.cells:
        return
    header = report_mod.header(backend, config.getoption("hal_depth"))
    data = results.to_json(header, LEVELS)
    path = config.getoption("hal_json")
    if path:
        report_mod.write(data, path)
    config._hal_report = data


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    data = getattr(config, "_hal_report", None)
    if data is not None:
        terminalreporter.write_sep("=", "HAL conformance report")
        terminalreporter.write_line(report_mod.markdown(data))
