"""Trainer-side recomputation of rollout logprobs: the same tokens through the training forward.

The completions are packed into training batches in a seeded random order and random batch sizes
(as a trainer's data loader would), each batch one ``DecoderLM.sequence_logprobs`` call (training
mode: autograd wrappers, packed sequences, K/V through write_kv into contiguous pages). Only
requests of one logprob temperature share a batch.
"""

from __future__ import annotations

import random
from typing import Sequence

import torch

from hal.model.model import DecoderLM
from hal.rollout.harness import Completion


def recompute_logprobs(model: DecoderLM, completions: Sequence[Completion], *, seed: int = 0,
                       max_batch_sequences: int | None = None, page_size: int = 16) -> list[torch.Tensor]:
    """Per completion, the fp32 logprobs (len(tokens),) of its generated tokens recomputed by the
    training forward (differentiable when grad is enabled), in the order of ``completions``.

    ``seed`` draws the packing: the order of completions and how many share a batch (1 to
    ``max_batch_sequences``, default all).
    """
    rng = random.Random(seed)
    out: list[torch.Tensor | None] = [None] * len(completions)
    by_temperature: dict[float, list[int]] = {}
    for i, c in enumerate(completions):
        by_temperature.setdefault(c.request.logprob_temperature, []).append(i)
    for temperature, indices in sorted(by_temperature.items()):
        rng.shuffle(indices)
        limit = max_batch_sequences or len(indices)
        while indices:
            take = rng.randint(1, min(limit, len(indices)))
            group, indices = indices[:take], indices[take:]
            logprobs = model.sequence_logprobs([completions[i].sequence for i in group],
                                               [len(completions[i].request.prompt) for i in group],
                                               temperature=temperature, page_size=page_size)
            for i, lp in zip(group, logprobs):
                out[i] = lp
    return out
