"""Vocabulary-chunked log-softmax and per-token log-probabilities for the cuda backend.

Reduction structure (contract [logprobs], read from ``vocab_chunk``):
  x = fl32(logit / T) (skipped when T == 1); M = row max (exact, any order);
  S = sum over chunks of VOCAB_CHUNK at absolute offsets, in ascending order, of the chunk's
      ``tl.sum`` of exp(fl32(x - M)) over a loaded tile of VOCAB_CHUNK lanes (a tree fixed by the width);
  logp = fl32(fl32(x - M) - log(S)).
Launches: (1) per (row, chunk) the chunk max and (2) the chunk's exp-sum, spread over the GPU so a
few rows still fill it; (3) per row the ascending combine and log; (4) the output. Splitting the
work across programs does not change the bits: every partial has a fixed place in the order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hal.backends.cuda.common import LAUNCH, zero_scalar


@triton.jit
def _scaled(x_ptr, offs, mask, inv_t_is_one: tl.constexpr, temperature):
    x = tl.load(x_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
    if not inv_t_is_one:
        x = tl.div_rn(x, temperature)
    return x


@triton.jit
def _chunk_max_kernel(x_ptr, cmax_ptr, vocab, stride_x, num_chunks, temperature,
                      T_IS_ONE: tl.constexpr, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    x = _scaled(x_ptr + row * stride_x, offs, offs < vocab, T_IS_ONE, temperature)
    tl.store(cmax_ptr + row * num_chunks + c, tl.max(x, axis=0))


@triton.jit
def _chunk_sum_kernel(x_ptr, cmax_ptr, csum_ptr, vocab, stride_x, num_chunks, temperature,
                      T_IS_ONE: tl.constexpr, CHUNK: tl.constexpr, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cm = tl.arange(0, BLOCK_C)
    row_max = tl.max(tl.load(cmax_ptr + row * num_chunks + cm, mask=cm < num_chunks, other=float("-inf")), axis=0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    mask = offs < vocab
    x = _scaled(x_ptr + row * stride_x, offs, mask, T_IS_ONE, temperature)
    e = tl.where(mask, tl.exp(x - row_max), 0.0)
    tl.store(csum_ptr + row * num_chunks + c, tl.sum(e, axis=0))


@triton.jit
def _row_log_sum_kernel(cmax_ptr, csum_ptr, stats_ptr, num_chunks, BLOCK_C: tl.constexpr):
    """stats[row] = (M, log S) with S the ascending sum of the chunk sums."""
    row = tl.program_id(0).to(tl.int64)
    cm = tl.arange(0, BLOCK_C)
    row_max = tl.max(tl.load(cmax_ptr + row * num_chunks + cm, mask=cm < num_chunks, other=float("-inf")), axis=0)
    total = zero_scalar()
    for c in range(0, num_chunks):
        total = total + tl.load(csum_ptr + row * num_chunks + c)
    tl.store(stats_ptr + 2 * row, row_max)
    tl.store(stats_ptr + 2 * row + 1, tl.log(total))


@triton.jit
def _log_softmax_out_kernel(x_ptr, stats_ptr, out_ptr, vocab, stride_x, stride_o, temperature,
                            T_IS_ONE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < vocab
    x = _scaled(x_ptr + row * stride_x, offs, mask, T_IS_ONE, temperature)
    row_max = tl.load(stats_ptr + 2 * row)
    log_sum = tl.load(stats_ptr + 2 * row + 1)
    tl.store(out_ptr + row * stride_o + offs, (x - row_max) - log_sum, mask=mask)


@triton.jit
def _token_logprob_kernel(x_ptr, ids_ptr, stats_ptr, out_ptr, stride_x, temperature, T_IS_ONE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    token = tl.load(ids_ptr + row).to(tl.int64)
    x = tl.load(x_ptr + row * stride_x + token).to(tl.float32)
    if not T_IS_ONE:
        x = tl.div_rn(x, temperature)
    tl.store(out_ptr + row, (x - tl.load(stats_ptr + 2 * row)) - tl.load(stats_ptr + 2 * row + 1))


def _row_stats(logits: torch.Tensor, temperature: float, chunk: int, num_warps: int = 8) -> torch.Tensor:
    rows, vocab = logits.shape
    num_chunks = triton.cdiv(vocab, chunk)
    cmax = torch.empty((rows, num_chunks), device=logits.device, dtype=torch.float32)
    csum = torch.empty_like(cmax)
    stats = torch.empty((rows, 2), device=logits.device, dtype=torch.float32)
    common = dict(T_IS_ONE=temperature == 1.0, CHUNK=chunk, **LAUNCH)
    block_c = triton.next_power_of_2(num_chunks)
    _chunk_max_kernel[(rows, num_chunks)](logits, cmax, vocab, logits.stride(0), num_chunks, temperature,
                                          num_warps=num_warps, **common)
    _chunk_sum_kernel[(rows, num_chunks)](logits, cmax, csum, vocab, logits.stride(0), num_chunks, temperature,
                                          BLOCK_C=block_c, num_warps=num_warps, **common)
    _row_log_sum_kernel[(rows,)](cmax, csum, stats, num_chunks, BLOCK_C=block_c, **LAUNCH)
    return stats


def log_softmax(logits: torch.Tensor, temperature: float, chunk: int, num_warps: int = 8) -> torch.Tensor:
    rows, vocab = logits.shape
    out = torch.empty((rows, vocab), device=logits.device, dtype=torch.float32)
    if rows == 0:
        return out
    stats = _row_stats(logits, temperature, chunk, num_warps)
    block = 4096
    _log_softmax_out_kernel[(rows, triton.cdiv(vocab, block))](logits, stats, out, vocab, logits.stride(0),
                                                              out.stride(0), temperature,
                                                              T_IS_ONE=temperature == 1.0, BLOCK=block, **LAUNCH)
    return out


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, temperature: float, chunk: int) -> torch.Tensor:
    rows = logits.shape[0]
    out = torch.empty(rows, device=logits.device, dtype=torch.float32)
    if rows == 0:
        return out
    stats = _row_stats(logits, temperature, chunk)
    _token_logprob_kernel[(rows,)](logits, token_ids, stats, out, logits.stride(0), temperature,
                                   T_IS_ONE=temperature == 1.0, **LAUNCH)
    return out
