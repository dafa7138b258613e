"""The ``reference`` backend: pure PyTorch, the executable form of the contract.

It runs on the CPU (and on any torch device) and is bitwise batch-invariant and phase-consistent
by construction: every reduction chunk is a correctly rounded fp32 sum (``exact.py``), every
transcendental is built from IEEE add/mul/div, and every other step is an elementwise op, so no
row's bits can depend on its batch-mates, its position, the thread count or the phase.

What it does not promise: the same bits as a GPU backend. The contract leaves the order inside one
reduction chunk and the exp/log ulps implementation-defined; the reference picks "correctly
rounded", which no tensor core does.
"""

from __future__ import annotations

import torch

from hal import fp8, moe
from hal.backend import AttentionMetadata, Backend, Probe
from hal.backends.reference import exact
from hal.backends.reference.attention import paged_attention
from hal.backends.reference.exact import MANTISSA_BITS, blocked_sum_fp32, exp_fp32, log_fp32, matmul_fp32
from hal.errors import UnsupportedError


def _fdiv(a: torch.Tensor, b: torch.Tensor | float) -> torch.Tensor:
    """IEEE division a / b of fp32 values, correctly rounded to fp32, on any host.

    Computed in fp64 and rounded once: for fp32 operands the fp64 quotient rounded to fp32 is the
    correctly rounded fp32 quotient (double rounding is innocuous for +, -, *, / and sqrt when the
    wider format has at least 2p + 2 bits: 53 >= 50). This keeps the result off torch's fp32 CPU
    kernels. A scalar divisor is materialised as a tensor: torch replaces division by a Python scalar
    with multiplication by its reciprocal, which is not correctly rounded."""
    if not isinstance(b, torch.Tensor):
        b = torch.full_like(a, float(b))   # in a's dtype (fp32): the divisor is fl32(b)
    return torch.div(a.double(), b.double()).float()


def _fsqrt(x: torch.Tensor) -> torch.Tensor:
    """IEEE sqrt of fp32 values, correctly rounded to fp32, on any host (fp64, rounded once; see
    ``_fdiv``). torch's fp32 CPU sqrt is not: on an AVX2 build running on an AMD EPYC it was 1 ulp off
    for ~20% of random inputs, so the reference never uses it."""
    return torch.sqrt(x.double()).float()


def _square_bits(dtype: torch.dtype) -> int:
    """Significant bits of the square of a value of ``dtype`` (exact in fp64)."""
    return 2 * MANTISSA_BITS[dtype]


class ReferenceBackend(Backend):
    name = "reference"
    description = "pure PyTorch, contract-exact and invariant by construction (CPU or any torch device)"
    kind = "cpu"
    contracts = ("bf16-dense-v1", "bf16-moe-v1", "bf16-ascend-v1", "bf16-fp8-v1", "bf16-fp8-v2",
                 "bf16-moe-fp8-v1")
    dtypes = (torch.bfloat16, torch.float32)

    @classmethod
    def probe(cls) -> Probe:
        return Probe.ok("cpu", threads=torch.get_num_threads())

    # -- GEMM ---------------------------------------------------------------------------------

    def linear(self, x, weight, bias=None, *, out_dtype=None):
        out_dtype = out_dtype or x.dtype
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        # [gemm]: K in chunks of k_chunk at absolute offsets, each a correctly rounded fp32 sum,
        # chunk sums added in ascending order in fp32, bias added in fp32, one output rounding.
        acc = None
        for start, end in self.contract.gemm.chunk_ranges(k):
            part = matmul_fp32(x2[:, start:end], weight[:, start:end].T)
            acc = part if acc is None else acc + part
        if acc is None:
            acc = torch.zeros(x2.shape[0], weight.shape[0], device=x.device)
        if bias is not None:
            acc = acc + bias.float()
        return acc.to(out_dtype).reshape(*x.shape[:-1], weight.shape[0])

    # -- attention and the KV cache -----------------------------------------------------------

    def attention(self, q, k_cache, v_cache, meta: AttentionMetadata, *, scale):
        return paged_attention(q, k_cache, v_cache, meta, scale, self.contract.attention)

    # -- pointwise and row ops ----------------------------------------------------------------

    def rms_norm(self, x, weight, eps, residual=None):
        dtype = x.dtype
        spec = self.contract.rms_norm
        xf = x.float()
        if residual is not None:
            residual_out = (xf + residual.float()).to(dtype)
            xf = residual_out.float()
        n = x.shape[-1]
        sum_sq = blocked_sum_fp32(xf.double().square(), spec.row_block, _square_bits(dtype))
        if spec.inv_rms == "mul_reciprocal_div_rn_sqrt_rn":    # mean = fl32(ss * fl32(1 / n))
            mean_sq = sum_sq * _fdiv(torch.ones_like(sum_sq), float(n))
        else:                                                  # mean = fl32(ss / n)
            mean_sq = _fdiv(sum_sq, float(n))
        eps32 = torch.tensor(eps, dtype=torch.float32, device=x.device)
        inv = _fdiv(torch.ones_like(mean_sq), _fsqrt(mean_sq + eps32))
        out = ((xf * inv.unsqueeze(-1)) * weight.float()).to(dtype)
        return out if residual is None else (out, residual_out)

    def silu_mul(self, gate_up):
        dtype = gate_up.dtype
        g, u = gate_up.float().chunk(2, dim=-1)
        silu = torch.div(g, 1.0 + exp_fp32(-g))
        return (silu * u).to(dtype)

    def rotary(self, positions, q, k, cos_sin_cache):
        dtype = q.dtype
        rot = cos_sin_cache.shape[-1]
        cos, sin = cos_sin_cache[positions.long()].chunk(2, dim=-1)       # (T, R/2) each
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

        def rotate(x):
            xf = x.float()
            x1, x2, rest = xf[..., : rot // 2], xf[..., rot // 2: rot], xf[..., rot:]
            # [rope].fma = none: each product rounded, then the add.
            o1 = x1 * cos - x2 * sin
            o2 = x2 * cos + x1 * sin
            return torch.cat([o1, o2, rest], dim=-1).to(dtype)

        return rotate(q), rotate(k)

    # -- log-probabilities --------------------------------------------------------------------

    def _shifted_and_log_sum(self, logits, temperature):
        """x - max and log(sum exp(x - max)) per row, as [logprobs] says."""
        x = logits.float()
        if temperature != 1.0:
            x = _fdiv(x, float(temperature))
        shifted = x - x.amax(-1, keepdim=True)
        total = blocked_sum_fp32(exp_fp32(shifted).double(), self.contract.logprobs.vocab_chunk, 24)
        return shifted, log_fp32(total)

    def log_softmax(self, logits, temperature=1.0):
        shifted, log_sum = self._shifted_and_log_sum(logits, temperature)
        return shifted - log_sum.unsqueeze(-1)

    def token_logprobs(self, logits, token_ids, temperature=1.0):
        shifted, log_sum = self._shifted_and_log_sum(logits, temperature)
        return shifted.gather(-1, token_ids.long().view(-1, 1)).squeeze(-1) - log_sum

    # -- vocab-parallel pieces of token_logprobs ([parallel], hal/parallel.py) -------------------

    def _vocab_chunks(self, op, logits, vocab_offset, temperature):
        return self.check_vocab_shard(op, logits, vocab_offset, temperature).chunk_ranges(logits.shape[-1])

    def _scaled(self, logits, temperature):
        x = logits.float()
        return _fdiv(x, float(temperature)) if temperature != 1.0 else x

    def logprob_chunk_max(self, logits, temperature=1.0, vocab_offset=0):
        ranges = self._vocab_chunks("logprob_chunk_max", logits, vocab_offset, temperature)
        x = self._scaled(logits, temperature)
        return torch.stack([x[:, s:e].amax(-1) for s, e in ranges], dim=-1)

    def logprob_chunk_sums(self, logits, row_max, temperature=1.0, vocab_offset=0):
        ranges = self._vocab_chunks("logprob_chunk_sums", logits, vocab_offset, temperature)
        shifted = self._scaled(logits, temperature) - row_max.float().unsqueeze(-1)
        terms = exp_fp32(shifted).double()
        return torch.stack([exact.sum_fp32(terms[:, s:e], 24) for s, e in ranges], dim=-1)

    def logprob_combine(self, token_logits, row_max, chunk_sums, temperature=1.0):
        total = torch.zeros_like(row_max, dtype=torch.float32)
        for c in range(chunk_sums.shape[-1]):
            total = total + chunk_sums[:, c]
        x_t = self._scaled(token_logits, temperature)
        return (x_t - row_max) - log_fp32(total)

    # -- reductions and top-k -----------------------------------------------------------------

    def _sum_last(self, x):
        bits = MANTISSA_BITS.get(x.dtype)
        if bits is None:
            raise UnsupportedError(f"sum: dtype {x.dtype} is not realised")
        return blocked_sum_fp32(x.double(), self.contract.reduce.row_block, bits)

    def sum(self, x, dim=-1):
        return self._sum_last(x.movedim(dim, -1))

    def mean(self, x, dim=-1):
        x = x.movedim(dim, -1)
        return _fdiv(self._sum_last(x), float(x.shape[-1]))

    def topk(self, x, k):
        # A stable descending sort keeps equal values in index order: ties go to the lower index.
        values, indices = torch.sort(x, dim=-1, descending=True, stable=True)
        return values[..., :k], indices[..., :k]

    # -- mixture of experts ([moe], hal/moe.py) ------------------------------------------------

    def moe_route(self, router_logits, routing, correction_bias=None):
        moe.check_contract(self)
        return moe.route(router_logits, routing, correction_bias, exp=exp_fp32, div=_fdiv,
                         row_sum=self.sum, topk=self.topk)

    def moe_experts(self, x, w13, w2, topk_weights, topk_ids, shared=None):
        moe.check_contract(self)
        return moe.experts(self, x, w13, w2, topk_weights, topk_ids, shared)


    # -- block FP8 ([fp8], hal/fp8.py) -----------------------------------------------------------

    def fp8_linear(self, x, weight, weight_scale_inv, bias=None, *, out_dtype=None):
        spec = fp8.spec_of(self.contract, "reference.fp8_linear")
        k = x.shape[-1]
        xq, x_scale = fp8.quantise_activations(x.reshape(-1, k), spec)
        out = fp8.block_gemm(xq, x_scale, weight, weight_scale_inv, bias, out_dtype or x.dtype, spec)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    def fp8_moe_experts(self, x, w13, w13_scale_inv, w2, w2_scale_inv, topk_weights, topk_ids, shared=None):
        moe.check_contract(self)
        return moe.fp8_experts(self, x, w13, w13_scale_inv, w2, w2_scale_inv, topk_weights, topk_ids, shared)

    def fp8_write_kv(self, k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping):
        fp8.write_kv_exact(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping,
                           fp8.spec_of(self.contract, "reference.fp8_write_kv"))

    def fp8_attention(self, q, k_cache, v_cache, k_scale, v_scale, meta: AttentionMetadata, *, scale):
        # fp32_multiply_round_act: the read path materialised, then the contract's attention; f16_operands: the
        # contract's attention on f16 operands, the fixed scales on the scores and the output. Exact by
        # construction either way. Only the pages the block table names are read (a vLLM engine's cache is
        # mostly pages of other requests, or none); the table is renumbered to them, so every key meets the
        # same values.
        pages = torch.unique(meta.block_table.long())
        table = torch.searchsorted(pages, meta.block_table.long()).to(meta.block_table.dtype)
        renumbered = AttentionMetadata(meta.query_start_loc, meta.seq_lens, table)
        if fp8.spec_of(self.contract, "reference.fp8_attention").kv_dequant == "f16_operands":
            return paged_attention(q, k_cache[pages], v_cache[pages], renumbered, scale, self.contract.attention,
                                   fixed_scales=(k_scale, v_scale))
        per_token = k_scale.dim() > 0
        k = fp8.dequantise_kv(k_cache[pages], k_scale[pages] if per_token else k_scale, q.dtype)
        v = fp8.dequantise_kv(v_cache[pages], v_scale[pages] if per_token else v_scale, q.dtype)
        return self.attention(q, k, v, renumbered, scale=scale)


__all__ = ["ReferenceBackend", "exact"]
