"""Issue #5's speed targets, checked against committed H200 benchmark results (no GPU needed).

Reads the JSON that ``bench/bench_cuda.py`` writes, one file per speed round, and prints, per
target, how many cells meet it and the worst cell; writes the verdicts as JSON and, with
``--plot``, one panel per target (every cell of every round against the target line).

    python bench/targets.py                                    # the committed rounds
    python bench/targets.py --round "mine=bench.json" --plot targets.png --json targets.json

Ratios are stock time / our time from CUDA-graph replays (device time) where the file has them
(``ratio_graph``), else eager (the first benchmark, marked ``eager``). Bandwidth fractions are
K/V bytes per second over the read ceiling measured in the same run (a 1 GiB ``sum``); files
without that ceiling give none. A round may list several files separated by ``+``: rows of a later
file replace those of an earlier one with the same op and shape (the first speed round re-measured
its decode rows in a fifth call).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass
from typing import Callable

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
ROUNDS = {
    "before #5": "h200-2026-11-29/bench_cuda.json",
    "round 1": "h200-2026-11-29-speed/bench_cuda.json+h200-2026-11-29-speed/call5/bench_cuda.json",
    "round 2": "h200-2026-11-29-session3/bench_cuda.json",
    "round 3": "h200-2026-11-29-session4/bench_cuda.json",
    "round 4": "h200-2026-11-29-session5/bench_cuda.json",
    "round 5": "h200-2026-11-29-session6/bench_cuda.json",
}
ROUND_NOTES = {
    "round 1": "its decode rows that call 5 did not re-measure (B = 256; contexts 128 and 1024) timed SDPA's "
               "flash backend, slow for one query at large batch: their ratios flatter the cuda backend",
}
LLAMA_NK = {(4096, 4096), (14336, 4096), (4096, 14336)}


def shape_numbers(shape: str) -> dict:
    """'M=64 N=4096 K=4096' -> {'M': 64, 'N': 4096, 'K': 4096}."""
    return {key: int(value) for key, value in re.findall(r"(\w+)=(\d+)", shape)}


def ratio(row: dict) -> float | None:
    return row.get("ratio_graph", row.get("ratio"))


def read_fraction(row: dict, ceilings: dict) -> float | None:
    if "kv_GBps" not in row or "read_GBps" not in ceilings:
        return None
    return row["kv_GBps"] / ceilings["read_GBps"]


@dataclass(frozen=True)
class Target:
    name: str
    op: str
    threshold: float
    metric: str  # "ratio", "read fraction", or "ratio or read fraction" (either may meet it)
    selects: Callable[[dict], bool] = lambda numbers: True
    bandwidth_alternative: float | None = None  # for "ratio or read fraction"

    def value(self, row: dict, ceilings: dict) -> float | None:
        if self.metric == "read fraction":
            return read_fraction(row, ceilings)
        return ratio(row)

    def met(self, row: dict, ceilings: dict) -> bool | None:
        value = self.value(row, ceilings)
        if value is None:
            return None
        if value >= self.threshold:
            return True
        if self.bandwidth_alternative is not None:
            fraction = row.get("hbm_frac")
            return fraction is not None and fraction >= self.bandwidth_alternative
        return False


TARGETS = [
    Target("GEMM >= 0.90x cuBLAS (Llama shapes)", "gemm", 0.90, "ratio",
           lambda s: (s["N"], s["K"]) in LLAMA_NK),
    Target("GEMM >= 0.85x cuBLAS (lm_head)", "gemm", 0.85, "ratio", lambda s: s["N"] == 152064),
    Target("prefill >= 0.85x SDPA (flash)", "prefill", 0.85, "ratio"),
    Target("decode >= 70% of the HBM read ceiling (ctx >= 4096)", "decode", 0.70, "read fraction",
           lambda s: s["ctx"] >= 4096),
    Target("decode >= SDPA on contiguous KV (batch >= 8)", "decode", 1.00, "ratio", lambda s: s["B"] >= 8),
    # The same decode on 64-token pages (bench_cuda.py's decode_page64 rows, from the fourth round).
    Target("decode, 64-token pages: >= 70% of the read ceiling (ctx >= 4096)", "decode_page64", 0.70,
           "read fraction", lambda s: s["ctx"] >= 4096),
    Target("decode, 64-token pages: >= SDPA (batch >= 8)", "decode_page64", 1.00, "ratio", lambda s: s["B"] >= 8),
    Target("RMSNorm + residual >= 0.90x torch or >= 80% of HBM", "rms_norm+res", 0.90, "ratio",
           bandwidth_alternative=0.80),
    Target("SiLU*up >= 0.90x torch or >= 80% of HBM", "silu_mul", 0.90, "ratio", bandwidth_alternative=0.80),
    Target("token logprobs >= 0.90x torch or >= 80% of HBM", "token_logprobs", 0.90, "ratio",
           bandwidth_alternative=0.80),
]


def load_round(spec: str) -> tuple[list[dict], dict]:
    """Rows and ceilings of one round: files joined by '+', later rows replacing earlier ones."""
    rows: dict[tuple[str, str], dict] = {}
    ceilings: dict = {}
    for path in spec.split("+"):
        path = path if os.path.isabs(path) or os.path.exists(path) else os.path.join(RESULTS, path)
        if not os.path.exists(path):
            raise SystemExit(f"no such benchmark file: {path}")
        with open(path) as f:
            data = json.load(f)
        for row in data["rows"]:
            rows[(row["op"], row["shape"])] = row
        if not ceilings:  # the first file that measured them
            ceilings = data.get("ceilings", {})
    return list(rows.values()), ceilings


def verdicts(rows: list[dict], ceilings: dict) -> list[dict]:
    """Per target: the cells it covers with their value and verdict."""
    out = []
    for target in TARGETS:
        cells = []
        for row in rows:
            if row["op"] != target.op or not target.selects(shape_numbers(row["shape"])):
                continue
            cells.append(dict(shape=row["shape"], value=target.value(row, ceilings), met=target.met(row, ceilings),
                              eager="ratio_graph" not in row))
        out.append(dict(target=target.name, threshold=target.threshold, metric=target.metric, cells=cells))
    return out


def summary(cells: list[dict]) -> str:
    judged = [c for c in cells if c["met"] is not None]
    if not judged:
        return "-"
    met = sum(c["met"] for c in judged)
    worst = min(judged, key=lambda c: c["value"])
    eager = " eager" if any(c["eager"] for c in judged) else ""
    return f"{met}/{len(judged)} (worst {worst['value']:.3f}{eager})"  # 3 places: 0.898 is not 0.90


def _shape_order(shape: str) -> tuple:
    """GEMM by (N, K, M); the others by their numbers in the order written (L; B, ctx; M)."""
    numbers = shape_numbers(shape)
    if "N" in numbers and "K" in numbers:
        return numbers["N"], numbers["K"], numbers.get("M", 0)
    return tuple(numbers.values())


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(TARGETS), 1, figsize=(12, 2.6 * len(TARGETS)))
    for index, (ax, target) in enumerate(zip(axes, TARGETS)):
        shapes = sorted({cell["shape"] for per_round in results.values() for cell in per_round[index]["cells"]},
                        key=_shape_order)
        for offset, (label, per_round) in enumerate(results.items()):
            xs, ys = [], []
            for cell in per_round[index]["cells"]:
                if cell["value"] is not None:  # rounds side by side within a shape's column
                    xs.append(shapes.index(cell["shape"]) + 0.12 * (offset - (len(results) - 1) / 2))
                    ys.append(cell["value"])
            if xs:
                ax.plot(xs, ys, "o", color=f"C{offset}", label=label, alpha=0.8)  # a round keeps its colour
        ax.axhline(target.threshold, color="k", linestyle="--", linewidth=1)
        ax.set_title(target.name, fontsize=10)
        ax.set_ylabel("read fraction" if target.metric == "read fraction" else "stock / ours")
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels([s.replace(" Hq=32 Hkv=8 D=128", "") for s in shapes], rotation=60, ha="right",
                           fontsize=7)
        ax.grid(axis="y", alpha=0.3)
        if index == 0:
            ax.legend(fontsize=8, ncol=len(results))
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--round", action="append", metavar="LABEL=FILE[+FILE]",
                        help="a round's benchmark JSON (repeatable; default: the committed rounds)")
    parser.add_argument("--json", help="write the verdicts here")
    parser.add_argument("--plot", help="write a PNG with one panel per target")
    args = parser.parse_args(argv)
    rounds = dict(spec.split("=", 1) for spec in args.round) if args.round else ROUNDS
    results = {label: verdicts(*load_round(spec)) for label, spec in rounds.items()}
    labels = list(results)
    print("| target | " + " | ".join(labels) + " |")
    print("|---" * (len(labels) + 1) + "|")
    for index, target in enumerate(TARGETS):
        print(f"| {target.name} | " + " | ".join(summary(results[label][index]["cells"]) for label in labels) + " |")
    print("cells met / cells measured; worst: the lowest value (ratio, or fraction of the read ceiling).")
    for label in labels:
        if label in ROUND_NOTES and not args.round:
            print(f"{label}: {ROUND_NOTES[label]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.plot:
        plot(results, args.plot)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
