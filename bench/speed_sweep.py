"""Sweep of launch shapes for the cuda kernels on the H200: the evidence behind the per-shape
configs in gemm.py and attention.py. Every variant's output is checked bitwise against the first
measured kernels (written into .old_kernels/ by bench/old_kernels.sh; --base) on the same inputs,
then timed next to them and the stock ops.

Variants are few on purpose (each is a separate compile, ~1-2 s): picked by reasoning about the
shape (weight-read bound small M, MMA-bound large M; decode streaming KV, prefill MMA-bound) and
screened without a GPU by bench/sm90_report.py. Small shapes are host-bound in eager timing
(Triton's Python launch path): ``--graph`` times them by device time instead; the ``overhead``
step measures the host cost per call.

    cd bench && python3 speed_sweep.py --graph --only gemm,attention --json sweep.json
    cd bench && python3 speed_sweep.py --only overhead --json overhead.json
    cd bench && python3 speed_sweep.py --graph --only layouts --json layouts.json   # KV-cache orders

Steps (--only): overhead, gemm, attention (= prefill + decode), prefill, decode, vllm-decode (a vLLM decode step
of ragged short contexts), layouts, logprobs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import torch
import torch.nn.functional as F
import triton
from triton.runtime.errors import OutOfResources

import old_kernels
from bench_cuda import copies, paged_problem, relayout, rotating, sdpa_problem
from hal.kernels.tuning import do_bench_cudagraph_synced  # noqa: E402  (waits for queued input writes)
from hal.api import create_backend
from hal.backends.cuda.launch import CUDA_LAUNCH
from hal.contract import load_contract
from hal.kernels import attention, gemm, logprobs

v0_gemm = v0_attention = v0_logprobs = None  # the old kernels (--base), set by main()

GRAPH = False  # --graph: time variants by device time (CUDA-graph replay) instead of eager calls


def eager(fn) -> float:
    """Eager timing (also for code that syncs with the host: the first attention kernels cannot be
    graph-captured)."""
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def bench(fn) -> float:
    if GRAPH:
        return do_bench_cudagraph_synced(fn, rep=20, return_mode="median")
    return eager(fn)


def host_us(fn, calls: int = 200) -> float:
    """Host microseconds per call when the GPU keeps up (enqueue cost: Python + launches)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def graph_ms(fn) -> float:
    """Device time alone: the call captured in a CUDA graph and replayed."""
    try:
        return do_bench_cudagraph_synced(fn, rep=40, return_mode="median")
    except Exception as exc:  # noqa: BLE001 - recorded, not fatal
        print("graph capture failed:", repr(exc)[:200])
        return float("nan")


def _v(bm, bn, bk, warps, stages, **kw):
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages, **kw)


# Second round (bench/results/h200-2026-11-29-session3/sweep_1, sweep_2): TMA at every M and tile
# widths against wave quantisation. First round: ../h200-2026-11-29-speed/sweep_call1. The second round
# also timed a persistent GEMM, never faster beyond noise (`git show 93e0a42:bench/lab/gemm_persistent.py`).
GEMM_VARIANTS = {
    "small": [_v(16, 32, 256, 4, 4), _v(16, 16, 256, 4, 4), _v(16, 16, 256, 4, 6), _v(16, 64, 128, 4, 5),
              _v(16, 64, 128, 4, 6), _v(16, 16, 512, 4, 4), _v(16, 32, 256, 4, 4, tma=True),
              _v(16, 64, 128, 4, 6, tma=True), _v(16, 16, 256, 4, 6, tma=True)],
    "m64": [_v(64, 32, 128, 4, 4), _v(64, 32, 128, 4, 4, tma=True), _v(64, 32, 128, 4, 6, tma=True),
            _v(64, 64, 64, 4, 6, tma=True), _v(64, 64, 128, 4, 4, tma=True), _v(64, 128, 64, 4, 4, tma=True),
            _v(64, 16, 256, 4, 4, tma=True)],
    "m256": [_v(128, 128, 64, 8, 4, GROUP_M=8, tma=True), _v(64, 128, 64, 4, 3, GROUP_M=8, tma=True),
             _v(64, 128, 64, 4, 4, GROUP_M=8, tma=True), _v(64, 64, 64, 4, 6, GROUP_M=8, tma=True),
             _v(64, 64, 128, 4, 4, GROUP_M=8, tma=True), _v(128, 64, 64, 4, 4, GROUP_M=8, tma=True),
             _v(128, 64, 64, 4, 3, GROUP_M=8, tma=True),
             _v(128, 256, 64, 8, 3, GROUP_M=8, tma=True)],
    "large": [_v(128, 128, 64, 8, 4, GROUP_M=8, tma=True), _v(128, 128, 64, 8, 3, GROUP_M=8, tma=True),
              _v(64, 128, 64, 4, 3, GROUP_M=8, tma=True), _v(64, 128, 64, 4, 4, GROUP_M=8, tma=True),
              _v(128, 64, 64, 4, 4, GROUP_M=8, tma=True), _v(128, 256, 64, 8, 3, GROUP_M=8, tma=True),
              _v(128, 128, 64, 8, 4, GROUP_M=16, tma=True)],
}
for _variants in GEMM_VARIANTS.values():  # pointer loads, direct launch unless a variant asks otherwise
    for _cfg in _variants:
        _cfg.setdefault("tma", False)
        _cfg.setdefault("split", False)
        _cfg.setdefault("GROUP_M", 1)


def gemm_spec(k_chunk):
    """The contract's [gemm] with this K chunk (the old kernels of --base take the bare number)."""
    return dataclasses.replace(load_contract().gemm, k_chunk=k_chunk)


def logprobs_spec(chunk):
    return dataclasses.replace(load_contract().logprobs, vocab_chunk=chunk)


def run_variant(x, w, out_dtype, k_chunk, cfg):
    return gemm.linear(x, w, None, out_dtype, gemm_spec(k_chunk), cfg, policy=CUDA_LAUNCH)


def _times(row) -> str:
    """Every variant's time in microseconds, in the order of the variant list ('-' = did not run)."""
    return " ".join(f"{v['ms'] * 1e3:.1f}" if v["ms"] == v["ms"] else "-" for v in row["variants"])


def mm_args(pair):
    x, w = pair
    return x, w.T


def _class(m: int) -> str:
    return "small" if m <= 16 else "m64" if m <= 64 else "m256" if m <= 256 else "large"


def gemm_sweep(k_chunk, ms, pairs):
    rows = []
    for n, k in pairs:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
        ws = [w] + [w.clone() for _ in range(3 if n * k * 2 < (120 << 20) else 0)]  # graph replays: not from L2
        out_dtype = torch.float32 if n == 152064 else torch.bfloat16
        for m in ms:
            xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
            pairs = [(xs[i], ws[i % len(ws)]) for i in range(4)]
            it = iter(range(10 ** 9))
            ref = v0_gemm.linear(xs[0], w, None, out_dtype, k_chunk)
            row = dict(op="gemm", shape=f"M={m} N={n} K={k}", v0_ms=bench(
                lambda: v0_gemm.linear(*pairs[next(it) % 4], None, out_dtype, k_chunk)))
            if out_dtype == torch.float32:
                row["stock_ms"] = bench(lambda: torch.mm(*mm_args(pairs[next(it) % 4])).float())
            else:
                row["stock_ms"] = bench(lambda: torch.mm(*mm_args(pairs[next(it) % 4])))
            row["variants"] = []
            for cfg in GEMM_VARIANTS[_class(m)]:
                try:
                    same = torch.equal(run_variant(xs[0], w, out_dtype, k_chunk, cfg), ref)
                    t = bench(lambda: run_variant(*pairs[next(it) % 4], out_dtype, k_chunk, cfg))
                except OutOfResources as exc:
                    same, t = None, float("nan")
                    print("out of resources", cfg, str(exc)[:100])
                row["variants"].append(dict(cfg=cfg, ms=t, equal_v0=same))
            row["default_ms"] = bench(lambda: gemm.linear(*pairs[next(it) % 4], None, out_dtype, gemm_spec(k_chunk),
                                                          policy=CUDA_LAUNCH))
            best = min((v for v in row["variants"] if v["ms"] == v["ms"]), key=lambda v: v["ms"])
            print(f"gemm {row['shape']:<24} cublas {row['stock_ms']:.4f} v0 {row['v0_ms']:.4f} default "
                  f"{row['default_ms']:.4f} best {best['ms']:.4f} ({best['cfg']}) ratio {row['stock_ms'] / best['ms']:.2f}"
                  f" all_equal={all(v['equal_v0'] for v in row['variants'] if v['equal_v0'] is not None)}"
                  f" | us: {_times(row)}", flush=True)
            rows.append(row)
        del w, ws
    return rows


# Third round (sweep_3, sweep_4 of ../h200-2026-11-29-session4): program numbering
# (``heads_fastest``: the programs that read one page's K/V of every head run side by side;
# prefill's longest tiles of every head start first), decode programs that walk several
# consecutive splits (``splits_per_program``: the start-up - locating the sequence, the first
# loads - paid less often), and (sweep_3 only) the GQA group's query heads in 2 or 4 programs
# (``head_split``: 1.2-4x slower, every program streams the whole K/V). Earlier rounds: prefill 64
# rows on 8 warps, 8/32-token tiles; decode 4/6 stages and 8 warps (sweep_2 of
# ../h200-2026-11-29-session3, sweep_call* of ../h200-2026-11-29-speed).
# The first variant is always the code's default; the others name every choice they make, so the
# lists keep their meaning when defaults move (sweep_4 ran them when tiles-fastest, one split per
# program was the default).
PREFILL_VARIANTS = [dict(), dict(heads_fastest=True, tma=False), dict(heads_fastest=True, tma=True),
                    dict(heads_fastest=True, tma=True, num_stages=3), dict(heads_fastest=True, num_stages=3)]
DECODE_VARIANTS = [dict(), dict(heads_fastest=False, splits_per_program=1)] + [
    dict(heads_fastest=True, splits_per_program=g) for g in (1, 2, 4, 8)] + [
    dict(heads_fastest=True, splits_per_program=2, num_stages=4),
    dict(heads_fastest=True, splits_per_program=1, num_warps=8), dict(heads_fastest=True, splits_per_program=2, num_warps=8)]
# Fourth round: the cache's memory order and page size (hal.kvcache). vLLM's NHD order puts one
# head's 256-byte key rows 2 KB apart (8 KV heads); HND makes one head's page contiguous. The same
# keys at the same positions in every layout: bitwise equal. sweep_5 (NHD/HND x 16/64-key pages x
# default, 1 and 2 splits per program): HND = NHD within 1%; 64-key pages 2-4% faster than 16.
# sweep_6 (../h200-2026-11-29-session5): K/V by tensor descriptor (``tma``), the merge loop's
# pipeline depth (``merge_stages`` 1/3/6, since removed: 3 was 15% slower at B = 1 x 32k), 2 warps.
# Fifth round (sweep_7 of ../h200-2026-11-29-session6; every variant bitwise equal, none faster
# than the default): a deeper K/V pipeline (``num_stages=7``: three chunk buffers instead of two,
# 2 programs per multiprocessor instead of 3, by bench/sm90_report.py; 1-8% slower), the 64-row
# MMA tile (``block_q=16``: wgmma from shared memory, row max and sum inside each warp, 4x the MMA
# work of the 16-row tile; 1.2-3.8x slower), and a merge kernel that loaded eight splits before
# folding them (``merge_by_eight``, since removed: the merge kernel 10-33% slower).
DECODE_LAYOUTS = [("NHD", 16), ("NHD", 64)]
DECODE_LAYOUT_LAUNCHES = [dict(), dict(num_stages=7), dict(block_q=16, num_stages=3)]


def _attention_variants(row, sets, spec, variants, ref):
    """Time each launch variant on rotating input sets (graph replays must not run from L2)."""
    def args_of(problem):
        q, kc, vc, meta = problem
        return (q, kc, vc, meta.query_start_loc, meta.seq_lens, meta.block_table, q.shape[-1] ** -0.5, spec)
    nxt = rotating(sets)
    for lc in variants:
        try:
            same = torch.equal(attention.paged_attention(*args_of(sets[0]), policy=CUDA_LAUNCH, **lc), ref)
            t = bench(lambda: attention.paged_attention(*args_of(nxt()), policy=CUDA_LAUNCH, **lc))
        except OutOfResources:
            same, t = None, float("nan")
        row["variants"].append(dict(cfg=lc, ms=t, equal_v0=same))
    return min((v for v in row["variants"] if v["ms"] == v["ms"]), key=lambda v: v["ms"])


def kernel_times(fn, calls: int = 20) -> dict:
    """Device microseconds per call of each kernel that ``fn`` launches (torch profiler)."""
    fn()
    torch.cuda.synchronize()
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
        return {event.key[:40]: round(event.device_time_total / calls, 2) for event in prof.key_averages()
                if event.device_time_total > 0}
    except Exception as exc:  # noqa: BLE001 - the breakdown is extra evidence, not the measurement
        return {"error": repr(exc)[:200]}


def prefill_sweep(spec):
    rows = []
    hq, hkv, d = 32, 8, 128
    for seq in (512, 1024, 2048, 4096, 8192):
        problem = paged_problem([seq], [seq], hq, hkv, d, 64)
        q, kc, vc, meta = problem
        qs, ks, vs = sdpa_problem(1, seq, seq, hq, hkv, d)
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            stock = bench(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True))
        ref = v0_attention.paged_attention(q, kc, vc, meta.query_start_loc, meta.seq_lens, meta.block_table,
                                           d ** -0.5, spec.kv_chunk, spec.kv_split)
        row = dict(op="prefill", shape=f"L={seq}", stock_ms=stock, variants=[])
        best = _attention_variants(row, [problem], spec, PREFILL_VARIANTS, ref)
        flops = 4 * seq * seq * d * hq / 2
        print(f"prefill L={seq:<6} sdpa {stock:.4f} default {row['variants'][0]['ms']:.4f} best {best['ms']:.4f} "
              f"{best['cfg']} ratio {stock / row['variants'][0]['ms']:.2f} -> {stock / best['ms']:.2f} "
              f"{flops / best['ms'] / 1e9:.0f} TFLOP/s "
              f"all_equal={all(v['equal_v0'] for v in row['variants'] if v['equal_v0'] is not None)} | us: {_times(row)}",
              flush=True)
        rows.append(row)
    return rows


# A vLLM decode step (bench/vllm_gpu.py's 1.7B run): 256 sequences of 64..768 keys (prompts of
# 64..512 plus up to 256 new tokens), Qwen3-1.7B's 16 query / 8 KV heads, 64-key pages. The
# profile of session 7 put our decode attention at 167 us per layer there against stock vLLM's
# FlashAttention 3 at 128 us (its KV stream: ~577 MB, 3.5 vs 4.5 TB/s).
VLLM_DECODE_VARIANTS = DECODE_VARIANTS + [
    dict(num_stages=3), dict(num_stages=4), dict(num_stages=6), dict(num_warps=2), dict(num_warps=8),
    dict(splits_per_program=2, num_warps=8), dict(heads_fastest=False)]


def vllm_decode_sweep(spec):
    rows = []
    hq, hkv, d, page = 16, 8, 128, 64
    g = torch.Generator().manual_seed(0)
    for batch, lo, hi in [(256, 64, 768), (128, 64, 768), (256, 600, 1024)]:
        lens = torch.randint(lo, hi + 1, (batch,), generator=g).tolist()
        kv_bytes = 2 * sum(lens) * hkv * d * 2
        sets = [paged_problem(lens, [1] * batch, hq, hkv, d, page) for _ in range(copies(kv_bytes))]
        q, kc, vc, meta = sets[0]
        ref = v0_attention.paged_attention(q, kc, vc, meta.query_start_loc, meta.seq_lens, meta.block_table,
                                           d ** -0.5, spec.kv_chunk, spec.kv_split)
        row = dict(op="vllm-decode", shape=f"B={batch} ctx={lo}..{hi} heads={hq}/{hkv} page={page}", variants=[])
        best = _attention_variants(row, sets, spec, VLLM_DECODE_VARIANTS, ref)
        default = row["variants"][0]
        print(f"vllm-decode {row['shape']:<36} default {default['ms'] * 1e3:.1f} us "
              f"({kv_bytes / default['ms'] / 1e9:.2f} TB/s) best {best['ms'] * 1e3:.1f} us {best['cfg']} "
              f"({kv_bytes / best['ms'] / 1e9:.2f} TB/s) all_equal={all(v['equal_v0'] for v in row['variants'] if v['equal_v0'] is not None)} "
              f"| us: {_times(row)}", flush=True)
        rows.append(row)
        del sets
    return rows

def decode_sweep(spec, layouts=False):
    """Decode launch variants on vLLM's cache order (page 16, NHD); with ``layouts``, the cache
    orders and page sizes of DECODE_LAYOUTS instead, each with DECODE_LAYOUT_LAUNCHES."""
    rows = []
    hq, hkv, d = 32, 8, 128
    for batch, ctx in [(1, 4096), (1, 32768), (8, 4096), (8, 32768), (64, 4096), (64, 32768), (256, 4096)]:
        kv_bytes = 2 * batch * ctx * hkv * d * 2
        n_sets = copies(kv_bytes)
        sets = [paged_problem([ctx] * batch, [1] * batch, hq, hkv, d, 16) for _ in range(n_sets)]
        sdpa = [sdpa_problem(batch, 1, ctx, hq, hkv, d) for _ in range(n_sets)]
        nxt_sdpa = rotating(sdpa)
        stock = bench(lambda: F.scaled_dot_product_attention(*nxt_sdpa(), enable_gqa=True))
        q, kc, vc, meta = sets[0]
        ref = v0_attention.paged_attention(q, kc, vc, meta.query_start_loc, meta.seq_lens, meta.block_table,
                                           d ** -0.5, spec.kv_chunk, spec.kv_split)
        row = dict(op="decode", shape=f"B={batch} ctx={ctx}", stock_ms=stock, variants=[])
        if layouts:
            for layout, page in DECODE_LAYOUTS:
                paged = sets if (layout, page) == ("NHD", 16) else [relayout(p, page, layout) for p in sets]
                before = len(row["variants"])
                _attention_variants(row, paged, spec, DECODE_LAYOUT_LAUNCHES, ref)
                for v in row["variants"][before:]:
                    v["layout"], v["page"] = layout, page
                del paged
            best = min((v for v in row["variants"] if v["ms"] == v["ms"]), key=lambda v: v["ms"])
        else:
            best = _attention_variants(row, sets, spec, DECODE_VARIANTS, ref)
        default = row["variants"][0]
        if not layouts:
            row["kernels_us"] = {name: kernel_times(lambda: attention.paged_attention(
                q, kc, vc, meta.query_start_loc, meta.seq_lens, meta.block_table, d ** -0.5, spec,
                policy=CUDA_LAUNCH, **v["cfg"])) for name, v in (("default", default), ("best", best))}
        print(f"decode {row['shape']:<16} sdpa {stock:.4f} default {default['ms']:.4f} best {best['ms']:.4f} "
              f"{best['cfg']} {best.get('layout', '')}{best.get('page', '')} ratio {stock / default['ms']:.2f} -> {stock / best['ms']:.2f} "
              f"{kv_bytes / best['ms'] / 1e6:.0f} GB/s kernels(us) {row.get('kernels_us', '-')} "
              f"all_equal={all(v['equal_v0'] for v in row['variants'])} | us: {_times(row)}", flush=True)
        rows.append(row)
        del sets, sdpa
    return rows


def logprob_sweep(chunk):
    rows = []
    for m in (1, 64, 1024):
        logits = torch.randn(m, 152064, device="cuda", dtype=torch.float32) * 4
        ids = torch.randint(0, 152064, (m,), device="cuda")
        same = torch.equal(logprobs.token_logprobs(logits, ids, 1.0, logprobs_spec(chunk)),
                           v0_logprobs.token_logprobs(logits, ids, 1.0, chunk))
        row = dict(op="token_logprobs", shape=f"M={m}", equal_v0=same,
                   ms=bench(lambda: logprobs.token_logprobs(logits, ids, 1.0, logprobs_spec(chunk))),
                   v0_ms=bench(lambda: v0_logprobs.token_logprobs(logits, ids, 1.0, chunk)),
                   stock_ms=bench(lambda: torch.log_softmax(logits, -1).gather(-1, ids[:, None])),
                   graph_ms=graph_ms(lambda: logprobs.token_logprobs(logits, ids, 1.0, logprobs_spec(chunk))),
                   host_us=host_us(lambda: logprobs.token_logprobs(logits, ids, 1.0, logprobs_spec(chunk))))
        print(f"logprobs M={m:<5} torch {row['stock_ms']:.4f} v0 {row['v0_ms']:.4f} new {row['ms']:.4f} "
              f"graph {row['graph_ms']:.4f} host {row['host_us']:.0f}us equal={same}", flush=True)
        rows.append(row)
    return rows


def overhead_rows(k_chunk):
    """Host cost per call vs device time, at sizes where the device is fast; at M = 64 the same
    tiles with descriptor (TMA) and pointer loads, and building the two descriptors alone."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows = []
    bf = torch.bfloat16
    w = torch.randn(4096, 4096, device="cuda", dtype=bf)
    x = torch.randn(1, 4096, device="cuda", dtype=bf)
    x64 = torch.randn(64, 4096, device="cuda", dtype=bf)
    tma = dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=128, tma=True, num_warps=4, num_stages=6)
    pointer = dict(tma, tma=False, num_stages=4)
    backend = create_backend("cuda")
    spec = gemm_spec(k_chunk)
    for name, fn in [("torch.mm M=1", lambda: torch.mm(x, w.T)),
                     ("gemm.linear M=1", lambda: gemm.linear(x, w, None, bf, spec, policy=CUDA_LAUNCH)),
                     ("backend.linear M=1", lambda: backend.linear(x, w)),
                     ("v0 linear M=1", lambda: v0_gemm.linear(x, w, None, bf, k_chunk)),
                     ("torch.mm M=64", lambda: torch.mm(x64, w.T)),
                     ("gemm.linear M=64 TMA", lambda: gemm.linear(x64, w, None, bf, spec, tma, policy=CUDA_LAUNCH)),
                     ("gemm.linear M=64 pointer", lambda: gemm.linear(x64, w, None, bf, spec, pointer,
                                                                      policy=CUDA_LAUNCH)),
                     ("2 descriptors", lambda: (TensorDescriptor.from_tensor(x64, [64, 128]),
                                                TensorDescriptor.from_tensor(w, [32, 128]))),
                     ("torch.empty", lambda: torch.empty(16, device="cuda"))]:
        rows.append(dict(op="overhead", shape=name, host_us=host_us(fn), graph_ms=graph_ms(fn), ms=bench(fn)))
        print(f"overhead {name:<26} host {rows[-1]['host_us']:.1f}us graph {rows[-1]['graph_ms'] * 1e3:.1f}us "
              f"eager {rows[-1]['ms'] * 1e3:.1f}us", flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--only", default="overhead,gemm,attention,logprobs")
    parser.add_argument("--graph", action="store_true", help="time variants by CUDA-graph replay (device time)")
    parser.add_argument("--ms", default="1,16,64,256,1024,4096,8192", help="GEMM M values")
    parser.add_argument("--nk", default="4096x4096,14336x4096,4096x14336,152064x4096", help="GEMM (N, K) pairs")
    old_kernels.add_argument(parser)
    args = parser.parse_args()
    global GRAPH, v0_gemm, v0_attention, v0_logprobs
    GRAPH = args.graph
    base = old_kernels.load(args.base)
    v0_gemm, v0_attention, v0_logprobs = base.gemm, base.attention, base.logprobs
    contract = create_backend("cuda").contract
    start = time.time()
    rows = []
    steps = {"overhead": lambda: overhead_rows(contract.gemm.k_chunk),
             "logprobs": lambda: logprob_sweep(contract.logprobs.vocab_chunk),
             "attention": lambda: prefill_sweep(contract.attention) + decode_sweep(contract.attention),
             "prefill": lambda: prefill_sweep(contract.attention),
             "decode": lambda: decode_sweep(contract.attention),
             "vllm-decode": lambda: vllm_decode_sweep(contract.attention),
             "layouts": lambda: decode_sweep(contract.attention, layouts=True),
             "gemm": lambda: gemm_sweep(contract.gemm.k_chunk, [int(m) for m in args.ms.split(",")],
                                        [tuple(int(v) for v in nk.split("x")) for nk in args.nk.split(",")])}
    for name in args.only.split(","):
        rows += steps[name]()
        print(f"{name} done at {time.time() - start:.0f}s", flush=True)
        with open(args.json, "w") as f:  # after every step: a timeout keeps what was measured
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
