"""Kernel launches with less host time: a compiled kernel reused without ``JITFunction.run``.

``kernel[grid](*args, **kwargs)`` costs 15-35 us of Python on the H200's host (issue #20: argument
specialisation, the cache key, option parsing, then the launcher), several times what the small
kernels of a decode step take on the GPU. ``launch(kernel, grid, *args, **kwargs)`` does the same
launch, and after the first call of a *specialisation* it calls the ``CompiledKernel``'s launcher
directly, the one ``JITFunction.run`` would have called.

Why that is safe: Triton compiles one kernel per specialisation of the arguments. For a non-constexpr
argument that is a tensor's dtype and whether its address is 16-byte aligned; an int's value class
(== 1, divisible by 16, 32 or 64 bits); a tensor descriptor's dtype and block shape; a float or bool
argument only its type; constexprs and options by value. ``_arg_key`` is a refinement of that: tensors
by (dtype, aligned), ints and constexprs by their exact value, descriptors by their whole geometry. So
two calls with one key always have one specialisation, and the cached compiled kernel is the kernel
Triton itself would launch. The bits cannot depend on this path in any case: the compiled code and its
arguments are the same.

``HAL_LAUNCH_VERIFY=1`` checks that claim on every fast launch: it also asks Triton for the kernel of
the call (``warmup=True``: specialise and look up, no launch) and raises if it is another one.
``HAL_FAST_LAUNCH=0`` turns the fast path off (every launch through ``kernel[grid]``). Triton's
interpreter (``TRITON_INTERPRET=1``), launch hooks (profilers) and argument types the key does not know
always take Triton's own path.

Caveat: changing Triton's process-wide knobs (debug mode, instrumentation) after a kernel's first launch
is not seen by the cache; set them before the first launch, or set ``HAL_FAST_LAUNCH=0``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from hal.kernels.common import INTERPRET

ENABLED = not INTERPRET and os.environ.get("HAL_FAST_LAUNCH", "1") != "0"
VERIFY = os.environ.get("HAL_LAUNCH_VERIFY", "0") == "1"
MAX_KEYS = 4096   # per kernel; past it the table starts again (Triton's own cache keeps the compiled kernels)


class LaunchVerifyError(RuntimeError):
    """The fast path's cached kernel is not the one Triton picks for the call (a gap in ``_arg_key``)."""


class _Unkeyed(Exception):
    """An argument the key does not know: the call takes Triton's own path."""


_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def _arg_key(a: Any):
    """One positional argument's part of a launch's cache key (the module docstring says why it suffices)."""
    t = type(a)
    if t is int or a is None:
        return a
    if t in _TENSOR_TYPES or isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if t is float:
        return float                                        # Triton passes it as fp32, never specialises it
    if t is bool:
        return ("bool", a)                                  # True == 1 as a dict key: keep them apart
    if hasattr(a, "block_shape") and hasattr(a, "base"):   # triton.tools.tensor_descriptor.TensorDescriptor
        return ("desc", a.base.dtype, a.base.data_ptr() % 16 == 0, tuple(a.shape), tuple(a.strides),
                tuple(a.block_shape), a.padding, getattr(a, "round_f32_to_tf32", False))
    raise _Unkeyed(t.__name__)


class _KernelLaunches:
    """The compiled specialisations of one ``@triton.jit`` kernel. Per key: the compiled kernel and the
    values of the parameters after the positional ones (constexprs, fixed by the key)."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.names = list(kernel.arg_names)
        self.constexprs = {p.name for p in kernel.params if p.is_constexpr}
        params = kernel.signature.parameters
        self.defaults = {name: p.default for name, p in params.items() if p.default is not p.empty}
        self.compiled: dict[tuple, tuple[Any, tuple]] = {}

    def tail(self, n_positional: int, kwargs: dict) -> tuple | None:
        """The values of the parameters after the first ``n_positional``, in signature order, if they are all
        constexprs (then the key, which holds the keyword values, fixes them); else None (no fast path)."""
        values = []
        for name in self.names[n_positional:]:
            if name not in self.constexprs:
                return None
            if name in kwargs:
                values.append(kwargs[name])
            elif name in self.defaults:
                values.append(self.defaults[name])
            else:
                return None
        return tuple(values)


# By id(kernel): a JITFunction's own hash takes a lock and hashes its source key. Kernels are module globals,
# never freed, so an id is never reused for another kernel.
_LAUNCHES: dict[int, _KernelLaunches] = {}


try:
    from triton import knobs as _knobs
except ImportError:                          # a Triton without knobs: no launch hooks to honour
    _knobs = None


def _current_device() -> int:
    return torch.cuda.current_device()


def current_device() -> int:
    """The device whose current stream a launch uses (part of a caller's key for ``Prepared`` launches)."""
    return _current_device()


def _current_stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)      # what Triton's driver asks torch for


def _hooks_set() -> bool:
    """A launch hook (a profiler such as proton) is installed: Triton's path calls it, so take that path."""
    if _knobs is None:
        return False
    hook = _knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))   # 3.6: None or a callable; later: a HookChain


def launch(kernel, grid: tuple, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``: the same launch, with a seen specialisation's compiled kernel
    called directly. Pass the kernel's tensor and scalar arguments positionally and its constexprs and
    launch options (num_warps, ...) by keyword; ``grid`` is a tuple of 1-3 ints (no callables)."""
    if not ENABLED:
        return kernel[grid](*args, **kwargs)
    try:
        key = (_current_device(), tuple(kwargs.items()), *map(_arg_key, args))
        launches = _LAUNCHES[id(kernel)]
        hit = launches.compiled.get(key)
    except _Unkeyed:
        return kernel[grid](*args, **kwargs)
    except KeyError:
        launches = _LAUNCHES[id(kernel)] = _KernelLaunches(kernel)
        hit = None
    except TypeError:                          # an unhashable keyword value
        return kernel[grid](*args, **kwargs)
    if hit is None or _hooks_set():
        compiled = kernel[grid](*args, **kwargs)
        tail = launches.tail(len(args), kwargs)
        if compiled is not None and tail is not None:
            if len(launches.compiled) >= MAX_KEYS:   # ints are keyed by value: a trainer's varying token
                launches.compiled.clear()            # counts would grow the table without bound
            launches.compiled[key] = (compiled, tail)
        return compiled
    compiled, tail = hit
    if VERIFY:
        _verify(kernel, grid, args, kwargs, compiled, f"key {key}")
    stream = _current_stream(key[0])
    # The launcher call of JITFunction.run, with no launch metadata and no hooks (none are set: above).
    compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
                 compiled.function, compiled.packed_metadata, None, None, None, *args, *tail)
    return compiled


def _verify(kernel, grid, args, kwargs, compiled, what: str) -> None:
    """HAL_LAUNCH_VERIFY: raise unless ``compiled`` is the kernel Triton itself picks for this call."""
    picked = kernel.run(*args, grid=grid, warmup=True, **kwargs)
    if picked is not compiled:
        raise LaunchVerifyError(f"hal.kernels.launcher: {kernel.__name__}'s cached kernel for {what} is not "
                                f"the one Triton picks for this call; the fast-launch key misses a "
                                f"specialised property (run with HAL_FAST_LAUNCH=0 meanwhile)")


class Prepared:
    """One launch with its kernel's specialisation, grid and keyword arguments fixed: ``prepared(*args)``
    launches the compiled kernel with new positional arguments, no key computed. The caller keeps one per
    key of its own that fixes everything ``_arg_key`` reads (dtypes, alignments, int values), so the
    compiled kernel is the one Triton would pick; HAL_LAUNCH_VERIFY checks that on every call. A GEMM's
    plan (hal/kernels/gemm.py) holds these: its host cost per call is then the tensors' allocation and this."""

    __slots__ = ("kernel", "grid", "kwargs", "compiled", "tail", "device")

    def __init__(self, kernel, grid: tuple, kwargs: dict, compiled, tail: tuple, device: int):
        self.kernel, self.kwargs, self.compiled, self.tail, self.device = kernel, kwargs, compiled, tail, device
        self.grid = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)

    def __call__(self, *args) -> None:
        if _hooks_set():                        # a profiler asked to see launches: Triton's own path
            self.kernel[self.grid](*args, **self.kwargs)
            return
        if VERIFY:
            _verify(self.kernel, self.grid, args, self.kwargs, self.compiled, "a prepared launch")
        compiled, (gx, gy, gz) = self.compiled, self.grid
        compiled.run(gx, gy, gz, _current_stream(self.device), compiled.function, compiled.packed_metadata,
                     None, None, None, *args, *self.tail)


class Plans(dict):
    """An op's launch plans by call signature (``gemm``'s, ``rows.rms_norm``'s): the first call of a signature takes
    the op's whole path and ``keep``s a plan of its launches (``Prepared``); later calls look it up. A signature
    holds the call's row count, which a trainer varies from step to step: past ``limit`` plans the table starts
    again (the compiled kernels stay in Triton's cache)."""

    def __init__(self, limit: int = MAX_KEYS):
        super().__init__()
        self.limit = limit

    def keep(self, key: tuple, plan) -> None:
        if len(self) >= self.limit:
            self.clear()
        self[key] = plan


def prepare(kernel, grid: tuple, *args, **kwargs) -> Prepared | None:
    """``launch(kernel, grid, *args, **kwargs)``, and a ``Prepared`` for the calls that follow with the same
    specialisation; None where the fast path does not apply (it is off, an argument or keyword it cannot key,
    a parameter after the positional ones that is not a constexpr)."""
    compiled = launch(kernel, grid, *args, **kwargs)
    launches = _LAUNCHES.get(id(kernel))
    if not ENABLED or compiled is None or launches is None:
        return None
    try:
        for a in args:
            _arg_key(a)
    except _Unkeyed:
        return None
    tail = launches.tail(len(args), kwargs)
    if tail is None:
        return None
    return Prepared(kernel, grid, dict(kwargs), compiled, tail, _current_device())


def cached_specialisations(kernel) -> int:
    """How many specialisations of ``kernel`` the fast path holds (for tests and benchmarks)."""
    launches = _LAUNCHES.get(id(kernel))
    return 0 if launches is None else len(launches.compiled)
