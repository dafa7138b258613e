"""The ``ascend`` backend: the contract on Huawei Ascend NPUs, through one of two paths.

Installed as ``hal.backends.ascend``. This module stays cheap to import: torch_npu, triton and the
op packages are imported by ``probe()`` and ``__init__`` only.

Paths (constructor argument ``path`` or ``HAL_ASCEND_PATH``; reported in the probe's details; a
missing piece of the chosen path makes the backend unavailable, it never falls back to the other):
  cann    (default) torch_npu + CANN's batch-invariant op package for GEMM and reductions, with the
          contract's K chunks / row blocks / vocabulary chunks enforced on the host around each op;
          attention through the op package's batch-invariant fused-inference-attention, one call path
          for every phase; RMSNorm as add, then ``npu_rms_norm``; SiLU*up as plain torch ops.
          Realises bf16-ascend-v1 (the native kernels' rules), refuses bf16-dense-v1. ``cann_ops.py``
  triton  the shared Triton kernels (``hal.kernels``) with tiles fitted to the unified buffer
          (``tiles.py``, ``launch.py``): CPU emulation under TRITON_INTERPRET=1 only. On an NPU it is
          refused: triton-ascend gives no rounding guarantee for div_rn/sqrt_rn, ignores
          enable_fp_fusion and lacks the bitcasts the bf16 rounding uses (api_facts.toml). ``triton_ops.py``
Every numerics-relevant NPU argument is a pure function of the contract (``mapping.py``); the
determinism and precision settings are applied at construction and read back (``settings.py``);
``numerics_report()`` returns both with the contract fingerprint.

Status: nothing of this backend has run on NPU hardware. ``probe()`` reports available only where
every piece of the chosen path and a device are present, with ``verified_on_hardware=False``.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from hal.backend import Allowed, AttentionMetadata, Backend, Capabilities, Probe
from hal.backends.ascend.mapping import HEAD_DIMS, KNOWN
from hal.errors import UnsupportedError

#: What both paths realise: the enumerated contract choices the mapping knows (``mapping.KNOWN``).
#: What one path adds is checked at construction: ``path_capabilities``; what depends on a call's
#: shapes (a context longer than kv_split on the cann path, a tile that outgrows the unified buffer)
#: is refused per call.
CAPABILITIES = Capabilities(
    contracts=("bf16-ascend-v1",),
    dtypes=(torch.bfloat16, torch.float32),
    head_dims=HEAD_DIMS,
    page_sizes=None,  # any: the cann path re-blocks the cache, the triton kernels read any page size
    contract_values={f"{section}.{key}": Allowed.one_of(value)
                     for section, values in KNOWN.items() for key, value in values.items()},
)


def path_capabilities(path: str) -> Capabilities:
    """The capabilities of one path: the triton path adds the shared kernels' limits (row blocks and
    vocabulary chunks are single tiles, the KV chunk is the key tile)."""
    if path != "triton":
        return CAPABILITIES
    from hal.kernels.realises import CONTRACT_VALUES

    return dataclasses.replace(CAPABILITIES, contracts=("bf16-dense-v1", "bf16-ascend-v1"),
                               contract_values=CONTRACT_VALUES)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


class AscendBackend(Backend):
    name = "ascend"
    description = "Huawei Ascend NPUs: torch_npu + CANN's batch-invariant ops (bf16-ascend-v1); unverified on hardware"
    kind = "accelerator"
    capabilities = CAPABILITIES

    @classmethod
    def probe(cls) -> Probe:
        from hal.backends.ascend.probe import diagnose

        try:
            d = diagnose()
        except UnsupportedError as exc:  # a bad HAL_ASCEND_PATH / HAL_ASCEND_ATTENTION
            return Probe.missing(str(exc))
        details = dict(path=d.path, attention_impl=d.attention_impl, verified_on_hardware=False, **d.found)
        if not d.complete:
            return Probe.missing(d.reason, missing=list(d.missing), **details)
        return Probe.ok(f"npu:0 ({d.path} path)", **details)

    @classmethod
    def default_device(cls) -> torch.device:
        import torch_npu  # noqa: F401  (registers the "npu" device type)

        return torch.device("npu")

    def __init__(self, contract, device=None, *, path: str | None = None, attention_impl: str | None = None,
                 settings_surface=None, hccl: str = "true", cann_handles: dict | None = None):
        from hal.backends.ascend import mapping, settings
        from hal.backends.ascend.probe import resolve_attention_impl, resolve_path

        self.path = resolve_path(path)
        self.attention_impl = resolve_attention_impl(attention_impl)
        emulated = device is not None and torch.device(device).type == "cpu"
        if emulated and not (self.path == "triton" and _interpreting()):
            raise UnsupportedError("ascend: a CPU device is only accepted for the triton path under "
                                   "TRITON_INTERPRET=1 (emulation for CI)")
        if self.path == "triton" and not emulated:
            from hal.backends.ascend.probe import triton_ascend_refusal

            raise UnsupportedError(f"ascend: {triton_ascend_refusal()}")
        # The contract is checked against this path's capabilities (the cann path realises
        # bf16-ascend-v1 only; the emulated triton path both), not the class's (the cann path's).
        super().__init__(None, device)
        self.contract = contract
        self.capabilities = path_capabilities(self.path)
        if self.contract is not None:
            self.check_realises(self.contract, self.capabilities)
        if self.path == "cann":
            mapping.check_contract(self.contract)
        self.emulated = emulated
        # Settings: applied and read back at selection; a wrong read-back refuses the backend.
        if settings_surface is None and not emulated:
            try:
                settings_surface = settings.real_surface()
            except ImportError as exc:
                raise UnsupportedError(f"ascend: cannot apply the NPU settings: {exc}") from exc
        self.hccl = hccl
        self.settings = settings.apply_and_verify(settings_surface, hccl) if settings_surface is not None else None
        if self.path == "cann":
            from hal.backends.ascend.cann_ops import CannOps

            self._ops = CannOps(self.contract, self.attention_impl, **(cann_handles or {}))
        else:
            from hal.backends.ascend.triton_ops import TritonOps

            self._ops = TritonOps(self.contract)

    def numerics_report(self) -> dict:
        """What decides this instance's bits: contract + fingerprint, path, NPU op arguments, settings."""
        from hal.backends.ascend import mapping, settings

        return {
            "backend": self.name, "path": self.path, "attention_impl": self.attention_impl,
            "contract": self.contract.name, "fingerprint": self.fingerprint,
            "settings": self.settings,
            "settings_fingerprint": settings.fingerprint(self.settings) if self.settings is not None else None,
            "mapping": mapping.describe(self.contract, self.attention_impl) if self.path == "cann" else "triton tiles",
            "emulated": self.emulated, "verified_on_hardware": False,
        }

    # -- ops ------------------------------------------------------------------------------------

    def linear(self, x, weight, bias=None, *, out_dtype=None):
        self.check_devices("linear", x, weight, bias)
        x2 = x.reshape(-1, x.shape[-1])
        out_dtype = out_dtype or x.dtype
        if weight.shape[0] == 0:
            return x.new_empty((*x.shape[:-1], 0), dtype=out_dtype)
        return self._ops.linear(x2, weight, bias, out_dtype).reshape(*x.shape[:-1], weight.shape[0])

    def attention(self, q, k_cache, v_cache, meta: AttentionMetadata, *, scale):
        self.check_devices("attention", q, k_cache, v_cache)
        return self._ops.attention(q, k_cache, v_cache, meta, scale)

    def rms_norm(self, x, weight, eps, residual=None):
        self.check_devices("rms_norm", x, weight, residual)
        return self._ops.rms_norm(x, weight, eps, residual)

    def silu_mul(self, gate_up):
        if self.path == "triton":
            return self._ops.silu_mul(gate_up)
        g, u = gate_up.float().chunk(2, dim=-1)
        return ((g / (1.0 + torch.exp(-g))) * u).to(gate_up.dtype)  # plain SiLU*up, never npu_swiglu

    def rotary(self, positions, q, k, cos_sin_cache):
        table = cos_sin_cache.to(q.device).contiguous()
        pos = positions.to(q.device).contiguous()
        if self.path == "triton":
            return self._ops.rotary(pos, q, k, table)
        return _rotary_torch(pos, q, table), _rotary_torch(pos, k, table)

    def log_softmax(self, logits, temperature=1.0):
        return self._ops.log_softmax(logits, float(temperature))

    def token_logprobs(self, logits, token_ids, temperature=1.0):
        return self._ops.token_logprobs(logits, token_ids, float(temperature))

    def sum(self, x, dim=-1):
        x2 = x.movedim(dim, -1)
        return self._ops.sum(x2.reshape(-1, x2.shape[-1])).view(x2.shape[:-1])

    def mean(self, x, dim=-1):
        x2 = x.movedim(dim, -1)
        return self._ops.mean(x2.reshape(-1, x2.shape[-1])).view(x2.shape[:-1])

    def topk(self, x, k):
        values, indices = torch.sort(x, dim=-1, descending=True, stable=True)  # comparisons only
        return values[..., :k].contiguous(), indices[..., :k].contiguous()

    # Mixture of experts: not realised. CANN's MoE ops (npu_moe_gating_top_k_softmax, npu_moe_init_routing,
    # npu_grouped_matmul, npu_moe_finalize_routing) would be the route, but no NPU was reachable to
    # establish their reduction order, tie-breaking and combine order against [moe], and the backend's
    # contracts do not include bf16-moe-v1 (binding an MoE contract is refused before this).
    _MOE_REFUSAL = ("backend 'ascend' does not realise mixture-of-experts layers: CANN's MoE ops "
                    "(npu_moe_gating_top_k_softmax, npu_grouped_matmul, npu_moe_finalize_routing) are not "
                    "checked against the contract's [moe] (ties, K chunks, the rank-order combine) on an NPU; "
                    "run MoE models on 'cuda' or 'reference'")

    def moe_route(self, router_logits, routing, correction_bias=None):
        raise UnsupportedError(self._MOE_REFUSAL)

    def moe_experts(self, x, w13, w2, topk_weights, topk_ids, shared=None):
        raise UnsupportedError(self._MOE_REFUSAL)

    # Block FP8: not realised. The route would be torch_npu's quantised matmuls (npu_quant_matmul with
    # per-group scales) and its dynamic quantisation (npu_dynamic_quant), but no NPU was reachable to
    # establish whether their FP8 data types exist on the targeted chips, how they form and scale a K
    # block's partial and in which order they add the blocks, against [fp8]; the backend's contracts do
    # not include bf16-fp8-v1 (binding an FP8 contract is refused before this).
    _FP8_REFUSAL = ("backend 'ascend' does not realise FP8 linears: torch_npu's quantised matmul and dynamic "
                    "quantisation are not checked against the contract's [fp8] (the group scale rule, the "
                    "per-block partial, the scale order, ascending K blocks) on an NPU; run FP8 models on "
                    "'cuda' or 'reference'")

    def fp8_linear(self, x, weight, weight_scale_inv, bias=None, *, out_dtype=None):
        raise UnsupportedError(self._FP8_REFUSAL)

    def fp8_moe_experts(self, x, w13, w13_scale_inv, w2, w2_scale_inv, topk_weights, topk_ids, shared=None):
        raise UnsupportedError(self._FP8_REFUSAL)


def _rotary_torch(positions, x, table):
    """Neox rotary with one torch op per product and sum: fl(fl(x1 c) - fl(x2 s)), no FMA."""
    half = table.shape[-1] // 2
    cos, sin = table[positions.long(), :half][:, None, :], table[positions.long(), half:][:, None, :]
    x1, x2 = x[..., :half].float(), x[..., half:2 * half].float()
    out = x.clone()
    out[..., :half] = ((x1 * cos) - (x2 * sin)).to(x.dtype)
    out[..., half:2 * half] = ((x2 * cos) + (x1 * sin)).to(x.dtype)
    return out
