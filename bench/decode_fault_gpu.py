"""Find which decode launch faults (an illegal memory access) on the GPU: each case in its own process (a fault
ends the CUDA context), with CUDA_LAUNCH_BLOCKING=1 so the fault is reported at the launch that made it.

A case is a decode attention call as ``hal tune`` builds it (``tuning._random_paged_cache``: pages in random
order, one query token per sequence), over a bf16 cache or the contract's FP8 cache, with the kernel's own
launch or a launch override (``attention.decode_candidates`` keys). Prints one line per case: ok (and whether
the output is finite) or the error.

    python3 bench/decode_fault_gpu.py --json decode_fault.json                  # the built-in case list
    python3 bench/decode_fault_gpu.py --one '{"batch": 1, "ctx": 32768, ...}'   # one case (what each process runs)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

CASES = [
    # the cell whose default launch faulted in hal tune (H100, 2026-12-07): bf16-fp8-v2, B = 1 x 32k, 16-key pages
    dict(batch=1, ctx=32768, page=16, kv="e4m3", contract="bf16-fp8-v2", launch=None, copies=1),
    dict(batch=1, ctx=32768, page=16, kv="e4m3", contract="bf16-fp8-v2", launch=None, copies=2),
    dict(batch=1, ctx=32768, page=16, kv="bf16", contract="bf16-fp8-v2", launch=None, copies=1),
    dict(batch=1, ctx=32768, page=16, kv="e4m3", contract="bf16-fp8-v1", launch=None, copies=1),
    dict(batch=1, ctx=32768, page=64, kv="e4m3", contract="bf16-fp8-v2", launch=None, copies=1),
    dict(batch=1, ctx=16384, page=16, kv="e4m3", contract="bf16-fp8-v2", launch=None, copies=1),
    dict(batch=2, ctx=32768, page=16, kv="e4m3", contract="bf16-fp8-v2", launch=None, copies=1),
    dict(batch=1, ctx=32768, page=16, kv="e4m3", contract="bf16-fp8-v2",
         launch=dict(split_parallel=True, splits_per_program=1, num_warps=4, num_stages=5, maxnreg=0), copies=1),
    dict(batch=1, ctx=32768, page=16, kv="e4m3", contract="bf16-fp8-v2",
         launch=dict(split_parallel=True, splits_per_program=4, num_warps=4, num_stages=5, maxnreg=0), copies=1),
    dict(batch=1, ctx=32768, page=16, kv="e4m3", contract="bf16-fp8-v2",
         launch=dict(split_parallel=False, num_warps=4, num_stages=5, maxnreg=0), copies=1),
    # hal tune's own path for that cell (cache copies read in turn, CUDA-graph timing), as it faulted
    dict(batch=1, ctx=32768, page=16, kv="e4m3", contract="bf16-fp8-v2", tune=True),
]


def run_one(case: dict) -> dict:
    import torch

    from hal.api import create_backend
    from hal.backends.cuda.launch import CUDA_LAUNCH_UNTUNED
    from hal.kernels import attention, tuning

    backend = create_backend("cuda", case["contract"])
    spec, fp8 = backend.contract.attention, backend.contract.fp8
    batch, ctx, page, hq, hkv, d = case["batch"], case["ctx"], case["page"], 32, 8, 128
    if case.get("tune"):
        report: list = []
        tuning.tune_decode([(batch, ctx, hq, hkv, d, page, case["kv"])], spec, fp8=fp8, cache=tuning.TuneCache("x", "x"),
                           progress=print, report=report)
        torch.cuda.synchronize()
        return dict(ok=True, finite=True, default_ms=report[0]["default_ms"], best_ms=report[0]["best_ms"])
    per_seq = -(-ctx // page)
    pages = batch * per_seq
    g = torch.Generator(device="cuda").manual_seed(0)
    outs = []
    for _ in range(case.get("copies", 1)):
        k_cache, v_cache, scales = tuning._random_paged_cache(pages, page, hkv, d, case["kv"], torch.bfloat16, fp8, g,
                                                              "cuda")
        table = torch.randperm(pages, generator=g, device="cuda").to(torch.int32).view(batch, per_seq)
        q = torch.randn(batch, hq, d, generator=g, device="cuda").to(torch.bfloat16)
        query_start = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        out = attention.paged_attention(q, k_cache, v_cache, query_start, seq_lens, table, d ** -0.5, spec,
                                        policy=CUDA_LAUNCH_UNTUNED, **scales, **(case["launch"] or {}))
        torch.cuda.synchronize()
        outs.append(bool(torch.isfinite(out.float()).all()))
    return dict(ok=True, finite=all(outs))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--one", help="run this case (JSON) in this process and print its result as JSON")
    parser.add_argument("--json")
    parser.add_argument("--timeout-s", type=float, default=120)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(json.loads(args.one))), flush=True)
        return 0
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    results = []
    for case in CASES:
        t0 = time.time()
        try:
            proc = subprocess.run([sys.executable, __file__, "--one", json.dumps(case)], capture_output=True, text=True,
                                  env=env, timeout=args.timeout_s)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
            result = json.loads(lines[-1]) if proc.returncode == 0 and lines else dict(
                ok=False, error=(proc.stderr.strip().splitlines() or ["?"])[-1][:300],
                where=[line.strip() for line in proc.stderr.splitlines() if "File " in line][-3:])
        except subprocess.TimeoutExpired:
            result = dict(ok=False, error="timeout")
        result.update(case=case, seconds=round(time.time() - t0, 1))
        results.append(result)
        print(f"{json.dumps(case)} -> {'ok' if result['ok'] else 'FAULT'} "
              f"{result.get('finite', '')} {result.get('error', '')} {result.get('where', '')}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
