"""The conformance kit as a pytest plugin (registered through the ``pytest11`` entry point).

    pytest --pyargs hal.conformance --hal-backend NAME [--hal-contract NAME] [--hal-json FILE]
           [--hal-level 1,2] [--hal-op linear,attention] [--hal-shard I/N] [--hal-resume FILE]
    hal conformance --backend NAME ...            (the same, through the CLI)

Shards: the selected kit tests (by level and op) are sorted by node id and dealt round robin, so
``--hal-shard I/N`` (I = 1..N) is the same slice in every process; each slice writes its own report
and ``hal conformance merge`` joins them. ``--hal-resume FILE`` skips the tests FILE records and
appends the new results to it.

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
    group.addoption("--hal-level", default=None, help="only these levels, comma-separated (e.g. 1,2)")
    group.addoption("--hal-op", default=None, help="only these ops (report rows), comma-separated (e.g. linear,attention)")
    group.addoption("--hal-shard", default=None, help="I/N: run the I-th of N deterministic slices (I = 1..N)")
    group.addoption("--hal-resume", default=None,
                    help="a report of an earlier run: skip the tests it records and append to it")
    group.addoption("--hal-parts", type=int, default=None,
                    help="run the examples of each test that takes parts (phase consistency) in this many parts, "
                         "each its own test id, so that --hal-shard spreads them (default: 10 at full depth, else 1)")


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


#: At full depth a test that takes the ``hal_part`` fixture runs its hypothesis examples in this many
#: parts, each its own test id with its share of the examples: shards (``--hal-shard``) then spread one
#: slow test over several slices, each of which fits a time-limited run (phase consistency at full
#: depth took longer than 420 s as one test on the H200; in 5 parts of 10 examples, 7 of 10 parts took
#: 2-6 min and 3 did not finish in 440 s, so 10 parts of 5). ``--hal-parts N`` sets the count at any
#: depth (quick depth's phase tests under the Ascend contract compile so many kernel variants that one
#: test did not finish in 420 s on the H200 either).
PARTS_AT_FULL_DEPTH = 10


def _parts(config) -> int:
    parts = config.getoption("hal_parts", None)
    if parts is not None and parts < 1:
        raise pytest.UsageError(f"--hal-parts must be >= 1, got {parts}")
    return parts or (PARTS_AT_FULL_DEPTH if config.getoption("hal_depth", "quick") == "full" else 1)


def pytest_generate_tests(metafunc):
    if "hal_part" in metafunc.fixturenames:
        count = _parts(metafunc.config)
        metafunc.parametrize("hal_part", [(i, count) for i in range(count)],
                             ids=[f"part{i + 1}of{count}" for i in range(count)])


def part_settings(hal_part: tuple[int, int]):
    """A decorator for one part's hypothesis test: the profile's examples divided among the parts. A
    derandomised profile (quick, tiny, CI) would draw the same examples in every part, so each part of
    several is seeded with its own index instead: different examples per part, the same on every run.
    Full depth draws at random (not derandomised), so its parts draw different examples anyway."""
    from hypothesis import seed, settings

    index, count = hal_part
    profile = settings.get_profile("hal-conformance")
    share = settings(profile, max_examples=max(1, -(-profile.max_examples // count)))
    if count == 1 or not profile.derandomize:
        return share

    def decorate(test):
        return seed(index)(settings(share, derandomize=False)(test))
    return decorate


def _kit_items(items):
    return [item for item in items if item.get_closest_marker("hal") is not None]


def kit_id(item) -> str:
    """A test's id that does not depend on pytest's rootdir (which moves with the paths on the command line):
    the kit module's file name and the test's name with its parameters."""
    return f"{item.path.name}::{item.name}"


def _item_op(item) -> str:
    """The report row of a kit test: the marker's op, else its ``op`` parameter, else its name."""
    params = getattr(item, "callspec", None)
    return item.get_closest_marker("hal").kwargs.get("op") or (params.params.get("op") if params else None) \
        or item.name


def _csv(config, name: str) -> list[str] | None:
    value = config.getoption(name)
    return sorted({v.strip() for v in value.split(",") if v.strip()}) if value else None


def _shard(config) -> tuple[int, int] | None:
    value = config.getoption("hal_shard")
    if not value:
        return None
    try:
        index, count = (int(v) for v in value.split("/"))
    except ValueError:
        index = count = 0
    if not 1 <= index <= count:
        raise pytest.UsageError(f"--hal-shard {value!r}: expected I/N with 1 <= I <= N, e.g. 1/4")
    return index, count


def _selection(config, items) -> tuple[list, dict]:
    """Filter the kit's tests by --hal-level / --hal-op; return them and the selection's description."""
    levels, ops = _csv(config, "hal_level"), _csv(config, "hal_op")
    if levels and not all(v.isdigit() and int(v) in LEVELS for v in levels):
        raise pytest.UsageError(f"--hal-level {config.getoption('hal_level')!r}: expected levels among "
                                f"{sorted(LEVELS)}, comma-separated")
    chosen = [item for item in items
              if (levels is None or str(item.get_closest_marker("hal").kwargs["level"]) in levels)
              and (ops is None or _item_op(item) in ops)]
    if ops:
        known = {_item_op(item) for item in items}
        unknown = sorted(set(ops) - known)
        if unknown:
            raise pytest.UsageError(f"--hal-op: no kit test for {', '.join(unknown)}; ops: {', '.join(sorted(known))}")
    description = {"levels": levels, "ops": ops, "tests": len(chosen),
                   "max_examples": config.getoption("hal_max_examples"), "shard": config.getoption("hal_shard")}
    return chosen, description


def _create_backend(config):
    """The backend under test, created once; a backend that cannot be created stops the session with one line."""
    from hal.api import create_backend
    from hal.errors import HalError

    name = config.getoption("hal_backend") or os.environ.get("HAL_BACKEND")
    try:
        return create_backend(name, config.getoption("hal_contract"))
    except HalError as exc:
        pytest.exit(f"hal conformance: cannot test backend {name!r}: {exc}", returncode=4)


def pytest_collection_modifyitems(session, config, items):
    kit = _kit_items(items)
    if not kit:
        return
    if not (config.getoption("hal_backend") or os.environ.get("HAL_BACKEND")):
        from hal.registry import describe_installed

        pytest.exit("the HAL conformance kit needs a backend: pass --hal-backend NAME (or `hal conformance "
                    "--backend NAME`, or set HAL_BACKEND). Installed backends:\n" + describe_installed(),
                    returncode=4)
    config._hal_backend = _create_backend(config)
    chosen, config._hal_selection = _selection(config, kit)
    chosen.sort(key=kit_id)
    shard = _shard(config)
    if shard:
        index, count = shard
        chosen = chosen[index - 1::count]
    resume = config.getoption("hal_resume")
    if resume and os.path.exists(resume):
        config._hal_previous = report_mod.load(resume)
        done = set(config._hal_previous.get("tests", {}))
        chosen = [item for item in chosen if kit_id(item) not in done]
    keep = set(id(item) for item in chosen)
    deselected = [item for item in kit if id(item) not in keep]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if id(item) in keep or item.get_closest_marker("hal") is None]
    from hypothesis import settings

    settings.load_profile("hal-conformance")


@pytest.fixture(scope="session")
def hal_backend(request):
    return request.config._hal_backend


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
        item.config._hal_results.add(_item_op(item), marker.kwargs["level"], rep, kit_id(item))
        # after every test: a slice killed by a time limit keeps what it finished, for --resume
        _write_report(item.config)


def pytest_sessionfinish(session, exitstatus):
    _write_report(session.config)


def _write_report(config) -> None:
    results = getattr(config, "_hal_results", None)
    backend = getattr(config, "_hal_backend", None)
    previous = getattr(config, "_hal_previous", None)
    if results is None or backend is None or not (results.cells or previous):
        return
    header = report_mod.header(backend, config.getoption("hal_depth"))
    header["selection"] = config._hal_selection
    data = results.to_json(header, LEVELS)
    path = config.getoption("hal_json") or config.getoption("hal_resume")
    if previous is not None:
        resume = config.getoption("hal_resume")
        data = report_mod.merge([(resume, previous), ("this run", data)])
        data["header"]["selection"]["shard"] = config.getoption("hal_shard")
    if path:
        report_mod.write(data, path)
    config._hal_report = data


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    data = getattr(config, "_hal_report", None)
    if data is not None:
        terminalreporter.write_sep("=", "HAL conformance report")
        terminalreporter.write_line(report_mod.markdown(data))
