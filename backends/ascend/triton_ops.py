"""The triton path: the shared Triton kernels (``hal.kernels``), launched with Ascend tiles (triton-ascend).

Why reuse: the kernels' source *is* the contract's reduction structure (K chunks, KV chunks and
splits, row blocks, vocabulary chunks, the rounding points); on Ascend only the tiling must change
(``tiles.py``: unified-buffer size, fixed BLOCK_K per chunk width, ieee fp32 dots). So the same
structure runs here with no second copy of the numerics.

Under ``TRITON_INTERPRET=1`` these launches run on CPU tensors (CI): that proves the Ascend tile
choices keep the invariances in the kernels' logic, not that triton-ascend compiles them. On an NPU
the backend refuses this path (``probe.triton_ascend_refusal``): triton-ascend ignores
``enable_fp_fusion``, lowers ``tl.div_rn``/``tl.sqrt_rn`` to plain divide/sqrt and does not support the
uint32 bitcasts/shifts of ``round_to_bf16`` (api_facts.toml [triton_ascend]).
"""

from __future__ import annotations

import torch

from hal.backends.ascend import tiles


class TritonOps:
    def __init__(self, contract):
        self.contract = contract
        from hal.backends.ascend.launch import ASCEND_LAUNCH
        from hal.kernels import attention, gemm, logprobs, rows
        from hal.kernels.common import INTERPRET

        if INTERPRET:
            from hal.kernels.interpreter import patch_row_dot

            patch_row_dot()
        self._gemm, self._attention, self._rows, self._logprobs = gemm, attention, rows, logprobs
        self._launch = ASCEND_LAUNCH
        tiles.row_block_fits(contract.rms_norm.row_block)
        tiles.row_block_fits(contract.reduce.row_block, tiles=2)
        tiles.row_block_fits(contract.logprobs.vocab_chunk, tiles=2)

    def linear(self, x2, weight, bias, out_dtype):
        return self._gemm.linear(x2, weight, bias, out_dtype, self.contract.gemm, policy=self._launch)

    def attention(self, q, k_cache, v_cache, meta, scale):
        return self._attention.paged_attention(
            q.contiguous(), k_cache, v_cache, meta.query_start_loc.to(torch.int32), meta.seq_lens.to(torch.int32),
            meta.block_table.to(torch.int32), scale, self.contract.attention, policy=self._launch)

    def rms_norm(self, x, weight, eps, residual):
        out, res_out = self._rows.rms_norm(x.contiguous(), weight, eps,
                                           None if residual is None else residual.contiguous(),
                                           self.contract.rms_norm)
        return out if residual is None else (out, res_out)

    def silu_mul(self, gate_up):
        return self._rows.silu_mul(gate_up.contiguous())

    def rotary(self, positions, q, k, table):
        return self._rows.rotary(positions, q, k, table)

    def sum(self, x2):
        return self._rows.reduce_last(x2.contiguous(), False, self.contract.reduce)

    def mean(self, x2):
        return self._rows.reduce_last(x2.contiguous(), True, self.contract.reduce)

    def log_softmax(self, logits, temperature):
        return self._logprobs.log_softmax(logits.contiguous(), float(temperature), self.contract.logprobs)

    def token_logprobs(self, logits, token_ids, temperature):
        return self._logprobs.token_logprobs(logits.contiguous(), token_ids.contiguous(), float(temperature),
                                             self.contract.logprobs)
