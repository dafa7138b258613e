"""Per-step metrics (JSONL), the live progress line, and the contract-vs-baseline comparison report.

``metrics.jsonl`` has one JSON object per step (keys in docs/rl.md); a resumed run first drops the
lines of steps after its checkpoint, so the file always reads as one run with steps 1..N.
The comparison report (``report.md`` + ``k3_kl.png``, ``max_abs_dlogp.png``, ``reward.png``) puts
the contract backend next to the stock ``torch`` baseline; the diff plots use a symmetric-log y
axis so that exact zeros sit on the axis and 1e-8-sized differences are still visible.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Sequence

from hal.errors import HalError

log = logging.getLogger("hal.rl")

# The linear range of a symmetric-log axis when a plot has no non-zero value at all.
SYMLOG_LINTHRESH = 1e-12


class MetricsLog:
    """Append-only JSONL file of per-step metrics (flushed and fsynced every line: a crash loses
    nothing written, except at worst the line being written, which a resume drops)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def append(self, metrics: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(metrics, sort_keys=False) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def truncate_after(self, step: int) -> None:
        """Keep only the lines of steps <= ``step`` (what a checkpoint of ``step`` has seen); a partial
        last line (a kill mid-write) is dropped with a warning. Atomic: temp file, then rename."""
        kept = [m for m in read_metrics(self.path, drop_partial_last=True) if m["step"] <= step] \
            if self.path.exists() else []
        tmp = self.path.with_name(self.path.name + ".tmp")
        with tmp.open("w") as f:
            f.write("".join(json.dumps(m) + "\n" for m in kept))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


def read_metrics(path: str | Path, *, drop_partial_last: bool = False) -> list[dict]:
    """The per-step objects of a metrics.jsonl. A line that is not JSON raises ``HalError``, except,
    with ``drop_partial_last``, an unterminated last line: the line a killed run was writing, which
    is dropped with a warning on the ``hal.rl`` logger."""
    path = Path(path)
    lines = path.read_bytes().split(b"\n")       # a complete file ends with a newline: lines[-1] == b""
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line.decode("utf-8")))
            continue
        except ValueError:                          # also UnicodeDecodeError: a cut inside a character
            pass
        if drop_partial_last and number == len(lines):
            log.warning("%s: dropping its last line (%d bytes, no newline, not valid JSON): the line a killed "
                        "run was writing; that step is re-run from the checkpoint", path, len(line))
            continue
        raise HalError(f"{path}: line {number} is not valid JSON ({line[:60]!r}); the metrics file is damaged: "
                       f"fix or remove that line, or start a new run (overwrite=true)")
    return out


def _g(x: float) -> str:
    return "0" if x == 0 else f"{x:.2e}"


def progress_line(m: dict, steps: int) -> str:
    """One line per step: what an operator watches."""
    diff = "diff = 0" if m["mismatches"] == 0 else f"{m['mismatches']}/{m['num_tokens']} differ"
    return (f"[{m['backend']}] step {m['step']:>3}/{steps}  reward {m['reward']:.3f}  {diff:<14} "
            f"max|dlogp| {_g(m['max_abs_diff']):<8} k3-KL {_g(m['k3_kl']):<8} entropy {m['entropy']:.3f}  "
            f"rollout {m['rollout_tokens_per_s']:.0f} tok/s  train {m['train_tokens_per_s']:.0f} tok/s"
            + (f"  sync {m['sync_s']:.2f} s" if "sync_s" in m else "")
            + ("  (resumed)" if m.get("resumed") else ""))


def summarize(metrics: Sequence[dict]) -> dict:
    """Numbers for the summary table of one run."""
    if not metrics:
        return {"steps": 0}
    k = min(5, len(metrics))
    return {
        "steps": len(metrics),
        "steps_with_diff_0": sum(m["mismatches"] == 0 for m in metrics),
        "mismatching_tokens": sum(m["mismatches"] for m in metrics),
        "tokens_compared": sum(m["num_tokens"] for m in metrics),
        "max_abs_dlogp": max(m["max_abs_diff"] for m in metrics),
        "max_k3_kl": max(m["k3_kl"] for m in metrics),
        "mean_k3_kl": sum(m["k3_kl"] for m in metrics) / len(metrics),
        "reward_first": sum(m["reward"] for m in metrics[:k]) / k,
        "reward_last": sum(m["reward"] for m in metrics[-k:]) / k,
        "entropy_first": metrics[0]["entropy"],
        "entropy_last": metrics[-1]["entropy"],
        "rollout_tokens_per_s": sum(m["rollout_tokens"] for m in metrics) / max(sum(m["rollout_s"] for m in metrics), 1e-9),
        "train_tokens_per_s": sum(m["train_tokens"] for m in metrics) / max(sum(m["train_s"] for m in metrics), 1e-9),
    }


def _plot(runs: dict[str, list[dict]], key: str, ylabel: str, path: Path, symlog: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    for label, metrics in runs.items():
        ax.plot([m["step"] for m in metrics], [m[key] for m in metrics], marker="o", markersize=3, label=label)
    if symlog:   # linear only below the smallest non-zero value: zeros on the axis, every difference visible
        nonzero = [abs(m[key]) for ms in runs.values() for m in ms if m[key] != 0]
        linthresh = min(nonzero) / 10 if nonzero else SYMLOG_LINTHRESH
        ax.set_yscale("symlog", linthresh=linthresh)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_comparison(out_dir: str | Path, runs: dict[str, list[dict]], *, title: str, wall_s: dict[str, float]) -> Path:
    """Write ``report.md`` and the three PNG plots into ``out_dir``; returns the report's path."""
    out = Path(out_dir)
    _plot(runs, "k3_kl", "k3-KL (train vs rollout), symlog", out / "k3_kl.png", True)
    _plot(runs, "max_abs_diff", "max |dlogp| per step, symlog", out / "max_abs_dlogp.png", True)
    _plot(runs, "reward", "mean reward", out / "reward.png", False)
    sums = {label: summarize(m) for label, m in runs.items()}
    rows = [("steps with diff = 0", lambda s: f"{s['steps_with_diff_0']}/{s['steps']}"),
            ("mismatching tokens (all steps)", lambda s: f"{s['mismatching_tokens']}/{s['tokens_compared']}"),
            ("max per-token abs(dlogp)", lambda s: _g(s["max_abs_dlogp"])),
            ("max k3-KL of a step", lambda s: _g(s["max_k3_kl"])),
            ("mean k3-KL", lambda s: _g(s["mean_k3_kl"])),
            ("reward, first 5 steps -> last 5", lambda s: f"{s['reward_first']:.3f} -> {s['reward_last']:.3f}"),
            ("entropy, first step -> last", lambda s: f"{s['entropy_first']:.3f} -> {s['entropy_last']:.3f}"),
            ("rollout tokens/s", lambda s: f"{s['rollout_tokens_per_s']:.0f}"),
            ("training tokens/s", lambda s: f"{s['train_tokens_per_s']:.0f}")]
    labels = list(runs)
    lines = [f"# {title}", "",
             "Train/rollout log-probability consistency per GRPO step, measured before each update on the "
             "same weights and tokens (response tokens only).", "",
             "| | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    lines += [f"| {name} | " + " | ".join(fmt(sums[label]) for label in labels) + " |" for name, fmt in rows]
    lines += ["| wall time | " + " | ".join(f"{wall_s.get(label, 0):.1f} s" for label in labels) + " |", "",
              "![k3-KL per step](k3_kl.png)", "", "![max abs dlogp per step](max_abs_dlogp.png)", "",
              "![reward per step](reward.png)", "",
              "## Per step", "",
              "| step | " + " | ".join(f"{label} mismatches | {label} max abs(dlogp) | {label} k3-KL | {label} reward"
                                      for label in labels) + " |",
              "|---|" + "---|---|---|---|" * len(labels)]
    by_step: dict[int, dict[str, dict]] = {}
    for label, metrics in runs.items():
        for m in metrics:
            by_step.setdefault(m["step"], {})[label] = m
    for step in sorted(by_step):
        cells = []
        for label in labels:
            m = by_step[step].get(label)
            cells.append(" | | | " if m is None else
                         f"{m['mismatches']}/{m['num_tokens']} | {_g(m['max_abs_diff'])} | {_g(m['k3_kl'])} | {m['reward']:.3f}")
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    (out / "summary.json").write_text(json.dumps(sums, indent=2) + "\n")
    return path


def side_by_side(runs: dict[str, list[dict]]) -> str:
    """Per step, every run's diff next to the others' (the console view of compare mode)."""
    by_step: dict[int, dict[str, dict]] = {}
    for label, metrics in runs.items():
        for m in metrics:
            by_step.setdefault(m["step"], {})[label] = m

    def cell(m: dict | None) -> str:
        if m is None:
            return "-"
        if m["mismatches"] == 0:
            return "diff = 0"
        return f"{m['mismatches']}/{m['num_tokens']} differ, max|dlogp| {_g(m['max_abs_diff'])}, k3-KL {_g(m['k3_kl'])}"

    return "\n".join(f"step {step:>3}: " + " | ".join(f"{label} {cell(by_step[step].get(label))}" for label in runs)
                     for step in sorted(by_step))


def summary_table(runs: dict[str, list[dict]]) -> str:
    """The console version of the summary (printed at the end of a comparison)."""
    sums = {label: summarize(m) for label, m in runs.items()}
    keys = ["steps_with_diff_0", "mismatching_tokens", "max_abs_dlogp", "max_k3_kl", "reward_first", "reward_last"]
    width = max(len(k) for k in keys) + 2
    out = [" " * width + "".join(f"{label:>16}" for label in runs)]
    for k in keys:
        cells = []
        for label in runs:
            v = sums[label].get(k, 0)
            cells.append(f"{v:>16}" if isinstance(v, int) else f"{v:>16.3g}")
        out.append(f"{k:<{width}}" + "".join(cells))
    return "\n".join(out)
