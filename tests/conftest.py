import os
import sys
from pathlib import Path

import pytest

# The cuda backend's kernels run under Triton's CPU interpreter in these tests when no GPU is
# present. The variable must be set before triton is first imported: triton decorates its own
# standard library (tl.sum, tl.cdiv, ...) at import time, interpreted or compiled.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

# The example backends import from here.
sys.path.insert(0, str(Path(__file__).parent.parent / "examples" / "broken_backend"))

# HAL_TEST_NO_SKIP=1 (set by `make test`, hence CI): a skipped test or module is a failure. A skip is
# never a pass: in CI every dependency (vLLM, triton, safetensors) is installed, so a skip there can
# only mean a broken install step or a test that silently stopped testing.
NO_SKIP = os.environ.get("HAL_TEST_NO_SKIP") == "1"


def backend_for_tests(name: str):
    """A backend for CPU tests: ``cuda`` runs its kernels under Triton's interpreter (set above when no
    GPU is present); with a GPU present the interpreter tests skip (the kernels are checked on the GPU
    with bench/h200.sh)."""
    from hal.api import create_backend

    if name == "cuda":
        pytest.importorskip("triton")
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("a GPU is present: the cuda kernels are tested on it with bench/h200.sh, not interpreted")
    return create_backend(name)


def assert_schedules_and_trainer_agree(runs, trains) -> None:
    """The train == rollout property of the harness tests: every schedule gives the first schedule's
    tokens and bitwise its logprobs, and every training packing recomputes those logprobs bitwise (fp32,
    one per response token)."""
    import torch

    first = runs[0]
    for run in runs[1:]:
        for a, b in zip(first, run):
            assert a.tokens == b.tokens and torch.equal(a.logprobs, b.logprobs)
    for train in trains:
        for c, lp in zip(first, train):
            assert lp.dtype == torch.float32 and lp.shape == c.logprobs.shape
            assert torch.equal(lp, c.logprobs), f"request {c.request}: train {lp} vs rollout {c.logprobs}"


def plant_bit_change(monkeypatch, module, name: str, when) -> None:
    """Replace ``module.name`` (an attention-like function returning a (tokens, heads, dim) tensor) by one whose
    output differs in one element for the calls whose keyword arguments satisfy ``when``: a launch that changes
    bits, planted for a tuner to refuse."""
    real = getattr(module, name)

    def planted(*args, **kwargs):
        out = real(*args, **kwargs)
        if when(kwargs):
            out[0, 0, 0] = out[0, 0, 0] * 2 + 1
        return out
    monkeypatch.setattr(module, name, planted)


def spy_launches(monkeypatch, module) -> list:
    """Record every ``module.launch(kernel, grid, *args, **meta)`` (still launched) as (kernel, grid, meta)."""
    launches = []
    real = module.launch

    def spy(kernel, grid, *args, **meta):
        launches.append((kernel, grid, meta))
        return real(kernel, grid, *args, **meta)
    monkeypatch.setattr(module, "launch", spy)
    return launches


class HostFact(UserWarning):
    """A fact about this host's stock kernels (for example: its BLAS happens to be batch-invariant).
    Reported in pytest's warnings summary, never asserted: tests assert properties of the project."""


def _fail_skip(report) -> None:
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = (f"skipped, but HAL_TEST_NO_SKIP=1 requires every test to run: {reason}\n"
                       f"(install what it needs: `make test` does; or unset HAL_TEST_NO_SKIP outside CI)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if NO_SKIP and report.skipped and not hasattr(report, "wasxfail"):
        _fail_skip(report)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if NO_SKIP and report.skipped:
        _fail_skip(report)


#: test files that each take minutes on 2 cores, longest first: they run first, so that pytest-xdist
#: (--dist loadfile --no-loadscope-reorder, the Makefile's: files in collection order) does not start
#: one of them last, when the other worker has nothing left to run beside it (measured: the tiny-depth
#: cuda kit started 6-7 minutes in made the suite 12 minutes instead of 10)
LONGEST_FIRST = ("test_cuda_conformance_tiny.py", "test_cuda_interpreter.py", "test_conformance_kit.py",
                 "test_vllm.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: the order within a file stays


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny shapes: OpenMP threads cost more than they save there, and stall when the CPU is shared
    (measured: 0.1 s vs 5 s for a stock-backend model test on a busy 2-core machine). Bits do not
    depend on it: the reference backend is thread-count invariant by construction."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
