"""The built-in rollout harness and the trainer-side recomputation of its logprobs.

    from hal.rollout import HarnessConfig, Request, RolloutHarness, recompute_logprobs
    completions = RolloutHarness(model, HarnessConfig(page_size=16, seed=0)).generate(
        [Request(prompt=(1, 2, 3), max_new_tokens=8, seed=7)])
    train = recompute_logprobs(model, completions)        # equal bitwise on a conforming backend
"""

from hal.rollout.harness import Completion, HarnessConfig, HarnessStats, Request, RolloutHarness
from hal.rollout.recompute import recompute_logprobs
from hal.rollout.sampler import gumbel_noise, position_seed, sample_token

__all__ = ["Completion", "HarnessConfig", "HarnessStats", "Request", "RolloutHarness", "gumbel_noise",
           "position_seed", "recompute_logprobs", "sample_token"]
