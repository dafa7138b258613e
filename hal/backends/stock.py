"""The ``torch`` backend: stock PyTorch ops with no invariance claims.

It is the baseline that every comparison measures against, and the negative control of every
invariance test: F.linear picks its BLAS kernel and split by shape, SDPA tiles differently in
prefill and decode, reductions change their tree with the row count. It computes the same
mathematical function as the contract backends, with the usual rounding points of the stock
implementations (vLLM / Hugging Face), so its outputs are close, never bitwise-guaranteed.

Masked keys are not NaN-safe here (the contract's [attention].mask is not realised): SDPA with a
boolean mask lets a NaN in a causally masked key's K or V reach the earlier queries of a prefill
(measured with torch 2.13 on CPU, fp32 and bf16: every output of the earlier queries NaN), while a
decode call (q_len 1, no mask) never reads a later key. Left as is: it is the stock baseline.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hal.backend import AttentionMetadata, Backend, Probe


def _default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


class TorchBackend(Backend):
    name = "torch"
    description = "stock PyTorch ops (F.linear, SDPA, ...): fast, no invariance; the baseline and negative control"
    kind = "baseline"
    contracts = ()
    dtypes = (torch.bfloat16, torch.float16, torch.float32)

    @classmethod
    def probe(cls) -> Probe:
        return Probe.ok(str(_default_device()))

    @classmethod
    def default_device(cls) -> torch.device:
        return _default_device()

    def linear(self, x, weight, bias=None, *, out_dtype=None):
        out = F.linear(x, weight, bias)
        return out if out_dtype in (None, out.dtype) else out.to(out_dtype)

    def attention(self, q, k_cache, v_cache, meta: AttentionMetadata, *, scale):
        out = torch.empty_like(q)
        page = k_cache.shape[1]
        group = q.shape[1] // k_cache.shape[2]
        starts, seq_lens, table = meta.host_lists()
        for b, seq_len in enumerate(seq_lens):
            q0, q1 = starts[b], starts[b + 1]
            if q1 == q0:
                continue
            pages = torch.tensor(table[b][: -(-seq_len // page)], device=q.device)
            k = k_cache.index_select(0, pages).flatten(0, 1)[:seq_len].transpose(0, 1)  # (Hkv, L, D)
            v = v_cache.index_select(0, pages).flatten(0, 1)[:seq_len].transpose(0, 1)
            k = k.repeat_interleave(group, dim=0)
            v = v.repeat_interleave(group, dim=0)
            qh = q[q0:q1].transpose(0, 1)                                                    # (Hq, ql, D)
            q_len = q1 - q0
            mask = None
            if q_len > 1:  # queries sit at the end of the context: causal with an offset
                positions = torch.arange(seq_len - q_len, seq_len, device=q.device)
                mask = torch.arange(seq_len, device=q.device).unsqueeze(0) <= positions.unsqueeze(1)
            o = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale)
            out[q0:q1] = o.transpose(0, 1)
        return out

    def rms_norm(self, x, weight, eps, residual=None):
        if residual is not None:
            x = x + residual
            residual = x
        xf = x.float()
        out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight
        return out if residual is None else (out, residual)

    def silu_mul(self, gate_up):
        g, u = gate_up.chunk(2, dim=-1)
        return F.silu(g) * u

    def rotary(self, positions, q, k, cos_sin_cache):
        rot = cos_sin_cache.shape[-1]
        cos, sin = cos_sin_cache[positions.long()].chunk(2, dim=-1)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

        def rotate(x):
            x1, x2, rest = x[..., : rot // 2], x[..., rot // 2: rot], x[..., rot:]
            o1 = (x1 * cos - x2 * sin).to(x.dtype)
            o2 = (x2 * cos + x1 * sin).to(x.dtype)
            return torch.cat([o1, o2, rest], dim=-1)

        return rotate(q), rotate(k)

    def log_softmax(self, logits, temperature=1.0):
        return _log_softmax(logits, temperature)

    def token_logprobs(self, logits, token_ids, temperature=1.0):
        # the module function, not self.log_softmax: the public op would run the input checks again
        return _log_softmax(logits, temperature).gather(-1, token_ids.long().view(-1, 1)).squeeze(-1)

    def sum(self, x, dim=-1):
        return x.float().sum(dim)

    def mean(self, x, dim=-1):
        return x.float().mean(dim)

    def topk(self, x, k):
        return torch.topk(x, k, dim=-1)

    def moe_route(self, router_logits, routing, correction_bias=None):
        # Hugging Face's routing: torch.softmax / sigmoid, torch.topk (which breaks ties as its kernel
        # happens to), an unordered sum for the renormalisation.
        x = router_logits.float()
        scores = torch.softmax(x, dim=-1) if routing.scoring == "softmax" else torch.sigmoid(x)
        choice = scores if correction_bias is None else scores + correction_bias.float()
        if routing.num_groups > 1:
            t, e = choice.shape
            grouped = choice.view(t, routing.num_groups, e // routing.num_groups)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
            kept = group_scores.topk(routing.topk_groups, dim=-1).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(-1, kept, True)
            choice = grouped.masked_fill(~keep.unsqueeze(-1), 0.0).view(t, e)
        ids = torch.topk(choice, routing.top_k, dim=-1).indices
        weights = scores.gather(-1, ids)
        if routing.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights * routing.scaling, ids.to(torch.int32)

    def moe_experts(self, x, w13, w2, topk_weights, topk_ids, shared=None):
        # Hugging Face's expert loop: each expert's tokens batched through F.linear (a BLAS call whose
        # kernel depends on how many tokens the expert got), the weighted outputs rounded to the
        # activation dtype and added into the output in expert order, not in each token's rank order.
        return _expert_loop(x, lambda rows, e: F.linear(rows, w13[e]), lambda act, e: F.linear(act, w2[e]),
                            topk_weights, topk_ids, shared)

    def fp8_moe_experts(self, x, w13, w13_scale_inv, w2, w2_scale_inv, topk_weights, topk_ids, shared=None):
        # The same loop with per-tensor dynamic FP8 linears (fp8_linear below): each activation scale is
        # taken over all the tokens an expert got, so a token's bits follow them.
        return _expert_loop(x, lambda rows, e: self.fp8_linear(rows, w13[e], w13_scale_inv[e]),
                            lambda act, e: self.fp8_linear(act, w2[e], w2_scale_inv[e]), topk_weights, topk_ids,
                            shared)

    def fp8_linear(self, x, weight, weight_scale_inv, bias=None, *, out_dtype=None):
        # vLLM's per-tensor dynamic FP8 (scaled_fp8_quant without a static scale): one activation scale
        # from the amax of the whole batch, so a token's FP8 values follow its batch-mates; then the
        # dequantised product through F.linear (its BLAS picks the reduction order by shape).
        scale = (x.float().abs().amax().clamp(min=1e-10) / 448.0)
        xq = (x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        b = 128
        n, k = weight.shape
        w = weight.float() * weight_scale_inv.repeat_interleave(b, 0).repeat_interleave(b, 1)[:n, :k]
        out = F.linear(xq.float() * scale, w, None if bias is None else bias.float())
        return out.to(out_dtype or x.dtype)


def _log_softmax(logits, temperature):
    return torch.log_softmax(logits.float() / temperature, dim=-1)


def _expert_loop(x, gate_up, down, topk_weights, topk_ids, shared):
    """Hugging Face's MoE expert loop: per expert (ascending id), its tokens' rows through ``gate_up(rows,
    e)`` and ``down(act, e)``, weighted and added into the output in expert order."""
    out = torch.zeros_like(x) if shared is None else shared.clone()
    for expert in topk_ids.unique().tolist():
        token, rank = (topk_ids == expert).nonzero(as_tuple=True)
        gate, up = gate_up(x[token], expert).chunk(2, dim=-1)
        y = down(F.silu(gate) * up, expert)
        out.index_add_(0, token, (y * topk_weights[token, rank].unsqueeze(-1).to(y.dtype)))
    return out
