"""Host cost of one GEMM call with and without tensor-descriptor (TMA) loads, on the GPU machine.

Enqueue time per call while the GPU keeps up (the figure that limits eager decode), for the
default launch at M = 64 (TMA), the same tiles with pointer loads, the descriptor construction
alone, and M = 1 (pointer loads) for scale.

    cd bench && python3 lab/host_cost.py
"""

from __future__ import annotations

import time

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from hal.backends.cuda import gemm


def host_us(fn, calls: int = 300) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main() -> None:
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    x64 = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    x1 = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    bf = torch.bfloat16
    tma_cfg = dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=128, tma=True, num_warps=4, num_stages=6)
    ptr_cfg = dict(tma_cfg, tma=False, num_stages=4)
    rows = [("torch.mm M=64", lambda: torch.mm(x64, w.T)),
            ("gemm.linear M=64 default", lambda: gemm.linear(x64, w, None, bf, 512)),
            ("gemm.linear M=64 TMA 64x32x128", lambda: gemm.linear(x64, w, None, bf, 512, tma_cfg)),
            ("gemm.linear M=64 pointer 64x32x128", lambda: gemm.linear(x64, w, None, bf, 512, ptr_cfg)),
            ("2x TensorDescriptor.from_tensor", lambda: (TensorDescriptor.from_tensor(x64, [64, 128]),
                                                         TensorDescriptor.from_tensor(w, [32, 128]))),
            ("gemm.linear M=1 default", lambda: gemm.linear(x1, w, None, bf, 512)),
            ("torch.empty", lambda: torch.empty(16, device="cuda"))]
    for name, fn in rows:
        print(f"{name:<40} {host_us(fn):7.1f} us per call", flush=True)


if __name__ == "__main__":
    main()
