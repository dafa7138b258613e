"""The Gluon block-FP8 GEMM for Hopper (hal/kernels/fp8_gemm_sm90.py) on the GPU: bitwise against the Triton
kernel, then timed against it and against cuBLAS's block-scaled GEMM (issue #22's large-M target).

Sections (``--only``), each printing a table; every number goes to --json:

  bits    every Gluon launch of ``LAUNCHES``, and the kernel's own launch ("default": from 1024 rows on Hopper the
          warp-specialised kernel), == the Triton kernel's own launch (``fp8_gemm._config``, untuned),
          bitwise (torch.equal on the raw bits), on shapes that cross every edge: M not a multiple of the
          tile (1, 100, 257, 1000, 1500), N not a multiple of 128 (a partial last weight block: 200, 2112), one
          to many K blocks, block counts that leave a tail after the kernel's steps of 2-4 blocks and ones that do not,
          bias, bf16 and fp32 out. Inputs of wide dynamic range (``fp8_gpu.activations``).
  speed   device time (``triton.testing.do_bench_cudagraph``, median: no host time) of the Triton kernel's own launch,
          each Gluon launch, ``torch._scaled_mm`` with 1x128 / 128x128 block scales (cuBLAS) and cuBLAS bf16,
          on DeepSeek-V3 / Qwen3-like (N, K) at M = 256..8192. Ratios: cuBLAS block-scaled time / ours.

Exit status 1 if any Gluon launch gives other bits than the Triton kernel (or fails to run).

    python3 bench/fp8_sm90_gpu.py --json fp8_sm90_gpu.json      # on the H200 (bash bench/h200.sh fp8sm90)
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import triton

sys.path.insert(0, __import__("os").path.dirname(__file__))
from fp8_gpu import CUDA_LAUNCH_UNTUNED, SPEC, activations, bits, layer, speed_weight  # noqa: E402

from hal.kernels.tuning import do_bench_cudagraph_synced  # noqa: E402  (waits for queued input writes)
from hal.kernels import fp8_gemm, fp8_gemm_sm90  # noqa: E402

# (BLOCK_M, BLOCK_N, warps, stages, unroll[, "ws"]): blocks per step, of which all but the last have their add
# overlapped (unroll 1 waits for every block's MMAs before its add: the Triton kernel's schedule, in Gluon,
# the control that shows what the overlap buys; bench/results/h100-2026-12-06-fp8sm90-prefill/ ran it).
# "ws": the warp-specialised kernel (a loader warp and a partition per math warpgroup; 4 warps = the default
# partition, 128 rows; 256 columns = two weight blocks, one half at a time, unroll 1).
LAUNCHES = [(128, 128, 8, 4, 2), (128, 128, 8, 4, 3), (64, 128, 4, 4, 3), (128, 64, 8, 6, 2), (128, 64, 8, 4, 4),
            (128, 64, 8, 6, 4), (128, 128, 4, 4, 2, "ws"), (128, 128, 4, 4, 3, "ws"), (128, 128, 4, 6, 2, "ws"),
            (128, 128, 4, 6, 3, "ws"), (128, 256, 4, 3, 1, "ws"), (128, 256, 4, 4, 1, "ws")]
BIT_SHAPES = [  # (N, K, bias, out dtype)
    (200, 128, True, torch.bfloat16), (200, 384, False, torch.float32), (2112, 640, True, torch.bfloat16),
    (4096, 7168, False, torch.bfloat16), (7168, 2048, True, torch.float32), (2112, 7168, False, torch.bfloat16)]
BIT_MS = (1, 100, 257, 1000, 1500)   # from 1024 rows the kernel's own launch on Hopper is the ws kernel ("default")
SPEED_SHAPES = [(4096, 4096), (2112, 7168), (7168, 2048), (24576, 1536), (7168, 18432)]
SPEED_MS = (256, 1024, 4096, 8192)


def graph_ms(fn) -> float:
    """Device time of one call, replayed in a CUDA graph (median): the host's cost of a launch (descriptors
    are built on the host per call, ~25-40 us) stays out of it, which plain do_bench measured at small M."""
    return do_bench_cudagraph_synced(fn, rep=50, return_mode="median")


def log(msg: str) -> None:
    print(msg, flush=True)


def cfg_of(launch) -> dict:
    bm, bn, warps, stages, unroll = launch[:5]
    return dict(BLOCK_M=bm, BLOCK_N=bn, GROUP_M=8, num_warps=warps, num_stages=stages, tma=True, pair=False,
                halves=False, sm90=True, unroll=unroll, ws="ws" in launch[5:])


def name_of(launch) -> str:
    bm, bn, warps, stages, unroll = launch[:5]
    return f"gl{' ws' if 'ws' in launch[5:] else ''} {bm}x{bn} w{warps} s{stages} u{unroll}"


def bits_section(device) -> tuple[list, bool]:
    rows, ok = [], True
    for si, (n, k, has_bias, out_dtype) in enumerate(BIT_SHAPES):
        wq, ws, bias = (t.to(device) if t is not None else None for t in layer(n, k, seed=40 + si, bias=has_bias))
        for m in BIT_MS:
            xq, xs = fp8_gemm.quantise_activations(activations(m, k, seed=50 + m).to(device), SPEC)
            base = fp8_gemm.gemm(xq, xs, wq, ws, bias, out_dtype, SPEC, fp8_gemm._config(m, n),
                                 policy=CUDA_LAUNCH_UNTUNED)   # the Triton kernel's own launch
            row = dict(n=n, k=k, m=m, bias=has_bias, out=str(out_dtype), identical=[], differing=[], errors=[])
            for launch in LAUNCHES:
                try:
                    out = fp8_gemm.gemm(xq, xs, wq, ws, bias, out_dtype, SPEC, cfg_of(launch),
                                        policy=CUDA_LAUNCH_UNTUNED)
                    torch.cuda.synchronize()
                except Exception as exc:  # noqa: BLE001 - reported and failed, never skipped
                    row["errors"].append(dict(launch=name_of(launch), error=str(exc).splitlines()[0][:300]))
                    continue
                same = torch.equal(bits(out), bits(base))
                row["identical" if same else "differing"].append(name_of(launch))
                if not same:
                    diff = (out.float() - base.float()).abs()
                    row.setdefault("max_abs_diff", {})[name_of(launch)] = float(diff.max())
            own = fp8_gemm.gemm(xq, xs, wq, ws, bias, out_dtype, SPEC, policy=CUDA_LAUNCH_UNTUNED)
            row["identical" if torch.equal(bits(own), bits(base)) else "differing"].append("default")
            ok &= not row["differing"] and not row["errors"]
            rows.append(row)
            log(f"bits M={m} N={n} K={k} bias={has_bias} {out_dtype}: {len(row['identical'])}/{len(LAUNCHES)} "
                f"identical (+ default {'same' if 'default' in row['identical'] else 'DIFFERS'})" + (f", DIFFER {row['differing']}" if row["differing"] else "")
                + (f", ERRORS {row['errors']}" if row["errors"] else ""))
    return rows, ok


def speed_section(device, shapes, ms) -> list:
    rows = []
    bf16 = torch.bfloat16
    for si, (n, k) in enumerate(shapes):
        w = speed_weight(n, k, seed=70 + si, device=device)
        for m in ms:
            x = torch.randn(m, k, device=device, generator=torch.Generator(device=device).manual_seed(m)).bfloat16()
            xq, xs = fp8_gemm.quantise_activations(x, SPEC)
            xs_col = xs.t().contiguous().t()
            fns = {"triton": lambda: fp8_gemm.gemm(xq, xs, w["wq"], w["ws"], None, bf16, SPEC,
                                                   fp8_gemm._config(m, n), policy=CUDA_LAUNCH_UNTUNED),
                   "scaled_mm_blockwise": lambda: torch._scaled_mm(xq, w["wq"].t(), scale_a=xs_col,
                                                                   scale_b=w["ws"].t(), out_dtype=bf16),
                   "cublas_bf16": lambda: torch.nn.functional.linear(x, w["bf16"])}
            for launch in LAUNCHES:
                fns[name_of(launch)] = (lambda cfg: lambda: fp8_gemm.gemm(xq, xs, w["wq"], w["ws"], None, bf16, SPEC,
                                                                          cfg, policy=CUDA_LAUNCH_UNTUNED))(cfg_of(launch))
            row = dict(m=m, n=n, k=k, us={}, na={})
            for name, fn in fns.items():
                try:
                    fn()
                    torch.cuda.synchronize()
                    row["us"][name] = graph_ms(fn) * 1000
                except Exception as exc:  # noqa: BLE001 - a comparator this torch lacks: n/a, with why
                    row["na"][name] = str(exc).splitlines()[0][:200]
            us = row["us"]
            gl_times = {nm: t for nm, t in us.items() if nm.startswith("gl ") and not nm.endswith("u1")}
            if gl_times:
                best = min(gl_times, key=gl_times.get)
                row["best_gluon"] = best
                row["triton_over_best_gluon"] = us["triton"] / gl_times[best]
                if "scaled_mm_blockwise" in us:
                    row["cublas_block_over_triton"] = us["scaled_mm_blockwise"] / us["triton"]
                    row["cublas_block_over_best_gluon"] = us["scaled_mm_blockwise"] / gl_times[best]
                ws_times = {nm: t for nm, t in gl_times.items() if nm.startswith("gl ws ")}
                if ws_times:   # the warp-specialised launches alone
                    best_ws = min(ws_times, key=ws_times.get)
                    row["best_ws"] = best_ws
                    if "scaled_mm_blockwise" in us:
                        row["cublas_block_over_best_ws"] = us["scaled_mm_blockwise"] / ws_times[best_ws]
            row["tflops"] = {nm: 2.0 * m * n * k / (t * 1e-6) / 1e12 for nm, t in us.items()}
            rows.append(row)
            log(f"speed M={m} N={n} K={k}: " + ", ".join(f"{nm} {t:.1f}" for nm, t in us.items()))
    print(f"\n{'M':>5} {'N':>6} {'K':>6} {'triton us':>10} {'best gluon':>27} {'us':>8} {'cuBLAS blk':>10} "
          f"{'blk/triton':>10} {'blk/gluon':>10} {'blk/ws':>8}")
    for r in rows:
        us = r["us"]
        if "best_gluon" not in r:
            continue
        print(f"{r['m']:>5} {r['n']:>6} {r['k']:>6} {us['triton']:>10.1f} {r['best_gluon']:>27} "
              f"{us[r['best_gluon']]:>8.1f} {us.get('scaled_mm_blockwise', float('nan')):>10.1f} "
              f"{r.get('cublas_block_over_triton', float('nan')):>10.2f} "
              f"{r.get('cublas_block_over_best_gluon', float('nan')):>10.2f} "
              f"{r.get('cublas_block_over_best_ws', float('nan')):>8.2f}")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--only", default="bits,speed")
    ap.add_argument("--quick", action="store_true", help="three speed shapes at M = 1024 and 8192 only")
    args = ap.parse_args()
    device = torch.device("cuda")
    if not fp8_gemm_sm90.available(device):
        log("fp8_gemm_sm90 is not available here (needs Triton's Gluon and a Hopper GPU)")
        return 1
    started = time.time()
    out = dict(device=torch.cuda.get_device_name(), triton=triton.__version__, torch=torch.__version__,
               launches=[name_of(launch) for launch in LAUNCHES])
    ok = True
    only = args.only.split(",")
    if "bits" in only:
        out["bits"], ok = bits_section(device)
        log(f"bits: {'PASS' if ok else 'FAIL'}")
    if "speed" in only:
        shapes, ms = (SPEED_SHAPES[:2] + SPEED_SHAPES[-1:], (1024, 8192)) if args.quick else (SPEED_SHAPES, SPEED_MS)
        out["speed"] = speed_section(device, shapes, ms)
    out["seconds"] = time.time() - started
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
