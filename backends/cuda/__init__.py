"""The ``cuda`` backend: the shared Triton kernels (``hal.kernels``) on NVIDIA GPUs.

Installed as ``hal.backends.cuda``. This module stays cheap to import: triton and the kernels are
imported by ``probe()`` and ``__init__`` only.

What is NVIDIA's here: the probe (compute capability), the launch policy (``launch.py``: the
multiprocessor count the kernels size their waves by) and the capabilities (which contract values
the kernels with their H200 tile table realise). The reduction order of each op is written at the top
of its kernel module in ``hal/kernels/``.
Top-k uses ``torch.sort(stable=True)``: comparison only, no arithmetic, so any correct stable sort
gives the contract's bits (value descending, ties to the lower index). The KV-cache write is an
exact copy too (``hal/kernels/kv_write.py``): a kernel instead of the base class's masked select, so a
call never synchronises with the host (vLLM writes the KV of every layer between its graph pieces).

Under ``TRITON_INTERPRET=1`` (no GPU, CI) the same kernels run on CPU tensors through Triton's
interpreter, with bf16 upcast after each load (exact) because the interpreter cannot do bf16
arithmetic. Interpreter bits are not GPU bits: only invariances and tolerances are checked there.
"""

from __future__ import annotations

import os

import torch

from hal import fp8, moe
from hal.backend import Allowed, AttentionMetadata, Backend, Capabilities, Probe, mark_values_checked
from hal.errors import UnsupportedError
from hal.kernels.realises import CONTRACT_VALUES, HEAD_DIMS

MIN_CAPABILITY = (8, 0)  # bf16 tensor-core MMA

CAPABILITIES = Capabilities(
    contracts=("bf16-dense-v1", "bf16-moe-v1", "bf16-ascend-v1", "bf16-fp8-v1", "bf16-fp8-v2", "bf16-moe-fp8-v1"),
    dtypes=(torch.bfloat16, torch.float32),
    head_dims=HEAD_DIMS,
    page_sizes=None,  # any: a KV chunk that crosses pages is loaded key by key
    contract_values={
        **CONTRACT_VALUES,
        # The GEMM's tile table (hal.kernels.gemm._config) steps through a K chunk in BLOCK_K of up
        # to 256; a chunk must hold whole steps.
        "gemm.k_chunk": Allowed.multiples_of(256),
    },
)


def _int32(t: torch.Tensor) -> torch.Tensor:
    """The metadata as the kernels read it: int32, consecutive along the last dim (a block table's rows may sit
    apart: its row stride is passed; a strided seq_lens view read as contiguous sent the kernel past its pages).
    No call when it already is (a .to() costs the host ~1 us)."""
    if t.dtype != torch.int32:
        t = t.to(torch.int32)
    return t if t.stride(-1) == 1 else t.contiguous()


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# The GPU architectures on which the FP8 kernels' bits were shown batch- and tile-invariant
# (bench/fp8_gpu.py; H200, bench/results/h200-2026-12-01-session7). The fp8 MMA accumulates a K block
# with fewer bits than fp32 and in an order of the hardware's choosing, so another architecture's MMA
# must be shown invariant before it is trusted.
FP8_VERIFIED_CAPABILITIES = ((9, 0),)


def _check_fp8_architecture(device: torch.device) -> None:
    capability = torch.cuda.get_device_capability(device)
    if capability not in FP8_VERIFIED_CAPABILITIES:
        raise UnsupportedError(
            f"cuda.fp8_linear: the FP8 kernels are verified bitwise (batch invariance, tile freedom) on "
            f"compute capability {', '.join(f'{a}.{b}' for a, b in FP8_VERIFIED_CAPABILITIES)} only, this GPU "
            f"is {capability[0]}.{capability[1]}; run bench/fp8_gpu.py on it (docs/fp8.md) before adding it")


class CudaBackend(Backend):
    name = "cuda"
    description = "Triton kernels for NVIDIA GPUs (or Triton's CPU interpreter with TRITON_INTERPRET=1)"
    kind = "accelerator"
    capabilities = CAPABILITIES

    @classmethod
    def probe(cls) -> Probe:
        try:
            import triton
        except ImportError as exc:
            return Probe.missing(f"triton is not importable ({exc}); install the 'cuda' extra")
        if _interpreting():
            # Usable for CI on CPU tensors, but never picked automatically as "the accelerator".
            return Probe.ok("cpu (triton interpreter)", triton=triton.__version__, emulated=True)
        if not torch.cuda.is_available():
            return Probe.missing(f"no CUDA device visible to torch {torch.__version__} "
                                 f"(built with CUDA {torch.version.cuda}); for CPU runs set TRITON_INTERPRET=1")
        capability = torch.cuda.get_device_capability()
        if capability < MIN_CAPABILITY:
            return Probe.missing(f"compute capability {capability} < {MIN_CAPABILITY} required for bf16 MMA")
        return Probe.ok(f"cuda:{torch.cuda.current_device()} ({torch.cuda.get_device_name()})",
                        triton=triton.__version__, capability=capability)

    @classmethod
    def default_device(cls) -> torch.device:
        return torch.device("cpu") if _interpreting() else torch.device("cuda")

    def __init__(self, contract, device=None):
        super().__init__(contract, device)
        from hal.backends.cuda.launch import CUDA_LAUNCH
        from hal.kernels import attention, fp8_gemm, fp8_moe, gemm, kv_write, logprobs, moe, rows

        if _interpreting():
            from hal.kernels.interpreter import patch_row_dot

            patch_row_dot()
        self._gemm, self._attention, self._rows, self._logprobs = gemm, attention, rows, logprobs
        self._kv_write, self._moe, self._fp8_gemm, self._fp8_moe = kv_write, moe, fp8_gemm, fp8_moe
        self._launch = CUDA_LAUNCH

    # -- GEMM ---------------------------------------------------------------------------------

    def linear(self, x, weight, bias=None, *, out_dtype=None):
        self.check_devices("linear", x, weight, bias)
        if x.dim() == 2:              # the common case: no reshapes (each costs the host ~1 us)
            return self._gemm.linear(x, weight, bias, out_dtype or x.dtype, self.contract.gemm, policy=self._launch)
        x2 = x.reshape(-1, x.shape[-1])
        out = self._gemm.linear(x2, weight, bias, out_dtype or x.dtype, self.contract.gemm, policy=self._launch)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    def linear_chunk_partials(self, x, weight, k_offset=0):
        # One split-K launch whose programs store each K chunk's fp32 sum (hal/kernels/gemm.py): the
        # chunk's sum is the same wherever the chunk sits in K, so a shard's partials are the full
        # GEMM's partials of those chunks.
        spec = self.check_chunk_partials_inputs(x, weight, k_offset)
        self.check_devices("linear_chunk_partials", x, weight)
        x2 = x.reshape(-1, x.shape[-1])
        return self._gemm.chunk_partials(x2.contiguous(), weight, spec, policy=self._launch)

    def combine_chunks(self, partials, bias=None, *, out_dtype):
        # The split-K launch's own combine kernel: +0, the partials in ascending order, the bias, one rounding.
        self.check_combine_inputs(partials, bias)
        self.check_devices("combine_chunks", partials, bias)
        return self._gemm.combine(partials, bias, out_dtype)

    # -- attention and the KV cache -----------------------------------------------------------

    def attention(self, q, k_cache, v_cache, meta: AttentionMetadata, *, scale):
        self.check_devices("attention", q, k_cache, v_cache)
        if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
            raise UnsupportedError(f"attention: the caches' head_dim must be contiguous (stride 1); got strides "
                                   f"{k_cache.stride()} and {v_cache.stride()}")
        return self._attention.paged_attention(
            q.contiguous(), k_cache, v_cache, _int32(meta.query_start_loc), _int32(meta.seq_lens),
            _int32(meta.block_table), scale, self.contract.attention, policy=self._launch)

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping):
        self.check_devices("write_kv", k, v, k_cache, v_cache, slot_mapping)
        self._kv_write.write_kv(k, v, k_cache, v_cache, slot_mapping)

    # -- row and pointwise ops ----------------------------------------------------------------

    def rms_norm(self, x, weight, eps, residual=None):
        out, res_out = self._rows.rms_norm(x.contiguous(), weight, eps,
                                           None if residual is None else residual.contiguous(),
                                           self.contract.rms_norm, many_rows=True)
        return out if residual is None else (out, res_out)

    def silu_mul(self, gate_up):
        return self._rows.silu_mul(gate_up.contiguous())

    def rotary(self, positions, q, k, cos_sin_cache):
        table = cos_sin_cache.to(q.device).contiguous()
        pos = positions.to(q.device).contiguous()
        return self._rows.rotary(pos, q, k, table)   # q and k in one launch, read through their strides

    # Vocab-parallel pieces ([parallel]): the kernels of token_logprobs, cut where ranks exchange.
    def logprob_chunk_max(self, logits, temperature=1.0, vocab_offset=0):
        spec = self.check_vocab_shard("logprob_chunk_max", logits, vocab_offset, temperature)
        self.check_devices("logprob_chunk_max", logits)
        return self._logprobs.chunk_max(logits.contiguous(), float(temperature), spec)

    def logprob_chunk_sums(self, logits, row_max, temperature=1.0, vocab_offset=0):
        spec = self.check_vocab_shard("logprob_chunk_sums", logits, vocab_offset, temperature)
        self.check_devices("logprob_chunk_sums", logits, row_max)
        return self._logprobs.chunk_sums(logits.contiguous(), row_max.float(), float(temperature), spec)

    def logprob_combine(self, token_logits, row_max, chunk_sums, temperature=1.0):
        self.check_devices("logprob_combine", token_logits, row_max, chunk_sums)
        return self._logprobs.combine(token_logits, row_max.float(), chunk_sums.float(), float(temperature))

    def log_softmax(self, logits, temperature=1.0):
        return self._logprobs.log_softmax(logits.contiguous(), float(temperature), self.contract.logprobs)

    def token_logprobs(self, logits, token_ids, temperature=1.0):
        return self._logprobs.token_logprobs(logits.contiguous(), token_ids.contiguous(), float(temperature),
                                             self.contract.logprobs)

    def sum(self, x, dim=-1):
        return self._rows.reduce_last(x.movedim(dim, -1).contiguous(), False, self.contract.reduce)

    def mean(self, x, dim=-1):
        return self._rows.reduce_last(x.movedim(dim, -1).contiguous(), True, self.contract.reduce)

    def topk(self, x, k):
        values, indices = torch.sort(x, dim=-1, descending=True, stable=True)
        return values[..., :k].contiguous(), indices[..., :k].contiguous()

    # -- mixture of experts ([moe]) -----------------------------------------------------------

    def moe_route(self, router_logits, routing, correction_bias=None):
        moe.check_contract(self)
        self.check_devices("moe_route", router_logits, correction_bias)
        weights, ids = self._moe.route(router_logits, routing, correction_bias, self.contract.reduce)
        mark_values_checked(ids)          # in 0..E-1 by construction: moe_experts need not read them
        return weights, ids

    def moe_experts(self, x, w13, w2, topk_weights, topk_ids, shared=None):
        # The grouped expert GEMM over expert-sorted slots (hal/kernels/moe.py): each slot's bits are
        # the dense GEMM's of its token's row, so they do not depend on the expert's other tokens.
        moe.check_contract(self)
        self.check_devices("moe_experts", x, w13, w2, topk_weights, topk_ids, shared)
        return self._moe.experts(x.contiguous(), w13, w2, topk_weights, topk_ids, shared, self.contract.gemm,
                                 policy=self._launch)

    # -- block FP8 ([fp8]) ----------------------------------------------------------------------

    def fp8_linear(self, x, weight, weight_scale_inv, bias=None, *, out_dtype=None):
        # Two launches (hal/kernels/fp8_gemm.py): the per-group activation quantisation, then the
        # block-scaled GEMM; each token's groups are quantised from that token alone.
        spec = fp8.spec_of(self.contract, "cuda.fp8_linear")
        self.check_devices("fp8_linear", x, weight, weight_scale_inv, bias)
        if not _interpreting():
            _check_fp8_architecture(x.device)
        x2 = x.reshape(-1, x.shape[-1])
        out = self._fp8_gemm.linear(x2, weight, weight_scale_inv, bias, out_dtype or x.dtype, spec,
                                    policy=self._launch)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    def fp8_moe_experts(self, x, w13, w13_scale_inv, w2, w2_scale_inv, topk_weights, topk_ids, shared=None):
        # Grouped FP8 GEMMs over expert-sorted slots (hal/kernels/fp8_moe.py), no host synchronisation:
        # each slot gets the bits of fp8_linear / silu_mul / fp8_linear of its token's row alone.
        moe.check_contract(self)
        spec = fp8.spec_of(self.contract, "cuda.fp8_moe_experts")   # devices: the shared input checks
        if not _interpreting():
            _check_fp8_architecture(x.device)
        return self._fp8_moe.experts(x, w13, w13_scale_inv, w2, w2_scale_inv, topk_weights, topk_ids, shared, spec)

    # The FP8 KV cache ([fp8].kv_format / kv_scale): the write quantises in the write kernel; attention reads
    # each K/V tile as it loads it by [fp8].kv_dequant: dequantised (then the bits of ``attention`` over the
    # dequantised caches) or as f16 MMA operands (the fixed scales on the scores and the output). Half the
    # bytes of a bf16 cache either way.
    def fp8_write_kv(self, k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping):
        self._kv_write.write_kv_fp8(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping,
                                    fp8.spec_of(self.contract, "cuda.fp8_write_kv"))

    def fp8_attention(self, q, k_cache, v_cache, k_scale, v_scale, meta: AttentionMetadata, *, scale):
        if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
            raise UnsupportedError(f"fp8_attention: the caches' head_dim must be contiguous (stride 1); got strides "
                                   f"{k_cache.stride()} and {v_cache.stride()}")
        return self._attention.paged_attention(
            q.contiguous(), k_cache, v_cache, _int32(meta.query_start_loc), _int32(meta.seq_lens),
            _int32(meta.block_table), scale, self.contract.attention, policy=self._launch,
            k_scale=k_scale, v_scale=v_scale,
            f16_operands=fp8.spec_of(self.contract, "cuda.fp8_attention").kv_dequant == "f16_operands")
