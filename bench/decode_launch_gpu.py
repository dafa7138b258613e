"""Decode attention's launch choices on the GPU (issues #20 and #22): register caps, stages and splits per
program, over a bf16 cache and over the contract's FP8 cache, each checked bitwise against the kernel's
own launch and timed.

Why: the decode kernel (16-row MMA tiles, 4 warps) compiles to 207-255 registers a thread, so a
multiprocessor holds two programs (8 warps); the FP8 cache's dequantisation (1.8x the instructions of the
bf16 kernel) then waits on latency with nothing else to issue (bench/results/h200-2026-12-04-session18,
call 5: SM 37 % busy, DRAM 35 %). ptxas fits the one-split kernel into 168 registers without spilling
(sm_90, offline), which makes room for a third program. Every variant is a launch choice (the register
allocation and the pipelining depth never change an operation), so each must give the default's bits.

For each (cache, shape, variant): bitwise equality with the default launch's output, device time under
CUDA-graph replay (median), and the compiled kernel's registers and spills. Prints a table per shape and
writes JSON. Since the FP8 rule (``attention._decode_launch``: one split, 128 registers, 3 stages once the
programs fill the GPU) "default" is that launch for the FP8 cache, and "bf16-rule" the one it replaced.

    python3 bench/decode_launch_gpu.py --json decode_launch.json      # on the GPU (PYTHONPATH=/tmp/site)
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from hal.api import create_backend
from hal.kernels import attention as attention_kernels
from hal.kernels import launcher
from hal.kvcache import build_metadata

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from fp8_kv_gpu import FP8, filled_cache, rows  # noqa: E402

# name -> paged_attention overrides ({}: the kernel's own launch; "bf16-rule": the launch the bf16 cache's
# rule gives this shape, for both caches: the FP8 cache's launch before the register-capped one)
VARIANTS = {
    "default": {},
    "bf16-rule": "bf16-rule",
    "spp1": dict(splits_per_program=1, maxnreg=0, num_stages=5),
    "spp2": dict(splits_per_program=2, maxnreg=0, num_stages=5),
    "spp1-r168": dict(splits_per_program=1, maxnreg=168, num_stages=5),
    "spp2-r168": dict(splits_per_program=2, maxnreg=168, num_stages=5),
    "spp1-r128-s3": dict(splits_per_program=1, maxnreg=128, num_stages=3),
    "spp2-r128-s3": dict(splits_per_program=2, maxnreg=128, num_stages=3),
    "spp1-r128-s2": dict(splits_per_program=1, maxnreg=128, num_stages=2),
    "spp1-r96-s2": dict(splits_per_program=1, maxnreg=96, num_stages=2),
}
# (batch, context, q heads, kv heads, head dim, page)
SHAPES = [(1, 4096, 32, 8, 128, 64), (1, 32768, 32, 8, 128, 64), (4, 8192, 32, 8, 128, 64),
          (16, 4096, 32, 8, 128, 64), (16, 16384, 32, 8, 128, 64), (64, 8192, 32, 8, 128, 64),
          (256, 4096, 32, 8, 128, 64), (16, 8192, 40, 8, 128, 32), (64, 4096, 16, 8, 64, 16)]


def log(msg: str) -> None:
    print(msg, flush=True)


def compiled_registers() -> dict:
    """(KV_FP8, SPLITS_PER_PROGRAM, num_stages, maxnreg) -> (registers, spills) of every compiled decode variant."""
    out = {}
    for key, (compiled, _) in launcher._LAUNCHES.get(id(attention_kernels._attention_kernel),
                                                     launcher._KernelLaunches(attention_kernels._attention_kernel)
                                                     ).compiled.items():
        kw = dict(key[1])
        tag = (kw["KV_FP8"], kw["SPLITS_PER_PROGRAM"], kw["num_stages"], kw.get("maxnreg", 0), kw["HEAD_DIM"],
               kw["PAGE_SIZE"], kw["GROUP_PAD"])
        out[tag] = (compiled.n_regs, compiled.n_spills)
    return out


def main(argv=None) -> int:
    import triton

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--rep", type=int, default=40, help="CUDA-graph replay time per measurement (ms)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    names = args.variants.split(",")
    cuda = create_backend("cuda", FP8)
    rows_out, failures, t0 = [], 0, time.time()
    for batch, ctx, hq, hkv, d, page in SHAPES:
        cache, lists = filled_cache(FP8.fp8, [ctx] * batch, hkv, d, page, "cuda")
        meta = build_metadata([1] * batch, [ctx] * batch, lists, "cuda")
        q = rows(batch, hq, d, 5, "cuda")
        k_bf16, v_bf16 = cache.read(torch.bfloat16)
        qsl, lens, table = meta.query_start_loc.int(), meta.seq_lens.int(), meta.block_table.int()
        caches = {"bf16": dict(k=k_bf16, v=v_bf16, scales={}),
                  "fp8": dict(k=cache.k, v=cache.v, scales=dict(k_scale=cache.k_scale, v_scale=cache.v_scale))}
        bytes_read = {"bf16": batch * ctx * hkv * d * 2 * 2, "fp8": batch * ctx * hkv * (d + 4) * 2}
        times = {}
        for kind, c in caches.items():
            def run(overrides, c=c):
                return attention_kernels.paged_attention(q, c["k"], c["v"], qsl, lens, table, d ** -0.5,
                                                         cuda.contract.attention, policy=cuda._launch,
                                                         **c["scales"], **overrides)
            want = run({})
            programs = batch * hkv * cuda.contract.attention.split_count(ctx)
            bf16_rule = attention_kernels._decode_launch(programs, cuda._launch.multiprocessors(q.device), False,
                                                         max_splits=cuda.contract.attention.split_count(ctx), head_dim=d,
                                                         page=page)
            for name in names:
                overrides = bf16_rule if VARIANTS[name] == "bf16-rule" else VARIANTS[name]
                out = run(overrides)
                same = torch.equal(out, want)
                failures += not same
                ms = triton.testing.do_bench_cudagraph(lambda: run(overrides), rep=args.rep, return_mode="median")
                times[kind, name] = ms
                rows_out.append(dict(batch=batch, ctx=ctx, hq=hq, hkv=hkv, d=d, page=page, cache=kind, variant=name,
                                     overrides=overrides, equal_default=same, ms=ms,
                                     TBps=bytes_read[kind] / ms / 1e9))
        log(f"\nB={batch} ctx={ctx} heads {hq}/{hkv} D={d} page={page}   (us; fp8 speed-up = bf16 default / fp8)")
        log(f"{'variant':>14} {'bf16 us':>9} {'fp8 us':>9} {'bf16 TB/s':>9} {'fp8 TB/s':>9} {'vs bf16 default':>16}")
        for name in names:
            r = [x for x in rows_out[-2 * len(names):] if x["variant"] == name]
            bad = "" if all(x["equal_default"] for x in r) else "   bits DIFFER"
            log(f"{name:>14} {times['bf16', name] * 1e3:9.1f} {times['fp8', name] * 1e3:9.1f} "
                f"{bytes_read['bf16'] / times['bf16', name] / 1e9:9.2f} {bytes_read['fp8'] / times['fp8', name] / 1e9:9.2f} "
                f"{times['bf16', 'default'] / times['fp8', name]:15.2f}x{bad}")
        del cache, k_bf16, v_bf16, caches
    regs = compiled_registers()
    log("\ncompiled decode variants: (fp8, splits/program, stages, maxnreg, D, page, group_pad) -> (registers, spills)")
    for tag, (r, s) in sorted(regs.items(), key=str):
        log(f"  {tag}: {r} registers, {s} spills")
    result = dict(device=torch.cuda.get_device_name(), rows=rows_out, failures=failures,
                  registers=[dict(tag=list(map(str, t)), registers=r, spills=s) for t, (r, s) in regs.items()],
                  seconds=time.time() - t0)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    log(f"\n{failures} variants differ from the default launch's bits, {result['seconds']:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
