"""Attention through the HAL on CUDA (vLLM 0.26): vLLM's ``CUSTOM`` attention backend member.

Written against vLLM 0.26.0's source (``v1/attention/backends/triton_attn.py``); run on the H200 (diff = 0
with torch.compile and CUDA graphs: bench/results/h200-2026-12-01-session3/).
It reuses the Triton backend's metadata builder and cache layout: logical (pages, Hkv, P, 2D), K and V
side by side, which ``hal.vllm.attention.hal_cache_views`` reads as strided (pages, P, Hkv, D) views.
The cache write (``do_kv_cache_update``) and the attention call the HAL backend
(``hal.vllm.attention.HalAttentionRoute``).

CUDA graphs: the builder declares ``AttentionCGSupport.NEVER``, so vLLM's default
``FULL_AND_PIECEWISE`` becomes ``PIECEWISE``: the compiled pieces between attention calls are captured
as graphs, and attention with its cache write runs eagerly between them, where the HAL's attention
input checks may read the metadata (one host synchronisation per step) and ``write_kv`` may select
the valid slots. Whether the HAL attention can join full graphs is left to a measurement.

Imported only on CUDA platforms (``hal.vllm.attention.install``): it imports vLLM's Triton backend.
"""

from __future__ import annotations

from typing import ClassVar

from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend, TritonAttentionImpl, TritonAttentionMetadataBuilder)

from hal.contract import load_contract
from hal.vllm import quant
from hal.vllm.attention import HalAttentionRoute


class HalGpuAttentionImpl(HalAttentionRoute, TritonAttentionImpl):
    """Triton's implementation class, with the HAL route in front (stock for engines not HAL-bound)."""


class HalGpuMetadataBuilder(TritonAttentionMetadataBuilder):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER


class HalGpuAttentionBackend(TritonAttentionBackend):
    """``attention_config={"backend": "CUSTOM"}``: the HAL's paged attention on vLLM's Triton cache."""

    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"                      # vLLM looks the member up by this name

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        """KV pages of the contract's KV chunk (64 keys in bf16-dense-v1) unless the user set
        ``block_size``: a chunk inside one page is one block-table lookup and one contiguous load per
        chunk; with vLLM's default 16-key pages every key of a chunk finds its page on its own. The
        page size never changes the bits (the chunks sit at absolute key positions)."""
        hal = quant.bound_config()
        contract = load_contract(hal.binding.contract if hal is not None else None)
        chunk = contract.attention.kv_chunk
        return chunk if chunk % 16 == 0 else default_block_size

    @staticmethod
    def get_impl_cls():
        return HalGpuAttentionImpl

    @staticmethod
    def get_builder_cls():
        return HalGpuMetadataBuilder

    @classmethod
    def supports_sink(cls) -> bool:
        return False

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return False

    @classmethod
    def supports_alibi_sqrt(cls) -> bool:
        return False
