"""Benchmark the cuda backend against stock kernels and the measured hardware ceilings (H200).

One run, side by side, median of repeated CUDA-event timings (triton.testing.do_bench), random
inputs, several rotating input sets where the data would fit in L2:
  GEMM        cuda vs torch.mm (cuBLAS), M in 1..8192 for the Llama-8B and lm_head shapes; also
              the weight-read roofline (bytes of W / copy bandwidth) at small M
  prefill     cuda paged attention vs torch SDPA (flash) on the same causal problem
  decode      cuda paged attention vs SDPA on contiguous KV; achieved KV bandwidth
  rms_norm    cuda vs torch (x.float().pow(2).mean ... as in HF); logprobs: cuda vs torch.log_softmax

    python bench/bench_cuda.py --json bench.json [--quick]
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

from hal.api import create_backend
from hal.kvcache import build_metadata


def bench(fn, rep_ms: int = 60) -> float:
    """Median milliseconds."""
    return triton.testing.do_bench(fn, warmup=20, rep=rep_ms, return_mode="median")


def ceilings() -> dict:
    n = 1 << 30  # 1 GiB copy
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    copy_ms = bench(lambda: b.copy_(a))
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = bench(lambda: x @ y)
    return {"copy_GBps": 2 * n / copy_ms / 1e6, "bf16_mm_TFLOPs": 2 * 8192 ** 3 / mm_ms / 1e9}


def gemm_rows(backend, ceil, quick):
    rows = []
    shapes = [(4096, 4096), (14336, 4096), (4096, 14336), (152064, 4096)]
    ms = [1, 4, 16, 64, 256, 1024, 4096, 8192] if not quick else [1, 16, 256, 4096]
    for n, k in shapes:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
        for m in ms:
            xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
            it = iter(range(10 ** 9))
            out_dtype = torch.float32 if n == 152064 else torch.bfloat16
            t_ours = bench(lambda: backend.linear(xs[next(it) % 4], w, out_dtype=out_dtype))
            if out_dtype == torch.float32:
                t_ref = bench(lambda: torch.mm(xs[next(it) % 4], w.T).float())
            else:
                t_ref = bench(lambda: torch.mm(xs[next(it) % 4], w.T))
            flops = 2 * m * n * k
            weight_ms = n * k * 2 / (ceil["copy_GBps"] * 1e6)
            rows.append(dict(op="gemm", shape=f"M={m} N={n} K={k}", ours_ms=t_ours, stock_ms=t_ref,
                             ratio=t_ref / t_ours, ours_TFLOPs=flops / t_ours / 1e9,
                             weight_roofline_frac=weight_ms / t_ours))
        del w
    return rows


def _paged(seq_lens, q_lens, hq, hkv, d, page, dtype=torch.bfloat16):
    total_pages = sum(-(-n // page) for n in seq_lens)
    k_cache = torch.randn(total_pages, page, hkv, d, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(total_pages).tolist()
    lists, at = [], 0
    for n in seq_lens:
        lists.append(perm[at: at + -(-n // page)])
        at += -(-n // page)
    q = torch.randn(sum(q_lens), hq, d, device="cuda", dtype=dtype)
    return q, k_cache, v_cache, build_metadata(q_lens, seq_lens, lists, "cuda"), lists


def attention_rows(backend, ceil, quick):
    rows = []
    hq, hkv, d = 32, 8, 128
    for seq in ([512, 2048, 8192] if quick else [512, 1024, 2048, 4096, 8192]):
        q, kc, vc, meta, _ = _paged([seq], [seq], hq, hkv, d, 64)
        qs = torch.randn(1, hq, seq, d, device="cuda", dtype=torch.bfloat16)
        ks = torch.randn(1, hkv, seq, d, device="cuda", dtype=torch.bfloat16)
        vs = torch.randn_like(ks)
        t_ours = bench(lambda: backend.attention(q, kc, vc, meta, scale=d ** -0.5))
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            t_ref = bench(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True))
        flops = 4 * seq * seq * d * hq / 2
        rows.append(dict(op="prefill", shape=f"L={seq} Hq={hq} Hkv={hkv} D={d}", ours_ms=t_ours, stock_ms=t_ref,
                         ratio=t_ref / t_ours, ours_TFLOPs=flops / t_ours / 1e9))
    for batch in ([1, 8, 64, 256] if not quick else [1, 64]):
        for ctx in ([128, 1024, 4096, 32768] if not quick else [4096, 32768]):
            if batch * ctx > 2 ** 21:
                continue
            q, kc, vc, meta, _ = _paged([ctx] * batch, [1] * batch, hq, hkv, d, 16)
            ks = torch.randn(batch, hkv, ctx, d, device="cuda", dtype=torch.bfloat16)
            vs = torch.randn_like(ks)
            qs = torch.randn(batch, hq, 1, d, device="cuda", dtype=torch.bfloat16)
            t_ours = bench(lambda: backend.attention(q, kc, vc, meta, scale=d ** -0.5))
            t_ref = bench(lambda: F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True))
            kv_bytes = 2 * batch * ctx * hkv * d * 2
            rows.append(dict(op="decode", shape=f"B={batch} ctx={ctx}", ours_ms=t_ours, stock_ms=t_ref,
                             ratio=t_ref / t_ours, kv_GBps=kv_bytes / t_ours / 1e6,
                             hbm_frac=kv_bytes / t_ours / 1e6 / ceil["copy_GBps"]))
    return rows


def row_rows(backend, ceil, quick):
    rows = []
    for m, h in [(1, 4096), (256, 4096), (8192, 4096)]:
        x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
        r = torch.randn_like(x)
        w = torch.randn(h, device="cuda", dtype=torch.bfloat16)

        def stock():
            s = x + r
            sf = s.float()
            return (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(s.dtype) * w

        t_ours = bench(lambda: backend.rms_norm(x, w, 1e-6, r))
        t_ref = bench(stock)
        nbytes = 4 * m * h * 2  # read x, r; write out, residual
        rows.append(dict(op="rms_norm+res", shape=f"M={m} H={h}", ours_ms=t_ours, stock_ms=t_ref,
                         ratio=t_ref / t_ours, hbm_frac=nbytes / t_ours / 1e6 / ceil["copy_GBps"]))
    for m, v in [(1, 152064), (64, 152064), (1024, 152064)]:
        logits = torch.randn(m, v, device="cuda", dtype=torch.float32) * 4
        ids = torch.randint(0, v, (m,), device="cuda")
        t_ours = bench(lambda: backend.token_logprobs(logits, ids))
        t_ref = bench(lambda: torch.log_softmax(logits, -1).gather(-1, ids[:, None]))
        nbytes = 2 * m * v * 4  # two reads of the logits (max, then exp-sum)
        rows.append(dict(op="token_logprobs", shape=f"M={m} V={v}", ours_ms=t_ours, stock_ms=t_ref,
                         ratio=t_ref / t_ours, hbm_frac=nbytes / t_ours / 1e6 / ceil["copy_GBps"]))
    for m, i in [(1, 14336), (1024, 14336)]:
        gu = torch.randn(m, 2 * i, device="cuda", dtype=torch.bfloat16)
        t_ours = bench(lambda: backend.silu_mul(gu))
        t_ref = bench(lambda: F.silu(gu[:, :i]) * gu[:, i:])
        rows.append(dict(op="silu_mul", shape=f"M={m} I={i}", ours_ms=t_ours, stock_ms=t_ref, ratio=t_ref / t_ours,
                         hbm_frac=3 * m * i * 2 / t_ours / 1e6 / ceil["copy_GBps"]))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    backend = create_backend("cuda")
    start = time.time()
    ceil = ceilings()
    print(f"ceilings: copy {ceil['copy_GBps']:.0f} GB/s, bf16 mm {ceil['bf16_mm_TFLOPs']:.0f} TFLOP/s", flush=True)
    rows = []
    for fn in (gemm_rows, attention_rows, row_rows):
        rows += fn(backend, ceil, args.quick)
        print(f"{fn.__name__} done at {time.time() - start:.0f}s", flush=True)
    with open(args.json, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                       contract=backend.contract.name, fingerprint=backend.fingerprint, ceilings=ceil, rows=rows),
                  f, indent=2)
    print(f"\n{'op':<15} {'shape':<28} {'ours ms':>9} {'stock ms':>9} {'stock/ours':>10}  extra")
    for r in rows:
        extra = ", ".join(f"{k}={r[k]:.2f}" for k in ("ours_TFLOPs", "weight_roofline_frac", "kv_GBps", "hbm_frac")
                          if k in r and not math.isnan(r[k]))
        print(f"{r['op']:<15} {r['shape']:<28} {r['ours_ms']:>9.4f} {r['stock_ms']:>9.4f} {r['ratio']:>10.2f}  {extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
