"""A batch-independent sampler: the noise depends only on (request seed, position).

Gumbel-max: ``token = argmax(logits / T + G)`` with ``G_i = -log(-log(U_i))`` and ``U`` (V,) drawn
from a fresh CPU generator seeded by a hash of (request seed, position). The draw is a function of
those two numbers alone, so a request samples the same token whatever shares its batch, in which
order requests run, whether it was preempted and recomputed, and on which device its logits were
computed (the noise and the argmax are evaluated on the CPU in fp64, one row at a time).
Ties in the argmax go to the lower token id. ``temperature == 0`` is greedy (argmax of the logits).
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_seed(seed: int, position: int) -> int:
    """The generator seed of the token at ``position`` of a request seeded ``seed`` (63 bits)."""
    return _splitmix64(_splitmix64(int(seed) & _MASK64) ^ (int(position) & _MASK64)) >> 1


def gumbel_noise(seed: int, position: int, vocab_size: int) -> torch.Tensor:
    """(V,) fp64 Gumbel(0, 1) noise for (seed, position), on the CPU."""
    g = torch.Generator().manual_seed(position_seed(seed, position))
    u = torch.rand(vocab_size, generator=g, dtype=torch.float64)
    return -torch.log(-torch.log(u))   # u = 0 gives -inf: never chosen


def sample_token(logits: torch.Tensor, seed: int, position: int, temperature: float) -> int:
    """Token id for one row of logits (V,): Gumbel-max at ``temperature`` (> 0), greedy at 0."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    row = logits.detach().to("cpu", torch.float64)
    if temperature == 0:
        return int(torch.argmax(row))
    return int(torch.argmax(row / temperature + gumbel_noise(seed, position, row.shape[0])))
