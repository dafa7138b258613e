"""The cann path: torch_npu and CANN's batch-invariant op package.

Why this shape: the closed ops reduce in an order we cannot see, so every contract chunk boundary
that the host *can* enforce is enforced here, around the op: one GEMM call per K chunk (fp32
operands, the fp32 chunk sums added in ascending order), one reduce-sum call per row block or
vocabulary chunk (ascending fp32 adds), the KV cache re-blocked into blocks of kv_chunk keys for the
attention kernel. Every argument comes from ``mapping.py``, and every call is checked against the
vendored schema first (``api_facts.check_call``). Pointwise ops are plain torch ops on the NPU (one
kernel per operation, so no FMA contraction; SiLU*up never uses npu_swiglu).

Attention is one call path for every phase: the fused-inference-attention op picks
IncreFlashAttention when the query's S axis is 1 and PromptFlashAttention otherwise, and those are
different kernels, so a decode step and the prefill of the same token would not share bits. Every
call here is BSND with S >= 2 (a decode-only batch is padded with one unused query row per
sequence), so prefill, chunked prefill, decode, mixed batches and the training forward all take
the PromptFlashAttention branch with the same arguments.

Nothing in this file has run on NPU hardware. The op handles are injected (``ops``, ``torch_npu``)
so the host-side logic (and every call's arguments) can be exercised on a CPU with stand-ins.
"""

from __future__ import annotations

import math

import torch

from hal.backends.ascend import api_facts, mapping
from hal.errors import UnsupportedError


def _call(name, fn, *args, **kwargs):
    """Check the call against the vendored schema of ``name``, then make it."""
    api_facts.check_call(name, args, kwargs)
    return fn(*args, **kwargs)


class CannOps:
    def __init__(self, contract, attention_impl: str, ops=None, torch_npu=None):
        self.contract = contract
        self.attention_impl = attention_impl
        mapping.check_contract(contract)
        self.gemm = mapping.gemm_args(contract)
        if attention_impl != "fia_batch_invariant":  # flash_attn_npu_3 realises no shipped contract
            mapping.attention_args(contract, attention_impl, num_q_heads=1, num_kv_heads=1, head_dim=64,
                                   scale=1.0, max_seq_len=1)
        if ops is None:
            import batch_invariant_ops  # noqa: F401  (registers torch.ops.batch_invariant_ops)

            ops = torch.ops.batch_invariant_ops
        self.ops = ops
        if torch_npu is None:
            import torch_npu
        self.torch_npu = torch_npu

    # -- GEMM ---------------------------------------------------------------------------------

    def linear(self, x2, weight, bias, out_dtype):
        """x2 (M, K) @ weight (N, K).T: one mm per K chunk in fp32, chunk sums added ascending."""
        m, k = x2.shape
        total = torch.zeros((m, weight.shape[0]), dtype=torch.float32, device=x2.device)
        for start, end in self.contract.gemm.chunk_ranges(k):
            a = x2[:, start:end].float().contiguous()
            b = weight[:, start:end].float().t().contiguous()
            total = total + _call("npu_mm_batch_invariant", self.ops.npu_mm_batch_invariant, a, b)
        if bias is not None:
            total = total + bias.float()
        return total.to(out_dtype)

    # -- reductions ---------------------------------------------------------------------------

    def _blocked_sum(self, x2, blocks):
        total = torch.zeros(x2.shape[0], dtype=torch.float32, device=x2.device)
        for start, end in blocks:
            part = x2[:, start:end].float().contiguous()
            total = total + _call("npu_reduce_sum_batch_invariant", self.ops.npu_reduce_sum_batch_invariant,
                                  part, -1, False)
        return total

    def sum(self, x2):
        return self._blocked_sum(x2, mapping.reduce_args(self.contract, x2.shape[-1])["blocks"])

    def mean(self, x2):
        return self.sum(x2) / x2.shape[-1]  # fp32 / fp32 is correctly rounded (div_rn)

    def _log_stats(self, logits, temperature):
        args = mapping.logprobs_args(self.contract, logits.shape[-1])
        x = logits.float()
        if temperature != 1.0:
            x = x / temperature
        row_max = x.max(dim=-1, keepdim=True).values
        shifted = x - row_max
        total = self._blocked_sum(torch.exp(shifted), args["chunks"])
        return shifted, torch.log(total)

    def log_softmax(self, logits, temperature):
        shifted, log_sum = self._log_stats(logits, temperature)
        return shifted - log_sum[:, None]

    def token_logprobs(self, logits, token_ids, temperature):
        shifted, log_sum = self._log_stats(logits, temperature)
        return shifted.gather(-1, token_ids.long()[:, None]).squeeze(-1) - log_sum

    # -- rows ---------------------------------------------------------------------------------

    def rms_norm(self, x, weight, eps, residual):
        args = mapping.rms_norm_args(self.contract, x.shape[-1], eps)
        if residual is not None:
            x = (x.float() + residual.float()).to(x.dtype)  # add first, one rounding; never npu_add_rms_norm
        out = _call("npu_rms_norm", self.torch_npu.npu_rms_norm, x, weight, epsilon=args["epsilon"])[0]
        return out if residual is None else (out, x)

    # -- attention ----------------------------------------------------------------------------

    def attention(self, q, k_cache, v_cache, meta, scale):
        """One BSND call with the query S axis = max(2, longest query): see the module docstring."""
        if q.dtype != torch.bfloat16:
            raise UnsupportedError(f"ascend attention (cann path): the NPU attention kernels take bf16, got {q.dtype}")
        starts, lens, table = meta.host_lists()
        _, q_heads, head_dim = q.shape
        kv_heads = k_cache.shape[2]
        args = mapping.attention_args(self.contract, self.attention_impl, num_q_heads=q_heads,
                                      num_kv_heads=kv_heads, head_dim=head_dim, scale=scale,
                                      max_seq_len=max(lens) if lens else 0)
        q_lens = [starts[i + 1] - starts[i] for i in range(len(lens))]
        q_s = max([args["min_query_s"], *q_lens])
        q_pad = q.new_zeros((len(lens), q_s, q_heads, head_dim))  # right padding: rows past q_len unused
        for b, n in enumerate(q_lens):
            q_pad[b, :n] = q[starts[b]:starts[b + 1]]
        k_blocks, v_blocks, block_table = reblock(k_cache, v_cache, lens, table, args["block_size"])
        blocks, bs = k_blocks.shape[:2]
        mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device=q.device), diagonal=1)
        out, _ = _call(
            "npu_fused_infer_attention_score_batch_invariant",
            self.ops.npu_fused_infer_attention_score_batch_invariant,
            q_pad, k_blocks.view(blocks, bs, -1), v_blocks.view(blocks, bs, -1), atten_mask=mask,
            actual_seq_lengths=q_lens, actual_seq_lengths_kv=lens, block_table=block_table,
            num_heads=args["num_heads"], scale=args["scale"], pre_tokens=args["pre_tokens"],
            next_tokens=args["next_tokens"], input_layout=args["input_layout"],
            num_key_value_heads=args["num_key_value_heads"], sparse_mode=args["sparse_mode"],
            inner_precise=args["inner_precise"], block_size=args["block_size"],
            softmax_lse_flag=args["softmax_lse_flag"])
        return torch.cat([out[b, :n] for b, n in enumerate(q_lens)]) if q_lens else q.new_empty(q.shape)


def reblock(k_cache, v_cache, seq_lens, block_table, block_size):
    """Copy each sequence's keys/values (pages of any size P) into blocks of ``block_size`` keys, so the
    kernel's KV blocks start at absolute positions 0, C, 2C, ... An exact copy."""
    page = k_cache.shape[1]
    flat_k = k_cache.reshape(-1, *k_cache.shape[2:])
    flat_v = v_cache.reshape(-1, *v_cache.shape[2:])
    per_seq = [max(1, math.ceil(n / block_size)) for n in seq_lens]
    total = sum(per_seq)
    k_out = k_cache.new_zeros((total * block_size, *k_cache.shape[2:]))
    v_out = v_cache.new_zeros((total * block_size, *v_cache.shape[2:]))
    table = torch.zeros((len(seq_lens), max(per_seq) if per_seq else 1), dtype=torch.int32)
    first = 0
    for b, n in enumerate(seq_lens):
        pos = torch.arange(n)
        pages = torch.tensor(block_table[b], dtype=torch.long)[pos // page] if n else pos
        src = (pages * page + pos % page).to(k_cache.device)
        k_out[first * block_size:first * block_size + n] = flat_k[src]
        v_out[first * block_size:first * block_size + n] = flat_v[src]
        table[b, :per_seq[b]] = torch.arange(first, first + per_seq[b], dtype=torch.int32)
        first += per_seq[b]
    shape = (total, block_size, *k_cache.shape[2:])
    return k_out.view(shape), v_out.view(shape), table.to(k_cache.device)


