"""The cuda backend's launch policy for the shared kernels (``hal.kernels``): the GPU's multiprocessors.

The kernels size their launch shapes in waves of programs on the multiprocessors (a second, partial
wave costs a quarter of the time at some shapes); the count is the one thing about an NVIDIA device
they need, and it comes from here. Tiles are the kernels' own tables, tuned on the H200, unless a
tuning cache of this GPU (``hal tune``, hal/kernels/tuning.py) holds a measured choice for a GEMM shape
(bf16 or block-FP8, or an MoE layer's grouped expert GEMMs) or for a decode or prefill attention shape.
"""

from __future__ import annotations

import functools
import os

import torch

from hal.contract import Attention, Fp8, Gemm
from hal.kernels import tuning
from hal.kernels.policy import LaunchPolicy

_IN_DTYPES = {2: torch.bfloat16, 4: torch.float32}


class CudaLaunch(LaunchPolicy):
    """``tuned=False``: the kernels' own tiles even where a tuning cache holds a choice (the tuner's baseline)."""

    def __init__(self, tuned: bool = True):
        self.tuned = tuned

    def multiprocessors(self, device: torch.device) -> int:
        """The GPU's streaming multiprocessors; 0 for CPU tensors (Triton's interpreter)."""
        return _multiprocessors(device.index or 0) if device.type == "cuda" else 0

    def gemm_tiles(self, m: int, n: int, k: int, spec: Gemm, in_bytes: int,
                   out_dtype: torch.dtype | None = None) -> dict | None:
        """The tuned configuration of this GEMM's shape class (``hal tune``, hal/kernels/tuning.py), if
        this device has a tuning cache holding it; otherwise the kernel's own table decides."""
        cache = _tuning_cache() if self.tuned else None
        if cache is None:
            return None
        in_dtype = _IN_DTYPES.get(in_bytes)
        return cache.config(tuning.shape_class(m, n, k, in_dtype, out_dtype or in_dtype, spec.k_chunk))

    def fp8_tiles(self, m: int, n: int, k: int, spec: Fp8, out_dtype: torch.dtype) -> dict | None:
        """The tuned launch of this block-FP8 GEMM's shape class, as ``gemm_tiles`` for bf16."""
        cache = _tuning_cache() if self.tuned else None
        if cache is None:
            return None
        return cache.config(tuning.fp8_shape_class(m, n, k, spec, out_dtype))

    def moe_tiles(self, slots: int, num_experts: int, hidden: int, inter: int, spec: Gemm,
                  dtype: torch.dtype) -> tuple[dict, dict] | None:
        """The tuned launches of this MoE layer's shape class (``hal tune`` of an MoE model), as ``gemm_tiles``."""
        cache = _tuning_cache() if self.tuned else None
        entry = cache.config(tuning.moe_shape_class(slots, num_experts, hidden, inter, dtype, spec.k_chunk)) \
            if cache is not None else None
        return (entry["gate_up"], entry["down"]) if entry else None

    def decode_launch(self, tokens: int, num_seqs: int, context: int, q_heads: int, kv_heads: int, head_dim: int,
                      page: int, q_dtype: torch.dtype, kv_dtype: torch.dtype, spec: Attention) -> dict | None:
        """The tuned launch of this decode call's shape class (``hal tune``'s decode cells), as ``gemm_tiles``."""
        if not self.tuned or _tuning_cache() is None:
            return None
        return _decode_config(tokens, num_seqs, context, q_heads, kv_heads, head_dim, page, q_dtype, kv_dtype, spec)

    def prefill_launch(self, tokens: int, num_seqs: int, q_heads: int, kv_heads: int, head_dim: int, page: int,
                       q_dtype: torch.dtype, kv_dtype: torch.dtype, spec: Attention) -> dict | None:
        """The tuned launch of this prefill call's shape class (``hal tune``'s prefill cells), as ``gemm_tiles``."""
        if not self.tuned or _tuning_cache() is None:
            return None
        return _prefill_config(tokens, num_seqs, q_heads, kv_heads, head_dim, page, q_dtype, kv_dtype, spec)


@functools.lru_cache(maxsize=None)
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=4096)
def _decode_config(*call) -> dict | None:
    """The tuning cache's decode launch for a call's shape (remembered: decode attention runs once per layer
    and step, and building the key costs more than the lookup). Shared between calls: read-only."""
    return _tuning_cache().config(tuning.decode_shape_class(*call))


@functools.lru_cache(maxsize=4096)
def _prefill_config(*call) -> dict | None:
    """The tuning cache's prefill launch for a call's shape, remembered as ``_decode_config``."""
    return _tuning_cache().config(tuning.prefill_shape_class(*call))


@functools.lru_cache(maxsize=None)
def _tuning_cache() -> tuning.TuneCache | None:
    """This process's tuning cache (read once: a shape class keeps its configuration for the process's
    life); None without a GPU (Triton's interpreter) or without a cache file for this GPU."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1" or not torch.cuda.is_available():
        return None
    import triton

    return tuning.runtime_cache(torch.cuda.get_device_name(), triton.__version__)


CUDA_LAUNCH = CudaLaunch()
CUDA_LAUNCH_UNTUNED = CudaLaunch(tuned=False)
