"""Vocabulary-chunked log-softmax and per-token log-probabilities.

Reduction structure (contract [logprobs], read from ``vocab_chunk``):
  x = fl32(logit / T) (skipped when T == 1); M = row max (exact, any order);
  S = sum over chunks of VOCAB_CHUNK at absolute offsets, in ascending order, of the chunk's
      ``tl.sum`` of exp(fl32(x - M)) over a loaded tile of VOCAB_CHUNK lanes (a tree fixed by the width);
  logp = fl32(fl32(x - M) - log(S)).
Launches: (1) per (row, chunk) the chunk max, spread over the GPU so a few rows still fill it;
(2) per row the chunk sums in ascending order, the log and, for token logprobs, the token's value
(with few rows the row is still in L2 from (1)); (3) for log_softmax, the output. Which program
computes a partial does not change the bits: every partial has a fixed place in the order, and
each chunk's ``tl.sum`` is the same tile with the same ``num_warps`` (pinned: the 1-D tree
depends on it) wherever it runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hal.contract import Logprobs
from hal.kernels.common import LAUNCH, cdiv, next_power_of_2, zero_scalar
from hal.kernels.launcher import launch


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
def _row_stats_kernel(x_ptr, cmax_ptr, stats_ptr, ids_ptr, out_ptr, vocab, stride_x, num_chunks, temperature,
                      T_IS_ONE: tl.constexpr, TOKEN: tl.constexpr, CHUNK: tl.constexpr, BLOCK_C: tl.constexpr):
    """stats[row] = (M, log S), S the ascending sum of the chunk sums; with TOKEN, also the logprob of
    ids[row]. A program walks its row's chunks, which the max kernel has just brought into L2."""
    row = tl.program_id(0).to(tl.int64)
    cm = tl.arange(0, BLOCK_C)
    row_max = tl.max(tl.load(cmax_ptr + row * num_chunks + cm, mask=cm < num_chunks, other=float("-inf")), axis=0)
    total = zero_scalar()
    for c in range(0, num_chunks):
        offs = c * CHUNK + tl.arange(0, CHUNK)
        mask = offs < vocab
        x = _scaled(x_ptr + row * stride_x, offs, mask, T_IS_ONE, temperature)
        total = total + tl.sum(tl.where(mask, tl.exp(x - row_max), 0.0), axis=0)
    log_sum = tl.log(total)
    tl.store(stats_ptr + 2 * row, row_max)
    tl.store(stats_ptr + 2 * row + 1, log_sum)
    if TOKEN:
        token = tl.load(ids_ptr + row).to(tl.int64)
        x = tl.load(x_ptr + row * stride_x + token).to(tl.float32)
        if not T_IS_ONE:
            x = tl.div_rn(x, temperature)
        tl.store(out_ptr + row, (x - row_max) - log_sum)


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
def _chunk_sums_kernel(x_ptr, row_max_ptr, sums_ptr, vocab, stride_x, num_chunks, temperature,
                       T_IS_ONE: tl.constexpr, CHUNK: tl.constexpr):
    """sums[row, c]: chunk c's sum of exp(x - M) for a given row max M: the same expression, tile and
    ``tl.sum`` as ``_row_stats_kernel``'s loop body (so, launched with the same num_warps, the same bits)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    mask = offs < vocab
    x = _scaled(x_ptr + row * stride_x, offs, mask, T_IS_ONE, temperature)
    row_max = tl.load(row_max_ptr + row)
    tl.store(sums_ptr + row * num_chunks + c, tl.sum(tl.where(mask, tl.exp(x - row_max), 0.0), axis=0))


@triton.jit
def _combine_kernel(token_logit_ptr, row_max_ptr, sums_ptr, out_ptr, num_chunks, temperature,
                    T_IS_ONE: tl.constexpr):
    """The end of ``_row_stats_kernel`` from gathered pieces: S = +0 + the chunk sums in ascending order,
    then (x_t - M) - log S with the same ``tl.log``."""
    row = tl.program_id(0).to(tl.int64)
    total = zero_scalar()
    for c in range(0, num_chunks):
        total = total + tl.load(sums_ptr + row * num_chunks + c)
    row_max = tl.load(row_max_ptr + row)
    x = tl.load(token_logit_ptr + row).to(tl.float32)
    if not T_IS_ONE:
        x = tl.div_rn(x, temperature)
    tl.store(out_ptr + row, (x - row_max) - tl.log(total))


def chunk_max(logits: torch.Tensor, temperature: float, spec: Logprobs, num_warps: int = 8) -> torch.Tensor:
    """(M, C) fp32: each vocab chunk's max of logits / temperature (the first launch of ``_row_stats``)."""
    rows, vocab = logits.shape
    num_chunks = cdiv(vocab, spec.vocab_chunk)
    cmax = torch.empty((rows, num_chunks), device=logits.device, dtype=torch.float32)
    if rows and num_chunks:
        launch(_chunk_max_kernel, (rows, num_chunks),
               logits, cmax, vocab, logits.stride(0), num_chunks, temperature, T_IS_ONE=temperature == 1.0,
               CHUNK=spec.vocab_chunk, num_warps=num_warps, **LAUNCH)
    return cmax


def chunk_sums(logits: torch.Tensor, row_max: torch.Tensor, temperature: float, spec: Logprobs,
               num_warps: int = 8) -> torch.Tensor:
    """(M, C) fp32: each vocab chunk's sum of exp(fl32(x - row_max)), x = logits / temperature; the
    num_warps of ``_row_stats`` (the 1-D ``tl.sum`` tree depends on it)."""
    rows, vocab = logits.shape
    num_chunks = cdiv(vocab, spec.vocab_chunk)
    sums = torch.empty((rows, num_chunks), device=logits.device, dtype=torch.float32)
    if rows and num_chunks:
        launch(_chunk_sums_kernel, (rows, num_chunks),
               logits, row_max.contiguous(), sums, vocab, logits.stride(0), num_chunks, temperature,
               T_IS_ONE=temperature == 1.0, CHUNK=spec.vocab_chunk, num_warps=num_warps, **LAUNCH)
    return sums


def combine(token_logits: torch.Tensor, row_max: torch.Tensor, sums: torch.Tensor, temperature: float) -> torch.Tensor:
    """(M,) fp32 log-probabilities from each row's token logit, row max and (M, C) chunk sums in chunk order."""
    rows = token_logits.shape[0]
    out = torch.empty(rows, device=token_logits.device, dtype=torch.float32)
    if rows:
        launch(_combine_kernel, (rows,),
               token_logits.contiguous(), row_max.contiguous(), sums.contiguous(), out, sums.shape[1], temperature,
               T_IS_ONE=temperature == 1.0, num_warps=1, **LAUNCH)
    return out


def _row_stats(logits: torch.Tensor, temperature: float, chunk: int, token_ids: torch.Tensor | None = None,
               out: torch.Tensor | None = None, num_warps: int = 8) -> torch.Tensor:
    rows, vocab = logits.shape
    num_chunks = cdiv(vocab, chunk)
    cmax = torch.empty((rows, num_chunks), device=logits.device, dtype=torch.float32)
    stats = torch.empty((rows, 2), device=logits.device, dtype=torch.float32)
    common = dict(T_IS_ONE=temperature == 1.0, CHUNK=chunk, num_warps=num_warps, **LAUNCH)
    launch(_chunk_max_kernel, (rows, num_chunks),
           logits, cmax, vocab, logits.stride(0), num_chunks, temperature, **common)
    token = token_ids is not None
    launch(_row_stats_kernel, (rows,),
           logits, cmax, stats, token_ids if token else stats, out if token else stats, vocab, logits.stride(0),
           num_chunks, temperature, TOKEN=token, BLOCK_C=next_power_of_2(num_chunks), **common)
    return stats


def log_softmax(logits: torch.Tensor, temperature: float, spec: Logprobs, num_warps: int = 8) -> torch.Tensor:
    """fp32 (M, V) log-softmax of logits / temperature, summed in vocabulary chunks of ``spec.vocab_chunk``."""
    rows, vocab = logits.shape
    out = torch.empty((rows, vocab), device=logits.device, dtype=torch.float32)
    if rows == 0:
        return out
    stats = _row_stats(logits, temperature, spec.vocab_chunk, num_warps=num_warps)
    block = 4096
    launch(_log_softmax_out_kernel, (rows, cdiv(vocab, block)),
           logits, stats, out, vocab, logits.stride(0), out.stride(0), temperature, T_IS_ONE=temperature == 1.0,
           BLOCK=block, **LAUNCH)
    return out


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, temperature: float, spec: Logprobs) -> torch.Tensor:
    """fp32 (M,) log-probability of each row's token, the row summed as in ``log_softmax``."""
    rows = logits.shape[0]
    out = torch.empty(rows, device=logits.device, dtype=torch.float32)
    if rows:
        _row_stats(logits, temperature, spec.vocab_chunk, token_ids, out)
    return out
