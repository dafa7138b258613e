"""hal.kernels.rows.rms_norm's launch plans (issue #20, host cost per op call), as test_gemm_plans.py checks
``linear``'s: the first call of a signature takes the whole path and records its launch; a later call of that
signature launches the recorded plan. The kernels are test_launcher's stand-in (CI has no GPU): a plan must
launch the same compiled kernel with the same grid and arguments as the whole path would (the bits then cannot
differ), and a call that differs in anything Triton or the launch choice reads must not reuse another's plan."""

from __future__ import annotations

import pytest
import torch

from hal.api import create_backend
from hal.kernels import launcher, rows
from test_launcher import FakeKernel, fast  # noqa: F401  (fast: a fixture used by `kernels`)

KERNELS = ("_rms_norm_kernel", "_rms_norm_kernel_width_1", "_rms_norm_rows_kernel")


@pytest.fixture
def kernels(fast, monkeypatch):
    # `fast` (test_launcher's fixture): the launcher's fast path on, its device, stream and hooks stood in
    monkeypatch.setattr(rows, "_NORM_PLANS", launcher.Plans())
    fakes = {}
    for name in KERNELS:
        fakes[name] = FakeKernel(getattr(rows, name).fn)
        monkeypatch.setattr(rows, name, fakes[name])
    return list(fakes.values())


@pytest.fixture
def spec():
    return create_backend("reference", "bf16-dense-v1").contract.rms_norm


def _launches(fakes):
    return [launch for fake in fakes for compiled in fake.cache.values() for launch in compiled.launches]


def _call(spec, fakes, shape, *, residual=False, eps=1e-6, offset=0, many_rows=True, num_warps=None):
    """One rms_norm call on new tensors; returns its launches, each tensor argument as (role, shape, strides):
    the kernels take x, the residual and the outputs as (rows, n) views, named here by the storage they view."""
    n = shape[-1]
    storage = torch.randn(torch.Size(shape).numel() + offset, dtype=torch.bfloat16)
    x = storage[offset:].view(shape)
    w = torch.randn(n, dtype=torch.bfloat16)
    r = torch.randn(shape, dtype=torch.bfloat16) if residual else None
    before = len(_launches(fakes))
    out, res_out = rows.rms_norm(x, w, eps, r, spec, num_warps, many_rows=many_rows)
    assert out.shape == x.shape and (res_out is None) == (r is None)
    # without a residual the kernels get x and out in its place (and read and write neither)
    roles = {t.data_ptr(): role for role, t in (("res_out", res_out), ("out", out), ("residual", r), ("w", w),
                                                  ("x", x)) if t is not None}
    return [(grid, tuple((roles.get(v.data_ptr(), "unknown"), tuple(v.shape), v.stride())
                         if isinstance(v, torch.Tensor) else v for v in values))
            for grid, _, values in _launches(fakes)[before:]]


@pytest.mark.parametrize("shape, residual, many_rows", [((4, 1024), False, True), ((3, 5, 2048), True, True),
                                                        ((64, 8, 128), False, True),      # narrow rows: many a program
                                                        ((7, 1), True, True),             # width 1: its own kernel
                                                        ((64, 128), True, False)])        # one row a program
def test_a_plan_launches_what_the_whole_path_launches(spec, kernels, shape, residual, many_rows):
    first = _call(spec, kernels, shape, residual=residual, many_rows=many_rows)
    slow = sum(fake.slow_calls for fake in kernels)
    assert slow == len(first) == 1 and len(rows._NORM_PLANS) == 1
    second = _call(spec, kernels, shape, residual=residual, many_rows=many_rows)
    assert second == first                               # same kernel, grid, arguments (the tensors by role)
    assert sum(fake.slow_calls for fake in kernels) == slow, "the second call took Triton's path again"
    # Negative control: a plan that passed another int argument (the row width one less) is caught.
    (plan,) = rows._NORM_PLANS.values()
    width = plan.scalars.index(shape[-1])
    plan.scalars = (*plan.scalars[:width], shape[-1] - 1, *plan.scalars[width + 1:])
    assert _call(spec, kernels, shape, residual=residual, many_rows=many_rows) != first


def test_calls_that_differ_in_what_triton_or_the_launch_reads_do_not_share_a_plan(spec, kernels):
    _call(spec, kernels, (8, 1024))
    for variant in (dict(offset=1),                      # x no longer 16-byte aligned: another specialisation
                    dict(residual=True), dict(eps=1e-5), dict(num_warps=8)):
        _call(spec, kernels, (8, 1024), **variant)
    _call(spec, kernels, (9, 1024))                      # another row count: another grid
    _call(spec, kernels, (8, 128), many_rows=False)      # narrow rows one a program
    _call(spec, kernels, (8, 128))                       # and many a program
    assert len(rows._NORM_PLANS) == 8
    slow = sum(fake.slow_calls for fake in kernels)
    _call(spec, kernels, (9, 1024))                      # negative control: a seen call adds no plan
    assert len(rows._NORM_PLANS) == 8 and sum(fake.slow_calls for fake in kernels) == slow


def test_no_plans_when_the_fast_path_is_off_or_there_are_no_rows(spec, kernels, monkeypatch):
    _call(spec, kernels, (0, 1024))                      # nothing launched: nothing to plan
    assert not rows._NORM_PLANS
    monkeypatch.setattr(launcher, "ENABLED", False)
    _call(spec, kernels, (2, 512))
    _call(spec, kernels, (2, 512))
    assert not rows._NORM_PLANS and sum(fake.slow_calls for fake in kernels) == 2


def test_the_plan_table_starts_again_when_full():
    plans = launcher.Plans(limit=2)
    plans.keep(("a",), 1)
    plans.keep(("b",), 2)
    plans.keep(("c",), 3)
    assert dict(plans) == {("c",): 3}
