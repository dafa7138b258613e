"""The HAL's sampler: a token is a function of (request seed, position, logits) alone.

Both rollout engines sample with it (the built-in harness directly, vLLM through the plugin's
sampler), so for the same seed, position and logits they pick the same token.

Gumbel-max: ``token = argmax(logits / T + G)`` with ``G_i = -log(-log(U_i))``. The uniform ``U_i``
comes from a counter-based generator: a stateless integer hash (splitmix64's finaliser, in wrapping
int64 torch ops) of (seed, position, vocabulary index). There is no generator state to advance or
rewind, so the draw does not depend on what shares the batch, in which order requests run, how a
prompt is chunked, or whether a request was preempted and recomputed. Ties go to the lower token id.
``temperature == 0`` is greedy.

Where it runs: logits on the CPU are sampled in fp64 on the CPU, one (V,) row at a time (the CPU's
vectorised log has SIMD and scalar-tail paths, so an element's place in a loop must never depend on
the batch). Logits on an accelerator are sampled there, all rows at once (``sample_rows``; its
elementwise kernels compute every element alike, wherever it sits in the batch): sampling 151936-wide
rows one by one on the host took ~5 ms per row, most of a GPU decode step. The hash bits and the
uniforms are exact integers and exactly rounded fp64 on every device; the two logs are the device's
fp64 log, so a CPU and a GPU engine could pick different tokens only where two candidates' scores lie
within an ulp of each other. Engines that must agree (vLLM and the harness on one backend) sample on
the same device.

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


def position_seeds(seeds: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
    """(B,) int64 CPU tensor: ``position_seed`` of every (seed, position) pair, in wrapping int64 tensor ops
    (one vectorised pass; in Python integers a row costs ~2.5 us on the CI host, 0.65 ms for a 256-row
    decode step). The same bits as ``position_seed`` (tests/test_rollout.py)."""
    seed_t = torch.tensor([_signed(int(s)) for s in seeds], dtype=torch.int64)
    position_t = torch.tensor([_signed(int(p)) for p in positions], dtype=torch.int64)
    return _mix(_mix(seed_t + _signed(_GAMMA)) ^ position_t)


def _stream_bits(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(B, V) int64: splitmix64's stream from each key (B,), on the keys' device: element i of a row is
    ``mix(key + (i + 1) * gamma)`` (int64 products and sums wrap mod 2**64, as the hash wants)."""
    index = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=keys.device) * _signed(_GAMMA)
    return _mix(index[None, :] + keys[:, None])


def _uniform(bits: torch.Tensor) -> torch.Tensor:
    """fp64 uniforms in the open interval (0, 1) from hash bits: the top 53 bits, centred in their cell."""
    return (_shr(bits, 11).to(torch.float64) + 0.5) * 2.0 ** -53


def _gumbel(bits: torch.Tensor) -> torch.Tensor:
    """fp64 Gumbel(0, 1) noise from hash bits, ``-log(-log(u))`` (finite: u is never 0 or 1)."""
    return -torch.log(-torch.log(_uniform(bits)))


def uniform_bits(seed: int, position: int, vocab_size: int) -> torch.Tensor:
    """(V,) int64: the 64 hash bits of (seed, position, index) for every vocabulary index."""
    return _stream_bits(torch.tensor([position_seed(seed, position)], dtype=torch.int64), vocab_size)[0]


def uniform_noise(seed: int, position: int, vocab_size: int) -> torch.Tensor:
    """(V,) fp64 uniforms in the open interval (0, 1): the top 53 hash bits, centred in their cell."""
    return _uniform(uniform_bits(seed, position, vocab_size))


def gumbel_noise(seed: int, position: int, vocab_size: int) -> torch.Tensor:
    """(V,) fp64 Gumbel(0, 1) noise for (seed, position), on the CPU (finite: U is never 0 or 1)."""
    return _gumbel(uniform_bits(seed, position, vocab_size))


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
    """(B,) int64 tokens for (B, V) logits, on the logits' device: on the CPU ``sample_token`` row by
    row, on an accelerator ``sample_rows`` (each row's token depends on that row alone either way)."""
    if logits.device.type != "cpu":
        return sample_rows(logits, seeds, positions, temperatures)
    return torch.tensor([sample_token(logits[i], seeds[i], positions[i], temperatures[i])
                         for i in range(logits.shape[0])], dtype=torch.int64)


#: rows ``sample_rows`` evaluates at once (bounds its fp64 / int64 temporaries to ~80 MB each at V = 152k)
ROWS_AT_ONCE = 64


def sample_rows(logits: torch.Tensor, seeds: Sequence[int], positions: Sequence[int],
                temperatures: Sequence[float]) -> torch.Tensor:
    """``sample_token`` for every row of (B, V) logits at once, on their device: the same hash bits and
    uniforms as ``uniform_bits`` / ``uniform_noise`` row by row, the same fp64 score, the first maximum.
    On a CUDA GPU one fused pass (``hal.kernels.sampling``: the same tokens, 5.4 ms -> 0.57 ms for
    256 x 151936 on the H200, bench/results/h200-2026-12-01-session4/sampler/); elsewhere
    ``sample_rows_torch``."""
    if not len(seeds) == len(positions) == len(temperatures) == logits.shape[0]:
        raise ValueError(f"sample_rows: {logits.shape[0]} rows of logits, but {len(seeds)} seeds, "
                         f"{len(positions)} positions and {len(temperatures)} temperatures")
    if any(t < 0 for t in temperatures):
        raise ValueError(f"temperature must be >= 0, got {min(temperatures)}")
    if logits.device.type == "cuda":
        from hal.kernels import sampling

        # keys and temperatures (both 8-byte) in one pinned buffer: one asynchronous copy per step (a
        # pageable source makes the copy stage through the driver on the host before the call returns)
        staged = torch.empty((2, len(seeds)), dtype=torch.int64, pin_memory=True)
        staged[0] = position_seeds(seeds, positions)
        staged[1] = torch.tensor([float(t) for t in temperatures], dtype=torch.float64).view(torch.int64)
        on_device = staged.to(logits.device, non_blocking=True)
        return sampling.sample(logits.detach(), on_device[0], on_device[1].view(torch.float64))
    return sample_rows_torch(logits, seeds, positions, temperatures)


def sample_rows_torch(logits: torch.Tensor, seeds: Sequence[int], positions: Sequence[int],
                      temperatures: Sequence[float]) -> torch.Tensor:
    """``sample_rows`` in torch ops, ``ROWS_AT_ONCE`` rows at a time (any device)."""
    device, (rows, vocab) = logits.device, logits.shape
    tokens = torch.empty(rows, dtype=torch.int64, device=device)
    for start in range(0, rows, ROWS_AT_ONCE):
        part = range(start, min(start + ROWS_AT_ONCE, rows))
        keys = position_seeds([seeds[i] for i in part], [positions[i] for i in part]).to(device)
        temps = torch.tensor([float(temperatures[i]) for i in part], dtype=torch.float64, device=device)[:, None]
        x = logits[start:part.stop].detach().to(torch.float64)
        greedy = temps == 0
        scores = torch.where(greedy, x, x / torch.where(greedy, 1.0, temps) + _gumbel(_stream_bits(keys, vocab)))
        tokens[start:part.stop] = torch.argmax(scores, dim=1)     # the first maximum: ties to the lower id
    return tokens
