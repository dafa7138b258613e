"""Fingerprints of tensors' bytes, computed where the tensor lives: the weight-sync and checkpoint checks.

A weight sync copies the trainer's weights into the rollout engine's own buffers, and the run checks
that both then hold the same bytes. The check used to be a sha256 of every weight on the host: for a
Qwen3-1.7B-shaped model (3.4 GB) 8-15 s per side on the H200 machine, against 0.02-0.03 s for the copy
itself, so the check, not the copy, set the sync's speed and a third of each GRPO step. ``fingerprint``
reads each byte once on the device instead (a Triton kernel on CUDA tensors, the same function in
plain torch integer ops everywhere else) and ``tensor_digest`` turns it into a short hex string.

The function (exact integer arithmetic: the value does not depend on the device, the launch or the
order in which the partial sums are added):

* the tensor's bytes, row-major, are read as little-endian 32-bit words ``w_0 .. w_{n-1}`` (the last
  word zero-padded; the byte count enters the digest, so padding cannot collide with real zeros);
* for each word and each of two lanes ``L`` (seeds ``S_L``):
  ``key_i = fmix32(lo(i) * 0x9E3779B1 + hi(i) * 0x85EBCA77 + S_L)`` (``lo``, ``hi``: the 32-bit halves
  of the position), ``h_i = fmix32(w_i ^ key_i)``, with murmur3's 32-bit finaliser ``fmix32`` and every
  product taken mod 2**32;
* the lane's value is ``sum_i h_i mod 2**64`` (an exact integer sum).

What it guarantees: equal bytes give equal fingerprints on every device. A difference anywhere (a
flipped bit, a swapped or shifted word, a truncated copy) changes a lane's sum unless the per-word
changes cancel, which for a mixing finaliser keyed by position is a ~2**-32 event per lane (two
independent lanes: ~2**-64). It is a check against mis-copies and corruption, not against someone
forging bytes on purpose (use sha256 for that: the checkpoint file's payload keeps one).
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import torch

SEEDS = (0x2545F491, 0x6C078965)       # one per lane
POS_LO, POS_HI = 0x9E3779B1, 0x85EBCA77
FMIX1, FMIX2 = 0x85EBCA6B, 0xC2B2AE35
MASK32 = 0xFFFFFFFF
TORCH_CHUNK = 1 << 24                 # words per step of the torch implementation (bounded temporaries)


def words(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(the tensor's bytes as int32 words, zero-padded to a whole word; its byte count)."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    nbytes = flat.numel()
    if nbytes % 4:
        flat = torch.cat([flat, flat.new_zeros(4 - nbytes % 4)])
    return flat.view(torch.int32), nbytes


def fingerprints(tensors: Sequence[torch.Tensor]) -> list[tuple[int, int, int]]:
    """(byte count, lane 0, lane 1) of each tensor's bytes (the module docstring's function). CUDA tensors
    are read by ``hal.kernels.digest`` on their GPU, any other by the torch implementation; the lane sums
    stay on the device until one transfer for all of them (a weight sync checks hundreds of tensors)."""
    sums, sizes = [], []
    for t in tensors:
        w, nbytes = words(t)
        if w.device.type == "cuda":
            from hal.kernels.digest import lane_sums

            sums.append(lane_sums(w))
        else:
            sums.append(_lane_sums_torch(w))
        sizes.append(nbytes)
    return [(nbytes, *_lanes(values)) for nbytes, values in zip(sizes, _to_host(sums))]


def fingerprint(t: torch.Tensor) -> tuple[int, int, int]:
    """``fingerprints`` of one tensor."""
    return fingerprints([t])[0]


def fingerprint_torch(t: torch.Tensor) -> tuple[int, int, int]:
    """``fingerprint`` in plain torch integer ops on any device (the specification the kernel is tested
    against)."""
    w, nbytes = words(t)
    return (nbytes, *_lanes(_lane_sums_torch(w).tolist()))


def tensor_digests(tensors: Sequence[torch.Tensor]) -> list[str]:
    """A hex digest of each tensor's dtype, shape and bytes (``fingerprints``): equal for equal tensors on
    any device."""
    return [hashlib.sha256(f"{t.dtype}:{tuple(t.shape)}:{nbytes}:{lane0:016x}:{lane1:016x}".encode()).hexdigest()
            for t, (nbytes, lane0, lane1) in zip(tensors, fingerprints(tensors))]


def tensor_digest(t: torch.Tensor) -> str:
    """``tensor_digests`` of one tensor."""
    return tensor_digests([t])[0]


def _lanes(values) -> tuple[int, int]:
    """The two lane values from the four sums (lane 0's high and low 16-bit halves, then lane 1's)."""
    hi0, lo0, hi1, lo1 = (int(v) for v in values)
    return (hi0 * 65536 + lo0) % (1 << 64), (hi1 * 65536 + lo1) % (1 << 64)


def _to_host(sums: list[torch.Tensor]) -> list[list[int]]:
    """The (4,) int64 sums as Python ints, one transfer per device."""
    out: list[list[int] | None] = [None] * len(sums)
    by_device: dict[torch.device, list[int]] = {}
    for i, s in enumerate(sums):
        by_device.setdefault(s.device, []).append(i)
    for indices in by_device.values():
        for i, values in zip(indices, torch.stack([sums[i] for i in indices]).tolist()):
            out[i] = values
    return out


# -- the torch implementation: int64 tensors holding 32-bit unsigned values --------------------------

def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2**32 for x in [0, 2**32), without an int64 product overflowing: c in 16-bit halves."""
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (hi + x * (c & 0xFFFF)) & MASK32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, FMIX1)
    x = x ^ (x >> 13)
    x = _mul32(x, FMIX2)
    return x ^ (x >> 16)


def _lane_sums_torch(w: torch.Tensor) -> torch.Tensor:
    """(4,) int64 on ``w``'s device: each lane's sum of the high and of the low 16-bit halves of its mixed
    words (summed apart: exact in int64 for any tensor under 2**47 words, whatever torch's order)."""
    sums = torch.zeros(4, dtype=torch.int64, device=w.device)
    for start in range(0, w.numel(), TORCH_CHUNK):
        word = w[start:start + TORCH_CHUNK].to(torch.int64) & MASK32
        pos = torch.arange(start, start + word.numel(), dtype=torch.int64, device=w.device)
        lo, hi = pos & MASK32, pos >> 32
        for lane, seed in enumerate(SEEDS):
            key = _fmix32((_mul32(lo, POS_LO) + _mul32(hi, POS_HI) + seed) & MASK32)
            h = _fmix32(word ^ key)
            sums[2 * lane] += (h >> 16).sum()
            sums[2 * lane + 1] += (h & 0xFFFF).sum()
    return sums
