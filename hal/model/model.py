"""One decoder-LLM definition for training and rollout, in which every numerically relevant op is a HAL op.

Weights use vLLM's layout, so a trainer and an engine can hold the very same tensors:

    model.embed_tokens.weight                      (V, H)
    model.layers.N.input_layernorm.weight          (H,)
    model.layers.N.self_attn.qkv_proj.weight       (Hq*D + 2*Hkv*D, H)   rows [q | k | v]
    model.layers.N.self_attn.qkv_proj.bias         (Hq*D + 2*Hkv*D,)     Qwen2 only
    model.layers.N.self_attn.q_norm.weight         (D,)                  Qwen3 only (and k_norm)
    model.layers.N.self_attn.o_proj.weight         (H, Hq*D)
    model.layers.N.post_attention_layernorm.weight (H,)
    model.layers.N.mlp.gate_up_proj.weight         (2*I, H)              rows [gate | up]
    model.layers.N.mlp.down_proj.weight            (H, I)
  an MoE layer (Qwen3-MoE; ``config.moe_layer(N)``) has instead, as vLLM's FusedMoE holds them:
    model.layers.N.mlp.gate.weight                 (E, H)                the router
    model.layers.N.mlp.gate.e_score_correction_bias (E,) fp32            DeepSeek-style only
    model.layers.N.mlp.experts.w13_weight          (E, 2*Im, H)          rows [gate | up] per expert
    model.layers.N.mlp.experts.w2_weight           (E, H, Im)
    model.layers.N.mlp.shared_experts.*            a dense MLP of n_shared*Im  DeepSeek-style only
    model.norm.weight                              (H,)
    lm_head.weight                                 (V, H)                absent when tied to embed_tokens
  a block-FP8 model (``config.fp8``) holds each attention and dense-MLP projection as an ``Fp8Linear``:
    <proj>.weight                                  (N, K) model dtype    the master weight (trainable)
    <proj>.weight_fp8                              (N, K) float8_e4m3fn  buffer: what the forward uses
    <proj>.weight_scale_inv                        (N/128, K/128) fp32   buffer: one scale per block
  and its routed experts as ``Fp8Experts``: ``w13_weight`` / ``w2_weight`` the master weights, with the
  buffers ``w13_weight_fp8`` / ``w13_weight_scale_inv`` (E, 2*Im/128, H/128) and ``w2_weight_fp8`` /
  ``w2_weight_scale_inv`` (E, H/128, Im/128); the router gate stays in the model dtype

The block is vLLM's: the residual stream is carried next to the hidden state and added inside the
fused ``rms_norm(x, w, eps, residual)`` (layer 0 normalises the embedding without an add); Qwen3's
q/k-norm is an RMSNorm over head_dim of every head, before neox RoPE; attention scale head_dim**-0.5;
logits are fp32 straight out of ``backend.linear(..., out_dtype=float32)``.

Two modes run the same ``_core``:
* inference (``forward_infer``): backend kernels directly, K/V written into the caller's paged cache
  with ``write_kv`` and read by ``attention`` (prefill, chunked prefill, decode, mixed);
* training (``forward_train`` / ``sequence_logprobs``): the same kernel calls wrapped in
  ``hal.model.autograd`` (forward bits = kernel bits, fp32 reference gradients); packed sequences'
  K/V go through ``write_kv`` into contiguous pages and ``attention`` reads them, so a token's
  attention output has the bits the cache path gives it.
The embedding is an exact gather (``F.embedding``) in both modes.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hal import api
from hal.backend import AttentionMetadata, Backend
from hal.errors import HalError, UnsupportedError
from hal.fp8 import Fp8KVCache
from hal.kvcache import PagedKVCache
from hal.model import autograd as ag
from hal.model.config import ModelConfig
from hal.model.trace import OpTrace
from hal.rope import cos_sin_cache


# ---------------------------------------------------------------------------------------------
# Parameter holders: named like vLLM's modules; the forward is DecoderLM._core.
# ---------------------------------------------------------------------------------------------

class Linear(nn.Module):
    def __init__(self, out_features: int, in_features: int, bias: bool, dtype, device):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None


class Fp8Linear(nn.Module):
    """A block-FP8 projection: the master ``weight`` (model dtype, trainable) and, as buffers, the
    quantised form every forward uses, ``weight_fp8`` (e4m3) with ``weight_scale_inv`` (fp32, one per
    weight block, DeepSeek's layout). The buffers change only through ``hal.model.fp8``: loaded from a
    checkpoint as stored, or recomputed from the master weight (``refresh_fp8_weights``, the same
    function a weight sync sends). ``master_versions["weight"]`` is the master weight's version counter
    when the buffers were last set from it: a forward refuses stale buffers (``StaleFp8WeightsError``)."""

    def __init__(self, out_features: int, in_features: int, bias: bool, dtype, device, block: tuple[int, int]):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None
        rows, cols = block
        self.register_buffer("weight_fp8", torch.zeros(out_features, in_features, device=device)
                             .to(torch.float8_e4m3fn))
        self.register_buffer("weight_scale_inv", torch.full((-(-out_features // rows), -(-in_features // cols)),
                                                            float("nan"), dtype=torch.float32, device=device))
        self.master_versions: dict[str, int | None] = {"weight": None}    # None: the buffers hold no weights yet


def _linear(c: ModelConfig, out_features: int, in_features: int, bias: bool, dtype, device) -> nn.Module:
    if c.fp8 is not None:
        return Fp8Linear(out_features, in_features, bias, dtype, device, c.fp8.weight_block)
    return Linear(out_features, in_features, bias, dtype, device)


class RMSNorm(nn.Module):
    """An RMSNorm weight and its eps (a plain attribute: ``hal diff`` can plant another value)."""

    def __init__(self, size: int, eps: float, dtype, device):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype, device=device))
        self.eps = float(eps)


class Embedding(nn.Module):
    def __init__(self, vocab: int, hidden: int, dtype, device):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, hidden, dtype=dtype, device=device))


class Attention(nn.Module):
    def __init__(self, c: ModelConfig, dtype, device):
        super().__init__()
        self.qkv_proj = _linear(c, c.q_size + 2 * c.kv_size, c.hidden_size, c.qkv_bias, dtype, device)
        self.o_proj = _linear(c, c.hidden_size, c.q_size, False, dtype, device)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype, device)


class MLP(nn.Module):
    def __init__(self, c: ModelConfig, dtype, device, intermediate: int | None = None):
        super().__init__()
        intermediate = intermediate or c.intermediate_size
        self.gate_up_proj = _linear(c, 2 * intermediate, c.hidden_size, False, dtype, device)
        self.down_proj = _linear(c, c.hidden_size, intermediate, False, dtype, device)


class Router(nn.Module):
    def __init__(self, c: ModelConfig, dtype, device):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(c.num_experts, c.hidden_size, dtype=dtype, device=device))
        # DeepSeek-V3 keeps its correction bias in fp32 whatever the model dtype.
        # It steers the choice only and is set by load balancing, not by gradients.
        self.e_score_correction_bias = nn.Parameter(torch.empty(c.num_experts, dtype=torch.float32, device=device),
                                                    requires_grad=False) if c.e_score_correction_bias else None


class Experts(nn.Module):
    def __init__(self, c: ModelConfig, dtype, device):
        super().__init__()
        e, h, i = c.num_experts, c.hidden_size, c.moe_intermediate_size
        self.w13_weight = nn.Parameter(torch.empty(e, 2 * i, h, dtype=dtype, device=device))
        self.w2_weight = nn.Parameter(torch.empty(e, h, i, dtype=dtype, device=device))


class Fp8Experts(nn.Module):
    """Block-FP8 routed experts (DeepSeek-V3's): the stacked master weights ``w13_weight`` (E, 2I, H) rows
    [gate | up] and ``w2_weight`` (E, H, I) (model dtype, trainable), and as buffers the quantised form
    every forward uses: ``<w>_fp8`` (e4m3) and ``<w>_scale_inv`` (fp32, (E, rows/B, K/B): each expert's
    block grid), for w13_weight and w2_weight alike. They change only through ``hal.model.fp8``, as an
    ``Fp8Linear``'s do; ``master_versions`` holds each master weight's version when its buffers were set."""

    def __init__(self, c: ModelConfig, dtype, device):
        super().__init__()
        e, h, i = c.num_experts, c.hidden_size, c.moe_intermediate_size
        rows, cols = c.fp8.weight_block
        for name, (n, k) in (("w13_weight", (2 * i, h)), ("w2_weight", (h, i))):
            self.register_parameter(name, nn.Parameter(torch.empty(e, n, k, dtype=dtype, device=device)))
            self.register_buffer(name + "_fp8", torch.zeros(e, n, k, device=device).to(torch.float8_e4m3fn))
            self.register_buffer(name + "_scale_inv", torch.full((e, -(-n // rows), -(-k // cols)), float("nan"),
                                                                 dtype=torch.float32, device=device))
        self.master_versions: dict[str, int | None] = {"w13_weight": None, "w2_weight": None}


class MoE(nn.Module):
    def __init__(self, c: ModelConfig, dtype, device):
        super().__init__()
        self.routing = c.routing
        self.gate = Router(c, dtype, device)
        self.experts = Fp8Experts(c, dtype, device) if c.fp8 is not None else Experts(c, dtype, device)
        self.shared_experts = MLP(c, dtype, device, c.n_shared_experts * c.moe_intermediate_size) \
            if c.n_shared_experts else None


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, dtype, device, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.self_attn = Attention(c, dtype, device)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.mlp = MoE(c, dtype, device) if c.moe_layer(index) else MLP(c, dtype, device)


class Backbone(nn.Module):
    def __init__(self, c: ModelConfig, dtype, device):
        super().__init__()
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size, dtype, device)
        self.layers = nn.ModuleList(DecoderLayer(c, dtype, device, i) for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)


# ---------------------------------------------------------------------------------------------
# The two op sets: kernels directly, or kernels under autograd.
# ---------------------------------------------------------------------------------------------

class _KernelOps:
    """Inference: every op is the backend kernel."""

    def __init__(self, backend: Backend):
        self.backend = backend

    def linear(self, x, w, b=None, *, out_dtype=None, name=""):
        return self.backend.linear(x, w, b, out_dtype=out_dtype)

    def proj(self, x, layer, *, name=""):
        """A projection module's forward: ``linear`` of a ``Linear``, ``fp8_linear`` of an ``Fp8Linear``."""
        if isinstance(layer, Fp8Linear):
            return self.fp8_linear(x, layer, name=name)
        return self.linear(x, layer.weight, layer.bias, name=name)

    def fp8_linear(self, x, layer, *, name=""):
        return self.backend.fp8_linear(x, layer.weight_fp8, layer.weight_scale_inv, layer.bias)

    def rms_norm(self, x, w, eps, residual=None, *, name=""):
        return self.backend.rms_norm(x, w, eps, residual)

    def silu_mul(self, x, *, name=""):
        return self.backend.silu_mul(x)

    def rotary(self, positions, q, k, table, *, name=""):
        return self.backend.rotary(positions, q, k, table)

    def token_logprobs(self, logits, ids, temperature, *, name=""):
        return self.backend.token_logprobs(logits, ids, temperature)

    def moe_route(self, logits, routing, bias, *, name=""):
        return self.backend.moe_route(logits, routing, bias)

    def moe_experts(self, x, w13, w2, weights, ids, shared, *, name=""):
        return self.backend.moe_experts(x, w13, w2, weights, ids, shared)

    def fp8_moe_experts(self, x, experts, weights, ids, shared, *, name=""):
        return self.backend.fp8_moe_experts(x, experts.w13_weight_fp8, experts.w13_weight_scale_inv,
                                            experts.w2_weight_fp8, experts.w2_weight_scale_inv, weights, ids, shared)


class _AutogradOps(_KernelOps):
    """Training: the same kernel calls, with fp32 reference gradients (``hal.model.autograd``)."""

    def linear(self, x, w, b=None, *, out_dtype=None, name=""):
        return ag.linear(self.backend, x, w, b, out_dtype=out_dtype, name=name)

    def fp8_linear(self, x, layer, *, name=""):
        return ag.fp8_linear(self.backend, x, layer.weight, layer.weight_fp8, layer.weight_scale_inv, layer.bias,
                             name=name)

    def rms_norm(self, x, w, eps, residual=None, *, name=""):
        return ag.rms_norm(self.backend, x, w, eps, residual, name=name)

    def silu_mul(self, x, *, name=""):
        return ag.silu_mul(self.backend, x, name=name)

    def rotary(self, positions, q, k, table, *, name=""):
        return ag.rotary(self.backend, positions, q, k, table, name=name)

    def token_logprobs(self, logits, ids, temperature, *, name=""):
        return ag.token_logprobs(self.backend, logits, ids, temperature, name=name)

    def moe_route(self, logits, routing, bias, *, name=""):
        return ag.moe_route(self.backend, logits, routing, bias, name=name)

    def moe_experts(self, x, w13, w2, weights, ids, shared, *, name=""):
        return ag.moe_experts(self.backend, x, w13, w2, weights, ids, shared, name=name)

    def fp8_moe_experts(self, x, experts, weights, ids, shared, *, name=""):
        return ag.fp8_moe_experts(self.backend, x, experts, weights, ids, shared, name=name)


@dataclass
class InferenceBatch:
    """One engine step: packed query tokens of several sequences (any mix of phases).

    token_ids, positions, slot_mapping: (T,) int64; ``meta`` says which rows belong to which
    sequence and where its pages are; ``logits_rows`` (M,) int64 are the rows whose next-token
    logits are wanted (the last query row of each sequence that samples this step).
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor


# ---------------------------------------------------------------------------------------------
# The model.
# ---------------------------------------------------------------------------------------------

class DecoderLM(nn.Module):
    """A Llama / Qwen2 / Qwen3 / Qwen3-MoE decoder LLM on HAL ops (see the module docstring for the layout).

    ``backend``: the Backend its forwards run on; None means ``hal.api.current()`` at each call, so
    ``with hal.use(...)`` switches it. Weights live on ``device`` (default: the backend's device).
    """

    def __init__(self, config: ModelConfig, *, backend: Backend | None = None,
                 device: torch.device | str | None = None):
        super().__init__()
        self.config = config
        self._backend = backend
        device = torch.device(device) if device is not None else (backend or api.current()).device
        dtype = config.torch_dtype
        self.model = Backbone(config, dtype, device)
        self.lm_head = None if config.tie_word_embeddings else \
            Embedding(config.vocab_size, config.hidden_size, dtype, device)
        self._rope: torch.Tensor | None = None

    # -- identity -------------------------------------------------------------------------------

    @property
    def backend(self) -> Backend:
        return self._backend if self._backend is not None else api.current()

    @backend.setter
    def backend(self, backend: Backend | None) -> None:
        self._backend = backend

    @contextlib.contextmanager
    def using(self, backend: Backend | None):
        """Run this model's forwards on ``backend`` inside the block (None: the current backend)."""
        saved, self._backend = self._backend, backend
        try:
            yield self
        finally:
            self._backend = saved

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def full_config(self) -> ModelConfig:
        """The config of the whole (unsharded) model: ``config`` itself here; a tensor-parallel shard
        (``hal.model.parallel``) holds a config of its shard's sizes and returns the whole model's."""
        return self.config

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def fp8_spec(self, backend: Backend | None = None):
        """The contract's [fp8] section that this block-FP8 model's linears run under (None for a model
        without FP8 linears). Refuses a contract without [fp8], or one whose weight block is not the
        checkpoint's ``weight_block_size``; the stock baseline (no contract) takes bf16-fp8-v1's layout."""
        if self.config.fp8 is None:
            return None
        from hal import fp8

        backend = backend or self.backend
        if backend.contract is None:
            spec = fp8.baseline_spec()
        elif backend.contract.fp8 is None:
            raise UnsupportedError(f"this model has block-FP8 linears (quantization_config quant_method 'fp8'), "
                                   f"but backend {backend.name!r} runs contract {backend.contract.name!r}, which has "
                                   f"no [fp8] section to say how their bits are decided; use a contract that has "
                                   f"one (bf16-fp8-v1: hal.use(backend, contract='bf16-fp8-v1'))")
        else:
            spec = backend.contract.fp8
        block = tuple(self.config.fp8.weight_block)
        if block != (spec.weight_block, spec.weight_block):
            raise UnsupportedError(f"quantization_config.weight_block_size {list(block)} is not the contract's "
                                   f"[fp8].weight_block {spec.weight_block} x {spec.weight_block}; only that block "
                                   f"size is supported (the scales of another grid cannot be used as stored)")
        return spec

    def refresh_fp8_weights(self) -> None:
        """Recompute the FP8 linears' quantised weights from the master weights, exactly as a weight sync
        quantises them (``hal.model.fp8``); call after each ``optimizer.step()``. No-op without FP8."""
        from hal.model.fp8 import refresh_fp8_weights

        refresh_fp8_weights(self)

    def _check_fp8(self, backend: Backend) -> None:
        if self.config.fp8 is not None:
            from hal.model.fp8 import check_fresh

            self.fp8_spec(backend)
            check_fresh(self)

    def rope_table(self, length: int) -> torch.Tensor:
        """(>= length, head_dim) fp32 ``[cos | sin]`` rows from ``hal.rope`` (grown on demand; row p
        does not depend on the table's length)."""
        if length > self.config.max_position:
            raise UnsupportedError(f"position {length - 1} is beyond the model's max_position "
                                   f"{self.config.max_position}")
        if self._rope is None or self._rope.shape[0] < length or self._rope.device != self.device:
            size = min(self.config.max_position, max(256, 1 << (max(length, 1) - 1).bit_length()))
            self._rope = cos_sin_cache(self.config.head_dim, size, self.config.rope_theta, self.device)
        return self._rope

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def random(cls, config: ModelConfig, seed: int = 0, *, backend: Backend | None = None,
               device: torch.device | str | None = None) -> "DecoderLM":
        """A model with seeded random weights (drawn in fp32 on the CPU, then rounded to the dtype),
        scaled so that activations stay O(1) and next-token distributions are neither flat nor one-hot."""
        model = cls(config, backend=backend, device=device)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    values = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
                elif name.endswith(".bias") or name.endswith("correction_bias"):
                    values = 0.1 * torch.randn(p.shape, generator=g)
                elif name in ("model.embed_tokens.weight", "lm_head.weight"):
                    # logits = normed h . row: std ~2 whether the head is tied or not
                    values = torch.randn(p.shape, generator=g) * 2.0 * p.shape[1] ** -0.5
                else:
                    values = torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5   # fan-in
                p.copy_(values.to(p.dtype))
        model.refresh_fp8_weights()          # the FP8 linears' quantised form of their master weights
        return model

    # -- the forward, shared by both modes ------------------------------------------------------

    def _core(self, ops: _KernelOps, token_ids: torch.Tensor, positions: torch.Tensor,
              attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
              logits_rows: torch.Tensor | None, trace: OpTrace | None) -> torch.Tensor:
        """fp32 logits (M, V) of ``logits_rows`` (all rows if None) for packed tokens (T,)."""
        c = self.config
        t = token_ids.shape[0]
        table = self.rope_table(int(positions.max()) + 1 if t else 1)
        record = trace.record if trace is not None and trace.watching else (lambda *a, **k: None)
        if trace is not None:
            trace.record_tokens(token_ids)
        h = self._embed(token_ids)                                           # exact gather
        record("model.embed_tokens", h)
        residual = None
        for i, layer in enumerate(self.model.layers):
            p = f"model.layers.{i}."
            norm = layer.input_layernorm
            if residual is None:
                residual = h
                h = ops.rms_norm(h, norm.weight, norm.eps, name=p + "input_layernorm")
            else:
                h, residual = ops.rms_norm(h, norm.weight, norm.eps, residual, name=p + "input_layernorm")
            record(p + "input_layernorm", h)
            record(p + "input_layernorm.residual", residual)

            attn = layer.self_attn
            qkv = ops.proj(h, attn.qkv_proj, name=p + "self_attn.qkv_proj")
            record(p + "self_attn.qkv_proj", qkv)
            q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
            q = q.contiguous().view(t, c.num_heads, c.head_dim)
            k = k.contiguous().view(t, c.num_kv_heads, c.head_dim)
            v = v.contiguous().view(t, c.num_kv_heads, c.head_dim)
            if c.qk_norm:   # Qwen3: RMSNorm over head_dim of every head, before RoPE
                q = ops.rms_norm(q.view(-1, c.head_dim), attn.q_norm.weight, attn.q_norm.eps,
                                 name=p + "self_attn.q_norm").view(t, c.num_heads, c.head_dim)
                k = ops.rms_norm(k.view(-1, c.head_dim), attn.k_norm.weight, attn.k_norm.eps,
                                 name=p + "self_attn.k_norm").view(t, c.num_kv_heads, c.head_dim)
                record(p + "self_attn.q_norm", q)
                record(p + "self_attn.k_norm", k)
            q, k = ops.rotary(positions, q, k, table, name=p + "self_attn.rotary")
            record(p + "self_attn.rotary.q", q)
            record(p + "self_attn.rotary.k", k)
            o = attend(i, q, k, v)
            record(p + "self_attn.attn", o)
            h = ops.proj(o.reshape(t, c.q_size), attn.o_proj, name=p + "self_attn.o_proj")
            record(p + "self_attn.o_proj", h)

            norm = layer.post_attention_layernorm
            h, residual = ops.rms_norm(h, norm.weight, norm.eps, residual, name=p + "post_attention_layernorm")
            record(p + "post_attention_layernorm", h)
            record(p + "post_attention_layernorm.residual", residual)
            if isinstance(layer.mlp, MoE):
                h = self._moe(ops, layer.mlp, h, p + "mlp.", record)
            else:
                h = self._mlp(ops, layer.mlp, h, p + "mlp.", record)

        if logits_rows is not None and logits_rows.numel() == 0:   # a step of prefill chunks only
            return torch.zeros(0, c.vocab_size, dtype=torch.float32, device=h.device)
        if logits_rows is not None:            # only rows whose logits are wanted (row-wise ops below)
            h, residual = h[logits_rows], residual[logits_rows]
        row_map = logits_rows if logits_rows is not None else None
        norm = self.model.norm
        h, _ = ops.rms_norm(h, norm.weight, norm.eps, residual, name="model.norm")
        record("model.norm", h, row_map)
        logits = ops.linear(h, self.lm_head_weight, out_dtype=torch.float32, name="lm_head")
        record("lm_head", logits, row_map)
        return logits

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.model.embed_tokens.weight)

    def _op_set(self, backend: Backend, training: bool) -> _KernelOps:
        """The ops a forward runs: kernels (inference) or kernels under autograd (training)."""
        return _AutogradOps(backend) if training else _KernelOps(backend)

    def next_token_logprobs(self, logits: torch.Tensor, token_ids: torch.Tensor, temperature: float) -> torch.Tensor:
        """fp32 (M,) logprobs of sampled tokens from ``forward_infer``'s logits (the rollout's report)."""
        return self.backend.token_logprobs(logits, token_ids, temperature)

    @staticmethod
    def _mlp(ops: _KernelOps, mlp: MLP, h: torch.Tensor, p: str, record) -> torch.Tensor:
        h = ops.proj(h, mlp.gate_up_proj, name=p + "gate_up_proj")
        record(p + "gate_up_proj", h)
        h = ops.silu_mul(h, name=p + "act")
        record(p + "act", h)
        h = ops.proj(h, mlp.down_proj, name=p + "down_proj")
        record(p + "down_proj", h)
        return h

    def _moe(self, ops: _KernelOps, mlp: MoE, h: torch.Tensor, p: str, record) -> torch.Tensor:
        """[moe]: fp32 router logits, routing, the shared experts (a dense MLP), then the routed experts'
        combine, which adds the shared output before its one rounding."""
        logits = ops.linear(h, mlp.gate.weight, out_dtype=torch.float32, name=p + "gate")
        record(p + "gate", logits)
        weights, ids = ops.moe_route(logits, mlp.routing, mlp.gate.e_score_correction_bias, name=p + "router")
        record(p + "router.weights", weights)
        record(p + "router.ids", ids.float())
        shared = None
        if mlp.shared_experts is not None:
            shared = self._mlp(ops, mlp.shared_experts, h, p + "shared_experts.", record)
        if isinstance(mlp.experts, Fp8Experts):
            h = ops.fp8_moe_experts(h, mlp.experts, weights, ids, shared, name=p + "experts")
        else:
            h = ops.moe_experts(h, mlp.experts.w13_weight, mlp.experts.w2_weight, weights, ids, shared,
                                name=p + "experts")
        record(p + "experts", h)
        return h

    # -- inference ------------------------------------------------------------------------------

    def kv_spec(self, backend: Backend | None = None):
        """The contract's [fp8] section that this model's FP8 KV cache follows (``config.kv_cache_dtype``
        "fp8"), None for a cache in the activation dtype. Refuses a contract without [fp8]."""
        if self.config.kv_cache_dtype == "auto":
            return None
        backend = backend or self.backend
        if backend.contract is None or backend.contract.fp8 is None:
            contract = "no contract" if backend.contract is None else f"contract {backend.contract.name!r}"
            raise UnsupportedError(f"kv_cache_dtype 'fp8': backend {backend.name!r} runs {contract}, which has no "
                                   f"[fp8] section to say how the cache is quantised and read; use a contract that "
                                   f"has one (bf16-fp8-v1), or kv_cache_dtype 'auto'")
        return backend.contract.fp8

    def allocate_kv_cache(self, num_pages: int, page_size: int) -> list[PagedKVCache]:
        """One paged cache per layer, (num_pages, page_size, Hkv, D): in the model dtype, or with
        ``kv_cache_dtype`` "fp8" an ``hal.fp8.Fp8KVCache`` under the contract's [fp8]."""
        c = self.config
        spec = self.kv_spec()
        if spec is not None:
            return [Fp8KVCache(num_pages, page_size, c.num_kv_heads, c.head_dim, spec, self.device)
                    for _ in range(c.num_layers)]
        return [PagedKVCache.allocate(num_pages, page_size, c.num_kv_heads, c.head_dim, self.dtype, self.device)
                for _ in range(c.num_layers)]

    @torch.no_grad()
    def forward_infer(self, batch: InferenceBatch, kv_caches: Sequence[PagedKVCache],
                      trace: OpTrace | None = None) -> torch.Tensor:
        """One engine step: writes the batch's K/V into ``kv_caches`` (one per layer) and returns fp32
        logits (M, V) of ``batch.logits_rows``, all from backend kernels."""
        if len(kv_caches) != self.config.num_layers:
            raise HalError(f"forward_infer: {len(kv_caches)} KV caches for {self.config.num_layers} layers")
        fp8_cache = self.config.kv_cache_dtype == "fp8"
        if any(isinstance(c, Fp8KVCache) != fp8_cache for c in kv_caches):
            raise HalError(f"forward_infer: kv_cache_dtype is {self.config.kv_cache_dtype!r} but the caches given are "
                           f"{sorted({type(c).__name__ for c in kv_caches})}; training would read another cache than "
                           f"the rollout: allocate them with model.allocate_kv_cache")
        backend = self.backend
        self._check_fp8(backend)
        scale = self.config.head_dim ** -0.5

        def attend(i, q, k, v):
            return ag.write_and_attend(backend, q, k, v, kv_caches[i], batch.slot_mapping, batch.meta, scale)

        return self._core(self._op_set(backend, False), batch.token_ids, batch.positions, attend, batch.logits_rows, trace)

    # -- training -------------------------------------------------------------------------------

    def forward_train(self, token_ids: torch.Tensor, seq_lens: Sequence[int], *,
                      logits_rows: torch.Tensor | None = None, page_size: int = 16,
                      trace: OpTrace | None = None) -> torch.Tensor:
        """Packed training forward: token_ids (T,) holds sequences of ``seq_lens`` back to back, each
        starting at position 0. Returns fp32 logits (M, V) of ``logits_rows`` (default: all rows) with
        kernel forward bits and fp32 reference gradients; the backward first checks that no weight
        changed since this forward (``WeightsChangedError``)."""
        if sum(seq_lens) != token_ids.shape[0]:
            raise HalError(f"forward_train: seq_lens sum to {sum(seq_lens)} but {token_ids.shape[0]} tokens given")
        backend = self.backend
        self._check_fp8(backend)
        device = self.device
        layout = ag.PackedLayout.build(seq_lens, page_size, device)
        positions = torch.cat([torch.arange(n, device=device) for n in layout.seq_lens])
        scale = self.config.head_dim ** -0.5

        kv_spec = self.kv_spec(backend)

        def attend(i, q, k, v):
            return ag.train_attention(backend, q, k, v, layout, scale, kv_spec=kv_spec,
                                      name=f"model.layers.{i}.self_attn.attn")

        logits = self._core(self._op_set(backend, True), token_ids.to(device), positions, attend, logits_rows, trace)
        if torch.is_grad_enabled() and logits.requires_grad:
            # the FP8 linears' quantised buffers too: a refresh between forward and backward changes them
            fp8_buffers = ((n, b) for n, b in self.named_buffers() if n.endswith(("weight_fp8", "weight_scale_inv")))
            logits = ag.guard_weights(logits, ag.WeightSnapshot(itertools.chain(self.named_parameters(), fp8_buffers)))
        return logits

    def sequence_logprobs(self, sequences: Sequence[Sequence[int]], response_starts: Sequence[int] | None = None,
                          *, temperature: float = 1.0, page_size: int = 16, trace: OpTrace | None = None,
                          trace_sequence: int = 0) -> list[torch.Tensor]:
        """Trainer-side log-probabilities, one packed training forward for all ``sequences``.

        Returns, per sequence b, an fp32 tensor of the logprobs of tokens ``s[j]`` for
        ``j = max(1, response_starts[b]) .. len(s) - 1`` under softmax(logits / temperature) of the
        prefix ``s[:j]`` (differentiable). With ``trace``, the ops of sequence ``trace_sequence`` are
        captured at every position.
        """
        if response_starts is None:
            response_starts = [1] * len(sequences)
        if len(response_starts) != len(sequences):
            raise HalError("sequence_logprobs: one response start per sequence is needed")
        device = self.device
        seq_lens = [len(s) for s in sequences]
        token_ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long, device=device)
        rows, targets, counts, offset = [], [], [], 0
        for s, start in zip(sequences, response_starts):
            js = range(max(1, int(start)), len(s))
            rows.extend(offset + j - 1 for j in js)
            targets.extend(s[j] for j in js)
            counts.append(len(js))
            offset += len(s)
        rows_t = torch.tensor(rows, dtype=torch.long, device=device)
        watch = contextlib.nullcontext()
        if trace is not None:
            first = sum(seq_lens[:trace_sequence])
            watch = trace.watch(range(first, first + seq_lens[trace_sequence]), range(seq_lens[trace_sequence]),
                                call=f"train batch of {len(sequences)} sequences, {offset} tokens")
        with watch:
            logits = self.forward_train(token_ids, seq_lens, logits_rows=rows_t, page_size=page_size, trace=trace)
            ops = self._op_set(self.backend, True)
            logprobs = ops.token_logprobs(logits, torch.tensor(targets, dtype=torch.long, device=device),
                                          temperature, name="logprob")
            if trace is not None:
                trace.record("logprob", logprobs.unsqueeze(-1), rows_t)
        return list(logprobs.split(counts))
