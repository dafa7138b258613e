"""Toy verifiable tasks: prompts drawn from a seed, rewards computed exactly from the tokens.

They exist to show that the GRPO loop learns (reward rises within a few dozen steps on a tiny model
on 2 CPU cores) while train/rollout logprobs stay bitwise equal; they are not benchmarks.

* ``count_up`` (default): the prompt is ``prompt_len`` random digit tokens; every response token
  earns 1/len if it is the successor (mod 10) of the token before it (the first response token
  continues the prompt's last digit). A bigram rule a tiny model learns within a few dozen steps
  (measured with recipes/harness.yaml, lr 1e-2, 8 prompts x 4 samples: mean reward 0.16 over the
  first 5 steps -> 0.68 over the last 5 of 30); rewards stay spread within a group for many steps,
  so GRPO's advantages keep a signal.
* ``target_token``: every response token equal to ``task.target`` earns 1/len. Learned in a handful
  of steps (then the policy is nearly deterministic): a smoke test.
* ``even_token``: every response token with an even id earns 1/len. A random model of any vocabulary
  already earns ~0.5 with a spread inside each group, so GRPO's advantages are non-zero from the first
  step and every step updates the weights: the task for full-size random models (``count_up`` and
  ``target_token`` pay ~1/vocab per token there, so every group's rewards are equal, every advantage is
  0 and no step changes a weight).

Digit ``d`` is token ``DIGIT_BASE + d``; the vocabulary must hold tokens up to ``DIGIT_BASE + 9``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Sequence

from hal.errors import HalError

DIGIT_BASE = 2


def prompt_rng(seed: int, step: int) -> random.Random:
    """The generator of step ``step``'s prompts: a function of (seed, step) only, so a resumed run
    draws the prompts the uninterrupted run would have drawn."""
    return random.Random(f"hal.rl prompts {int(seed)} {int(step)}")


class Task:
    name = "task"

    def __init__(self, prompt_len: int, target: int = 0):
        self.prompt_len = prompt_len
        self.target = target

    def prompts(self, seed: int, step: int, count: int) -> list[tuple[int, ...]]:
        rng = prompt_rng(seed, step)
        return [tuple(DIGIT_BASE + rng.randrange(10) for _ in range(self.prompt_len)) for _ in range(count)]

    def reward(self, prompt: Sequence[int], response: Sequence[int]) -> float:
        raise NotImplementedError

    @classmethod
    def validate(cls, recipe, source: str) -> None:
        """Raise ``RecipeError`` if the task cannot run with the recipe's model."""
        from hal.rl.recipe import RecipeError

        if recipe.task.prompt_len < 1:
            raise RecipeError(f"{source}: task.prompt_len = {recipe.task.prompt_len}: must be >= 1")
        vocab = model_vocab_size(recipe)
        if vocab is not None and vocab < DIGIT_BASE + 10:
            raise RecipeError(f"{source}: task {recipe.task.name!r} uses tokens {DIGIT_BASE}..{DIGIT_BASE + 9} "
                              f"but the model's vocabulary has {vocab}; set model.overrides.vocab_size >= "
                              f"{DIGIT_BASE + 10}")


class CountUp(Task):
    name = "count_up"

    def reward(self, prompt, response):
        if not response:
            return 0.0
        prev, hits = prompt[-1], 0
        for token in response:
            hits += int(prev - DIGIT_BASE in range(10) and token == DIGIT_BASE + (prev - DIGIT_BASE + 1) % 10)
            prev = token
        return hits / len(response)


class TargetToken(Task):
    name = "target_token"

    def reward(self, prompt, response):
        return sum(t == self.target for t in response) / len(response) if response else 0.0

    @classmethod
    def validate(cls, recipe, source):
        super().validate(recipe, source)
        from hal.rl.recipe import RecipeError

        vocab = model_vocab_size(recipe)
        if recipe.task.target < 0 or (vocab is not None and recipe.task.target >= vocab):
            raise RecipeError(f"{source}: task.target = {recipe.task.target}: must be a token id of the "
                              f"model's vocabulary (0..{(vocab or 1) - 1})")


class EvenToken(Task):
    name = "even_token"

    def reward(self, prompt, response):
        return sum(t % 2 == 0 for t in response) / len(response) if response else 0.0


TASKS: dict[str, type[Task]] = {CountUp.name: CountUp, TargetToken.name: TargetToken, EvenToken.name: EvenToken}


def model_vocab_size(recipe) -> int | None:
    """The vocabulary size the recipe's model will have (None if it cannot be told without loading)."""
    m = recipe.model
    if m.checkpoint is not None:
        try:
            return int(json.loads((Path(m.checkpoint) / "config.json").read_text())["vocab_size"])
        except (OSError, ValueError, KeyError):
            return None
    from hal.model.config import tiny_config

    return int(m.overrides.get("vocab_size", tiny_config(m.arch).vocab_size))


def make_task(recipe) -> Task:
    if recipe.task.name not in TASKS:
        raise HalError(f"unknown task {recipe.task.name!r}; known: {', '.join(TASKS)}")
    return TASKS[recipe.task.name](recipe.task.prompt_len, recipe.task.target)
