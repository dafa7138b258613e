"""The cuda backend's launch policy for the shared kernels (``hal.kernels``): the GPU's multiprocessors.

The kernels size their launch shapes in waves of programs on the multiprocessors (a second, partial
wave costs a quarter of the time at some shapes); the count is the one thing about an NVIDIA device
they need, and it comes from here. Tiles are the kernels' own tables, tuned on the H200.
"""

from __future__ import annotations

import functools

import torch

from hal.kernels.policy import LaunchPolicy


class CudaLaunch(LaunchPolicy):
    def multiprocessors(self, device: torch.device) -> int:
        """The GPU's streaming multiprocessors; 0 for CPU tensors (Triton's interpreter)."""
        return _multiprocessors(device.index or 0) if device.type == "cuda" else 0


@functools.lru_cache(maxsize=None)
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


CUDA_LAUNCH = CudaLaunch()
