"""Issue #20's sweep: the cuda kernels over a shape *family* (not a list), against the stock kernels.

  gemm     every linear (qkv, o, gate_up, down, lm_head) of the dense Llama-3, Qwen2.5 and Qwen3 models
           from 0.5B to 72B (``MODELS``: their public configs) at M = 1, 2, 4, ..., 8192: ``backend.linear``
           (the kernel's table, or with ``HAL_TUNE_CACHE`` a ``hal tune`` cache) against cuBLAS
           (``F.linear``; fp32 logits for lm_head, as the trainer computes them).
  decode   paged decode attention, pages of 16/32/64/128 keys, GQA ratios 1/2/4/8 (8 KV heads), head dims
           64/128, B = 1, 4, 16, 64, 256, contexts 512..32k (B x ctx <= 2**19 keys), against SDPA on
           contiguous K/V (its default dispatch) and, where vLLM imports (the GPU bundle on PYTHONPATH),
           vLLM's FlashAttention-3 on the same paged cache (``flash_attn_varlen_func`` with a block table).
           Also the KV bytes read per second.
  prefill  causal prefill of one sequence, L = 512..16k, against SDPA's flash kernel.

Timing: device time under CUDA-graph replay (``graph_ms``: a graph of n calls, ~2 ms, inputs rotating over
enough copies to exceed L2, median of 5 replays), the same for every kernel. Cells are run in a seeded
random order, so a run cut by ``--budget-s`` leaves a uniform sample of the family; the JSON is rewritten
after every cell. Ratios are stock time / ours (> 1: ours faster). The summary prints the distribution
(min / 10th percentile / median) per op and how many cells meet issue #20's targets;
``bench/plot_family_sweep.py`` draws it.

    python3 bench/family_sweep.py --only gemm,decode,prefill --budget-s 500 --json family.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time

import torch
import torch.nn.functional as F

from bench_cuda import copies     # input copies to rotate over so that replays do not run from L2
from hal.api import create_backend

# (hidden, intermediate, query heads, KV heads, head dim, vocab) of each model's public config
MODELS = {
    "llama-3-8b": (4096, 14336, 32, 8, 128, 128256), "llama-3-70b": (8192, 28672, 64, 8, 128, 128256),
    "qwen2.5-0.5b": (896, 4864, 14, 2, 64, 151936), "qwen2.5-1.5b": (1536, 8960, 12, 2, 128, 151936),
    "qwen2.5-3b": (2048, 11008, 16, 2, 128, 151936), "qwen2.5-7b": (3584, 18944, 28, 4, 128, 152064),
    "qwen2.5-14b": (5120, 13824, 40, 8, 128, 152064), "qwen2.5-32b": (5120, 27648, 40, 8, 128, 152064),
    "qwen2.5-72b": (8192, 29568, 64, 8, 128, 152064), "qwen3-0.6b": (1024, 3072, 16, 8, 128, 151936),
    "qwen3-1.7b": (2048, 6144, 16, 8, 128, 151936), "qwen3-4b": (2560, 9728, 32, 8, 128, 151936),
    "qwen3-8b": (4096, 12288, 32, 8, 128, 151936), "qwen3-14b": (5120, 17408, 40, 8, 128, 151936),
    "qwen3-32b": (5120, 25600, 64, 8, 128, 151936),
}
GEMM_MS = [2 ** i for i in range(14)]          # 1 .. 8192


def log(msg: str) -> None:
    print(msg, flush=True)


def linears(hidden, inter, hq, hkv, hd, vocab):
    """(name, N, K) of a decoder's linears (merged qkv and gate_up, as vLLM and hal.model run them)."""
    return [("qkv", (hq + 2 * hkv) * hd, hidden), ("o", hidden, hq * hd), ("gate_up", 2 * inter, hidden),
            ("down", hidden, inter), ("lm_head", vocab, hidden)]


def graph_ms(calls, target_ms: float = 2.0) -> float:
    """Median device time of one call: ``calls`` is a list of zero-argument callables (one per input copy);
    a CUDA graph of n of them in turn (n so that the graph runs ~target_ms) replayed 5 times."""
    for fn in calls:
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for fn in calls:
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate = start.elapsed_time(end) / len(calls)
    n = max(len(calls), min(200, int(target_ms / max(estimate, 1e-3))))
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        calls[0]()                                 # warm the side stream (allocator, cuBLAS workspace)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        for i in range(n):
            calls[i % len(calls)]()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / n)
    del graph
    return sorted(times)[2]


def gemm_cells():
    shapes = {}
    for model, cfg in MODELS.items():
        for name, n, k in linears(*cfg):
            shapes.setdefault((n, k, name == "lm_head"), []).append(f"{model}.{name}")
    return [dict(op="gemm", m=m, n=n, k=k, logits=logits, layers=layers)
            for (n, k, logits), layers in shapes.items() for m in GEMM_MS]


def run_gemm(backend, cell):
    m, n, k = cell["m"], cell["n"], cell["k"]
    out_dtype = torch.float32 if cell["logits"] else torch.bfloat16
    sets = [(torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
             (torch.randn(n, k, device="cuda") * k ** -0.5).to(torch.bfloat16))
            for _ in range(copies(n * k * 2 + m * k * 2))]
    ours = [lambda x=x, w=w: backend.linear(x, w, out_dtype=out_dtype) for x, w in sets]
    if cell["logits"]:
        stock = [lambda x=x, w=w: F.linear(x, w).float() for x, w in sets]
    else:
        stock = [lambda x=x, w=w: F.linear(x, w) for x, w in sets]
    ours_ms, stock_ms = graph_ms(ours), graph_ms(stock)
    weight_bytes = n * k * 2
    return dict(ours_ms=ours_ms, cublas_ms=stock_ms, ratio=stock_ms / ours_ms,
                tflops=2 * m * n * k / ours_ms / 1e9, weight_TBps=weight_bytes / ours_ms / 1e9)


def decode_cells():
    cells = []
    for d in (64, 128):
        for group in (1, 2, 4, 8):
            for batch in (1, 4, 16, 64, 256):
                for ctx in (512, 2048, 8192, 32768):
                    if batch * ctx > 2 ** 19:
                        continue
                    cells.append(dict(op="decode", batch=batch, ctx=ctx, hq=8 * group, hkv=8, d=d))
    return cells


def paged(batch, ctx, hkv, d, page, seed):
    """Random paged K/V caches for ``batch`` sequences of ``ctx`` keys (pages in random order)."""
    per_seq = -(-ctx // page)
    g = torch.Generator(device="cuda").manual_seed(seed)
    k_cache = torch.randn(batch * per_seq, page, hkv, d, device="cuda", generator=g).to(torch.bfloat16)
    v_cache = torch.randn(batch * per_seq, page, hkv, d, device="cuda", generator=g).to(torch.bfloat16)
    perm = torch.randperm(batch * per_seq, device="cuda", generator=g).to(torch.int32)
    return k_cache, v_cache, perm.view(batch, per_seq)


def flash_attention_3():
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except Exception as exc:           # no vLLM bundle on the path, or its CUDA libraries missing
        log(f"decode: no vLLM FlashAttention-3 ({type(exc).__name__}: {exc}); SDPA only")
        return None
    return flash_attn_varlen_func


def run_decode(backend, cell, fa3):
    batch, ctx, hq, hkv, d = cell["batch"], cell["ctx"], cell["hq"], cell["hkv"], cell["d"]
    kv_bytes = 2 * batch * ctx * hkv * d * 2
    n_sets = copies(kv_bytes)
    scale = d ** -0.5
    q = [torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16) for _ in range(n_sets)]
    sdpa_kv = [(torch.randn(batch, hkv, ctx, d, device="cuda", dtype=torch.bfloat16),
                torch.randn(batch, hkv, ctx, d, device="cuda", dtype=torch.bfloat16)) for _ in range(n_sets)]
    sdpa = [lambda i=i: F.scaled_dot_product_attention(q[i].unsqueeze(2), *sdpa_kv[i], enable_gqa=True)
            for i in range(n_sets)]
    result = dict(sdpa_ms=graph_ms(sdpa), kv_MB=kv_bytes / 1e6)
    del sdpa_kv, sdpa
    cu_q = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    seq_lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    for page in (16, 32, 64, 128):
        caches = [paged(batch, ctx, hkv, d, page, seed=i) for i in range(n_sets)]
        metas = [_meta(cu_q, seq_lens, bt) for _, _, bt in caches]
        ours = [lambda i=i: backend.attention(q[i], caches[i][0], caches[i][1], metas[i], scale=scale)
                for i in range(n_sets)]
        result[f"ours_ms_p{page}"] = graph_ms(ours)
        if fa3 is not None and "fa3_ms" not in result:
            try:
                fa = [lambda i=i: fa3(q[i], caches[i][0], caches[i][1], cu_seqlens_q=cu_q, max_seqlen_q=1,
                                      seqused_k=seq_lens, max_seqlen_k=ctx, softmax_scale=scale, causal=True,
                                      block_table=caches[i][2], fa_version=3) for i in range(n_sets)]
                result["fa3_ms"] = graph_ms(fa)
                result["fa3_page"] = page
            except Exception as exc:
                result.setdefault("fa3_error", f"page {page}: {type(exc).__name__}: {str(exc)[:120]}")
        del caches, metas, ours
    ours_best = min(result[f"ours_ms_p{p}"] for p in (16, 32, 64, 128))
    stock = min(v for key, v in result.items() if key in ("sdpa_ms", "fa3_ms"))
    result.update(ours_ms=result["ours_ms_p64"], ratio=stock / result["ours_ms_p64"],
                  ratio_per_page={p: stock / result[f"ours_ms_p{p}"] for p in (16, 32, 64, 128)},
                  ours_best_ms=ours_best, hbm_TBps_p64=kv_bytes / result["ours_ms_p64"] / 1e9)
    return result


def _meta(cu_q, seq_lens, block_table):
    from hal.backend import AttentionMetadata

    return AttentionMetadata(query_start_loc=cu_q, seq_lens=seq_lens, block_table=block_table)


def prefill_cells():
    return [dict(op="prefill", seq=seq, hq=hq, hkv=hkv, d=d) for seq in (512, 1024, 2048, 4096, 8192, 16384)
            for hq, hkv, d in ((32, 8, 128), (16, 8, 128), (14, 2, 64))]


def run_prefill(backend, cell):
    seq, hq, hkv, d = cell["seq"], cell["hq"], cell["hkv"], cell["d"]
    page = 64
    k_cache, v_cache, bt = paged(1, seq, hkv, d, page, seed=1)
    q = torch.randn(seq, hq, d, device="cuda", dtype=torch.bfloat16)
    meta = _meta(torch.tensor([0, seq], device="cuda", dtype=torch.int32),
                 torch.tensor([seq], device="cuda", dtype=torch.int32), bt)
    qs, ks, vs = (torch.randn(1, h, seq, d, device="cuda", dtype=torch.bfloat16) for h in (hq, hkv, hkv))

    def sdpa():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
    ours_ms = graph_ms([lambda: backend.attention(q, k_cache, v_cache, meta, scale=d ** -0.5)])
    sdpa_ms = graph_ms([sdpa])
    return dict(ours_ms=ours_ms, sdpa_ms=sdpa_ms, ratio=sdpa_ms / ours_ms,
                tflops=4 * seq * seq * d * hq / 2 / ours_ms / 1e9)


def quantile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))] if xs else float("nan")


def summary(rows) -> dict:
    """Distribution of the ratio per op and the cells meeting issue #20's targets."""
    out = {}
    for op in ("gemm", "decode", "prefill"):
        done = [r for r in rows if r["op"] == op and "ratio" in r]
        if not done:
            continue
        ratios = [r["ratio"] for r in done]
        s = dict(cells=len(done), min=min(ratios), p10=quantile(ratios, 0.1), median=quantile(ratios, 0.5),
                 max=max(ratios))
        if op == "gemm":
            small = [r for r in done if r["m"] <= 16]
            s.update(target="ratio >= 0.90 everywhere, >= 1.0 at M <= 16",
                     meeting_090=sum(r["ratio"] >= 0.9 for r in done),
                     small_m_cells=len(small), small_m_meeting_100=sum(r["ratio"] >= 1.0 for r in small))
            for m in GEMM_MS:
                at = [r["ratio"] for r in done if r["m"] == m]
                if at:
                    s[f"median_m{m}"] = quantile(at, 0.5)
                    s[f"min_m{m}"] = min(at)
        elif op == "decode":
            b4 = [r for r in done if r["batch"] >= 4]
            b1 = [r for r in done if r["batch"] == 1 and r["ctx"] >= 4096]
            s.update(target="ratio >= 0.90 at B >= 4 (vs the faster of SDPA / FA3); >= 70% HBM at B = 1, >= 4k keys",
                     b4_cells=len(b4), b4_meeting_090=sum(r["ratio"] >= 0.9 for r in b4),
                     b1_long_cells=len(b1), b1_hbm_TBps=[round(r["hbm_TBps_p64"], 2) for r in b1])
        else:
            s.update(target="ratio >= 0.85 (vs SDPA flash)", meeting_085=sum(r["ratio"] >= 0.85 for r in done))
        out[op] = s
    return out


def previous_decode_launch(programs: int, sms: int, kv_fp8: bool, *, max_splits: int, head_dim: int,
                           page: int) -> dict:
    """``attention._decode_launch`` as it was before its refit on the launch search (commit 54375fc): parallel
    splits, 4 warps, 5 stages, no register cap, two splits a program in the partial-wave band and above 16
    programs a multiprocessor; FP8 caches filling the GPU one split at 3 stages / 128 registers."""
    if sms == 0:
        return dict(splits_per_program=1, num_stages=5, maxnreg=0)
    if kv_fp8 and programs > sms:
        return dict(splits_per_program=1, num_stages=3, maxnreg=128)
    two = programs > 16 * sms or 3 * sms < programs <= 4 * sms
    return dict(splits_per_program=2 if two else 1, num_stages=5, maxnreg=0)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="gemm,decode,prefill")
    parser.add_argument("--budget-s", type=float, default=540, help="stop starting new cells after this many seconds")
    parser.add_argument("--seed", type=int, default=0, help="the cell order's shuffle")
    parser.add_argument("--gemm-m", default=None, help="GEMM cells at these M only (comma-separated; default all)")
    parser.add_argument("--decode-rule", choices=("current", "previous"), default="current",
                        help="previous: time decode with the launch rule before 2026-12-06's refit (a before/after "
                             "on one GPU; the bits are the same either way)")
    parser.add_argument("--resume", default=None,
                        help="a JSON this script wrote on the same kind of GPU: keep its rows and run only the cells "
                             "it lacks (a family too large for one device call is swept over several)")
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        log("family_sweep: needs a CUDA GPU")
        return 2
    if args.decode_rule == "previous":
        from hal.kernels import attention
        attention._decode_launch = previous_decode_launch
    backend = create_backend("cuda")
    only = args.only.split(",")
    cells = ([c for op in only for c in {"gemm": gemm_cells, "decode": decode_cells, "prefill": prefill_cells}[op]()])
    if args.gemm_m:
        keep = {int(m) for m in args.gemm_m.split(",")}
        cells = [c for c in cells if c["op"] != "gemm" or c["m"] in keep]
    random.Random(args.seed).shuffle(cells)
    fields = {c["op"]: sorted(c) for c in cells}          # each op's planned fields, before a run adds its own
    planned = {_cell_key(c, fields) for c in cells}
    rows = [r for r in _resumed_rows(args.resume, fields) if _cell_key(r, fields) in planned] if args.resume else []
    done = {_cell_key(r, fields) for r in rows}
    cells_total = len(cells)
    cells = [c for c in cells if _cell_key(c, fields) not in done]
    fa3 = flash_attention_3() if "decode" in only else None
    t0 = time.time()
    counts = ", ".join(f"{op}: {sum(c['op'] == op for c in cells)}" for op in only)
    log(f"{len(cells)} cells ({counts}), budget {args.budget_s:.0f} s, device {torch.cuda.get_device_name()}"
        + (f"; {len(rows)} of the family's {cells_total} kept from {args.resume}" if args.resume else ""))
    for i, cell in enumerate(cells):
        if time.time() - t0 > args.budget_s:
            log(f"budget reached after {i} of {len(cells)} cells")
            break
        try:
            if cell["op"] == "gemm":
                cell.update(run_gemm(backend, cell))
                label = f"M={cell['m']:5} N={cell['n']:6} K={cell['k']:5}"
            elif cell["op"] == "decode":
                cell.update(run_decode(backend, cell, fa3))
                label = f"B={cell['batch']:3} ctx={cell['ctx']:5} {cell['hq']}/{cell['hkv']}x{cell['d']}"
            else:
                cell.update(run_prefill(backend, cell))
                label = f"L={cell['seq']:5} {cell['hq']}/{cell['hkv']}x{cell['d']}"
            log(f"[{i + 1:4}/{len(cells)} {time.time() - t0:5.0f}s] {cell['op']:7} {label:32} ours "
                f"{cell['ours_ms'] * 1e3:9.1f} us  stock/ours {cell['ratio']:.2f}")
        except Exception as exc:          # a cell that cannot run (memory) is recorded, not fatal
            cell["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            log(f"[{i + 1:4}] {cell['op']} {cell}: {cell['error']}")
        rows.append(cell)
        torch.cuda.empty_cache()
        if i % 20 == 0 or i == len(cells) - 1:
            _write(args.json, rows, cells_total, t0)
    result = _write(args.json, rows, cells_total, t0)
    for op, s in result["summary"].items():
        log(f"{op}: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in s.items()))
    return 0


def _cell_key(row: dict, fields: dict) -> str:
    """A cell's identity: its planned fields (op, shape, ...), without what running it added."""
    return json.dumps([row.get(k) for k in fields[row["op"]]])


def _resumed_rows(path: str, fields: dict) -> list:
    """The rows of an earlier run of this family on the same kind of GPU (cells that errored run again)."""
    with open(path) as f:
        earlier = json.load(f)
    if earlier["device"] != torch.cuda.get_device_name():
        raise SystemExit(f"--resume {path}: measured on {earlier['device']}, this is {torch.cuda.get_device_name()}; "
                         "ratios from two GPUs do not make one distribution")
    return [r for r in earlier["rows"] if r["op"] in fields and "error" not in r]


def _write(path, rows, total, t0):
    result = dict(device=torch.cuda.get_device_name(), cells_planned=total, cells_run=len(rows),
                  seconds=time.time() - t0, summary=summary(rows), rows=rows)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    sys.exit(main())
