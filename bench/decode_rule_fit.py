"""Scores the decode launch rule (``hal.kernels.attention._decode_launch``) on decode launch-search runs.

``bench/decode_tune_gpu.py`` times every candidate launch of every cell (``timings`` in its JSON, each one
bit-checked against the rule's). The rule picks one of those candidates from what a call knows on the host
(one-split programs, multiprocessors, splits, head dim, the cache's format), so its time on each measured
cell can be read off without a GPU. Prints, per cell, the rule's pick, its time over the fastest candidate's
and the run's own rule time over the fastest (the rule the run was made with), then the distribution:

    python3 bench/decode_rule_fit.py bench/results/<run>/decode_tune.json [...]

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


def _normal(config: dict) -> tuple:
    """A launch as the kernel sees it (defaults filled in), to compare the rule's pick with a candidate."""
    walked = not config.get("split_parallel", True)
    return (walked, 1 if walked else config.get("splits_per_program", 1), config.get("num_warps", 4),
            config.get("num_stages", 5), config.get("maxnreg", 0) or 0, config.get("head_split", 1))


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
        times = {_normal(c): ms for c, ms in r["timings"]}
        if _normal(pick) not in times:
            raise SystemExit(f"decode_rule_fit: the rule's pick {pick} for {r['key']} is not a timed candidate")
        best = min(min(times.values()), r["default_ms"])
        out.append(dict(r, programs=programs, pick=pick, pick_ms=times[_normal(pick)], fastest_ms=best))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="decode_tune.json files")
    parser.add_argument("--cells", action="store_true", help="print every cell, not only the summary")
    args = parser.parse_args(argv)
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
