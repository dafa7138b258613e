"""The Python around each launch of the cuda backend's ops, on any machine (no GPU): issue #20's host cost.

Every Triton kernel of ``hal.kernels`` is replaced by a stand-in that compiles nothing and launches nothing, so a
loop of op calls on CPU tensors measures what the HAL itself costs per call: the input checks, the launch
tables, allocation, tensor descriptors, ``hal.kernels.launcher``'s key or ``gemm``'s launch plans, and the call
into a compiled kernel's launcher (here a no-op; on the GPU host Triton's own launcher adds ~6 us, and that host
runs Python about 3x slower than this one). It is the number to watch while changing the host path without a GPU;
``bench/host_overhead.py`` measures the real thing on the GPU.

    python3 bench/host_python.py [--calls 3000] [--json host_python.json]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import time

os.environ.pop("TRITON_INTERPRET", None)     # the compiled path's Python, not the interpreter's

import torch                                  # noqa: E402
import triton                                 # noqa: E402

from hal.backend import AttentionMetadata    # noqa: E402
from hal.kernels import attention, gemm, kv_write, launcher, logprobs, rows  # noqa: E402

MODULES = (gemm, rows, logprobs, attention, kv_write)


class _Compiled:
    """What ``kernel[grid]`` returns: a launcher to call (a no-op here)."""

    function = packed_metadata = None

    def run(self, *args):
        pass


class _Param:
    def __init__(self, name, is_constexpr):
        self.name, self.is_constexpr = name, is_constexpr


class StandIn:
    """A ``@triton.jit`` kernel's stand-in with what ``launcher.launch`` reads: its parameters, and one compiled
    launcher per call of ``kernel[grid]`` (the first call of a specialisation)."""

    def __init__(self, jit):
        self.__name__ = jit.fn.__name__
        self.signature = inspect.signature(jit.fn)
        self.arg_names = list(self.signature.parameters)
        self.params = [_Param(p.name, p.is_constexpr) for p in jit.params]

    def __getitem__(self, grid):
        return lambda *args, **kwargs: _Compiled()


def stand_in_kernels() -> None:
    launcher.ENABLED = True
    launcher._current_device = lambda: 0
    launcher._current_stream = lambda device: 0
    for module in MODULES:
        if hasattr(module, "INTERPRET"):
            module.INTERPRET = False          # the GPU's launch tables
        for name, obj in list(vars(module).items()):
            if isinstance(obj, triton.runtime.jit.JITFunction):
                setattr(module, name, StandIn(obj))


def per_call_us(fn, calls: int) -> float:
    """The fastest of 7 loops of ``calls`` calls: the least disturbed by the machine's other work (this measures
    the code, on a shared 2-core machine whose other load moves a median by half)."""
    for _ in range(50):
        fn()
    loops = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        loops.append((time.perf_counter() - start) / calls * 1e6)
    return min(loops)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    stand_in_kernels()
    from hal.api import resolve_contract
    from hal.backends.cuda import CudaBackend

    backend = CudaBackend(resolve_contract(CudaBackend, None), device=torch.device("cpu"))
    backend._launch.multiprocessors = lambda device: 132           # the H200's count: its launch tables
    bf16, g = torch.bfloat16, torch.Generator().manual_seed(0)

    def rand(*shape, dtype=bf16):
        return torch.randn(*shape, generator=g).to(dtype)

    x, res, norm = rand(4, 1024), rand(4, 1024), rand(1024)
    q, k = rand(4, 16, 128), rand(4, 8, 128)
    caches = rand(76, 16, 8, 128), rand(76, 16, 8, 128)
    meta = AttentionMetadata(torch.arange(5, dtype=torch.int32), torch.full((4,), 300, dtype=torch.int32),
                             torch.randperm(76, generator=g).to(torch.int32).view(4, 19))
    logits, ids = rand(4, 32000, dtype=torch.float32), torch.randint(0, 32000, (4,), generator=g)
    x2, table, slots = rand(4, 2048), torch.randn(4096, 128, generator=g), torch.tensor([5, 77, 300, 1000])
    cases = {f"linear_m{m}": (lambda a=rand(m, 1024), w=rand(512, 1024): backend.linear(a, w)) for m in (1, 64, 256)}
    cases.update({
        "rms_norm": lambda: backend.rms_norm(x, norm, 1e-6),
        "rms_norm_residual": lambda: backend.rms_norm(x, norm, 1e-6, res),
        "silu_mul": lambda: backend.silu_mul(x2),
        "rotary": lambda: backend.rotary(torch.arange(4), q, k, table),
        # on CPU tensors the metadata's values are checked at every call (on a GPU once per metadata object)
        "attention_decode (values checked)": lambda: backend.attention(q, *caches, meta, scale=128 ** -0.5),
        "write_kv": lambda: backend.write_kv(k, k, *caches, slots),
        "token_logprobs": lambda: backend.token_logprobs(logits, ids),
    })
    rows_out = []
    print(f"{'op':36} {'us per call':>11}   (Python around the launch, stand-in kernels, {platform.processor() or 'cpu'})")
    for name, fn in cases.items():
        us = per_call_us(fn, args.calls)
        rows_out.append(dict(op=name, us=us))
        print(f"{name:36} {us:11.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(python=platform.python_version(), torch=torch.__version__,
                           triton=triton.__version__, calls=args.calls, rows=rows_out), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
