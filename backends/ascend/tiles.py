"""Tile configurations for the triton-ascend path, fitted to the Ascend unified buffer.

The triton-ascend path launches the shared Triton kernels (``hal.kernels``: the same source, so the
same reduction structure) with tiles chosen here (through ``launch.py``). Why different tiles: on Ascend a program's vector
tiles live in the unified buffer (UB, 192 KB on Atlas A2) and the compiler rejects tiles that do
not fit; ``tl.dot`` is fp32-accumulating with ``ieee`` precision (the kernels pass
``input_precision="ieee"`` for fp32 and bf16 products are exact in fp32).

What may change with the tile and what may not (the contract's rule, checked by the tests):
  * BLOCK_K is a function of (k_chunk, dtype) only, never of M or N: the order inside one K chunk
    must be the same for every batch size;
  * the attention key tile is kv_chunk (it is the softmax chunk), the row-block and vocabulary
    tiles are the contract's widths: if such a tile cannot fit the UB the call is refused;
  * BLOCK_M, BLOCK_N, split-K and the query tile are free and chosen per call.

The byte counts are conservative upper bounds (every tile counted in the UB), checked against the
double-buffered budget of half the UB (96 KB); the real allocation is the compiler's and has not been
measured on an NPU. (The earlier bounds let tiles of 141-180 KB through against the whole 192 KB.)
"""

from __future__ import annotations

from hal.contract import Gemm
from hal.errors import UnsupportedError

UB_BYTES = 192 * 1024
#: what one stage of a tile may use: the compiler double-buffers the unified buffer, so half of it
#: (96 KB, api_facts.toml [triton_ascend]); every bound below is against this budget
UB_BUDGET = UB_BYTES // 2
MAX_BLOCK_K = 256  # the batch-invariant Triton fallback's fixed BLOCK_K for 16-bit inputs


def _bytes(dtype_bytes: int, *counts: int) -> int:
    return dtype_bytes * sum(counts)


def gemm_ub_bytes(block_m: int, block_n: int, block_k: int, in_bytes: int) -> int:
    """Double-buffered operand tiles + accumulator, chunk sum and total in fp32."""
    return 2 * _bytes(in_bytes, block_m * block_k, block_k * block_n) + _bytes(4, 3 * block_m * block_n)


def gemm_block_k(k_chunk: int, in_bytes: int) -> int:
    """The one BLOCK_K for this chunk width and dtype: the largest power of two <= 256 (128 for fp32)
    dividing k_chunk."""
    bk = MAX_BLOCK_K if in_bytes <= 2 else MAX_BLOCK_K // 2
    while bk >= 16 and k_chunk % bk:
        bk //= 2
    if bk < 16:
        raise UnsupportedError(f"ascend triton gemm: k_chunk {k_chunk} has no BLOCK_K >= 16 dividing it")
    return bk


def gemm_config(m: int, n: int, k: int, spec: Gemm, in_bytes: int) -> dict:
    """Tiles for ``hal.kernels.gemm.linear`` (over its own table); only BLOCK_M/BLOCK_N/split vary with M."""
    bk = gemm_block_k(spec.k_chunk, in_bytes)
    chunks = spec.chunk_count(k)
    if m <= 16:
        bm, bn, split = 16, 128, chunks > 1
    elif m <= 64:
        bm, bn, split = 32, 64, chunks > 1 and n <= 8192
    else:
        bm, bn, split = 64, 64, False
    while gemm_ub_bytes(bm, bn, bk, in_bytes) > UB_BUDGET and bn > 16:
        bn //= 2
    while gemm_ub_bytes(bm, bn, bk, in_bytes) > UB_BUDGET and bm > 16:
        bm //= 2
    if gemm_ub_bytes(bm, bn, bk, in_bytes) > UB_BUDGET:
        raise UnsupportedError(f"ascend triton gemm: no tile fits the {UB_BUDGET}-byte UB with BLOCK_K {bk}")
    # tma=False: triton-ascend has no host-side TensorDescriptor, and the kernel's own table would
    # pick descriptor loads for bf16 GEMMs with M > 64 off CUDA
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, split=split, tma=False, num_warps=4, num_stages=1)


def attention_ub_bytes(block_m: int, block_n: int, head_dim: int, in_bytes: int) -> int:
    """q, double-buffered k and v, ones; fp32 scores and P, accumulators (split and merged)."""
    return (_bytes(in_bytes, block_m * head_dim, 4 * block_n * head_dim, block_n * 16)
            + _bytes(4, 2 * block_m * block_n, 3 * block_m * head_dim))


def attention_block_q(kv_chunk: int, head_dim: int, group: int, in_bytes: int, max_q_len: int) -> int:
    """Query tokens per program: the largest that fits the UB (rows = tokens x padded GQA group)."""
    group_pad = 1 << max(0, (group - 1).bit_length())
    block_q = max(1, (16 if max_q_len <= 16 else 32) // group_pad)
    while block_q > 1 and attention_ub_bytes(block_q * group_pad, kv_chunk, head_dim, in_bytes) > UB_BUDGET:
        block_q //= 2
    if attention_ub_bytes(block_q * group_pad, kv_chunk, head_dim, in_bytes) > UB_BUDGET:
        raise UnsupportedError(f"ascend triton attention: kv_chunk {kv_chunk} x head dim {head_dim} with a GQA "
                               f"group of {group} does not fit the {UB_BUDGET}-byte UB")
    return block_q


def row_block_fits(width: int, tiles: int = 4) -> None:
    """A row kernel holds ~``tiles`` fp32 tiles of the reduced block width; the width is the contract's."""
    if 4 * tiles * width > UB_BUDGET:
        raise UnsupportedError(f"ascend triton: a row block of {width} fp32 values x {tiles} tiles does not fit "
                               f"the {UB_BUDGET}-byte UB, and the block width is the contract's")
