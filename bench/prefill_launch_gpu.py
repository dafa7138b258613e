"""Prefill attention launch shapes on the GPU (issue #20's prefill target, >= 0.85x SDPA flash): the default
launch against bit-neutral alternatives that bench/sm90_report.py screened without a GPU.

Why: compiled for sm_90, the default prefill program (64 query rows on 4 warps, the nested split loop) holds 255
registers (``sm90_report.py``); 128 rows on 8 warps halve the tiles (the GQA group of 8 gets 16 tokens a tile, not
8), a third stage deepens the K/V pipeline at the price of one program a multiprocessor. Which is faster is a
measurement.

For each causal prefill (one sequence of L tokens, 64- or 16-key pages, bf16): every variant's output is compared
bitwise with the default launch's (launch shapes never change the bits; a difference fails the run), then
timed by CUDA-graph replay (``triton.testing.do_bench_cudagraph``), beside SDPA flash on contiguous K/V.

    python3 bench/prefill_launch_gpu.py --json prefill_launch.json     # on the H200 (h200.sh prefill-launch)
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

from bench_cuda import paged_problem, sdpa_problem
from hal.kernels.tuning import do_bench_cudagraph_synced  # noqa: E402  (waits for queued input writes)
from hal.api import create_backend
from hal.backends.cuda.launch import CUDA_LAUNCH
from hal.kernels import attention

# (query rows per program, warps, stages); block_q = rows // the GQA group as laid out (a group that is not a
# power of two packed, as prefill's default packs it: 12 tokens x 5 heads in 64 rows)
VARIANTS = [(64, 4, 2), (64, 8, 2), (32, 4, 2), (128, 8, 2), (64, 4, 3), (128, 8, 3), (32, 4, 3), (16, 4, 2)]
# (L, query heads, KV heads, head dim, page): 16-key pages are vLLM's default (K/V by pointer, not descriptor);
# GQA groups of 4, 8, 7, 2, 5 and 3
CASES = [(512, 32, 8, 128, 64), (2048, 32, 8, 128, 64), (8192, 32, 8, 128, 64), (4096, 64, 8, 128, 64),
         (4096, 32, 8, 64, 64), (4096, 28, 4, 128, 16), (2048, 32, 8, 128, 16), (1024, 16, 8, 128, 16),
         (4096, 40, 8, 128, 16), (2048, 24, 8, 128, 64)]


def _cases(text: str) -> list[tuple[int, ...]]:
    """``--cases``: L:HQ:HKV:D:PAGE items, comma-separated."""
    cases = []
    for item in text.split(","):
        fields = item.split(":")
        if len(fields) != 5 or not all(f.isdigit() and int(f) > 0 for f in fields):
            raise argparse.ArgumentTypeError(f"{item!r} is not L:HQ:HKV:D:PAGE (five positive integers)")
        length, hq, hkv, d, page = map(int, fields)
        if hq % hkv:
            raise argparse.ArgumentTypeError(f"{item!r}: {hq} query heads are not a multiple of {hkv} KV heads")
        cases.append((length, hq, hkv, d, page))
    return cases


def _variants(text: str) -> list[tuple[int, int, int]]:
    """``--variants``: ROWS:WARPS:STAGES items, comma-separated."""
    out = []
    for item in text.split(","):
        fields = item.split(":")
        if len(fields) != 3 or not all(f.isdigit() and int(f) > 0 for f in fields):
            raise argparse.ArgumentTypeError(f"{item!r} is not ROWS:WARPS:STAGES (three positive integers)")
        out.append(tuple(map(int, fields)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--budget-s", type=float, default=1e9, help="start no new case after this many seconds")
    ap.add_argument("--cases", type=_cases, default=CASES,
                    help="comma-separated L:HQ:HKV:D:PAGE (e.g. 512:32:8:128:16,1024:40:8:128:16); default: CASES")
    ap.add_argument("--variants", type=_variants, default=VARIANTS,
                    help="comma-separated ROWS:WARPS:STAGES launch shapes timed beside the default (default: VARIANTS)")
    args = ap.parse_args()
    began = time.time()
    names = ["default"] + [f"{r}r w{w} s{s}" for r, w, s in args.variants]   # default: the rule's own launch

    def write(rows, ok, complete):   # after every case: a run cut short keeps what it finished
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), variants=names, rows=rows, bitwise_ok=ok,
                           complete=complete), f, indent=1)
    backend = create_backend("cuda")
    spec = backend.contract.attention
    rows_out, ok = [], True
    for length, hq, hkv, d, page in args.cases:
        if time.time() - began > args.budget_s:
            print(f"budget of {args.budget_s:.0f} s spent: L={length} {hq}/{hkv} d{d} p{page} and later not run")
            break
        q, kc, vc, meta = paged_problem([length], [length], hq, hkv, d, page)
        laid_out = hq // hkv   # prefill packs every group (a power of two needs no padding)

        def run(rows=None, warps=None, stages=None):
            return attention.paged_attention(q, kc, vc, meta.query_start_loc, meta.seq_lens, meta.block_table,
                                             d ** -0.5, spec, policy=CUDA_LAUNCH,
                                             block_q=None if rows is None else max(1, rows // laid_out),
                                             num_warps=warps, num_stages=stages)
        base = run()
        row = dict(length=length, hq=hq, hkv=hkv, d=d, page=page, us={}, identical={}, errors={})
        for rows, warps, stages in [(None, None, None)] + args.variants:
            name = "default" if rows is None else f"{rows}r w{warps} s{stages}"
            try:
                out = run(rows, warps, stages)
                torch.cuda.synchronize()
                row["identical"][name] = torch.equal(out.view(torch.int16), base.view(torch.int16))
                ok &= row["identical"][name]
                row["us"][name] = do_bench_cudagraph_synced(lambda: run(rows, warps, stages), rep=30,
                                                                    return_mode="median") * 1000
            except Exception as exc:  # noqa: BLE001 - reported, and the run fails
                row["errors"][name] = str(exc).splitlines()[0][:200]
                ok = False
        qs, ks, vs = sdpa_problem(1, length, length, hq, hkv, d)

        def sdpa():
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        try:
            row["us"]["sdpa_flash"] = do_bench_cudagraph_synced(sdpa, rep=30, return_mode="median") * 1000
        except Exception as exc:  # noqa: BLE001 - reported, not fatal: the variants still compare
            row["errors"]["sdpa_flash"] = str(exc).splitlines()[0][:200]
        rows_out.append(row)
        print(f"L={length} {hq}/{hkv} d{d} p{page}: " + ", ".join(f"{n} {t:.0f}us" for n, t in row["us"].items())
              + ("" if all(row["identical"].values()) else f"  DIFFER {row['identical']}")
              + (f"  ERRORS {row['errors']}" if row["errors"] else ""), flush=True)
        write(rows_out, ok, complete=False)
    print(f"\n{'case':>22} " + " ".join(f"{n:>12}" for n in names) + f" {'sdpa':>8}   (SDPA flash time / variant)")
    for r in rows_out:
        sd = r["us"].get("sdpa_flash")
        cells = [f"{sd / r['us'][n]:>12.2f}" if sd and n in r["us"] else f"{'-':>12}" for n in names]
        print(f"{r['length']:>6} {r['hq']:>3}/{r['hkv']} d{r['d']:<4} p{r['page']:<4} " + " ".join(cells)
              + f" {sd if sd else float('nan'):>8.0f}")
    write(rows_out, ok, complete=len(rows_out) == len(args.cases))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
