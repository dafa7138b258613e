"""Hardware-counter profiles (Nsight Compute) of the cuda kernels next to the stock kernels they are
compared with: where issue #5's remaining time goes. Needs `ncu` on the PATH and a GPU whose
counters it can read (the H200 machine of the `device` tool can; --clock-control none leaves the
clocks as found).

For every case one child process builds the problem, runs every kernel once outside the profiled
range (compiles, autotuning of cuBLAS / SDPA), then runs ours and the stock op once each between
cudaProfilerStart/Stop; ncu profiles those launches with cold caches (it flushes them before each
replay pass). Per kernel it reports time, DRAM and L2 traffic and throughput, SM and tensor-pipe
use, achieved occupancy, registers and the top warp stall reasons; the JSON keeps every metric.

    python3 bench/profile_kernels.py --out DIR [--cases decode_b8_4k,gemm_m256]   # on the GPU machine
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time

SECTIONS = ["SpeedOfLight", "MemoryWorkloadAnalysis", "ComputeWorkloadAnalysis", "Occupancy", "LaunchStats",
            "WarpStateStats", "SchedulerStats"]
EXTRA_METRICS = ["dram__bytes_read.sum", "dram__bytes_write.sum", "lts__t_bytes.sum"]

# name -> (description, what it runs); each builder returns [(label, fn)] for ours and stock.
CASES = {
    "gemm_m256": "GEMM M=256 N=4096 K=4096 (bf16): ours vs torch.mm",
    "gemm_m1024": "GEMM M=1024 N=14336 K=4096 (bf16): ours vs torch.mm",
    "gemm_m8192": "GEMM M=8192 N=4096 K=4096 (bf16): ours vs torch.mm",
    "prefill_512": "causal prefill L=512, 32/8 heads, D=128: ours vs SDPA flash",
    "prefill_8192": "causal prefill L=8192: ours vs SDPA flash",
    "decode_b1_32k": "decode B=1 ctx=32768: ours (page 16, NHD) vs SDPA",
    "decode_b8_4k": "decode B=8 ctx=4096: ours in NHD/HND order at pages 16/64 vs SDPA",
    "decode_b64_32k": "decode B=64 ctx=32768: ours NHD16 / HND64 vs SDPA",
    # the family sweep's weakest classes (bench/results/h200-2026-12-02-session9): mid-M GEMMs and small-B decode
    "gemm_m128_k12288": "GEMM M=128 N=4096 K=12288 (an 8B down_proj in a decode batch): ours vs torch.mm",
    "gemm_m512_n6144": "GEMM M=512 N=6144 K=4096 (an 8B qkv_proj): ours vs torch.mm",
    "decode_b4_8k_gqa5": "decode B=4 ctx=8192, 40/8 heads, 32-key pages (GQA 5): ours (NHD32) vs SDPA",
    "decode_b256_1k": "decode B=256 ctx=1024, 16/8 heads, 16-key pages (a vLLM 1.7B step): ours (NHD16) vs SDPA",
    # issue #20's worst decode cells (bench/results/h100-2026-12-07-session12): B = 1-4 at 512-2048 keys, where one
    # program walks a split's 8 chunks in order (bench/decode_chain_gpu.py measures the chain)
    "decode_b1_512": "decode B=1 ctx=512, 16/8 heads, 64-key pages (one split: a chain of 8 chunks): ours vs SDPA",
    "decode_b4_2k": "decode B=4 ctx=2048, 32/8 heads, 64-key pages (4 splits side by side, then the merge): ours vs SDPA",
    # issue #22: the FP8 KV cache reads half the bytes but is no faster than the bf16 one
    "decode_fp8_b64_8k": "decode B=64 ctx=8192, 32/8 heads, 16-key pages: ours over a bf16 cache and over the "
                         "contract's FP8 cache (per token-head scales) vs SDPA",
    # issue #22: the block-FP8 GEMM at large M: the Triton kernel's default launch, the Gluon kernels (one block at
    # a time and overlapped; warp-specialised), cuBLAS's block-scaled GEMM
    "fp8_gemm_m8192": "block-FP8 GEMM M=8192 N=4096 K=4096: ours (Triton default, Gluon u1 / u3, Gluon ws 128 / 256 "
                      "columns) vs "
                      "torch._scaled_mm blockwise",
    "fp8_gemm_m8192_k1536": "block-FP8 GEMM M=8192 N=24576 K=1536: ours (Triton default, Gluon ws) vs "
                            "torch._scaled_mm blockwise",
}
FP8_GEMMS = {"fp8_gemm_m8192": ((8192, 4096, 4096), ["triton", "gl_u1", "gl_u3", "gl_ws", "gl_ws_wide"]),
             "fp8_gemm_m8192_k1536": ((8192, 24576, 1536), ["triton", "gl_ws"])}
FP8_LAUNCHES = {"gl_u1": dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=4, unroll=1),
                "gl_u3": dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=4, unroll=3),
                "gl_ws": dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=4, num_stages=4, unroll=2, ws=True),
                "gl_ws_wide": dict(BLOCK_M=128, BLOCK_N=256, GROUP_M=8, num_warps=4, num_stages=4, unroll=1, ws=True)}
GEMMS = {"gemm_m256": (256, 4096, 4096), "gemm_m1024": (1024, 14336, 4096), "gemm_m8192": (8192, 4096, 4096),
         "gemm_m128_k12288": (128, 4096, 12288), "gemm_m512_n6144": (512, 6144, 4096)}
# decode: (batch, context, query heads, KV heads, [(layout, page size)]); the first layout is built, others relaid
DECODES = {"decode_b1_32k": (1, 32768, 32, 8, [("NHD", 16)]),
           "decode_b8_4k": (8, 4096, 32, 8, [("NHD", 16), ("HND", 16), ("NHD", 64), ("HND", 64)]),
           "decode_b64_32k": (64, 32768, 32, 8, [("NHD", 16), ("HND", 64)]),
           "decode_b4_8k_gqa5": (4, 8192, 40, 8, [("NHD", 32)]),
           "decode_b1_512": (1, 512, 16, 8, [("NHD", 64)]),
           "decode_b4_2k": (4, 2048, 32, 8, [("NHD", 64)]),
           "decode_b256_1k": (256, 1024, 16, 8, [("NHD", 16)])}


def build(case: str):
    """[(label, fn)] for one case, ours first and the stock op last; each fn makes one call."""
    import torch
    import torch.nn.functional as F

    from bench_cuda import paged_problem, relayout, sdpa_problem
    from hal.api import create_backend

    backend = create_backend("cuda")
    hq, hkv, d = 32, 8, 128
    if case.startswith("gemm_"):
        m, n, k = GEMMS[case]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
        return [("ours", lambda: backend.linear(x, w)), ("cublas", lambda: torch.mm(x, w.T))]
    if case.startswith("prefill_"):
        seq = int(case.split("_")[1])
        q, kc, vc, meta = paged_problem([seq], [seq], hq, hkv, d, 64)
        qs, ks, vs = sdpa_problem(1, seq, seq, hq, hkv, d)

        def flash():
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        return [("ours", lambda: backend.attention(q, kc, vc, meta, scale=d ** -0.5)), ("sdpa_flash", flash)]
    if case in FP8_GEMMS:
        from fp8_gpu import CUDA_LAUNCH_UNTUNED, SPEC, speed_weight

        from hal.kernels import fp8_gemm
        (m, n, k), labels = FP8_GEMMS[case]
        w = speed_weight(n, k, seed=7, device="cuda")
        xq, xs = fp8_gemm.quantise_activations(torch.randn(m, k, device="cuda").bfloat16(), SPEC)
        xs_col = xs.t().contiguous().t()

        def ours(label):
            cfg = (fp8_gemm._config(m, n) if label == "triton"
                   else dict(FP8_LAUNCHES[label], tma=True, pair=False, halves=False, sm90=True))
            return lambda: fp8_gemm.gemm(xq, xs, w["wq"], w["ws"], None, torch.bfloat16, SPEC, cfg,
                                         policy=CUDA_LAUNCH_UNTUNED)
        return [(label, ours(label)) for label in labels] + [
            ("cublas_block", lambda: torch._scaled_mm(xq, w["wq"].t(), scale_a=xs_col, scale_b=w["ws"].t(),
                                                      out_dtype=torch.bfloat16))]
    if case == "decode_fp8_b64_8k":
        q, kc, vc, meta = paged_problem([8192] * 64, [1] * 64, hq, hkv, d, 16)
        fp8_backend = create_backend("cuda", "bf16-fp8-v1")

        def fp8_cache(cache):   # per (token, head) scale = amax / 448, as [fp8].kv_scale (the bits do not matter here)
            scale = cache.float().abs().amax(-1).clamp_min(1e-10) / 448
            return (cache.float() / scale[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn), scale
        (k8, ks), (v8, vs) = fp8_cache(kc), fp8_cache(vc)
        qs, kss, vss = sdpa_problem(64, 1, 8192, hq, hkv, d)
        return [("ours_bf16", lambda: backend.attention(q, kc, vc, meta, scale=d ** -0.5)),
                ("ours_fp8", lambda: fp8_backend.fp8_attention(q, k8, v8, ks, vs, meta, scale=d ** -0.5)),
                ("sdpa", lambda: F.scaled_dot_product_attention(qs, kss, vss, enable_gqa=True))]
    batch, ctx, hq, hkv, layouts = DECODES[case]
    base = paged_problem([ctx] * batch, [1] * batch, hq, hkv, d, layouts[0][1])
    fns = []
    for layout, page in layouts:
        q, kc, vc, meta = base if (layout, page) == layouts[0] else relayout(base, page, layout)
        fns.append((f"ours_{layout}{page}", lambda q=q, kc=kc, vc=vc, meta=meta:
                    backend.attention(q, kc, vc, meta, scale=d ** -0.5)))
    qs, ks, vs = sdpa_problem(batch, 1, ctx, hq, hkv, d)
    fns.append(("sdpa", lambda: F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True)))
    return fns


def child(case: str) -> int:
    """Run inside ncu: warm up every fn, then one profiled call of each, ours first, the stock op
    last (the parent labels the kernels by that order: each of our main kernels starts the next
    label of ours; any kernel not ours is the stock op's)."""
    import torch

    fns = build(case)
    for _, fn in fns:
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    print("LABELS " + json.dumps([label for label, _ in fns]), flush=True)
    torch.cuda.cudart().cudaProfilerStart()
    for _, fn in fns:
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    return 0


OUR_MAIN_KERNELS = ("_gemm_kernel", "_attention_kernel", "_fp8_gemm_kernel", "_fp8_gemm_sm90_kernel",
                    "_fp8_gemm_ws_kernel")  # each call of ours starts with one of these
OUR_KERNELS = OUR_MAIN_KERNELS + ("_merge_kernel", "_combine_kernel")


def label_kernels(names: list[str], labels: list[str]) -> list[str]:
    """Which call each profiled kernel belongs to (``labels``: ours in launch order, then stock)."""
    out, ours_seen = [], -1
    for name in names:
        if name.startswith(OUR_MAIN_KERNELS):
            ours_seen += 1
        if name.startswith(OUR_KERNELS):
            out.append(labels[min(ours_seen, len(labels) - 2)] if ours_seen >= 0 else "?")
        else:
            out.append(labels[-1])
    return out


def _number(text: str):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return text


def parse_raw_csv(text: str) -> list[dict]:
    """ncu --page raw --csv: a header row, a units row, one row per kernel."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    if len(rows) < 3:
        return []
    header, units = rows[0], rows[1]
    return [{name: (_number(value), unit) for name, unit, value in zip(header, units, row)} for row in rows[2:]]


def pick(metrics: dict, name: str):
    value = metrics.get(name, (float("nan"), ""))[0]
    return value if isinstance(value, float) else float("nan")


def summary(metrics: dict) -> dict:
    """The few numbers the table shows (units normalised: us, GB, %)."""
    def scaled(name, to):
        value, unit = metrics.get(name, (float("nan"), ""))
        if not isinstance(value, float):
            return float("nan")
        factor = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3,
                  "byte": 1e-9, "Kbyte": 1e-6, "Mbyte": 1e-3, "Gbyte": 1.0, "KB": 1e-6, "MB": 1e-3,
                  "GB": 1.0}.get(unit)
        return value * factor / to if factor is not None else float("nan")
    stalls = {m.group(1): metrics[name][0] for name in metrics
              if (m := re.fullmatch(r"smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio", name))
              and isinstance(metrics[name][0], float)}
    top = sorted(stalls.items(), key=lambda kv: -kv[1])[:4]
    tensor = [metrics[name][0] for name in metrics if "pipe_tensor" in name and name.endswith("pct_of_peak_sustained_active")
              and isinstance(metrics[name][0], float)]
    return dict(kernel=str(metrics.get("Kernel Name", ("?", ""))[0])[:60],
                us=scaled("gpu__time_duration.sum", 1.0),
                dram_read_GB=scaled("dram__bytes_read.sum", 1.0), dram_write_GB=scaled("dram__bytes_write.sum", 1.0),
                l2_GB=scaled("lts__t_bytes.sum", 1.0),
                dram_pct=pick(metrics, "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed")
                if "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed" in metrics
                else pick(metrics, "dram__throughput.avg.pct_of_peak_sustained_elapsed"),
                l2_pct=pick(metrics, "lts__throughput.avg.pct_of_peak_sustained_elapsed"),
                sm_pct=pick(metrics, "sm__throughput.avg.pct_of_peak_sustained_elapsed"),
                tensor_pct=max(tensor) if tensor else float("nan"),
                occupancy_pct=pick(metrics, "sm__warps_active.avg.pct_of_peak_sustained_active"),
                registers=pick(metrics, "launch__registers_per_thread"),
                grid=pick(metrics, "launch__grid_size"),
                stalls={k: round(v, 2) for k, v in top})


def profile(case: str, out: str, ncu: str) -> dict:
    report = os.path.join(out, f"{case}.ncu-rep")
    base = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--target-processes", "all", "-f", "-o",
            report[:-len(".ncu-rep")]] + [a for s in SECTIONS for a in ("--section", s)]
    here = os.path.dirname(os.path.abspath(__file__))
    cmd = [sys.executable, os.path.abspath(__file__), "--child", case]
    start = time.time()
    run = subprocess.run(base + ["--metrics", ",".join(EXTRA_METRICS)] + cmd, capture_output=True, text=True, cwd=here)
    if run.returncode != 0:  # a metric name this ncu does not know: sections only
        run = subprocess.run(base + cmd, capture_output=True, text=True, cwd=here)
    log = run.stdout + run.stderr
    with open(os.path.join(out, f"{case}.log"), "w") as f:
        f.write(log)
    labels = json.loads(next((line[7:] for line in log.splitlines() if line.startswith("LABELS ")), "[]"))
    if run.returncode != 0 or not os.path.exists(report):
        return dict(case=case, error=log[-2000:], seconds=time.time() - start)
    raw = subprocess.run([ncu, "--import", report, "--csv", "--page", "raw"], capture_output=True, text=True)
    with open(os.path.join(out, f"{case}.csv"), "w") as f:
        f.write(raw.stdout)
    kernels = parse_raw_csv(raw.stdout)
    names = [str(m.get("Kernel Name", ("?", ""))[0]) for m in kernels]
    rows = [dict(label=label, **summary(metrics), metrics={k: v[0] for k, v in metrics.items()})
            for label, metrics in zip(label_kernels(names, labels), kernels)]
    return dict(case=case, description=CASES[case], kernels=rows, seconds=time.time() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="folder for the reports, logs and profile.json")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child)
    if not args.out:
        parser.error("--out is required")
    ncu = shutil.which("ncu") or next((p for p in ("/usr/local/cuda/bin/ncu",) if os.path.exists(p)), None)
    if ncu is None:
        print("ncu (Nsight Compute) is not on the PATH", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}; known: {list(CASES)}")
    results = []
    for case in cases:
        results.append(profile(case, args.out, ncu))
        print(f"{case}: {'error' if 'error' in results[-1] else len(results[-1]['kernels'])} "
              f"({results[-1]['seconds']:.0f} s)", flush=True)
        with open(os.path.join(args.out, "profile.json"), "w") as f:
            json.dump(results, f, indent=1)
    print(f"\n{'case':<15} {'label':<12} {'kernel':<28} {'us':>7} {'DRAM GB':>8} {'DRAM%':>6} {'L2 GB':>6} "
          f"{'L2%':>5} {'SM%':>5} {'TC%':>5} {'occ%':>5} {'regs':>4}  top stalls (warps per issue)")
    for r in results:
        if "error" in r:
            print(f"{r['case']:<15} ERROR {r['error'][-300:]}")
            continue
        for k in r["kernels"]:
            stalls = " ".join(f"{n}={v}" for n, v in k["stalls"].items())
            print(f"{r['case']:<15} {k['label']:<12} {k['kernel'][:28]:<28} {k['us']:>7.1f} "
                  f"{k['dram_read_GB'] + k['dram_write_GB']:>8.3f} {k['dram_pct']:>6.1f} {k['l2_GB']:>6.2f} "
                  f"{k['l2_pct']:>5.1f} {k['sm_pct']:>5.1f} {k['tensor_pct']:>5.1f} {k['occupancy_pct']:>5.1f} "
                  f"{k['registers']:>4.0f}  {stalls}")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
