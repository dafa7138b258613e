"""Experimental: a persistent variant of backends/cuda/gemm.py's kernel (same reduction structure:
K chunks of K_CHUNK from zero, chunk sums added in ascending order into an fp32 total, one
rounding). A fixed number of programs walk the output tiles, so one tile's epilogue overlaps the
next tile's loads and the last wave is not a partial one. Timed by bench/speed_sweep.py (the
``persistent`` variants) to decide whether gemm.py should have it: on the H200 it was never faster
than the direct launch beyond noise, and up to 1.4x slower with Triton's loop flattening
(bench/results/h200-2026-11-29-session3, calls 1-2), so gemm.py does not use it. Kept so that the
sweep can be re-run. Bitwise equal to gemm.linear in every measured case."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hal.backends.cuda.common import LAUNCH, to_activation


@triton.jit(do_not_specialize=["M"])
def _persistent_kernel(x, w, out_ptr, M, N, K, stride_om, stride_on, num_programs,
                       K_CHUNK: tl.constexpr, OUT_BF16: tl.constexpr, FLATTEN: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr):
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    num_tiles = tiles_m * tiles_n
    for tile in tl.range(tl.program_id(0), num_tiles, num_programs, flatten=FLATTEN):
        group = tile // (GROUP_M * tiles_n)
        first_m = group * GROUP_M
        rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (tile % (GROUP_M * tiles_n)) % rows_in_group
        pid_n = (tile % (GROUP_M * tiles_n)) // rows_in_group
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = x.load([pid_m * BLOCK_M, k0])
            b = w.load([pid_n * BLOCK_N, k0]).T
            acc = tl.dot(a, b, acc)
            if ((k0 + BLOCK_K) % K_CHUNK == 0) | (k0 + BLOCK_K >= K):
                total = total + acc
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on,
                 to_activation(total, OUT_BF16), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def linear(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype, k_chunk: int, cfg: dict) -> torch.Tensor:
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), device=x.device, dtype=out_dtype)
    tiles = triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    programs = min(tiles, sms * cfg.get("per_sm", 1))
    x_arg = TensorDescriptor.from_tensor(x, [cfg["BLOCK_M"], cfg["BLOCK_K"]])
    w_arg = TensorDescriptor.from_tensor(weight, [cfg["BLOCK_N"], cfg["BLOCK_K"]])
    _persistent_kernel[(programs,)](x_arg, w_arg, out, m, n, k, out.stride(0), out.stride(1), programs,
                                    K_CHUNK=k_chunk, OUT_BF16=out_dtype == torch.bfloat16, FLATTEN=cfg["flatten"],
                                    BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                                    GROUP_M=cfg["GROUP_M"], num_warps=cfg["num_warps"],
                                    num_stages=cfg["num_stages"], **LAUNCH)
    return out
