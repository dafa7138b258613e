"""``hal diff``: find the first op whose bits differ between two runs that should agree.

Two runs of the same model on the same tokens (side A and side B) each capture, for one request,
every op output at every position (``hal.model.trace.OpTrace``). The runs are one of:

* ``train-vs-rollout``: A is the rollout harness (continuous batching, chunked prefill, decode,
  preemption), B the trainer's packed training forward over the same tokens;
* ``rollout-vs-rollout``: the harness under two schedule seeds (other batch compositions, chunk
  cuts, page orders; B may use another page size);
* ``train-vs-train``: the training forward of the request alone (A) vs packed with the others (B).

Side B can also run another backend (``--backend-b``) or plant another RMSNorm eps on chosen norms
(``--eps-b NAME=VALUE``), to show what a divergence looks like or to bisect a suspicion.

The comparison walks (op, position) pairs in the order ``(op in forward order, position)``. That
order is topological: an op of a token reads only outputs of earlier ops (attention reads the
K/V of earlier positions from the rotary and qkv ops before it). So the first pair whose bits differ
is an op whose traced inputs are bitwise equal on both sides and whose output is not: the op itself
(its kernel under this batch/phase, or its parameters) is the cause. The report names it, its
layer and token, the shapes of the two calls it ran in, and a command that reproduces the run.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import json
import random
import shlex
from dataclasses import asdict, dataclass, field
from typing import Iterator

import torch

from hal.errors import HalError, NothingComparedError
from hal.metrics import LogprobComparison, compare_logprobs
from hal.model.trace import OpTrace, TraceEntry

SCENARIOS = ("train-vs-rollout", "rollout-vs-rollout", "train-vs-train")


# ---------------------------------------------------------------------------------------------
# Comparing two traces.
# ---------------------------------------------------------------------------------------------

@dataclass
class Divergence:
    """The first (op, position) whose outputs are not bitwise equal."""

    op: str
    position: int
    differing: int
    total: int
    max_abs_diff: float
    a: TraceEntry
    b: TraceEntry

    @property
    def layer(self) -> int | None:
        parts = self.op.split(".")
        return int(parts[2]) if self.op.startswith("model.layers.") else None


@dataclass
class TraceComparison:
    divergence: Divergence | None
    compared: int                       # (op, position) pairs compared
    positions: list[int]                # positions compared
    token_divergence: int | None        # first position whose input token differs (later ones skipped)
    only_a: list[str] = field(default_factory=list)   # ops captured on one side only
    only_b: list[str] = field(default_factory=list)


def _bitwise_equal(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (x == y) | (torch.isnan(x) & torch.isnan(y))


def first_divergence(a: OpTrace, b: OpTrace) -> TraceComparison:
    """Compare two traces in topological order; see the module docstring."""
    common_tokens = sorted(set(a.tokens) & set(b.tokens))
    token_divergence = next((p for p in common_tokens if a.tokens[p] != b.tokens[p]), None)
    order = a.op_order + [op for op in b.op_order if op not in a.op_order]
    compared, positions = 0, set()
    for op in order:
        both = sorted(set(a.positions(op)) & set(b.positions(op)))
        for p in both:
            if token_divergence is not None and p >= token_divergence:
                break
            ea, eb = a.entries[(op, p)], b.entries[(op, p)]
            compared += 1
            positions.add(p)
            if ea.value.shape != eb.value.shape or ea.value.dtype != eb.value.dtype:
                return TraceComparison(Divergence(op, p, -1, -1, float("inf"), ea, eb), compared,
                                       sorted(positions), token_divergence)
            same = _bitwise_equal(ea.value, eb.value)
            if not bool(same.all()):
                diff = (ea.value.double() - eb.value.double()).abs().nan_to_num(nan=float("inf"))
                return TraceComparison(Divergence(op, p, int((~same).sum()), same.numel(), float(diff.max()), ea, eb),
                                       compared, sorted(positions), token_divergence)
    return TraceComparison(None, compared, sorted(positions), token_divergence,
                           [op for op in a.op_order if op not in b.op_order],
                           [op for op in b.op_order if op not in a.op_order])


# ---------------------------------------------------------------------------------------------
# Running the two sides.
# ---------------------------------------------------------------------------------------------

@dataclass
class DiffSpec:
    """Everything that decides a ``hal diff`` run (and its repro command)."""

    scenario: str = "train-vs-rollout"
    arch: str = "llama"
    dtype: str = "float32"
    seed: int = 0                       # model weights (random model) and prompts
    model: str | None = None            # a local HF checkpoint instead of a random model
    schedule_seed: int = 0
    num_requests: int = 4
    prompt_len: tuple[int, int] = (4, 12)
    max_new_tokens: int = 8
    temperature: float = 1.0
    page_size: int = 4
    page_size_b: int | None = None
    request: int = 0
    position: int | None = None         # trace only this position (default: all)
    backend: str | None = None
    backend_b: str | None = None
    eps_b: dict[str, float] = field(default_factory=dict)

    def __post_init__(self):
        if self.scenario not in SCENARIOS:
            raise HalError(f"hal diff: scenario {self.scenario!r} is not one of {', '.join(SCENARIOS)}")
        if not 0 <= self.request < self.num_requests:
            raise HalError(f"hal diff: --request {self.request} is not in 0..{self.num_requests - 1}")
        if not 1 <= self.prompt_len[0] <= self.prompt_len[1]:
            raise HalError(f"hal diff: --prompt-len must be LO-HI with 1 <= LO <= HI, got {self.prompt_len}")

    def command(self) -> str:
        """The ``hal diff`` command line that reproduces this run."""
        args = ["hal", "diff", "--scenario", self.scenario]
        args += ["--model", self.model] if self.model else ["--arch", self.arch]
        args += ["--dtype", self.dtype, "--seed", str(self.seed), "--schedule-seed", str(self.schedule_seed),
                 "--num-requests", str(self.num_requests), "--prompt-len", f"{self.prompt_len[0]}-{self.prompt_len[1]}",
                 "--max-new-tokens", str(self.max_new_tokens), "--temperature", str(self.temperature),
                 "--page-size", str(self.page_size), "--request", str(self.request)]
        if self.page_size_b is not None:
            args += ["--page-size-b", str(self.page_size_b)]
        if self.position is not None:
            args += ["--position", str(self.position)]
        if self.backend:
            args += ["--backend", self.backend]
        if self.backend_b:
            args += ["--backend-b", self.backend_b]
        for name, eps in self.eps_b.items():
            args += ["--eps-b", f"{name}={eps!r}"]
        return shlex.join(args)


@contextlib.contextmanager
def planted_eps(model, overrides: dict[str, float]) -> Iterator[None]:
    """Set the eps of the RMSNorm modules whose names match each pattern (fnmatch), then restore."""
    from hal.model.model import RMSNorm

    norms = {name: m for name, m in model.named_modules() if isinstance(m, RMSNorm)}
    saved = {name: m.eps for name, m in norms.items()}
    try:
        for pattern, eps in overrides.items():
            hits = [name for name in norms if fnmatch.fnmatchcase(name, pattern)]
            if not hits:
                raise HalError(f"--eps-b {pattern}: no RMSNorm of the model matches; names look like "
                               f"{', '.join(list(norms)[:3])}, ...")
            for name in hits:
                norms[name].eps = float(eps)
        yield
    finally:
        for name, eps in saved.items():
            norms[name].eps = eps


def _requests(spec: DiffSpec, vocab: int):
    from hal.rollout import Request

    rng = random.Random(spec.seed)
    return [Request(tuple(rng.randrange(vocab) for _ in range(rng.randint(*spec.prompt_len))),
                    spec.max_new_tokens, seed=spec.seed * 1000 + i, temperature=spec.temperature)
            for i in range(spec.num_requests)]


def _restrict(trace: OpTrace, position: int | None) -> OpTrace:
    if position is not None:
        trace.entries = {k: v for k, v in trace.entries.items() if k[1] == position}
    return trace


@dataclass
class DiffReport:
    spec: DiffSpec
    side_a: str
    side_b: str
    comparison: TraceComparison
    logprobs: LogprobComparison          # the traced request's response logprobs, A vs B
    prompt_len: int
    sequence_len: int

    @property
    def diverged(self) -> bool:
        return self.comparison.divergence is not None or self.comparison.token_divergence is not None

    def to_dict(self) -> dict:
        d = self.comparison.divergence
        return {
            "side_a": self.side_a, "side_b": self.side_b, "command": self.spec.command(),
            "compared_pairs": self.comparison.compared, "positions": self.comparison.positions,
            "token_divergence": self.comparison.token_divergence, "logprobs": self.logprobs.as_dict(),
            "divergence": None if d is None else {
                "op": d.op, "layer": d.layer, "position": d.position, "differing": d.differing, "total": d.total,
                "max_abs_diff": d.max_abs_diff,
                "a": {"call": d.a.call, "call_shape": list(d.a.call_shape), "row": d.a.row},
                "b": {"call": d.b.call, "call_shape": list(d.b.call_shape), "row": d.b.row},
            },
            "spec": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self.spec).items()},
        }

    def format(self) -> str:
        c = self.comparison
        lines = [f"A: {self.side_a}", f"B: {self.side_b}",
                 f"request {self.spec.request}: prompt {self.prompt_len} tokens, sequence {self.sequence_len}; "
                 f"compared {c.compared} (op, position) pairs at {len(c.positions)} positions",
                 f"response logprobs A vs B: {self.logprobs}"]
        if c.token_divergence is not None:
            lines.append(f"the token streams differ from position {c.token_divergence} on (sampled tokens diverged); "
                         f"only earlier positions were compared")
        d = c.divergence
        if d is None:
            lines.append("no divergence: every captured op output is bitwise equal on both sides"
                         if c.token_divergence is None else "no op output differs before the token streams diverge")
        else:
            where = f"layer {d.layer}" if d.layer is not None else "outside the decoder layers"
            response = d.position - self.prompt_len + 1
            token = (f"response token {response} (its logits row)" if d.op in ("model.norm", "lm_head", "logprob")
                     else f"prompt token {d.position}" if d.position < self.prompt_len
                     else f"generated token {d.position - self.prompt_len}")
            lines += [
                f"FIRST DIVERGENCE: op {d.op} ({where}) at position {d.position} ({token})",
                f"  {d.differing}/{d.total} values differ, max |diff| {d.max_abs_diff:.3g}",
                f"  A: {d.a.call}; op output {tuple(d.a.call_shape)} {d.a.value.dtype}, this token in row {d.a.row}",
                f"  B: {d.b.call}; op output {tuple(d.b.call_shape)} {d.b.value.dtype}, this token in row {d.b.row}",
                "  every earlier op (earlier in the forward at any position, or this op at an earlier position) "
                "is bitwise equal on both sides, so this op computes different bits from equal traced inputs "
                "(its kernel under this batch/phase, or its parameters: weights, eps, backend)",
            ]
            if d.op.endswith(".attn") and self.spec.position is not None:
                lines.append("  note: attention reads the K/V of earlier positions; rerun without --position "
                             "to check them too")
        lines.append(f"repro: {self.spec.command()}")
        return "\n".join(lines)


def run_diff(spec: DiffSpec, model=None) -> DiffReport:
    """Run both sides of ``spec`` and compare them. ``model`` (optional) replaces the one the spec
    describes (a random tiny model of ``arch``/``dtype``/``seed`` or the checkpoint at ``model``)."""
    from hal import api
    from hal.model import DecoderLM, load_pretrained, tiny_config
    from hal.rollout import HarnessConfig, RolloutHarness

    backend_a = api.create_backend(spec.backend)
    backend_b = api.create_backend(spec.backend_b or spec.backend)
    if backend_a.device.type != backend_b.device.type:
        raise HalError(f"hal diff: the two backends run on different devices ({backend_a.device}, "
                       f"{backend_b.device}); the model lives on one")
    if model is None:
        model = (load_pretrained(spec.model, dtype=spec.dtype, device=backend_a.device) if spec.model else
                 DecoderLM.random(tiny_config(spec.arch, spec.dtype), spec.seed, device=backend_a.device))
    requests = _requests(spec, model.config.vocab_size)
    page_b = spec.page_size_b or spec.page_size
    harness_a = HarnessConfig(page_size=spec.page_size, max_num_seqs=spec.num_requests, max_batch_tokens=16,
                              max_chunk=5, preempt_prob=0.1, seed=spec.schedule_seed)
    trace_a, trace_b = OpTrace("A"), OpTrace("B")
    eps_note = f", eps {spec.eps_b}" if spec.eps_b else ""

    r = spec.request
    temperature = requests[r].logprob_temperature
    with model.using(backend_a):
        completions = RolloutHarness(model, harness_a).generate(
            requests, trace=trace_a if spec.scenario != "train-vs-train" else None, trace_request=r)
        sequences = [c.sequence for c in completions]
        starts = [len(c.request.prompt) for c in completions]
        if spec.scenario == "train-vs-train":
            label_a = f"training forward of request {r} alone on {backend_a.name} (page size {spec.page_size})"
            with torch.no_grad():
                model.sequence_logprobs([sequences[r]], [starts[r]], temperature=temperature,
                                        page_size=spec.page_size, trace=trace_a)
        else:
            label_a = (f"rollout harness on {backend_a.name} (schedule seed {spec.schedule_seed}, page size "
                       f"{spec.page_size}, chunked prefill, preemption)")
    with model.using(backend_b), planted_eps(model, spec.eps_b):
        if spec.scenario == "rollout-vs-rollout":
            harness_b = HarnessConfig(page_size=page_b, max_num_seqs=spec.num_requests, max_batch_tokens=16,
                                      max_chunk=5, preempt_prob=0.1, seed=spec.schedule_seed + 1)
            RolloutHarness(model, harness_b).generate(requests, trace=trace_b, trace_request=r)
            label_b = (f"rollout harness on {backend_b.name} (schedule seed {spec.schedule_seed + 1}, "
                       f"page size {page_b}{eps_note})")
        else:
            order = list(range(len(sequences)))
            random.Random(spec.schedule_seed).shuffle(order)
            with torch.no_grad():
                model.sequence_logprobs([sequences[i] for i in order], [starts[i] for i in order],
                                        temperature=temperature, page_size=page_b, trace=trace_b,
                                        trace_sequence=order.index(r))
            label_b = (f"training forward of all {len(order)} requests packed on {backend_b.name} "
                       f"(page size {page_b}{eps_note})")
    comparison = first_divergence(_restrict(trace_a, spec.position), _restrict(trace_b, spec.position))
    if comparison.compared == 0:
        length = len(sequences[r])
        why = (f"--position {spec.position} is outside it; choose one in that range or leave it out"
               if spec.position is not None and not 0 <= spec.position < length else
               "no op output was captured on both sides (this is a bug: please report it with the repro "
               f"command {spec.command()})")
        raise NothingComparedError(
            f"hal diff compared nothing: 0 (op, position) pairs for request {r} (a sequence of {length} tokens, "
            f"positions 0..{length - 1}): {why}")
    common = sorted(set(trace_a.positions("logprob")) & set(trace_b.positions("logprob")))
    if comparison.token_divergence is not None:
        common = [p for p in common if p < comparison.token_divergence]
    lp_a = torch.stack([trace_a.entries[("logprob", p)].value for p in common]) if common else torch.zeros(0)
    lp_b = torch.stack([trace_b.entries[("logprob", p)].value for p in common]) if common else torch.zeros(0)
    return DiffReport(spec, label_a, label_b, comparison, compare_logprobs(lp_b, lp_a),
                      len(requests[spec.request].prompt), len(sequences[spec.request]))


# ---------------------------------------------------------------------------------------------
# Command line.
# ---------------------------------------------------------------------------------------------

def _eps_arg(text: str) -> tuple[str, float]:
    name, sep, value = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return name, float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME=EPS (e.g. model.layers.1.post_attention_layernorm=1e-3), "
                                         f"got {text!r}") from None


def _range_arg(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    try:
        return int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO-HI (e.g. 4-12), got {text!r}") from None


def add_subcommand(sub) -> argparse.ArgumentParser:
    """Register ``hal diff`` on the ``hal`` command's subparsers."""
    from hal.model.config import ARCHITECTURES

    p = sub.add_parser("diff", help="find the first op whose bits differ between two runs that should agree",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", choices=SCENARIOS, default="train-vs-rollout")
    p.add_argument("--arch", choices=ARCHITECTURES, default="llama", help="random tiny model family")
    p.add_argument("--model", help="local Hugging Face checkpoint directory (instead of a random tiny model)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--seed", type=int, default=0, help="model weights and prompts")
    p.add_argument("--schedule-seed", type=int, default=0, help="rollout schedule and training packing")
    p.add_argument("--num-requests", type=int, default=4)
    p.add_argument("--prompt-len", type=_range_arg, default=(4, 12), metavar="LO-HI")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--page-size", type=int, default=4)
    p.add_argument("--page-size-b", type=int, default=None)
    p.add_argument("--request", type=int, default=0, help="the request whose ops are traced")
    p.add_argument("--position", type=int, default=None, help="trace only this token position")
    p.add_argument("--backend", default=None, help="side A (default: the selected backend)")
    p.add_argument("--backend-b", default=None, help="side B (default: the same as side A)")
    p.add_argument("--eps-b", type=_eps_arg, action="append", default=[], metavar="NAME=EPS",
                   help="plant another RMSNorm eps on side B (NAME: module name or fnmatch pattern)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_cli)
    return p


def _cli(args: argparse.Namespace) -> int:
    spec = DiffSpec(scenario=args.scenario, arch=args.arch, dtype=args.dtype, seed=args.seed, model=args.model,
                    schedule_seed=args.schedule_seed, num_requests=args.num_requests, prompt_len=args.prompt_len,
                    max_new_tokens=args.max_new_tokens, temperature=args.temperature, page_size=args.page_size,
                    page_size_b=args.page_size_b, request=args.request, position=args.position,
                    backend=args.backend, backend_b=args.backend_b, eps_b=dict(args.eps_b))
    report = run_diff(spec)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format())
    return 1 if report.diverged else 0
