"""True on-policy GRPO on one model object shared by the rollout engine and the trainer.

One step (one optimizer update per step: the step's batch is the mini-batch):

1. rollout: ``prompts_per_step`` prompts x ``samples_per_prompt`` samples through the recipe's
   engine (``hal.rl.engines``): the built-in harness (``hal.rollout.RolloutHarness``; its schedule
   and the samplers are seeded by the recipe seed and the step) or vLLM, on the recipe's backend;
2. rewards from the task, advantages normalised within each prompt's group
   ``A = (r - mean_group) / (std_group + 1e-6)`` (0 for a group whose rewards are all equal);
3. the trainer recomputes the logprobs of the same tokens on the same weights with the training
   forward (``recompute_logprobs``: packed sequences, autograd wrappers, a different batch layout);
4. consistency metrics *before* the update (``compare_logprobs``: mismatching tokens, max/mean/std
   |dlogp|, |dp|, k3-KL) and the entropy of the sampling distribution over response tokens;
5. the loss ``-mean_tokens(min(ratio * A, clip(ratio) * A))`` with ``ratio = exp(logp - old_logp)``
   and ``old_logp`` = the trainer's own recomputation, detached. With one update per step the ratio
   is exactly 1 and the loss is ``-(A * logp).mean()`` over response tokens; the clip (``clip:``) only
   matters if the recipe is changed to take several updates per batch;
6. ``torch.optim.Adam`` step on the model parameters;
7. weight sync: the harness holds the *same* ``DecoderLM`` object as the trainer (in place, no copy);
   vLLM gets the new weights copied into its own buffers in place. Either way it is checked, not
   assumed: the engine's digest of the weights it holds must equal the trainer's, or
   ``WeightSyncError`` is raised (see ``hal.rl.engines``).

Diff = 0 is the claim: on a conforming backend the trainer's logprobs in step 3 are bitwise the
rollout's, at every step, including the first step after a checkpoint restore. The ``torch``
baseline (stock kernels) shows what happens without the contract.

Checkpoints (``checkpoint.pt`` in the run directory, every ``checkpoint_every`` steps and at the
end): model and optimizer state, the step, the torch and Python RNG states, the recipe and the
backend/contract identity, written atomically with a sha256 over all of it that is verified before a
resume (``save_checkpoint``, ``load_checkpoint``). Prompts, sampling seeds and harness schedules are
functions of (seed, step), so a resumed run continues with exactly the batches the uninterrupted run
would have drawn. A resume under another contract fingerprint is refused.

A non-finite rollout or trainer logprob, loss or updated weight stops the run (``DivergedError``
naming the step) before that step is recorded.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import random
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from hal import api
from hal.errors import ContractMismatchError, DivergedError, HalError, TrainingCheckpointError, WeightSyncError
from hal.metrics import compare_logprobs
from hal.model import DecoderLM, load_pretrained, tiny_config
from hal.rl.engines import WEIGHTS_CHECKSUM_KIND, host_weights_checksum, open_engine, weights_checksum
from hal.rl.recipe import RESOLVED_RECIPE, Recipe, RecipeError, dump_recipe
from hal.rl.report import MetricsLog
from hal.rl.task import make_task
from hal.rollout import Completion, HarnessConfig, Request, RolloutHarness, recompute_logprobs

CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.jsonl"
# Recipe keys a checkpoint must agree with to be resumed (steps and output paths may change).
_RESUME_KEYS = ("model", "task", "backend", "contract", "engine", "prompts_per_step", "samples_per_prompt",
                "max_tokens", "temperature", "learning_rate", "clip", "seed", "harness")


@contextlib.contextmanager
def num_threads(n: int) -> Iterator[None]:
    """``torch.set_num_threads(n)`` inside the block, the caller's setting after it (tests run many
    things in one process)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def build_model(recipe: Recipe, backend) -> DecoderLM:
    """The recipe's model on ``backend``: a tiny seeded model or a local HF checkpoint."""
    m = recipe.model
    if m.checkpoint is not None:
        return load_pretrained(m.checkpoint, dtype=m.dtype, backend=backend)
    return DecoderLM.random(tiny_config(m.arch, m.dtype, **m.overrides), seed=m.seed, backend=backend)


def group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """(P, G) rewards -> (P*G,) advantages normalised within each prompt's group (fp64)."""
    r = rewards.double()
    std = r.std(dim=1, keepdim=True, unbiased=False)
    adv = (r - r.mean(dim=1, keepdim=True)) / (std + 1e-6)
    return torch.where(std > 0, adv, torch.zeros_like(adv)).reshape(-1)


def grpo_loss(logprobs: Sequence[torch.Tensor], old_logprobs: Sequence[torch.Tensor], advantages: torch.Tensor,
              clip: float | None) -> torch.Tensor:
    """Token-mean clipped surrogate over all response tokens of the batch."""
    lp = torch.cat(list(logprobs))
    old = torch.cat([o.detach().to(lp.device) for o in old_logprobs])
    adv = torch.cat([torch.full((len(o),), float(a), dtype=torch.float32, device=lp.device)
                     for o, a in zip(old_logprobs, advantages.tolist())])
    ratio = torch.exp(lp - old)
    surrogate = ratio * adv
    if clip is not None:
        surrogate = torch.minimum(surrogate, torch.clamp(ratio, 1 - clip, 1 + clip) * adv)
    return -surrogate.mean()


ENTROPY_ROWS = 1024   # response tokens per fp64 log-softmax in response_entropy (~1.2 GB at vocab 151936)


@torch.no_grad()
def response_entropy(model: DecoderLM, completions: Sequence[Completion], temperature: float) -> float:
    """Mean entropy (nats) of the sampling distribution softmax(logits / T) at every response token,
    from the trainer's logits (one packed training forward without autograd)."""
    seqs = [c.sequence for c in completions]
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long, device=model.device)
    rows, offset = [], 0
    for c, s in zip(completions, seqs):
        rows.extend(offset + j - 1 for j in range(len(c.prompt), len(s)))
        offset += len(s)
    if not rows:
        return 0.0
    logits = model.forward_train(ids, [len(s) for s in seqs],
                                 logits_rows=torch.tensor(rows, dtype=torch.long, device=model.device))
    # fp64 in slices of rows: the whole batch at once is rows x vocab x 8 bytes (a 1.7B-shaped model's
    # 8192 response tokens at vocab 151936: 9.3 GB, which ran the H200 out of memory beside vLLM)
    total = 0.0
    for part in logits.split(ENTROPY_ROWS):
        logp = torch.log_softmax(part.double() / temperature, dim=-1)
        total += float(-(logp.exp() * logp).sum())
    return total / logits.shape[0]


def _preflight(model: DecoderLM, recipe: Recipe) -> None:
    """One tiny rollout and training forward before anything is written: a backend that cannot run
    this model (a dtype or head_dim its kernels do not take) fails here, as a RecipeError."""
    try:
        completion = RolloutHarness(model, HarnessConfig(page_size=recipe.harness.page_size)).generate(
            [Request(prompt=(0, 1), max_new_tokens=2, seed=0, temperature=recipe.temperature)])[0]
        with torch.no_grad():
            model.sequence_logprobs([completion.sequence], [2], temperature=recipe.temperature)
    except HalError as exc:
        raise RecipeError(f"backend {recipe.backend!r} cannot run this recipe's model "
                          f"({model.config.architecture}, {model.config.dtype}, head_dim {model.config.head_dim}): "
                          f"{exc}\nFix: change the model (model.dtype, model.overrides) or the backend") from None


def _request_seed(seed: int, step: int, index: int) -> int:
    return int.from_bytes(hashlib.sha256(f"hal.rl sample {seed} {step} {index}".encode()).digest()[:7], "little")


#: the name this error has always had in ``hal.rl`` (hal.model's CheckpointError is the HF weights' one)
CheckpointError = TrainingCheckpointError


# A checkpoint file is this header line, the sha256 of the payload, a newline, then the payload
# (``torch.save`` of the state). The checksum covers everything restored: weights, Adam state, RNG
# states, the recipe; torch.load itself checks none of it (a flipped byte in exp_avg_sq loads fine).
_CHECKPOINT_MAGIC = b"hal-checkpoint-v1 sha256="


def save_checkpoint(path: str | Path, state: dict) -> None:
    """Write ``state`` atomically: a temp file, fsync, rename over ``path``, fsync of the directory.
    A crash at any point leaves either the old checkpoint or the new one, never a torn file."""
    path = Path(path)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        f.write(_CHECKPOINT_MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n")
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)             # the rename itself survives a power loss
    finally:
        os.close(directory)


def load_checkpoint(path: str | Path) -> dict:
    """The state saved by ``save_checkpoint``; ``CheckpointError`` unless its checksum matches."""
    path = Path(path)
    data = path.read_bytes()
    header, newline, payload = data.partition(b"\n")
    if not header.startswith(_CHECKPOINT_MAGIC) or not newline:
        raise CheckpointError(f"{path} is not a hal checkpoint of this version (it does not start with "
                              f"{_CHECKPOINT_MAGIC.decode()!r}); start a new run (another output_dir or overwrite=true)")
    expected = header[len(_CHECKPOINT_MAGIC):].decode("ascii", "replace")
    actual = hashlib.sha256(payload).hexdigest()
    if actual != expected:
        raise CheckpointError(f"{path} is corrupt: the sha256 of its contents is {actual[:16]}..., the one written "
                              f"with it is {expected[:16]}...; it was damaged after it was written (disk, copy). "
                              f"Restore it from a backup, or start a new run (overwrite=true)")
    return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=False)


def backend_identity(backend) -> dict:
    """What decides the bits of a run: the backend (name, package, version) and its contract."""
    from hal.registry import discover

    info = discover().get(backend.name)
    contract = backend.contract
    return {"backend": backend.name, "package": getattr(info, "package", "?"), "version": getattr(info, "version", "?"),
            "contract": None if contract is None else contract.name, "fingerprint": backend.fingerprint}


def _require_finite(step: int, what: str, tensors: Sequence[torch.Tensor]) -> None:
    for t in tensors:
        if not bool(torch.isfinite(t.detach()).all()):
            raise DivergedError(f"step {step}: the run diverged: {what} holds NaN or Inf; stopped before recording "
                                f"the step (metrics and checkpoint hold the steps before it). Lower learning_rate, "
                                f"or resume from the last checkpoint with another recipe")


class GRPORun:
    """One recipe on one backend, into ``run_dir`` (metrics.jsonl, checkpoint.pt, the resolved recipe).

    ``prepare`` does everything that can fail before the run directory is touched (backend, model,
    preflight, the verified checkpoint of a resume); ``execute`` then replaces or continues the run.
    ``hal run`` calls both while it holds the output directory's lock (``hal.rl.runner``)."""

    def __init__(self, recipe: Recipe, run_dir: str | Path, progress: Callable[[dict], None] | None = None):
        self.recipe = recipe
        self.run_dir = Path(run_dir)
        self.progress = progress
        self.task = make_task(recipe)
        self._prepared = False

    # -- checkpoints ----------------------------------------------------------------------------

    def _save(self, model, optimizer, step: int, checksum: str) -> None:
        state = {"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                 "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(),
                 "recipe": self.recipe.to_dict(), "weights_checksum": checksum,
                 "weights_checksum_kind": WEIGHTS_CHECKSUM_KIND, "binding": self.identity}
        save_checkpoint(self.run_dir / CHECKPOINT, state)

    def _restore(self, model, optimizer) -> dict:
        path = self.run_dir / CHECKPOINT
        state = load_checkpoint(path)
        saved, now = state["recipe"], self.recipe.to_dict()
        changed = [k for k in _RESUME_KEYS if saved.get(k) != now.get(k)]
        if changed:
            raise RecipeError(f"resume: the checkpoint in {self.run_dir} was written by a recipe with different "
                              f"{', '.join(changed)} ({', '.join(f'{k}={saved.get(k)!r}' for k in changed)}); "
                              f"resume with the same values or start a new output_dir")
        then = state.get("binding", {})
        if then.get("fingerprint") != self.identity["fingerprint"]:
            raise ContractMismatchError(
                f"resume: {path} was written under contract {then.get('contract')!r} (fingerprint "
                f"{then.get('fingerprint')}), this run binds {self.identity['contract']!r} (fingerprint "
                f"{self.identity['fingerprint']}): the bits would differ. Bind the same contract (HAL_CONTRACT, "
                f"contract=) or start a new output_dir")
        step = int(state["step"])
        if self.recipe.steps < step:
            raise RecipeError(f"resume: steps = {self.recipe.steps} but the checkpoint in {self.run_dir} is at step "
                              f"{step}; resume with steps >= {step} (nothing is rewritten)")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        # a checkpoint from before hal.digest carries the host sha256 of the weights instead
        checksum = weights_checksum if state.get("weights_checksum_kind") == WEIGHTS_CHECKSUM_KIND else host_weights_checksum
        if checksum(model) != state["weights_checksum"]:
            raise WeightSyncError(f"resume: the restored weights' checksum differs from the one saved in "
                                  f"{path}; the checkpoint is corrupt")
        return state

    # -- the loop -------------------------------------------------------------------------------

    def run(self) -> list[dict]:
        """Prepare and run (or resume) to ``recipe.steps``; returns this invocation's per-step metrics."""
        with num_threads(self.recipe.threads):
            self.prepare()
            return self.execute()

    def prepare(self) -> None:
        """Build and check everything; reads the run directory, writes nothing."""
        r = self.recipe
        self.backend = api.create_backend(r.backend, r.contract)
        self.identity = backend_identity(self.backend)
        self.model = build_model(r, self.backend)
        _preflight(self.model, r)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=r.learning_rate)
        self.restored = self._restore(self.model, self.optimizer) if r.resume else None
        self._prepared = True

    def execute(self) -> list[dict]:
        """Replace (or continue) the run in ``run_dir``: the first call that writes anything."""
        if not self._prepared:
            raise HalError("GRPORun.execute: call prepare() first")
        r, model, optimizer = self.recipe, self.model, self.optimizer
        torch.manual_seed(r.seed)
        random.seed(r.seed)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        metrics_log = MetricsLog(self.run_dir / METRICS)
        start = 0
        if self.restored is not None:
            start = int(self.restored["step"])
            torch.set_rng_state(self.restored["torch_rng"])
            random.setstate(self.restored["python_rng"])
            metrics_log.truncate_after(start)
        else:
            for name in (METRICS, CHECKPOINT):
                (self.run_dir / name).unlink(missing_ok=True)
        ident = self.identity
        (self.run_dir / RESOLVED_RECIPE).write_text(dump_recipe(r, [
            f"backend {ident['backend']} ({ident['package']} {ident['version']}), contract {ident['contract']}, "
            f"fingerprint {ident['fingerprint']}"]))
        engine = open_engine(r, model, self.backend, self.run_dir, lambda step: _request_seed(r.seed, step, -1))
        out = []
        try:
            seen = engine.check(model)         # the engine starts from the trainer's (restored) weights
            for step in range(start + 1, r.steps + 1):
                m = self._step(step, model, optimizer, engine)
                m["resumed"] = step == start + 1 and r.resume
                m["engine"] = engine.describe()
                m["contract_fingerprint"] = ident["fingerprint"]
                m["engine_weights_sha256"] = seen[:16]      # the weights this step's rollout used
                t0 = time.perf_counter()
                synced = engine.sync(model)                 # raises WeightSyncError unless exact
                m["sync_s"] = time.perf_counter() - t0      # the copy and its check
                m["weights_changed"] = synced != seen
                seen = synced
                metrics_log.append(m)
                out.append(m)
                if self.progress is not None:
                    self.progress(m)
                if step % r.checkpoint_every == 0 or step == r.steps:
                    self._save(model, optimizer, step, weights_checksum(model))
        finally:
            engine.close()
        return out

    def _step(self, step: int, model: DecoderLM, optimizer, engine) -> dict:
        r = self.recipe
        prompts = self.task.prompts(r.seed, step, r.prompts_per_step)
        requests = [Request(prompt=p, max_new_tokens=r.max_tokens, seed=_request_seed(r.seed, step, i * r.samples_per_prompt + j),
                            temperature=r.temperature)
                    for i, p in enumerate(prompts) for j in range(r.samples_per_prompt)]
        t0 = time.perf_counter()
        completions = engine.generate(requests, step)
        t1 = time.perf_counter()
        rewards = torch.tensor([self.task.reward(c.prompt, c.tokens) for c in completions], dtype=torch.float64)
        advantages = group_advantages(rewards.view(r.prompts_per_step, r.samples_per_prompt))

        # The trainer: recompute on the same weights (differentiable), compare before the update.
        train = recompute_logprobs(model, completions, seed=_request_seed(r.seed, step, -2))
        t2 = time.perf_counter()
        _require_finite(step, "the rollout's logprobs", [c.logprobs for c in completions])
        _require_finite(step, "the trainer's logprobs", train)
        consistency = compare_logprobs(train, [c.logprobs for c in completions])
        t_entropy = time.perf_counter()
        entropy = response_entropy(model, completions, r.temperature)   # the pre-update sampling policy
        entropy_s = time.perf_counter() - t_entropy
        old = [lp.detach() for lp in train]
        loss = grpo_loss(train, old, advantages, r.clip)
        optimizer.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        _require_finite(step, "the loss", [loss])
        loss.backward()
        optimizer.step()
        model.refresh_fp8_weights()     # block-FP8 models: quantise the new master weights as a sync does
        _require_finite(step, "the updated weights", list(model.parameters()))
        t4 = time.perf_counter()
        gen_tokens = sum(len(c.tokens) for c in completions)
        train_tokens = sum(len(c.sequence) for c in completions)
        train_s = (t2 - t1) + (t4 - t3)     # recompute + backward + optimizer (not metrics, entropy)
        return {
            "step": step, "backend": r.backend,
            "reward": float(rewards.mean()), "reward_std": float(rewards.std(unbiased=False)),
            **consistency.as_dict(),
            "entropy": entropy,
            "loss": float(loss.detach()),
            "rollout_tokens": gen_tokens, "train_tokens": train_tokens,
            "rollout_s": t1 - t0, "train_s": train_s, "entropy_s": entropy_s,
            "rollout_tokens_per_s": gen_tokens / max(t1 - t0, 1e-9),
            "train_tokens_per_s": train_tokens / max(train_s, 1e-9),
            "cached_prompt_tokens": sum(c.cached_prompt_tokens for c in completions),
            **(engine.step_metrics() if hasattr(engine, "step_metrics") else {}),
        }
