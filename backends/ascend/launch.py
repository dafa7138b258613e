"""The ascend backend's launch policy for the shared kernels (``hal.kernels``) on triton-ascend.

Why: a program's vector tiles live in the unified buffer and the compiler rejects tiles that do not
fit, so GEMM tiles and the attention query tile come from ``tiles.py`` instead of the kernels' own
(H200-tuned) tables. There is no multiprocessor count: triton-ascend maps programs onto the cores
itself, and the kernels' wave rules keep their plain shape.
"""

from __future__ import annotations

import torch

from hal.backends.ascend import tiles
from hal.contract import Attention, Gemm
from hal.kernels.policy import LaunchPolicy


class AscendLaunch(LaunchPolicy):
    def gemm_tiles(self, m: int, n: int, k: int, spec: Gemm, in_bytes: int, out_dtype=None) -> dict:
        return tiles.gemm_config(m, n, k, spec, in_bytes)

    def attention_block_q(self, q: torch.Tensor, k_cache: torch.Tensor, query_start_loc: torch.Tensor,
                          spec: Attention) -> int:
        starts = query_start_loc.tolist()  # the longest query decides the tile (one host read)
        max_q = max(starts[i + 1] - starts[i] for i in range(len(starts) - 1))
        return tiles.attention_block_q(spec.kv_chunk, q.shape[2], q.shape[1] // k_cache.shape[2], q.element_size(),
                                       max_q)


ASCEND_LAUNCH = AscendLaunch()
