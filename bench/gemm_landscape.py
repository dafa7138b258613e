"""Every contract-preserving GEMM launch on a sample of issue #20's shape family: the data a launch rule is
fitted to, and the tile-freedom check over the whole candidate set.

For each (M, N, K) cell it times every configuration of ``gemm.candidates`` (plus ``--extra`` tiles not in
the production set yet), the kernel's own table and cuBLAS, and checks that every configuration gives the
table's bits. Shapes: the linears of ``family_sweep.MODELS`` at the ``--m`` batch sizes, in a seeded random
order, so a run cut by ``--budget-s`` leaves a uniform sample; the JSON is rewritten every few cells.

Compiles come first, in ``--compile-workers`` processes that share Triton's cache (one configuration
compiles in ~1-2 s; there are ~100), so the timed loop compiles nothing.

    python3 bench/gemm_landscape.py --m 128,256,512,1024,2048,4096 --budget-s 300 --json landscape.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import sys
import time

import torch
import torch.nn.functional as F

from bench_cuda import copies
from family_sweep import gemm_cells, graph_ms

# Tiles beyond gemm._TILES to explore (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): two fp32 accumulators
# of a warpgroup's share must fit its registers (<= 64 x 128 per warpgroup).
EXTRA = [(64, 128, 64, 4, 5), (64, 128, 128, 4, 3), (128, 128, 64, 8, 3), (128, 128, 128, 8, 3),
         (64, 64, 128, 4, 5)]


def configs_for(m, n, k, spec, tma_ok, extra: bool):
    from hal.kernels import gemm

    tiles = gemm._TILES + (EXTRA if extra else [])
    out = gemm.candidates(m, n, k, spec, tma_ok, tiles=tiles)
    if m > 64 and tma_ok:
        # Above 64 rows descriptor loads won every earlier measurement (44 registers instead of 228): the
        # pointer-load twins only cost time here; two split-K launches stay, to see split-K priced.
        split = [dict(c, split=True, chunks_per_program=1) for c in out if not c["tma"]
                 and (c["BLOCK_M"], c["BLOCK_N"]) in ((64, 128), (128, 128))][:2]
        out = [c for c in out if c["tma"]] + (split if spec.chunk_count(k) > 1 else [])
    return out


def cells(ms):
    """family_sweep's GEMM cells (every linear of its models) at the batch sizes ``ms``."""
    return [c for c in gemm_cells() if c["m"] in ms]


def _compile(job):
    """Compile (by one small launch each) a list of configurations, for bf16 and fp32 (logits) outputs, on a
    small shape whose specialisations (multiples of 16) match the family's (M is not specialised)."""
    configs, = job
    from hal.api import create_backend
    from hal.backends.cuda.launch import CUDA_LAUNCH_UNTUNED
    from hal.kernels import gemm

    spec = create_backend("cuda").contract.gemm
    x = torch.randn(128, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 2048, device="cuda", dtype=torch.bfloat16)
    failed = 0
    for cfg in configs:
        for out_dtype in (torch.bfloat16, torch.float32):
            try:
                gemm.linear(x, w, None, out_dtype, spec, cfg, policy=CUDA_LAUNCH_UNTUNED)
            except Exception:              # noqa: BLE001 - out of resources: the timed loop skips it too
                failed += 1
    torch.cuda.synchronize()
    return failed


def _all_configs(ms, spec, extra):
    """Every distinct configuration the cells will time (a tile's compile does not depend on M)."""
    seen = {}
    for m in ms:
        for cfg in configs_for(m, 1024, 2048, spec, True, extra):
            seen.setdefault(json.dumps(cfg, sort_keys=True), cfg)
    return list(seen.values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", default="128,256,512,1024,2048,4096")
    ap.add_argument("--budget-s", type=float, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-extra", action="store_true", help="only the production candidate set")
    ap.add_argument("--compile-workers", type=int, default=12)
    ap.add_argument("--shape", action="append", default=[], help="M,N,K: only these cells (repeatable)")
    ap.add_argument("--sync-each", action="store_true",
                    help="name each configuration before its first launch and synchronise after it (with "
                         "CUDA_LAUNCH_BLOCKING=1: which launch faults)")
    ap.add_argument("--json", required=True)
    args = ap.parse_args(argv)
    from hal.api import create_backend
    from hal.backends.cuda.launch import CUDA_LAUNCH_UNTUNED as untuned
    from hal.kernels import gemm

    ms = [int(v) for v in args.m.split(",")]
    t0 = time.time()
    spec = create_backend("cuda").contract.gemm
    configs = _all_configs(ms, spec, not args.no_extra)
    workers = max(1, min(args.compile_workers, len(configs)))
    jobs = [(configs[i::workers],) for i in range(workers)]
    with mp.get_context("spawn").Pool(workers) as pool:
        failed = sum(pool.map(_compile, jobs))
    print(f"compiled {len(configs)} configurations x 2 output dtypes in {time.time() - t0:.0f} s "
          f"({failed} did not launch)", flush=True)
    todo = cells(ms)
    random.Random(args.seed).shuffle(todo)
    if args.shape:
        wanted = {tuple(int(v) for v in s_.split(",")) for s_ in args.shape}
        todo = [c for c in cells(sorted({m for m, _, _ in wanted})) if (c["m"], c["n"], c["k"]) in wanted]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows, t0 = [], time.time()
    for i, cell in enumerate(todo):
        if time.time() - t0 > args.budget_s:
            print(f"budget reached after {i} of {len(todo)} cells", flush=True)
            break
        m, n, k = cell["m"], cell["n"], cell["k"]
        out_dtype = torch.float32 if cell["logits"] else torch.bfloat16
        sets = [(torch.randn(m, k, device="cuda").to(torch.bfloat16),
                 (torch.randn(n, k, device="cuda") * k ** -0.5).to(torch.bfloat16))
                for _ in range(copies(n * k * 2 + m * k * 2))]
        x0, w0 = sets[0]
        reference = gemm.linear(x0, w0, None, out_dtype, spec, policy=untuned).view(torch.uint8)
        cell["table_ms"] = graph_ms([lambda x=x, w=w: gemm.linear(x, w, None, out_dtype, spec, policy=untuned)
                                     for x, w in sets], target_ms=0.5)
        cell["table_config"] = gemm._config(m, n, k, spec, True, sms)
        stock = [(lambda x=x, w=w: F.linear(x, w).float()) if cell["logits"] else (lambda x=x, w=w: F.linear(x, w))
                 for x, w in sets]
        cell["cublas_ms"] = graph_ms(stock, target_ms=0.5)
        cell["configs"], mismatched, failed = [], [], 0
        for cfg in configs_for(m, n, k, spec, gemm._tma_ok(x0) and gemm._tma_ok(w0), not args.no_extra):
            if args.sync_each:
                print(f"  launching {cfg}", flush=True)
            try:
                out = gemm.linear(x0, w0, None, out_dtype, spec, cfg, policy=untuned)
                if args.sync_each:
                    torch.cuda.synchronize()
            except torch.AcceleratorError:
                raise                      # a fault poisons the context: nothing after it can run
            except Exception:              # noqa: BLE001 - does not launch here (resources)
                failed += 1
                continue
            if not torch.equal(out.view(torch.uint8), reference):
                mismatched.append(cfg)
                continue
            ms_ = graph_ms([lambda x=x, w=w: gemm.linear(x, w, None, out_dtype, spec, cfg, policy=untuned)
                            for x, w in sets], target_ms=0.5)
            cell["configs"].append(dict(cfg, ms=ms_))
        cell["failed"], cell["mismatched"] = failed, mismatched
        best = min(cell["configs"], key=lambda c: c["ms"])
        cell["best_ms"], cell["best"] = best["ms"], {k_: v for k_, v in best.items() if k_ != "ms"}
        rows.append(cell)
        print(f"[{i + 1:4}/{len(todo)} {time.time() - t0:4.0f}s] M={m:5} N={n:6} K={k:5} "
              f"cuBLAS {cell['cublas_ms'] * 1e3:8.1f} us "
              f"table {cell['cublas_ms'] / cell['table_ms']:.2f}x  best {cell['cublas_ms'] / best['ms']:.2f}x "
              f"({len(cell['configs'])} configs{', %d MISMATCHED' % len(mismatched) if mismatched else ''})",
              flush=True)
        del sets, stock
        torch.cuda.empty_cache()
        if i % 10 == 0:
            _write(args.json, rows, len(todo))
    _write(args.json, rows, len(todo))
    bad = sum(len(r["mismatched"]) for r in rows)
    print(f"{len(rows)} cells, {sum(len(r['configs']) for r in rows)} configurations timed, {bad} gave other bits",
          flush=True)
    return 1 if bad else 0


def _write(path, rows, planned):
    with open(path, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), planned=planned, extra=EXTRA, rows=rows), f)


if __name__ == "__main__":
    sys.exit(main())
