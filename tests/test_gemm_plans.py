"""hal.kernels.gemm's launch plans (issue #20, host cost per op call): the first ``linear`` call of a signature
takes the whole path and records its launches; later calls of that signature launch the recorded plan.

CI has no GPU, so the kernels here are test_launcher's stand-in, which compiles one kernel per Triton
specialisation and records every launch. A plan must launch the same compiled kernels with the same grid and
the same arguments as the whole path would for that call (the bits then cannot differ), and a call that
differs in anything Triton or the tile table reads must not reuse another call's plan. On the GPU,
bench/host_overhead.py compares both paths bit for bit and HAL_LAUNCH_VERIFY=1 checks every prepared launch.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from hal.api import create_backend
from hal.kernels import gemm, launcher
from hal.kernels.policy import LaunchPolicy
from test_launcher import FakeKernel, fast  # noqa: F401  (fast: a fixture used by `kernels`)


class _Sms(LaunchPolicy):
    def multiprocessors(self, device):
        return 132


@pytest.fixture
def kernels(fast, monkeypatch):
    # `fast` (test_launcher's fixture): the launcher's fast path on, its device, stream and hooks stood in
    monkeypatch.setattr(gemm, "INTERPRET", False)           # the GPU's tile table
    monkeypatch.setattr(gemm, "_PLANS", launcher.Plans())
    fakes = FakeKernel(gemm._gemm_kernel.fn), FakeKernel(gemm._combine_kernel.fn)
    monkeypatch.setattr(gemm, "_gemm_kernel", fakes[0])
    monkeypatch.setattr(gemm, "_combine_kernel", fakes[1])
    return fakes


@pytest.fixture
def spec():
    return create_backend("reference", "bf16-dense-v1").contract.gemm


def _launches(fakes):
    """Each kernel's launches so far, GEMM kernel first (a linear call launches the GEMM, then the combine)."""
    return [[launch for compiled in fake.cache.values() for launch in compiled.launches] for fake in fakes]


def _shape_of(value, tensors):
    """A launch argument as the comparison sees it: the caller's tensors by role, fresh outputs by layout."""
    for role, t in tensors.items():
        if value is t:
            return role
    if isinstance(value, torch.Tensor):
        return ("fresh", tuple(value.shape), value.stride(), value.dtype)
    if hasattr(value, "block_shape"):                     # a tensor descriptor (loads by the copy engine)
        return ("descriptor", _shape_of(value.base, tensors), tuple(value.shape), tuple(value.strides),
                tuple(value.block_shape), value.padding)
    return value


def _call(spec, fakes, m, n, k, *, bias=False, offset=0, policy=_Sms(), out_dtype=torch.bfloat16):
    """One linear call on new tensors; returns its launches with the arguments by role."""
    storage = torch.randn(m * k + offset, dtype=torch.bfloat16)
    x = storage[offset:].view(m, k)
    w = torch.randn(n, k, dtype=torch.bfloat16)
    b = torch.randn(n, dtype=torch.bfloat16) if bias else None
    before = [len(launches) for launches in _launches(fakes)]
    out = gemm.linear(x, w, b, out_dtype, spec, policy=policy)
    assert out.shape == (m, n) and out.dtype == out_dtype
    roles = {"x": x, "w": w, "bias": b, "out": out}
    new = [launch for launches, seen in zip(_launches(fakes), before) for launch in launches[seen:]]
    return [(grid, tuple(_shape_of(v, roles) for v in values)) for grid, _, values in new]


@pytest.mark.parametrize("m, n, k, bias", [(1, 4096, 4096, False), (7, 896, 4864, True),   # split-K + combine
                                           (300, 1536, 1024, True), (1, 3001, 320, False)])
def test_a_plan_launches_what_the_whole_path_launches(spec, kernels, m, n, k, bias):
    first = _call(spec, kernels, m, n, k, bias=bias)
    slow = sum(fake.slow_calls for fake in kernels)
    assert slow == len(first) and len(gemm._PLANS) == 1
    second = _call(spec, kernels, m, n, k, bias=bias)
    assert second == first                               # same kernels, grids, arguments (x, w as passed)
    assert sum(fake.slow_calls for fake in kernels) == slow, "the second call took Triton's path again"
    if (m, n, k) == (7, 896, 4864):
        assert len(first) == 2, "this shape is one of the split rule's: the plan must hold the combine too"
    # Negative control: a plan that passed another int argument (here K one less) is caught by the comparison.
    (plan,) = gemm._PLANS.values()
    plan.ints = (*plan.ints[:2], plan.ints[2] - 1, *plan.ints[3:])
    assert _call(spec, kernels, m, n, k, bias=bias) != first


def test_calls_that_differ_in_what_triton_or_the_table_reads_do_not_share_a_plan(spec, kernels):
    _call(spec, kernels, 16, 1024, 1024)
    for variant in (dict(offset=1),                       # x no longer 16-byte aligned: another specialisation
                    dict(bias=True), dict(out_dtype=torch.float32), dict(policy=_Sms())):   # another policy object
        _call(spec, kernels, 16, 1024, 1024, **variant)
    _call(spec, kernels, 17, 1024, 1024)                 # another M: another grid and int argument
    assert len(gemm._PLANS) == 6
    # Negative control: the same call again adds no plan and takes no slow path.
    slow = sum(fake.slow_calls for fake in kernels)
    _call(spec, kernels, 17, 1024, 1024)
    assert len(gemm._PLANS) == 6 and sum(fake.slow_calls for fake in kernels) == slow


def test_no_plans_when_the_fast_path_is_off(spec, kernels, monkeypatch):
    monkeypatch.setattr(launcher, "ENABLED", False)
    _call(spec, kernels, 1, 512, 512)
    _call(spec, kernels, 1, 512, 512)
    assert not gemm._PLANS and sum(fake.slow_calls for fake in kernels) == 2


def test_a_plan_keeps_none_of_its_first_calls_tensors(spec, kernels):
    x, w = torch.randn(300, 1024, dtype=torch.bfloat16), torch.randn(1536, 1024, dtype=torch.bfloat16)
    gemm.linear(x, w, None, torch.bfloat16, spec, policy=_Sms())        # 300 rows: loads by tensor descriptor
    (plan,) = gemm._PLANS.values()
    assert plan.x_desc is not None, "this call was meant to record descriptors"
    for fake in kernels:                                 # the stand-in's own record of the launch holds x and w
        for compiled in fake.cache.values():
            compiled.launches.clear()
    refs = weakref.ref(x), weakref.ref(w)
    # Negative control: a descriptor that keeps its tensor (what the first call built) keeps it alive.
    kept = gemm._same_descriptor(plan.x_desc, x)
    del x, w
    gc.collect()
    assert refs[0]() is not None and refs[1]() is None
    del kept
    gc.collect()
    assert refs[0]() is None
