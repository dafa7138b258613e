"""Train/rollout logprob comparison metrics over response tokens.

For each response token t with rollout logprob ``a_t`` (what the engine reported) and trainer logprob
``b_t`` (recomputed on the same weights and prefix), with ``d_t = b_t - a_t`` evaluated in fp64:

* ``mismatches``: tokens whose two fp32 logprobs are not equal, or where either is NaN or +-Inf (a
  diverged or broken side never counts as a match, not even NaN vs NaN) -- the number that must be 0;
* ``max/mean/std |dlogp|``: of ``|d_t|`` (std is the population std, over all tokens);
* ``max/mean |dp|``: of ``|exp(b_t) - exp(a_t)|``, the difference in probability space;
* ``k3_kl``: ``mean(r - log r - 1)`` with ``r = p_train / p_rollout = exp(d_t)``, computed as
  ``expm1(d) - d`` (the k3 estimator of KL(rollout || train) on rollout samples; >= 0 per token).

"diff = 0" means mismatches == 0, and then every other number is exactly 0 as well.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

import torch

from hal.errors import HalError

Logprobs = torch.Tensor | Sequence[torch.Tensor]


def _flat(x: Logprobs, what: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().reshape(-1)
    parts = [t.detach().reshape(-1) for t in x]
    if not parts:
        return torch.zeros(0)
    devices = {p.device for p in parts}
    if len(devices) > 1:
        raise HalError(f"compare_logprobs: {what} tensors are on several devices {sorted(map(str, devices))}")
    return torch.cat(parts)


@dataclass(frozen=True)
class LogprobComparison:
    num_tokens: int
    mismatches: int
    max_abs_diff: float
    mean_abs_diff: float
    std_abs_diff: float
    max_prob_diff: float
    mean_prob_diff: float
    k3_kl: float

    @property
    def identical(self) -> bool:
        return self.mismatches == 0

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)

    def __str__(self) -> str:
        if self.num_tokens == 0:
            return "no response tokens compared"
        if self.identical:
            return f"{self.num_tokens} tokens: identical (diff = 0)"
        return (f"{self.num_tokens} tokens: {self.mismatches} differ; |dlogp| max {self.max_abs_diff:.3g} "
                f"mean {self.mean_abs_diff:.3g} std {self.std_abs_diff:.3g}; |dp| max {self.max_prob_diff:.3g} "
                f"mean {self.mean_prob_diff:.3g}; k3-KL {self.k3_kl:.3g}")


def compare_logprobs(train: Logprobs, rollout: Logprobs, mask: Logprobs | None = None) -> LogprobComparison:
    """Compare trainer and rollout logprobs of the same tokens.

    ``train``, ``rollout``: fp32 tensors of equal shape, or equal-length lists of them (one per
    sequence, concatenated). ``mask`` (same layout, bool) keeps only response tokens; default all.
    """
    b, a = _flat(train, "train"), _flat(rollout, "rollout")
    if a.shape != b.shape:
        raise HalError(f"compare_logprobs: train has {b.numel()} tokens, rollout {a.numel()}; they must be "
                       f"the logprobs of the same tokens")
    if mask is not None:
        keep = _flat(mask, "mask").to(torch.bool)
        if keep.shape != a.shape:
            raise HalError(f"compare_logprobs: mask has {keep.numel()} entries for {a.numel()} tokens")
        a, b = a[keep.to(a.device)], b[keep.to(b.device)]
    n = a.numel()
    if n == 0:
        return LogprobComparison(0, 0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    b = b.to(a.device)
    # A token matches only if both values are finite and equal. NaN != NaN already, but two equal
    # infinities compare equal, and a max over nan-ignoring ops would report 0: neither may pass.
    same = (a == b) & torch.isfinite(a) & torch.isfinite(b)
    a64, b64 = a.double().cpu(), b.double().cpu()
    d = b64 - a64
    # Matching tokens have d = 0 exactly; a non-finite side keeps its NaN/Inf, which max/mean propagate.
    d = torch.where(same.cpu(), torch.zeros_like(d), d)
    abs_d = d.abs()
    dp = (b64.exp() - a64.exp()).abs()
    dp = torch.where(same.cpu(), torch.zeros_like(dp), dp)
    k3 = torch.expm1(d) - d
    return LogprobComparison(
        num_tokens=n,
        mismatches=int((~same).sum()),
        max_abs_diff=float(abs_d.max()),
        mean_abs_diff=float(abs_d.mean()),
        std_abs_diff=float(abs_d.std(unbiased=False)),
        max_prob_diff=float(dp.max()),
        mean_prob_diff=float(dp.mean()),
        k3_kl=float(k3.mean()),
    )
