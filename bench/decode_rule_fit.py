"""Scores the decode launch rule (``hal.kernels.attention._decode_launch``) on decode launch-search runs.

``bench/decode_tune_gpu.py`` times every candidate launch of every cell (``timings`` in its JSON, each one
bit-checked against the rule's). The rule picks one of those candidates from what a call knows on the host
(one-split programs, multiprocessors, splits, head dim, the cache's format), so its time on each measured
cell can be read off without a GPU. Prints, per cell, the rule's pick, its time over the fastest candidate's
and the run's own rule time over the fastest (the rule the run was made with), then the distribution:

    python3 bench/decode_rule_fit.py bench/results/<run>/decode_tune.json [...]
    python3 bench/decode_rule_fit.py --family <new-rule>/family_sweep.json <previous-rule>/family_sweep.json [--plot P]

A rule's pick that is not among a cell's timed candidates is an error (the rule must choose from the
candidate set, which is what makes it bit-safe by the tuner's checks).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from hal.kernels import attention

SMS = {"H100": 132, "H200": 132}     # multiprocessors of the GPUs the runs were made on


def sms_of(device: str) -> int:
    for name, sms in SMS.items():
        if name in device:
            return sms
    raise SystemExit(f"decode_rule_fit: unknown GPU {device!r}; add its multiprocessor count to SMS")


def score(run: dict) -> list[dict]:
    sms = sms_of(run["device"])
    out = []
    for r in run["rows"]:
        if "timings" not in r:
            continue
        table_keys = -(-r["ctx"] // r["page"]) * r["page"]
        splits = -(-table_keys // 512)
        programs = r["batch"] * r["hkv"] * splits
        pick = attention._decode_launch(programs, sms, r["kv"] != "bf16", max_splits=splits, head_dim=r["d"],
                                        page=r["page"])
        times = {attention.decode_launch_key(c, splits): ms for c, ms in r["timings"]}
        pick_ms = times.get(attention.decode_launch_key(pick, splits))
        if pick_ms is None:
            raise SystemExit(f"decode_rule_fit: the rule's pick {pick} for {r['key']} is not a timed candidate")
        best = min(min(times.values()), r["default_ms"])
        out.append(dict(r, programs=programs, pick=pick, pick_ms=pick_ms, fastest_ms=best))
    return out


def _rule_as_run(programs: int, sms: int, kv_fp8: bool, *, max_splits: int, head_dim: int, page: int) -> dict:
    """The bf16 rule that bench/results/h100-2026-12-06-decode-rule/family-new-rule ran (commit 5ff9e28):
    needed to know which launch each of its times belongs to."""
    walkers = programs // max_splits
    walk = dict(split_parallel=False, splits_per_program=1, num_warps=4, head_split=1)
    parallel = dict(walk, split_parallel=True)
    capped = dict(num_stages=3, maxnreg=128)
    if max_splits == 1:
        if head_dim > 64 and programs <= sms:
            return dict(walk, num_warps=8, num_stages=5, maxnreg=0)
        return dict(walk, **(capped if walkers >= 3 * sms else dict(num_stages=5, maxnreg=0)))
    if head_dim <= 64:
        if walkers >= 3 * sms:
            return dict(walk, **capped)
        if programs > 8 * sms:
            return dict(parallel, splits_per_program=4, **capped)
    else:
        if programs > 8 * sms and walkers >= 64:
            return dict(walk, num_stages=5, maxnreg=0)
        if not sms // 2 < programs <= sms:
            return dict(parallel, num_stages=2, maxnreg=128)
        if page < 64:
            return dict(parallel, num_warps=8, num_stages=5, maxnreg=0)
    two = programs > 16 * sms or 3 * sms < programs <= 4 * sms
    return dict(parallel, splits_per_program=2 if two else 1, num_stages=5, maxnreg=0)


def family(new_path: str, previous_path: str, plot: str | None = None) -> int:
    """The current rule's time on every family cell x page, from two bench/family_sweep.py decode runs on one
    GPU: one with the rule as of 5ff9e28 (``_rule_as_run``), one with ``--decode-rule previous``. Each cell's
    pick must be one of the two launches timed there."""
    from family_sweep import previous_decode_launch

    runs = []
    for path in (new_path, previous_path):
        with open(path) as f:
            run = json.load(f)
        runs.append({(r["batch"], r["ctx"], r["hq"], r["hkv"], r["d"]): r for r in run["rows"] if r["op"] == "decode"})
    sms = sms_of(run["device"])
    new, previous = runs
    speedups, stock_ratios, points = [], [], []      # points: (batch, stock / previous, stock / this rule)
    for key, r in new.items():
        batch, ctx, hq, hkv, d = key
        for page in (16, 32, 64, 128):
            splits = -(-(-(-ctx // page) * page) // 512)
            args = (batch * hkv * splits, sms, False)
            kw = dict(max_splits=splits, head_dim=d, page=page)
            pick = attention.decode_launch_key(attention._decode_launch(*args, **kw), splits)
            if pick == attention.decode_launch_key(_rule_as_run(*args, **kw), splits):
                ms = r[f"ours_ms_p{page}"]
            elif pick == attention.decode_launch_key(previous_decode_launch(*args, **kw), splits):
                ms = previous[key][f"ours_ms_p{page}"]
            else:
                raise SystemExit(f"decode_rule_fit: the rule's pick for {key}, page {page} was not timed in either run")
            speedups.append(previous[key][f"ours_ms_p{page}"] / ms)
            if r.get("fa3_ms"):
                stock = min(r["sdpa_ms"], r["fa3_ms"])
                points.append((batch, stock / previous[key][f"ours_ms_p{page}"], stock / ms))
                if batch >= 4 and page == 64:
                    stock_ratios.append(stock / ms)
    speedups.sort()
    stock_ratios.sort()
    print(f"this rule over the previous rule, {len(speedups)} cell x page: min {speedups[0]:.3f}, "
          f"10th pct {speedups[len(speedups) // 10]:.3f}, median {statistics.median(speedups):.3f}, max {speedups[-1]:.3f}")
    if stock_ratios:
        print(f"faster of SDPA / FA3 over this rule, B >= 4, 64-key pages, {len(stock_ratios)} cells: min "
              f"{stock_ratios[0]:.2f}, 10th pct {stock_ratios[len(stock_ratios) // 10]:.2f}, median "
              f"{statistics.median(stock_ratios):.2f}, >= 0.90 in {sum(x >= 0.90 for x in stock_ratios)}")
    if plot:
        _plot(points, plot, run["device"])
    return 0


def _plot(points: list[tuple[int, float, float]], path: str, device: str) -> None:
    """The faster of SDPA / FA3 over ours per batch size, the previous rule beside this one (every page size)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({b for b, _, _ in points})
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for offset, (name, column, color) in enumerate((("previous rule", 1, "tab:gray"), ("this rule", 2, "tab:blue"))):
        xs = [batches.index(p[0]) + (offset - 0.5) * 0.3 for p in points]
        ax.scatter(xs, [p[column] for p in points], s=7, alpha=0.35, color=color, label=name)
        medians = [statistics.median(p[column] for p in points if p[0] == b) for b in batches]
        ax.plot([i + (offset - 0.5) * 0.3 for i in range(len(batches))], medians, color=color, marker="o")
    ax.axhline(0.9, color="tab:red", linestyle="--", linewidth=1, label="issue #20 target at B >= 4 (0.90)")
    ax.set_xticks(range(len(batches)), [str(b) for b in batches])
    ax.set_xlabel("batch (sequences); cells: contexts 512-32k, GQA 1-8, head dims 64/128, pages 16-128")
    ax.set_ylabel("faster of SDPA / FA3 time over ours")
    ax.set_title(f"Decode attention, launch rule before and after the refit ({device})")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="*", help="decode_tune.json files")
    parser.add_argument("--cells", action="store_true", help="print every cell, not only the summary")
    parser.add_argument("--family", nargs=2, metavar=("NEW", "PREVIOUS"),
                        help="score on two family_sweep.json decode runs instead (see ``family``)")
    parser.add_argument("--plot", help="with --family: draw stock / ours per batch size, both rules, to this PNG")
    args = parser.parse_args(argv)
    if args.family:
        return family(*args.family, plot=args.plot)
    rows = []
    for path in args.runs:
        with open(path) as f:
            rows += score(json.load(f))
    if not rows:
        print("decode_rule_fit: no cell has per-candidate timings (runs before they were recorded)")
        return 1
    rows.sort(key=lambda r: (r["d"], r["page"], r["batch"], r["ctx"], r["hq"]))
    if args.cells:
        for r in rows:
            print(f"B{r['batch']:4d} ctx {r['ctx']:6d} {r['hq']:3d}/{r['hkv']} x {r['d']:3d} page {r['page']:3d} "
                  f"programs {r['programs']:5d}: run's rule {r['default_ms'] / r['fastest_ms']:.2f}, "
                  f"this rule {r['pick_ms'] / r['fastest_ms']:.2f} x the fastest  pick {r['pick']}")
    for name, field in (("the run's rule", "default_ms"), ("this rule", "pick_ms")):
        slow = sorted(r[field] / r["fastest_ms"] for r in rows)
        print(f"{name:15}: time over the fastest candidate: median {statistics.median(slow):.3f}, "
              f"90th pct {slow[int(0.9 * (len(slow) - 1))]:.3f}, max {slow[-1]:.3f}; "
              f"within 5% in {sum(s <= 1.05 for s in slow)} of {len(slow)} cells")
    return 0


if __name__ == "__main__":
    sys.exit(main())
