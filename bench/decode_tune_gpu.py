"""Decode attention's launch search on the GPU (issue #20): ``hal.kernels.tuning.tune_decode`` over a decode
shape family, each cell's candidates bit-checked against the rule's launch and timed, against SDPA.

Cells: (query heads / KV heads / head dim) from ``--heads`` x sequences ``--batch`` x keys ``--context``
(B x keys <= ``--max-keys``) x ``--page`` x cache format ``--kv-cache``, in a seeded random order so that a
run cut by ``--budget-s`` leaves a uniform sample. Per cell: the rule's launch (``attention._decode_launch``)
and the fastest candidate (``attention.decode_candidates``), device time under CUDA-graph replay
(``tuning._device_ms``), every candidate bitwise equal to the rule's output (tuning stops with an error
otherwise), and the stock kernels issue #20 compares with (bf16 cells only): SDPA (its default dispatch,
contiguous K/V) and, where vLLM imports (the GPU bundle on PYTHONPATH), vLLM's FlashAttention-3 on the
cell's own paged cache; the ratio is against the faster. A cache smaller than twice the L2 is timed over
copies read in turn (``tune_decode``), ours and the stock kernels' alike, as bench/family_sweep.py does:
runs before that was added timed small cells from the L2.

Prints a line per cell and a summary (tuned / rule speed-up; the faster stock kernel / ours with the rule's
and the tuned launch, at B >= 4; KV TB/s at B = 1), writes the JSON report and the tuning cache (which
``HAL_TUNE_CACHE`` makes the cuda backend read).

    python3 bench/decode_tune_gpu.py --json decode_tune.json --cache decode_tune_cache.json   # PYTHONPATH=/tmp/site
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import sys
import time

import torch

from family_sweep import flash_attention_3     # vLLM's FA3 where the GPU bundle imports, else None
from hal.api import create_backend
from hal.cli import _sdpa_decode
from hal.kernels import tuning


def log(msg: str) -> None:
    print(msg, flush=True)


def cells(args) -> list[tuple]:
    heads = [tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")]
    out = [(b, ctx, hq, hkv, d, page, kv)
           for hq, hkv, d in heads for b in map(int, args.batch.split(",")) for ctx in map(int, args.context.split(","))
           for page in map(int, args.page.split(",")) for kv in args.kv_cache.split(",") if b * ctx <= args.max_keys]
    random.Random(args.seed).shuffle(out)
    return out


def summary(rows) -> dict:
    done = [r for r in rows if "best_ms" in r]
    speedup = [r["default_ms"] / r["best_ms"] for r in done]
    out = dict(cells=len(done), tuned_over_rule_min=min(speedup, default=None),
               tuned_over_rule_median=statistics.median(speedup) if speedup else None,
               tuned_over_rule_max=max(speedup, default=None),
               cells_tuned_faster_by_5pct=sum(s >= 1.05 for s in speedup))
    vs = [r for r in done if r.get("baseline_ms") and r["batch"] >= 4]
    for name, field in (("rule", "default_ms"), ("tuned", "best_ms")):
        ratios = sorted(r["baseline_ms"] / r[field] for r in vs)
        if ratios:
            out[f"stock_over_{name}_B4plus"] = dict(min=ratios[0], p10=ratios[len(ratios) // 10],
                                                   median=statistics.median(ratios), cells=len(ratios),
                                                   at_least_090=sum(x >= 0.90 for x in ratios))
    long_b1 = [r for r in done if r["batch"] == 1 and r["ctx"] >= 4096 and "TBps_tuned" in r]
    if long_b1:
        out["B1_4k_plus_TBps"] = dict(rule=sorted(round(r["TBps_rule"], 2) for r in long_b1),
                                      tuned=sorted(round(r["TBps_tuned"], 2) for r in long_b1))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", default="32/8/128,64/8/128,16/8/64,8/8/128",
                        help="query heads / KV heads / head dim, comma-separated")
    parser.add_argument("--batch", default="1,4,16,64,256")
    parser.add_argument("--context", default="512,2048,8192,32768")
    parser.add_argument("--page", default="16")
    parser.add_argument("--kv-cache", default="bf16", help="bf16 and/or the FP8 contract's e4m3")
    parser.add_argument("--max-keys", type=int, default=2 ** 19, help="largest B x context")
    parser.add_argument("--budget-s", type=float, default=420)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--contract", default=None,
                        help="the contract (default: bf16-fp8-v1 with an e4m3 cache, else bf16-dense-v1); "
                             "bf16-fp8-v2 tunes its f16-operand FP8 read")
    parser.add_argument("--json", required=True)
    parser.add_argument("--cache", required=True, help="the tuning cache to write")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        log("decode_tune_gpu: needs a CUDA GPU")
        return 2
    import triton

    contract = args.contract or ("bf16-fp8-v1" if "e4m3" in args.kv_cache else "bf16-dense-v1")
    backend = create_backend("cuda", contract)
    device = torch.cuda.get_device_name()
    cache = tuning.TuneCache(device, triton.__version__)
    todo, rows, t0 = cells(args), [], time.time()
    log(f"{len(todo)} decode cells on {device}, contract {contract}, budget {args.budget_s:.0f} s")

    def progress(line: str) -> None:
        r = rows[-1] if rows and "skipped" not in line else {}
        extra = ""
        if r.get("best_ms"):
            kv_bytes = 2 * r["batch"] * r["ctx"] * r["hkv"] * r["d"] * (2 if r["kv"] == "bf16" else 1)
            r["TBps_rule"], r["TBps_tuned"] = kv_bytes / r["default_ms"] / 1e9, kv_bytes / r["best_ms"] / 1e9
            extra = f" | {r['TBps_tuned']:.2f} TB/s"
            if r.get("baseline_ms"):
                extra += f" | stock/ours {r['baseline_ms'] / r['default_ms']:.2f} -> {r['baseline_ms'] / r['best_ms']:.2f}"
        log(f"[{time.time() - t0:5.0f}s]{line}{extra}")
        cache.save(args.cache)

    def write() -> dict:
        s = summary(rows)
        with open(args.json, "w") as f:
            json.dump(dict(device=device, triton=triton.__version__, contract=contract, cells_planned=len(todo),
                           seconds=time.time() - t0, summary=s, rows=rows), f, indent=1)
        return s

    fa3 = flash_attention_3()

    def stock(q, batch, context, kv_heads, paged):
        """SDPA on contiguous K/V and vLLM's FA3 on this cell's paged cache, each built once."""
        kernels = {"sdpa": _sdpa_decode(q, batch, context, kv_heads)}
        if fa3 is not None:
            kernels["fa3"] = functools.partial(
                fa3, q, paged["k_cache"], paged["v_cache"], cu_seqlens_q=paged["query_start"], max_seqlen_q=1,
                seqused_k=paged["seq_lens"], max_seqlen_k=context, softmax_scale=q.shape[-1] ** -0.5, causal=True,
                block_table=paged["block_table"], fa_version=3)
        return kernels

    for i, cell in enumerate(todo):
        if time.time() - t0 > args.budget_s:
            log(f"budget reached after {i} of {len(todo)} cells")
            break
        tuning.tune_decode([cell], backend.contract.attention, fp8=backend.contract.fp8, cache=cache,
                           progress=progress, baseline=stock if cell[-1] == "bf16" else None, report=rows,
                           max_cache_bytes=torch.cuda.mem_get_info()[0] // 4)
        torch.cuda.empty_cache()
        write()                 # after every cell: a run cut short keeps what it measured
    log(json.dumps(write(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
