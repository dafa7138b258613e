"""Benchmark the cuda backend against stock kernels, its own first version and the measured ceilings (H200).

One run, side by side, random inputs, medians of repeated timings in two modes:
  eager   triton.testing.do_bench (CUDA events around each call, L2 flushed between calls): what
          a Python caller sees, host launch cost included (it dominates small shapes);
  graph   triton.testing.do_bench_cudagraph (calls captured in a CUDA graph and replayed): device
          time alone, as under vLLM's CUDA graphs. Inputs rotate over enough copies to exceed L2.
Each row also times an older version of the kernels ("v0": by default the first measured one, written
into .old_kernels/ by bench/old_kernels.sh; eager, as its decode path syncs and cannot be captured)
and checks that ours and v0 give bitwise equal outputs on the same inputs.
  GEMM        cuda vs torch.mm (cuBLAS), M in 1..8192 for the Llama-8B and lm_head shapes, and the
              weight-read roofline (bytes of W / copy bandwidth)
  prefill     cuda paged attention vs torch SDPA (flash) on the same causal problem
  decode      cuda paged attention vs SDPA (default dispatch) on contiguous KV; achieved KV bandwidth;
              16-token pages (vLLM's default) and, as decode_page64, the same keys in 64-token pages
  rows        RMSNorm + residual, SiLU*up (vs torch), token logprobs (vs log_softmax + gather)

    python bench/bench_cuda.py --json bench.json [--quick] [--only gemm,attention,rows] [--base .old_kernels]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch
import torch.nn.functional as F
import triton

import old_kernels
from hal.api import create_backend
from hal.kvcache import build_metadata, cache_tensor

v0_gemm = v0_attention = v0_logprobs = None  # the old kernels (--base), set by main()

L2_BYTES = 60 << 20


def eager(fn) -> float:
    """Median milliseconds per call, host launch cost included when it exceeds the device time."""
    return triton.testing.do_bench(fn, warmup=20, rep=60, return_mode="median")


def graph(fn) -> float:
    """Median device milliseconds per call, from CUDA-graph replays."""
    return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median")


def copies(nbytes: int) -> int:
    """How many input copies to rotate over so that graph replays do not run from L2."""
    return max(1, min(8, -(-2 * L2_BYTES // max(1, nbytes))))


def rotating(tensors_list):
    """A function returning the next set of tensors on each call."""
    state = [0]

    def next_set():
        state[0] = (state[0] + 1) % len(tensors_list)
        return tensors_list[state[0]]
    return next_set


def ceilings() -> dict:
    n = 1 << 30  # 1 GiB
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    copy_ms = eager(lambda: b.copy_(a))
    f = torch.randn(n // 4, device="cuda")
    read_ms = eager(lambda: f.sum())
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = eager(lambda: x @ y)
    return {"copy_GBps": 2 * n / copy_ms / 1e6, "read_GBps": n / read_ms / 1e6,
            "bf16_mm_TFLOPs": 2 * 8192 ** 3 / mm_ms / 1e9}


def timed(ours, stock, v0=None) -> dict:
    row = dict(ours_ms=eager(ours), stock_ms=eager(stock), ours_graph_ms=graph(ours), stock_graph_ms=graph(stock))
    if v0 is not None:
        row["v0_ms"] = eager(v0)
    row["ratio"] = row["stock_ms"] / row["ours_ms"]
    row["ratio_graph"] = row["stock_graph_ms"] / row["ours_graph_ms"]
    if v0 is not None:
        row["speedup_vs_v0"] = row["v0_ms"] / row["ours_ms"]
    return row


def gemm_rows(backend, ceil, quick):
    rows = []
    k_chunk = backend.contract.gemm.k_chunk
    shapes = [(4096, 4096), (14336, 4096), (4096, 14336), (152064, 4096)]
    ms = [1, 4, 16, 64, 256, 1024, 4096, 8192] if not quick else [1, 16, 256, 4096]
    for n, k in shapes:
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies(n * k * 2))]
        out_dtype = torch.float32 if n == 152064 else torch.bfloat16
        for m in ms:
            sets = [(torch.randn(m, k, device="cuda", dtype=torch.bfloat16), ws[i % len(ws)]) for i in range(4)]
            nxt = rotating(sets)
            x0, w0 = sets[0]
            same = torch.equal(backend.linear(x0, w0, out_dtype=out_dtype),
                               v0_gemm.linear(x0, w0, None, out_dtype, k_chunk))
            if out_dtype == torch.float32:
                def stock():
                    x, w = nxt()
                    return torch.mm(x, w.T).float()
            else:
                def stock():
                    x, w = nxt()
                    return torch.mm(x, w.T)
            row = timed(lambda: backend.linear(*nxt(), out_dtype=out_dtype), stock,
                        lambda: v0_gemm.linear(*nxt(), None, out_dtype, k_chunk))
            flops = 2 * m * n * k
            weight_ms = n * k * 2 / (ceil["copy_GBps"] * 1e6)
            rows.append(dict(op="gemm", shape=f"M={m} N={n} K={k}", equal_v0=same, **row,
                             ours_TFLOPs=flops / row["ours_graph_ms"] / 1e9,
                             weight_roofline_frac=weight_ms / row["ours_graph_ms"]))
        del ws
    return rows


def paged_caches(seq_lens, q_lens, hkv, d, page, dtype=torch.bfloat16, layout="NHD"):
    """Zeroed caches for these sequences, pages handed out in random order, in memory order
    ``layout`` (hal.kvcache), and their metadata."""
    total_pages = sum(-(-n // page) for n in seq_lens)
    k_cache = cache_tensor(total_pages, page, hkv, d, dtype, "cuda", layout)
    v_cache = cache_tensor(total_pages, page, hkv, d, dtype, "cuda", layout)
    perm = torch.randperm(total_pages).tolist()
    lists, at = [], 0
    for n in seq_lens:
        lists.append(perm[at: at + -(-n // page)])
        at += -(-n // page)
    return k_cache, v_cache, build_metadata(q_lens, seq_lens, lists, "cuda")


def paged_problem(seq_lens, q_lens, hq, hkv, d, page, dtype=torch.bfloat16, layout="NHD"):
    """Random q and caches (``paged_caches`` filled with random values)."""
    k_cache, v_cache, meta = paged_caches(seq_lens, q_lens, hkv, d, page, dtype, layout)
    k_cache.normal_()
    v_cache.normal_()
    q = torch.randn(sum(q_lens), hq, d, device="cuda", dtype=dtype)
    return q, k_cache, v_cache, meta


def relayout(problem, page, layout):
    """The same attention problem (same q, the same keys and values at every position) with the
    caches re-paged to ``page`` tokens per page in memory order ``layout``: outputs must be
    bitwise equal, page size and memory order being free."""
    q, k_cache, v_cache, meta = problem
    q_lens = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).tolist()
    seq_lens = meta.seq_lens.tolist()
    old_page = k_cache.shape[1]
    new_k, new_v, new_meta = paged_caches(seq_lens, q_lens, k_cache.shape[2], q.shape[2], page, q.dtype, layout)
    for b, n in enumerate(seq_lens):
        pos = torch.arange(n, device=q.device)
        old_pages = meta.block_table[b, pos // old_page].long()
        new_pages = new_meta.block_table[b, pos // page].long()
        new_k[new_pages, pos % page] = k_cache[old_pages, pos % old_page]
        new_v[new_pages, pos % page] = v_cache[old_pages, pos % old_page]
    return q, new_k, new_v, new_meta


def sdpa_problem(batch, q_len, kv_len, hq, hkv, d, dtype=torch.bfloat16):
    """SDPA's inputs for the same attention on contiguous K/V: q (B, Hq, Lq, D), k and v (B, Hkv, Lkv, D)."""
    return (torch.randn(batch, hq, q_len, d, device="cuda", dtype=dtype),
            torch.randn(batch, hkv, kv_len, d, device="cuda", dtype=dtype),
            torch.randn(batch, hkv, kv_len, d, device="cuda", dtype=dtype))


def _attention_row(backend, paged_sets, sdpa_sets, causal):
    nxt_ours, nxt_sdpa = rotating(paged_sets), rotating(sdpa_sets)
    d = paged_sets[0][0].shape[-1]
    q, kc, vc, meta = paged_sets[0]
    spec = backend.contract.attention
    args = (q, kc, vc, meta.query_start_loc, meta.seq_lens, meta.block_table, d ** -0.5, spec.kv_chunk,
            spec.kv_split)
    same = torch.equal(backend.attention(q, kc, vc, meta, scale=d ** -0.5), v0_attention.paged_attention(*args))

    def ours():
        q, kc, vc, meta = nxt_ours()
        return backend.attention(q, kc, vc, meta, scale=d ** -0.5)

    def stock():
        qs, ks, vs = nxt_sdpa()
        if not causal:  # decode: SDPA's default dispatch (faster than flash for one query at batch >= 64)
            return F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True)
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)

    def v0():
        q, kc, vc, meta = nxt_ours()
        return v0_attention.paged_attention(q, kc, vc, meta.query_start_loc, meta.seq_lens, meta.block_table,
                                            d ** -0.5, spec.kv_chunk, spec.kv_split)
    return dict(equal_v0=same, **timed(ours, stock, v0))


def attention_rows(backend, ceil, quick):
    rows = []
    hq, hkv, d = 32, 8, 128
    for seq in ([512, 2048, 8192] if quick else [512, 1024, 2048, 4096, 8192]):
        paged = [paged_problem([seq], [seq], hq, hkv, d, 64)]
        sdpa = [sdpa_problem(1, seq, seq, hq, hkv, d)]
        row = _attention_row(backend, paged, sdpa, causal=True)
        flops = 4 * seq * seq * d * hq / 2
        rows.append(dict(op="prefill", shape=f"L={seq} Hq={hq} Hkv={hkv} D={d}", **row,
                         ours_TFLOPs=flops / row["ours_graph_ms"] / 1e9))
    for batch in ([1, 8, 64, 256] if not quick else [1, 8, 64]):
        for ctx in ([128, 1024, 4096, 32768] if not quick else [4096, 32768]):
            if batch * ctx > 2 ** 21:
                continue
            kv_bytes = 2 * batch * ctx * hkv * d * 2
            n_sets = copies(kv_bytes)
            paged = [paged_problem([ctx] * batch, [1] * batch, hq, hkv, d, 16) for _ in range(n_sets)]
            sdpa = [sdpa_problem(batch, 1, ctx, hq, hkv, d) for _ in range(n_sets)]
            # vLLM's default 16-token pages ("decode"), then the same keys in 64-token pages
            # ("decode_page64": one page-table read per 64-key chunk; the bits are the same).
            for op, page in (("decode", 16), ("decode_page64", 64)):
                sets = paged if page == 16 else [relayout(p, page, "NHD") for p in paged]
                row = _attention_row(backend, sets, sdpa, causal=False)
                rows.append(dict(op=op, shape=f"B={batch} ctx={ctx}", **row,
                                 kv_GBps=kv_bytes / row["ours_graph_ms"] / 1e6,
                                 hbm_frac=kv_bytes / row["ours_graph_ms"] / 1e6 / ceil["read_GBps"]))
            del paged, sets, sdpa
    return rows


def row_rows(backend, ceil, quick):
    rows = []
    chunk = backend.contract.logprobs.vocab_chunk
    for m, h in [(1, 4096), (256, 4096), (8192, 4096)]:
        sets = [(torch.randn(m, h, device="cuda", dtype=torch.bfloat16),
                 torch.randn(m, h, device="cuda", dtype=torch.bfloat16)) for _ in range(copies(2 * m * h * 2))]
        nxt = rotating(sets)
        w = torch.randn(h, device="cuda", dtype=torch.bfloat16)

        def stock():
            x, r = nxt()
            s = x + r
            sf = s.float()
            return (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(s.dtype) * w

        def ours():
            x, r = nxt()
            return backend.rms_norm(x, w, 1e-6, r)

        row = timed(ours, stock)
        nbytes = 4 * m * h * 2  # read x, r; write out, residual
        rows.append(dict(op="rms_norm+res", shape=f"M={m} H={h}", **row,
                         hbm_frac=nbytes / row["ours_graph_ms"] / 1e6 / ceil["copy_GBps"]))
    for m, v in [(1, 152064), (64, 152064), (1024, 152064)]:
        sets = [(torch.randn(m, v, device="cuda", dtype=torch.float32) * 4, torch.randint(0, v, (m,), device="cuda"))
                for _ in range(copies(m * v * 4))]
        nxt = rotating(sets)
        same = torch.equal(backend.token_logprobs(*sets[0]), v0_logprobs.token_logprobs(*sets[0], 1.0, chunk))

        def stock():
            logits, ids = nxt()
            return torch.log_softmax(logits, -1).gather(-1, ids[:, None])

        row = timed(lambda: backend.token_logprobs(*nxt()), stock,
                    lambda: v0_logprobs.token_logprobs(*nxt(), 1.0, chunk))
        nbytes = 2 * m * v * 4  # two reads of the logits (max, then exp-sum)
        rows.append(dict(op="token_logprobs", shape=f"M={m} V={v}", equal_v0=same, **row,
                         hbm_frac=nbytes / row["ours_graph_ms"] / 1e6 / ceil["copy_GBps"]))
    for m, i in [(1, 14336), (1024, 14336)]:
        sets = [torch.randn(m, 2 * i, device="cuda", dtype=torch.bfloat16) for _ in range(copies(m * 2 * i * 2))]
        nxt = rotating(sets)

        def stock():
            gu = nxt()
            return F.silu(gu[:, :i]) * gu[:, i:]

        row = timed(lambda: backend.silu_mul(nxt()), stock)
        rows.append(dict(op="silu_mul", shape=f"M={m} I={i}", **row,
                         hbm_frac=3 * m * i * 2 / row["ours_graph_ms"] / 1e6 / ceil["copy_GBps"]))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", default="gemm,attention,rows")
    old_kernels.add_argument(parser)
    args = parser.parse_args()
    global v0_gemm, v0_attention, v0_logprobs  # the old kernels every row is timed and checked against
    base = old_kernels.load(args.base)
    v0_gemm, v0_attention, v0_logprobs = base.gemm, base.attention, base.logprobs
    backend = create_backend("cuda")
    start = time.time()
    ceil = ceilings()
    print(f"ceilings: copy {ceil['copy_GBps']:.0f} GB/s (read + write), read {ceil['read_GBps']:.0f} GB/s, "
          f"bf16 mm {ceil['bf16_mm_TFLOPs']:.0f} TFLOP/s", flush=True)
    rows = []
    steps = dict(gemm=gemm_rows, attention=attention_rows, rows=row_rows)
    for name in args.only.split(","):
        rows += steps[name](backend, ceil, args.quick)
        print(f"{name} done at {time.time() - start:.0f}s", flush=True)
    with open(args.json, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                       contract=backend.contract.name, fingerprint=backend.fingerprint, ceilings=ceil, rows=rows),
                  f, indent=2)
    print(f"\n{'op':<15} {'shape':<27} {'ours ms':>8} {'stock':>8} {'ratio':>6} {'v0 ms':>8} {'v0/ours':>7}"
          f" | {'graph ours':>10} {'stock':>8} {'ratio':>6}  extra (device time)")
    for r in rows:
        extra = ", ".join(f"{k}={r[k]:.2f}" for k in ("ours_TFLOPs", "weight_roofline_frac", "kv_GBps", "hbm_frac")
                          if k in r and not math.isnan(r[k]))
        if "equal_v0" in r:
            extra += f", equal_v0={r['equal_v0']}"
        v0 = f"{r['v0_ms']:>8.4f} {r['speedup_vs_v0']:>7.2f}" if "v0_ms" in r else f"{'-':>8} {'-':>7}"
        print(f"{r['op']:<15} {r['shape']:<27} {r['ours_ms']:>8.4f} {r['stock_ms']:>8.4f} {r['ratio']:>6.2f} {v0}"
              f" | {r['ours_graph_ms']:>10.4f} {r['stock_graph_ms']:>8.4f} {r['ratio_graph']:>6.2f}  {extra}")
    if not all(r.get("equal_v0", True) for r in rows):
        print("BITS DIFFER from the old kernels in:", [r["shape"] for r in rows if not r.get("equal_v0", True)])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
