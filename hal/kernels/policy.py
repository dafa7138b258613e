"""The launch policy: what a vendor decides about a kernel launch, passed into the shared kernels.

Why a separate object: the kernels' source is the contract's reduction structure and is the same for
every vendor; what differs is how a launch fills the device (how many processors programs are spread
over, which tiles fit its on-chip memory). None of these choices can change a bit: the reduction
structure comes from the contract sections, and the kernels keep it for every tile.

The base class is the neutral policy: the kernels' own launch tables, no device knowledge. A vendor
folder subclasses it (``hal.backends.cuda.launch``, ``hal.backends.ascend.launch``).
"""

from __future__ import annotations

import torch

from hal.contract import Attention, Fp8, Gemm


class LaunchPolicy:
    """Neutral defaults; every method may be overridden by a vendor's policy."""

    def multiprocessors(self, device: torch.device) -> int:
        """Processors the programs of a launch are spread over (launch shapes are sized in waves of
        programs on them); 0 when unknown: the kernels' wave rules then keep their plain shape."""
        return 0

    def gemm_tiles(self, m: int, n: int, k: int, spec: Gemm, in_bytes: int,
                   out_dtype: torch.dtype | None = None) -> dict | None:
        """Tile choices that replace the kernel's own for this call (keys of ``gemm._config``:
        BLOCK_M/N/K, split, num_warps, num_stages, ...), or None for the kernel's own."""
        return None

    def fp8_tiles(self, m: int, n: int, k: int, spec: Fp8, out_dtype: torch.dtype) -> dict | None:
        """Launch choices that replace the block-FP8 GEMM's own for this call (keys of
        ``fp8_gemm._config``: BLOCK_M/N, GROUP_M, num_warps, num_stages, tma, pair), or None."""
        return None

    def moe_tiles(self, slots: int, num_experts: int, hidden: int, inter: int, spec: Gemm,
                  dtype: torch.dtype) -> tuple[dict, dict] | None:
        """(gate/up launch, down launch) of the grouped expert GEMMs (keys of ``moe.grouped_configs``'
        entries, the same BLOCK_M) for ``slots`` (token, rank) slots, or None for the kernel's own table."""
        return None

    def attention_block_q(self, q: torch.Tensor, k_cache: torch.Tensor, query_start_loc: torch.Tensor,
                          spec: Attention) -> int | None:
        """Query tokens per attention program for this call, or None for the kernel's own choice."""
        return None

    def decode_launch(self, tokens: int, num_seqs: int, context: int, q_heads: int, kv_heads: int, head_dim: int,
                      page: int, q_dtype: torch.dtype, kv_dtype: torch.dtype, spec: Attention) -> dict | None:
        """Launch choices that replace decode attention's rule for this call (keys of
        ``attention.decode_candidates``' entries), or None. ``context``: the keys the block table can hold."""
        return None

    def prefill_launch(self, tokens: int, num_seqs: int, q_heads: int, kv_heads: int, head_dim: int, page: int,
                       q_dtype: torch.dtype, kv_dtype: torch.dtype, spec: Attention) -> dict | None:
        """Launch choices that replace prefill attention's rule for this call (keys of
        ``attention.prefill_candidates``' entries: block_q, num_warps, num_stages), or None."""
        return None
