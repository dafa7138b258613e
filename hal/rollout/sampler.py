"""The HAL's sampler: a token is a function of (request seed, position, logits) alone.

Both rollout engines sample with it (the built-in harness directly, vLLM through the plugin's
sampler), so for the same seed, position and logits they pick the same token.

Gumbel-max: ``token = argmax(logits / T + G)`` with ``G_i = -log(-log(U_i))``. The uniform ``U_i``
comes from a counter-based generator: a stateless integer hash (splitmix64's finaliser, in wrapping
int64 torch ops) of (seed, position, vocabulary index). There is no generator state to advance or
rewind, so the draw does not depend on what shares the batch, in which order requests run, how a
prompt is chunked, or whether a request was preempted and recomputed. The noise and the argmax are
evaluated in fp64 on the CPU, one (V,) row at a time (so an element's place in a vectorised loop
never depends on the batch). Ties go to the lower token id. ``temperature == 0`` is greedy.

``position`` is the sequence position of the token being sampled (prompt length + tokens generated
so far).
"""

from __future__ import annotations

from typing import Sequence

import torch

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15          # splitmix64's increment
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB


def _signed(c: int) -> int:
    """A 64-bit pattern as the int64 value with the same bits (torch has no uint64 arithmetic)."""
    c &= _MASK64
    return c - (1 << 64) if c >> 63 else c


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's ``>>`` is arithmetic: clear the sign copies)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's output function on int64 tensors; products wrap mod 2**64 (two's complement)."""
    x = (x ^ _shr(x, 30)) * _signed(_MUL1)
    x = (x ^ _shr(x, 27)) * _signed(_MUL2)
    return x ^ _shr(x, 31)


def _mix_int(x: int) -> int:
    """``_mix`` in exact Python integers (the specification the tensor version is checked against)."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * _MUL1) & _MASK64
    x = ((x ^ (x >> 27)) * _MUL2) & _MASK64
    return x ^ (x >> 31)


def position_seed(seed: int, position: int) -> int:
    """The 64-bit key of the token at ``position`` of a request seeded ``seed`` (as a signed int64)."""
    key = _mix_int(_mix_int(int(seed) + _GAMMA) ^ (int(position) & _MASK64))
    return _signed(key)


def uniform_bits(seed: int, position: int, vocab_size: int) -> torch.Tensor:
    """(V,) int64: the 64 hash bits of (seed, position, index) for every vocabulary index (splitmix64's
    stream from the key: element i is ``mix(key + (i + 1) * gamma)``)."""
    index = torch.arange(1, vocab_size + 1, dtype=torch.int64)
    return _mix(index * _signed(_GAMMA) + position_seed(seed, position))


def uniform_noise(seed: int, position: int, vocab_size: int) -> torch.Tensor:
    """(V,) fp64 uniforms in the open interval (0, 1): the top 53 hash bits, centred in their cell."""
    top = _shr(uniform_bits(seed, position, vocab_size), 11)
    return (top.to(torch.float64) + 0.5) * 2.0 ** -53


def gumbel_noise(seed: int, position: int, vocab_size: int) -> torch.Tensor:
    """(V,) fp64 Gumbel(0, 1) noise for (seed, position), on the CPU (finite: U is never 0 or 1)."""
    return -torch.log(-torch.log(uniform_noise(seed, position, vocab_size)))


def sample_token(logits: torch.Tensor, seed: int, position: int, temperature: float) -> int:
    """Token id for one row of logits (V,): Gumbel-max at ``temperature`` (> 0), greedy at 0."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    row = logits.detach().to("cpu", torch.float64)
    if temperature == 0:
        return int(torch.argmax(row))
    return int(torch.argmax(row / temperature + gumbel_noise(seed, position, row.shape[0])))


def sample_tokens(logits: torch.Tensor, seeds: Sequence[int], positions: Sequence[int],
                  temperatures: Sequence[float]) -> torch.Tensor:
    """(B,) int64 tokens for (B, V) logits: ``sample_token`` row by row (each row's bits depend on
    that row alone)."""
    return torch.tensor([sample_token(logits[i], seeds[i], positions[i], temperatures[i])
                         for i in range(logits.shape[0])], dtype=torch.int64)
