"""Plots of ``bench/family_sweep.py``'s JSON: the distribution of stock time / ours per op (issue #20).

Three panels: GEMM ratio against M (every cell a dot, the median per M a line, the 0.9x and 1.0x targets),
decode attention ratio against batch size (page-64 caches, against SDPA or FA3 where the run had it), and
the prefill ratio against sequence length.

    python3 bench/plot_family_sweep.py family_sweep.json -o family_sweep.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json")
    parser.add_argument("-o", "--out", required=True)
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.load(open(args.json))
    rows = [r for r in data["rows"] if "ratio" in r]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    panels = (("gemm", "m", "M (tokens)", 0.9, "cuBLAS / ours"), ("decode", "batch", "batch (sequences)", 0.9,
                                                                     "stock / ours (64-key pages)"),
              ("prefill", "seq", "sequence length", 0.85, "SDPA flash / ours"))
    for ax, (op, key, label, target, ylabel) in zip(axes, panels):
        cells = [r for r in rows if r["op"] == op]
        if not cells:
            ax.set_title(f"{op}: no cells")
            continue
        xs = [r[key] for r in cells]
        ax.scatter(xs, [r["ratio"] for r in cells], s=8, alpha=0.35)
        keys = sorted(set(xs))
        ax.plot(keys, [statistics.median(r["ratio"] for r in cells if r[key] == k) for k in keys], "k-o", ms=4,
                label="median")
        ax.axhline(target, color="r", ls="--", lw=1, label=f"target {target}x")
        if op == "gemm":
            ax.axhline(1.0, color="orange", ls=":", lw=1, label="1.0x (target at M <= 16)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(label)
        ax.set_ylabel(ylabel)
        s = data["summary"][op]
        ax.set_title(f"{op}: {s['cells']} cells, min {s['min']:.2f} / p10 {s['p10']:.2f} / median {s['median']:.2f}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"cuda backend vs stock kernels over the shape family ({data['device']}; > 1: ours faster)")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
