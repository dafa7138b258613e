"""The rotary cos/sin table, computed one way and shared by every backend and both sides.

Why not ``torch.cos``: on a CPU it evaluates the body of a tensor with a SIMD polynomial and the
tail with the C library, so a position's bits could depend on the table's length (and trainer and
engine build tables of different lengths). Here every element goes through the same scalar C
library call in fp64 and is rounded once to fp32, as the contract's [rope].table says.
"""

from __future__ import annotations

import functools
import math

import torch


@functools.lru_cache(maxsize=16)
def _table(rotary_dim: int, max_position: int, base: float) -> torch.Tensor:
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    if max_position <= 0:
        raise ValueError(f"max_position must be positive, got {max_position}")
    half = rotary_dim // 2
    inv_freq = [base ** (-(2.0 * i) / rotary_dim) for i in range(half)]
    cos, sin = [], []
    for pos in range(max_position):
        angles = [pos * f for f in inv_freq]
        cos.extend(map(math.cos, angles))
        sin.extend(map(math.sin, angles))
    c = torch.tensor(cos, dtype=torch.float64).view(max_position, half)
    s = torch.tensor(sin, dtype=torch.float64).view(max_position, half)
    return torch.cat([c, s], dim=-1).float()


def cos_sin_cache(rotary_dim: int, max_position: int, base: float = 10000.0,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """(max_position, rotary_dim) fp32 table ``[cos | sin]`` with angle ``pos * base**(-2i/rotary_dim)``.

    Row p is the same whatever ``max_position`` is, so a longer table extends a shorter one.
    """
    return _table(int(rotary_dim), int(max_position), float(base)).to(device)
