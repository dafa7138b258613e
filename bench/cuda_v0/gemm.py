"""GEMM ``y = x @ w.T (+ bias)`` for the cuda backend.

Reduction structure (contract [gemm], read from ``k_chunk``):
  K is cut into chunks of K_CHUNK at absolute offsets 0, K_CHUNK, 2 K_CHUNK, ...; each chunk is
  accumulated from zero in fp32 by ``tl.dot`` steps of BLOCK_K in ascending k (the order inside a
  chunk is the MMA's: implementation-defined, the same for every tile shape); chunk sums are added
  in ascending order into an fp32 total that starts at +0; the bias is added in fp32; one rounding.

Two launch shapes give the same bits and are chosen per call for speed only:
  * direct: each program owns a (BLOCK_M, BLOCK_N) tile and walks all chunks;
  * split-K: each program computes one chunk's sum and stores it; ``_combine_kernel`` adds the
    chunk sums in ascending order (for small M, where direct tiles cannot fill the GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hal.backends.cuda.common import INTERPRET, LAUNCH, to_activation


@triton.jit
def _chunk_sum(x_ptr, w_ptr, offs_m, offs_n, M, N, K, chunk, stride_xm, stride_xk, stride_wn, stride_wk,
               K_CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               FP32_INPUTS: tl.constexpr, UPCAST: tl.constexpr):
    """fp32 sum over one K chunk, accumulated from zero."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(chunk * K_CHUNK, tl.minimum((chunk + 1) * K_CHUNK, K), BLOCK_K):
        ks = k0 + offs_k
        a = tl.load(x_ptr + offs_m[:, None] * stride_xm + ks[None, :] * stride_xk,
                    mask=(offs_m[:, None] < M) & (ks[None, :] < K), other=0.0)
        b = tl.load(w_ptr + offs_n[None, :] * stride_wn + ks[:, None] * stride_wk,
                    mask=(offs_n[None, :] < N) & (ks[:, None] < K), other=0.0)
        if UPCAST:  # the interpreter cannot do bf16 arithmetic; the upcast is exact
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if FP32_INPUTS or UPCAST:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, partial_ptr, M, N, K,
                 stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
                 K_CHUNK: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, OUT_BF16: tl.constexpr,
                 FP32_INPUTS: tl.constexpr, UPCAST: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SPLIT:
        # One chunk per program; the combine kernel adds the chunk sums in order.
        chunk = tl.program_id(2)
        acc = _chunk_sum(x_ptr, w_ptr, offs_m, offs_n, M, N, K, chunk, stride_xm, stride_xk, stride_wn,
                         stride_wk, K_CHUNK, BLOCK_M, BLOCK_N, BLOCK_K, FP32_INPUTS, UPCAST)
        base = chunk.to(tl.int64) * M * N
        tl.store(partial_ptr + base + offs_m[:, None] * N + offs_n[None, :], acc, mask=out_mask)
    else:
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for chunk in range(0, tl.cdiv(K, K_CHUNK)):
            total = total + _chunk_sum(x_ptr, w_ptr, offs_m, offs_n, M, N, K, chunk, stride_xm, stride_xk,
                                       stride_wn, stride_wk, K_CHUNK, BLOCK_M, BLOCK_N, BLOCK_K, FP32_INPUTS,
                                       UPCAST)
        if HAS_BIAS:
            total = total + tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
                 to_activation(total, OUT_BF16), mask=out_mask)


@triton.jit
def _combine_kernel(partial_ptr, bias_ptr, out_ptr, M, N, CHUNKS, stride_om, stride_on,
                    HAS_BIAS: tl.constexpr, OUT_BF16: tl.constexpr, BLOCK: tl.constexpr):
    """total = +0 + chunk 0 + chunk 1 + ... in ascending order; + bias; one rounding."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for chunk in range(0, CHUNKS):
        total = total + tl.load(partial_ptr + chunk * M * N + offs, mask=mask, other=0.0)
    n = offs % N
    if HAS_BIAS:
        total = total + tl.load(bias_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + (offs // N) * stride_om + n * stride_on, to_activation(total, OUT_BF16), mask=mask)


def _config(m: int, n: int, k: int, k_chunk: int) -> dict:
    """Tiling per shape: free (does not change the bits), chosen for speed."""
    chunks = triton.cdiv(k, k_chunk)
    if INTERPRET:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, split=chunks > 1 and m <= 16, num_warps=4, num_stages=1)
    if m <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, split=chunks > 1, num_warps=4, num_stages=4)
    if m <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, split=chunks > 1 and n <= 8192, num_warps=4, num_stages=4)
    if m <= 256:
        return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, split=False, num_warps=4, num_stages=4)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, split=False, num_warps=8, num_stages=3)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
           k_chunk: int, config: dict | None = None) -> torch.Tensor:
    """x (M, K) @ weight (N, K).T (+ bias) -> (M, N) out_dtype. ``config`` overrides the tiling (tests)."""
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), device=x.device, dtype=out_dtype)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.copy_((bias.float() if bias is not None else torch.zeros(n, device=x.device)).expand(m, n))
    cfg = dict(_config(m, n, k, k_chunk), **(config or {}))
    if k_chunk % cfg["BLOCK_K"]:
        raise ValueError(f"BLOCK_K {cfg['BLOCK_K']} must divide k_chunk {k_chunk}")
    chunks = triton.cdiv(k, k_chunk)
    common = dict(K_CHUNK=k_chunk, HAS_BIAS=bias is not None, OUT_BF16=out_dtype == torch.bfloat16,
                  FP32_INPUTS=x.dtype == torch.float32, UPCAST=INTERPRET and x.dtype != torch.float32,
                  BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **LAUNCH)
    bias_arg = bias if bias is not None else out
    grid_mn = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
    if cfg["split"] and chunks > 1:
        partial = torch.empty((chunks, m, n), device=x.device, dtype=torch.float32)
        _gemm_kernel[grid_mn + (chunks,)](x, weight, bias_arg, out, partial, m, n, k, x.stride(0), x.stride(1),
                                          weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
                                          SPLIT=True, **common)
        block = 1024
        _combine_kernel[(triton.cdiv(m * n, block),)](partial, bias_arg, out, m, n, chunks, out.stride(0),
                                                       out.stride(1), HAS_BIAS=bias is not None,
                                                       OUT_BF16=out_dtype == torch.bfloat16, BLOCK=block, **LAUNCH)
    else:
        _gemm_kernel[grid_mn](x, weight, bias_arg, out, out, m, n, k, x.stride(0), x.stride(1),
                              weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
                              SPLIT=False, **common)
    return out
