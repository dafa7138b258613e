"""Attention through the HAL on CUDA (vLLM 0.26): vLLM's ``CUSTOM`` attention backend member.

Written against vLLM 0.26.0's source (``v1/attention/backends/triton_attn.py``); run on the H200 (diff = 0
with torch.compile and CUDA graphs: bench/results/h200-2026-12-01-session3/).
It reuses the Triton backend's metadata builder and cache layout: logical (pages, Hkv, P, 2D), K and V
side by side, which ``hal.vllm.attention.hal_cache_views`` reads as strided (pages, P, Hkv, D) views.
The cache write (``do_kv_cache_update``) and the attention call the HAL backend
(``hal.vllm.attention.HalAttentionRoute``).

CUDA graphs: the builder declares ``AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE``, so vLLM's default
``FULL_AND_PIECEWISE`` captures decode steps (every request one new token) as full graphs, attention and
cache write included, and runs prefill and mixed steps piecewise (attention eagerly between the captured
pieces). The HAL's attention and ``write_kv`` can be captured: their launches depend on shapes alone
(the block table's width, not its contents; the metadata stays on the device), the value checks are
skipped while a graph is captured (``hal.backend._value_stamp``), and a captured decode step replays
with no Python at all (an eager attention call cost the host 0.1 ms standalone and 0.35-0.75 ms inside
vLLM, 28 of them per step of the 1.7B-shaped model: bench/results/h200-2026-12-01-session4/). vLLM captures with every seq_len 1 and pads
a replayed batch to the captured size; a padding request's row (no visible key) is computed and
dropped, its slot is -1 (nothing written). In eager (prefill and mixed) steps the HAL's value checks of
vLLM's metadata and positions, which would synchronise there, are skipped too: vLLM's scheduler builds them
valid (``hal.vllm.attention._hal_metadata``, ``hal.torch_ops.rotary``'s ``positions_in_range``), so no step
synchronises on them.

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
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE


class HalGpuAttentionBackend(TritonAttentionBackend):
    """``attention_config={"backend": "CUSTOM"}``: the HAL's paged attention on vLLM's Triton cache."""

    # "fp8": the contract's FP8 KV cache through the route (hal.vllm.attention), on vLLM's one-byte cache
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "fp8", "fp8_e4m3"]

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
