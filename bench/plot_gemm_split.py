"""Plot a ``bench/gemm_split_gpu.py`` run: per cell, cuBLAS / ours for the direct launch and for the launch the
table's current split rule (``gemm._weight_stream_split``) picks, where that launch was among the run's timed
ones. One panel per M; cells sorted by the direct launch's ratio. No GPU needed.

    python bench/plot_gemm_split.py gemm_split.json -o gemm_split.png
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("MPLBACKEND", "Agg")

import matplotlib.pyplot as plt  # noqa: E402

from gemm_split_gpu import launch_name  # noqa: E402  (the run's names of its launches)
from hal.contract import load_contract  # noqa: E402
from hal.kernels import gemm  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json")
    parser.add_argument("-o", "--out", required=True)
    args = parser.parse_args(argv)
    with open(args.json) as f:
        run = json.load(f)
    spec = load_contract("bf16-dense-v1").gemm
    gemm.INTERPRET = False          # the GPU's table, whatever this machine is
    ms = sorted({r["m"] for r in run["rows"]})
    fig, axes = plt.subplots(1, len(ms), figsize=(4 * len(ms), 4), sharey=True, squeeze=False)
    for ax, m in zip(axes[0], ms):
        rows = sorted((r for r in run["rows"] if r["m"] == m), key=lambda r: r["ratio"]["direct"])
        xs = range(len(rows))
        ax.plot(xs, [r["ratio"]["direct"] for r in rows], "o", color="tab:gray", label="direct launch")
        rule = [gemm._config(m, r["n"], r["k"], spec, True, run["sms"]) for r in rows]
        split = [(i, r["ratio"][launch_name(cfg)]) for i, (r, cfg) in enumerate(zip(rows, rule))
                 if cfg["split"] and launch_name(cfg) in r["ratio"]]
        if split:
            ax.plot(*zip(*split), "^", color="tab:blue", label="the rule's split")
        ax.axhline(0.9, color="red", ls="--", lw=1)
        ax.axhline(1.0, color="orange", ls=":", lw=1)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"{r['n']}x{r['k']}" for r in rows], rotation=90, fontsize=7)
        ax.set_title(f"M = {m}")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("cuBLAS / ours (> 1: ours faster)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"narrow GEMMs (N x K): direct launch vs split-K ({run['device']}, {run['sms']} SMs)")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
