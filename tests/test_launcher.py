"""hal.kernels.launcher: the fast launch path's cache (issue #20, host cost per op call).

CI has no GPU, so these tests drive the cache with a stand-in kernel that records what Triton would do:
compile one kernel per specialisation (Triton's own rule, written out below) and launch it. They check
that a call reuses a compiled kernel only when Triton's specialisation is the same, that it passes the
launcher the arguments Triton would, and that the verify mode catches a key that misses a property.
On the H200 the real kernels run the conformance kit with HAL_LAUNCH_VERIFY=1 (bench/h200.sh kit-full)
and bench/host_overhead.py compares both paths bit for bit.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from hal.kernels import launcher


def _triton_specialisation(args: dict, constexprs: set) -> tuple:
    """Triton's rule (runtime/jit.py, native_specialize_impl): tensors by dtype and 16-byte alignment,
    ints by value class (1, divisible by 16, 32/64 bit), floats and bools by type, constexprs by value."""
    out = []
    for name, a in args.items():
        if name in constexprs:
            out.append(("constexpr", a))
        elif isinstance(a, torch.Tensor):
            out.append((a.dtype, a.data_ptr() % 16 == 0))
        elif isinstance(a, bool):
            out.append("i1")
        elif isinstance(a, int):
            out.append(("i32" if -2**31 <= a < 2**31 else "i64", "one" if a == 1 else "D" if a % 16 == 0 else ""))
        elif isinstance(a, float):
            out.append("fp32")
        else:
            out.append(type(a).__name__)
    return tuple(out)


class _Compiled:
    def __init__(self, spec):
        self.spec, self.function, self.packed_metadata, self.launches = spec, object(), object(), []

    def run(self, gx, gy, gz, stream, function, packed, launch_metadata, enter, exit_, *values):
        assert function is self.function and packed is self.packed_metadata
        self.launches.append(((gx, gy, gz), stream, values))


class _Param:
    def __init__(self, name, is_constexpr):
        self.name, self.is_constexpr = name, is_constexpr


class FakeKernel:
    """A JITFunction stand-in: ``kernel[grid](...)`` specialises, compiles once per specialisation, launches."""

    def __init__(self, fn):
        self.__name__ = fn.__name__
        self.signature = inspect.signature(fn)
        self.arg_names = list(self.signature.parameters)
        # (annotations are strings here: `from __future__ import annotations` quotes them once more)
        self.constexprs = {n for n, p in self.signature.parameters.items() if "constexpr" in str(p.annotation)}
        self.params = [_Param(n, n in self.constexprs) for n in self.arg_names]
        self.cache: dict = {}
        self.slow_calls = 0

    def _bind(self, args, kwargs):
        options = {k: kwargs.pop(k) for k in list(kwargs) if k in ("num_warps", "num_stages", "enable_fp_fusion")}
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return bound.arguments, options

    def run(self, *args, grid, warmup, **kwargs):
        bound, options = self._bind(args, dict(kwargs))
        spec = (_triton_specialisation(bound, self.constexprs), tuple(sorted(options.items())))
        compiled = self.cache.setdefault(spec, _Compiled(spec))
        if not warmup:
            self.slow_calls += 1
            compiled.run(*(tuple(grid) + (1, 1))[:3], "stream", compiled.function, compiled.packed_metadata, None,
                         None, None, *bound.values())
        return compiled

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.run(*args, grid=grid, warmup=False, **kwargs)


def _kernel(x, out, n, stride, scale, flag, BLOCK: "constexpr", EVEN: "constexpr" = True):
    pass


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(launcher, "ENABLED", True)
    monkeypatch.setattr(launcher, "VERIFY", False)
    monkeypatch.setattr(launcher, "_current_device", lambda: 0)
    monkeypatch.setattr(launcher, "_current_stream", lambda device: "stream")
    monkeypatch.setattr(launcher, "_hooks_set", lambda: False)
    monkeypatch.setattr(launcher, "_LAUNCHES", {})
    return FakeKernel(_kernel)


def _buffers(offset_elems=0):
    base = torch.zeros(64, dtype=torch.float32)
    return base[offset_elems:offset_elems + 32], torch.zeros(32, dtype=torch.float32)


def test_a_seen_specialisation_is_launched_directly_with_tritons_arguments(fast):
    x, out = _buffers()
    launcher.launch(fast, (4,), x, out, 32, 1, 0.5, True, BLOCK=16, num_warps=4)
    assert fast.slow_calls == 1 and launcher.cached_specialisations(fast) == 1
    x2, out2 = _buffers()                             # other tensors, same dtypes and alignment
    launcher.launch(fast, (4, 2), x2, out2, 32, 1, 0.25, True, BLOCK=16, num_warps=4)
    assert fast.slow_calls == 1, "the second call must take the fast path"
    (compiled,) = fast.cache.values()
    assert len(compiled.launches) == 2
    grid, stream, values = compiled.launches[1]
    # The launcher gets what JITFunction.run passes: every parameter in order, constexprs and defaults included.
    assert grid == (4, 2, 1) and stream == "stream"
    assert values[:6] == (x2, out2, 32, 1, 0.25, True) and values[6:] == (16, True)


@pytest.mark.parametrize("change", ["alignment", "dtype", "int_class", "bool_for_int", "constexpr", "option"])
def test_every_specialised_property_gets_its_own_compiled_kernel(fast, change):
    x, out = _buffers()
    launcher.launch(fast, (1,), x, out, 32, 16, 0.5, True, BLOCK=16, num_warps=4)
    args = [x, out, 32, 16, 0.5, True]
    kwargs = dict(BLOCK=16, num_warps=4)
    if change == "alignment":
        args[0] = _buffers(offset_elems=1)[0]         # 4 bytes off a 16-byte boundary
    elif change == "dtype":
        args[0] = x.to(torch.bfloat16)
    elif change == "int_class":
        args[3] = 1                                   # == 1 is its own specialisation
    elif change == "bool_for_int":
        args[2] = True
    elif change == "constexpr":
        kwargs["BLOCK"] = 32
    else:
        kwargs["num_warps"] = 8
    launcher.launch(fast, (1,), *args, **kwargs)
    assert len(fast.cache) == 2, "Triton compiles another kernel for this change"
    assert fast.slow_calls == 2 and launcher.cached_specialisations(fast) == 2, "so the key must tell them apart"


def test_floats_are_not_part_of_the_key(fast):
    x, out = _buffers()
    for scale in (0.5, 0.125, 3.0):
        launcher.launch(fast, (1,), x, out, 32, 16, scale, True, BLOCK=16)
    assert fast.slow_calls == 1


def test_verify_mode_passes_a_sound_key_and_catches_a_key_that_misses_a_property(fast, monkeypatch):
    monkeypatch.setattr(launcher, "VERIFY", True)
    x, out = _buffers()
    launcher.launch(fast, (1,), x, out, 32, 16, 0.5, True, BLOCK=16)
    launcher.launch(fast, (1,), *_buffers(), 32, 16, 0.25, True, BLOCK=16)   # other buffers: verified, fast
    assert fast.slow_calls == 1
    # Negative control: a key blind to alignment maps a misaligned call onto the aligned kernel.
    blind = launcher._arg_key
    monkeypatch.setattr(launcher, "_arg_key",
                        lambda a: (a.dtype,) if isinstance(a, torch.Tensor) else blind(a))
    monkeypatch.setattr(launcher, "_LAUNCHES", {})
    launcher.launch(fast, (1,), x, out, 32, 16, 0.5, True, BLOCK=16)
    with pytest.raises(launcher.LaunchVerifyError, match="misses a specialised property"):
        launcher.launch(fast, (1,), _buffers(offset_elems=1)[0], out, 32, 16, 0.5, True, BLOCK=16)


def test_calls_the_key_cannot_describe_take_tritons_path_every_time(fast):
    x, out = _buffers()
    for _ in range(2):                                 # a non-constexpr argument passed by keyword
        launcher.launch(fast, (1,), x, out, 32, 16, 0.5, flag=True, BLOCK=16)
    for _ in range(2):                                 # an argument type the key does not know
        launcher.launch(fast, (1,), x, out, 32, 16, 0.5, [True], BLOCK=16)
    assert fast.slow_calls == 4 and launcher.cached_specialisations(fast) == 0


def test_launch_hooks_take_tritons_path(fast, monkeypatch):
    x, out = _buffers()
    launcher.launch(fast, (1,), x, out, 32, 16, 0.5, True, BLOCK=16)
    monkeypatch.setattr(launcher, "_hooks_set", lambda: True)
    launcher.launch(fast, (1,), x, out, 32, 16, 0.5, True, BLOCK=16)
    assert fast.slow_calls == 2


def test_under_the_interpreter_every_launch_is_tritons(monkeypatch):
    monkeypatch.setattr(launcher, "ENABLED", False)
    kernel = FakeKernel(_kernel)
    x, out = _buffers()
    for _ in range(3):
        launcher.launch(kernel, (1,), x, out, 32, 16, 0.5, True, BLOCK=16)
    assert kernel.slow_calls == 3


def test_the_table_is_bounded(fast, monkeypatch):
    monkeypatch.setattr(launcher, "MAX_KEYS", 3)
    x, out = _buffers()
    for n in range(32, 40):                            # every int value is its own key
        launcher.launch(fast, (1,), x, out, n, 16, 0.5, True, BLOCK=16)
    assert 1 <= launcher.cached_specialisations(fast) <= 3
