"""A backend with the classic bug: a kernel-choice threshold that changes the reduction structure.

Below the threshold it is the reference backend. Above ``LARGE_BATCH`` rows it switches to
kernels with other chunk sizes (as cuBLAS picks split-K by M, or an RMSNorm kernel switches its
block at 256 tokens), and in decode-only attention calls it uses a smaller KV chunk (as a
split-KV decode kernel does). Every single call is still accurate; only the invariances break,
which is exactly what the conformance kit's levels 2 and 3 must catch.
"""

from __future__ import annotations

import dataclasses

import torch

from hal.backend import Probe
from hal.backends.reference import ReferenceBackend

LARGE_BATCH = 64


def _other_structure(contract):
    return dataclasses.replace(
        contract,
        gemm=dataclasses.replace(contract.gemm, k_chunk=contract.gemm.k_chunk // 2),
        rms_norm=dataclasses.replace(contract.rms_norm, row_block=64),
        logprobs=dataclasses.replace(contract.logprobs, vocab_chunk=128),
        reduce=dataclasses.replace(contract.reduce, row_block=64),
    )


def _decode_structure(contract):
    return dataclasses.replace(contract, attention=dataclasses.replace(
        contract.attention, kv_chunk=contract.attention.kv_chunk // 2))


class BrokenThresholdBackend(ReferenceBackend):
    name = "broken-threshold"
    description = "reference ops, but other reduction chunks above 64 rows and in decode (deliberately broken)"
    kind = "cpu"

    def __init__(self, contract, device=None):
        super().__init__(contract, device)
        self._large = ReferenceBackend(_other_structure(contract), device)
        self._decode = ReferenceBackend(_decode_structure(contract), device)

    @classmethod
    def probe(cls):
        return Probe.ok("cpu")

    def _pick(self, x):
        rows = x.numel() // max(x.shape[-1], 1)
        return self._large if rows > LARGE_BATCH else super()

    def linear(self, x, weight, bias=None, *, out_dtype=None):
        return self._pick(x).linear(x, weight, bias, out_dtype=out_dtype)

    def rms_norm(self, x, weight, eps, residual=None):
        return self._pick(x).rms_norm(x, weight, eps, residual)

    def log_softmax(self, logits, temperature=1.0):
        return self._pick(logits).log_softmax(logits, temperature)

    def token_logprobs(self, logits, token_ids, temperature=1.0):
        return self._pick(logits).token_logprobs(logits, token_ids, temperature)

    def sum(self, x, dim=-1):
        return self._pick(x.movedim(dim, -1)).sum(x, dim)

    def mean(self, x, dim=-1):
        return self._pick(x.movedim(dim, -1)).mean(x, dim)

    def silu_mul(self, gate_up):
        if gate_up.numel() // gate_up.shape[-1] > LARGE_BATCH:  # a "fused" kernel with another exp
            g, u = gate_up.float().chunk(2, dim=-1)
            return (torch.nn.functional.silu(g) * u).to(gate_up.dtype)
        return super().silu_mul(gate_up)

    def topk(self, x, k):
        if x.numel() // x.shape[-1] > LARGE_BATCH:  # ties decided by another algorithm
            values, indices = torch.sort(x.flip(-1), dim=-1, descending=True, stable=True)
            return values[..., :k], (x.shape[-1] - 1 - indices)[..., :k]
        return super().topk(x, k)

    def attention(self, q, k_cache, v_cache, meta, *, scale):
        q_lens = meta.query_start_loc.diff()
        decode_only = bool((q_lens == 1).all())
        backend = self._decode if decode_only else super()
        return backend.attention(q, k_cache, v_cache, meta, scale=scale)
