"""Attention on vLLM's CPU platform: the cache write and the paged attention through the HAL.

The CPU platform ignores the requested attention backend and always picks the ``CPU_ATTN`` member, so
the plugin overrides that member through vLLM's attention backend registry. The replacement subclasses
the stock backend to reuse its metadata (query_start_loc, seq_lens, block_table, slot_mapping) and
cache layout; it routes per engine (``quant.bound_config()`` at construction) and stays stock for
engines that are not HAL-bound. A GPU route (vLLM's ``CUSTOM`` member) would live next to this one.
"""

from __future__ import annotations

import torch

from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from hal.backend import AttentionMetadata
from hal.errors import UnsupportedError
from hal.vllm import quant


def _hal_cache_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's CPU cache (pages, Hkv, P, 2D), K and V side by side in the last dim, as the HAL's
    (pages, P, Hkv, D) K and V views (strided; no copy)."""
    d = kv_cache.shape[-1] // 2
    return kv_cache[..., :d].transpose(1, 2), kv_cache[..., d:].transpose(1, 2)


class HalCpuAttentionImpl(CPUAttentionBackendImpl):
    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                 logits_soft_cap=None, attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None,
                 sinks=None):
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                         logits_soft_cap, attn_type, kv_sharing_target_layer_name, sinks)
        self.hal = quant.bound_config()
        if self.hal is None:
            return
        refused = {"ALiBi": alibi_slopes is not None, "a sliding window": sliding_window is not None,
                   "a logits soft-cap": bool(logits_soft_cap), "attention sinks": sinks is not None,
                   f"attention type {attn_type}": attn_type != AttentionType.DECODER,
                   f"KV cache dtype {kv_cache_dtype}": kv_cache_dtype != "auto",
                   "KV sharing": kv_sharing_target_layer_name is not None}
        if any(refused.values()):
            raise UnsupportedError(f"hal vLLM plugin: attention with {', '.join(k for k, v in refused.items() if v)} "
                                   f"has no HAL route")

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if self.hal is None:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        n = slot_mapping.shape[0]
        k_cache, v_cache = _hal_cache_views(kv_cache)
        self.hal.backend().write_kv(key[:n], value[:n], k_cache, v_cache, slot_mapping)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if self.hal is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        if attn_metadata is None:             # warm-up / profiling run
            return output
        if output_scale is not None or output_block_scale is not None or not attn_metadata.causal:
            raise UnsupportedError("hal vLLM plugin: only causal attention without output quantization has a "
                                   "HAL route")
        n = attn_metadata.num_actual_tokens
        b = attn_metadata.seq_lens.shape[0]
        meta = AttentionMetadata(query_start_loc=attn_metadata.query_start_loc[:b + 1].to(torch.int32),
                                 seq_lens=attn_metadata.seq_lens.to(torch.int32),
                                 block_table=attn_metadata.block_table[:b].to(torch.int32))
        k_cache, v_cache = _hal_cache_views(kv_cache)
        out = self.hal.backend().attention(query[:n], k_cache, v_cache, meta, scale=self.scale)
        output[:n].copy_(out.reshape(output[:n].shape))
        return output


class HalCpuAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU attention backend with the HAL implementation (stock for engines not HAL-bound)."""

    @staticmethod
    def get_impl_cls():
        return HalCpuAttentionImpl


def install() -> None:
    """Point the ``CPU_ATTN`` member at ``HalCpuAttentionBackend`` (vLLM imports it by this path, also in
    engine processes)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    backend = HalCpuAttentionBackend
    register_backend(AttentionBackendEnum.CPU_ATTN, f"{backend.__module__}.{backend.__qualname__}")
