"""Where a decode step's time goes, op by op, on the cuda backend (issues #19 and #20).

One decode step of a Qwen3-shaped model at batch B (one new token per sequence, contexts drawn from
64..768 keys), in the shapes and cache layout vLLM 0.26 hands the HAL: per layer RMSNorm (+ residual),
the QKV / O / gate-up / down linears, q/k RMSNorm, rotary, ``write_kv`` into vLLM's side-by-side cache
(pages, Hkv, P, 2D), paged attention over it, SiLU*up; then the logits GEMM, ``log_softmax`` and the
HAL sampler over the full vocabulary. Each op is timed twice (medians):

* eager: CUDA events around each call (triton.testing.do_bench): device time, or the host's cost per
  call where that is larger; this is what an op running between vLLM's CUDA-graph pieces costs;
* graph: replays of the call captured in a CUDA graph (do_bench_cudagraph): device time alone;

next to the stock op (cuBLAS / torch) where there is one. ``write_kv`` is timed for the default indexed
copy (a masked select: one host synchronisation per call) and for the kernel (hal/kernels/kv_write.py);
attention for 16- and 64-key pages. The step totals multiply a layer by the layer count.

    python3 bench/decode_step.py --json $OUT/decode_step.json [--shape 1.7b,8b] [--batch 64,256]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F
import triton

from hal.kernels.tuning import do_bench_cudagraph_synced  # noqa: E402  (waits for queued input writes)
from hal.api import create_backend
from hal.backend import AttentionMetadata, Backend
from hal.rollout.sampler import sample_rows

SHAPES = {  # hidden, intermediate, layers, q heads, kv heads, head dim, vocab
    "1.7b": (2048, 6144, 28, 16, 8, 128, 151936),
    "8b": (4096, 12288, 36, 32, 8, 128, 151936),
    "tiny": (256, 384, 2, 4, 2, 128, 4096),     # for --dry
}


DEVICE = "cuda"
DRY = False   # --dry: each op called once on the CPU (TRITON_INTERPRET=1), times are 0: checks the script itself


def eager(fn) -> float:
    if DRY:
        fn()
        return 0.0
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def graph(fn) -> float:
    if DRY:
        return 0.0
    return do_bench_cudagraph_synced(fn, rep=20, return_mode="median")


def host_us(fn, calls: int = 100) -> float:
    """Host microseconds per call with the device kept ahead (no synchronisation inside the loop)."""
    if DRY:
        return 0.0
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def vllm_cache(num_pages, page, hkv, d, dtype=torch.bfloat16):
    """vLLM's Triton-backend cache (pages, Hkv, P, 2D) and the HAL's strided (pages, P, Hkv, D) K, V views."""
    cache = torch.randn(num_pages, hkv, page, 2 * d, device=DEVICE, dtype=dtype)
    return cache, cache[..., :d].transpose(1, 2), cache[..., d:].transpose(1, 2)


def decode_problem(batch, page, hkv, d, gen):
    """Contexts of 64..768 keys; each sequence's pages in random order; the new token's slot."""
    seq_lens = torch.randint(64, 769, (batch,), generator=gen).tolist()
    width = -(-768 // page)
    num_pages = batch * width
    perm = torch.randperm(num_pages, generator=gen)
    table = perm.view(batch, width).to(torch.int32)
    cache, k_cache, v_cache = vllm_cache(num_pages, page, hkv, d)
    last = torch.tensor(seq_lens) - 1
    slots = (table[torch.arange(batch), last // page].long() * page + last % page)
    meta = AttentionMetadata(query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=DEVICE),
                             seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
                             block_table=table.to(DEVICE))
    return k_cache, v_cache, meta, slots.to(DEVICE), sum(seq_lens)


def row(name, ours, stock=None, per_layer=1, capturable=True, **extra) -> dict:
    """Times of one op; ``capturable=False``: an op that reads values on the host (no graph time)."""
    r = {"op": name, "per_layer": per_layer, "eager_ms": eager(ours), "graph_ms": graph(ours) if capturable else None,
         "host_us": host_us(ours)}
    if stock is not None:
        r["stock_eager_ms"], r["stock_graph_ms"] = eager(stock), graph(stock)
    r.update(extra)
    g = f"{r['graph_ms'] * 1e3:8.1f}" if r["graph_ms"] is not None else "       -"
    s = (f"{r['stock_graph_ms'] * 1e3:8.1f} {r['stock_graph_ms'] / r['graph_ms']:6.2f}"
         if stock is not None and r["graph_ms"] else "")
    print(f"  {name:28} x{per_layer:<2} eager {r['eager_ms'] * 1e3:8.1f} us  graph {g} us  host {r['host_us']:6.1f} us"
          f"  {'stock graph / ratio ' + s if s else ''}", flush=True)
    return r


def measure(shape: str, batch: int, cuda) -> dict:
    hidden, inter, layers, hq, hkv, d, vocab = SHAPES[shape]
    gen = torch.Generator().manual_seed(batch)
    dt = torch.bfloat16
    rows = []
    print(f"== {shape} B={batch}", flush=True)
    x = torch.randn(batch, hidden, device=DEVICE, dtype=dt)
    res = torch.randn_like(x)
    w_norm = torch.randn(hidden, device=DEVICE, dtype=dt)
    rows.append(row("rms_norm+residual", lambda: cuda.rms_norm(x, w_norm, 1e-6, res),
                    lambda: F.rms_norm(x + res, (hidden,), w_norm, 1e-6), per_layer=2))
    for name, n, k in (("linear qkv", (hq + 2 * hkv) * d, hidden), ("linear o", hidden, hq * d),
                       ("linear gate_up", 2 * inter, hidden), ("linear down", hidden, inter)):
        a = torch.randn(batch, k, device=DEVICE, dtype=dt)
        w = torch.randn(n, k, device=DEVICE, dtype=dt) * k ** -0.5
        rows.append(row(f"{name} N={n} K={k}", lambda a=a, w=w: cuda.linear(a, w), lambda a=a, w=w: F.linear(a, w)))
        del w
    q = torch.randn(batch, hq, d, device=DEVICE, dtype=dt)
    k = torch.randn(batch, hkv, d, device=DEVICE, dtype=dt)
    w_head = torch.randn(d, device=DEVICE, dtype=dt)
    rows.append(row("q/k rms_norm", lambda: (cuda.rms_norm(q.view(-1, d), w_head, 1e-6),
                                              cuda.rms_norm(k.view(-1, d), w_head, 1e-6)),
                    lambda: (F.rms_norm(q.view(-1, d), (d,), w_head, 1e-6), F.rms_norm(k.view(-1, d), (d,), w_head, 1e-6))))
    from hal.rope import cos_sin_cache
    table = cos_sin_cache(d, 1024, 1e6).to(DEVICE)
    positions = torch.randint(0, 1024, (batch,), device=DEVICE)
    rows.append(row("rotary", lambda: cuda.rotary(positions, q, k, table)))
    gate_up = torch.randn(batch, 2 * inter, device=DEVICE, dtype=dt)
    rows.append(row("silu_mul", lambda: cuda.silu_mul(gate_up),
                    lambda: F.silu(gate_up[:, :inter]) * gate_up[:, inter:]))
    for page in (16, 64):
        k_cache, v_cache, meta, slots, keys = decode_problem(batch, page, hkv, d, gen)
        kv = torch.randn(batch, hkv, d, device=DEVICE, dtype=dt)
        copy = Backend.write_kv.__wrapped__
        rows.append(row(f"write_kv copy P={page}", lambda: copy(cuda, kv, kv, k_cache, v_cache, slots),
                        capturable=False))
        from hal.kernels import kv_write
        rows.append(row(f"write_kv kernel P={page}", lambda: kv_write.write_kv(kv, kv, k_cache, v_cache, slots)))
        scale = d ** -0.5
        cuda.attention(q, k_cache, v_cache, meta, scale=scale)     # the value check once, as in a vLLM step
        kv_bytes = keys * hkv * d * 2 * 2
        r = row(f"attention P={page}", lambda: cuda.attention(q, k_cache, v_cache, meta, scale=scale), keys=keys)
        if r["graph_ms"]:  # (0 in a dry run)
            r["kv_GBps"] = kv_bytes / r["graph_ms"] / 1e6
            print(f"    {r['kv_GBps']:.0f} GB/s of K/V", flush=True)
        rows.append(r)
        del k_cache, v_cache
    h = torch.randn(batch, hidden, device=DEVICE, dtype=dt)
    emb = torch.randn(vocab, hidden, device=DEVICE, dtype=dt) * hidden ** -0.5
    rows.append(row("logits GEMM (fp32 out)", lambda: cuda.linear(h, emb, out_dtype=torch.float32),
                    lambda: F.linear(h, emb).float(), per_layer=0))
    logits = torch.randn(batch, vocab, device=DEVICE)
    rows.append(row("log_softmax", lambda: cuda.log_softmax(logits), lambda: torch.log_softmax(logits, -1), per_layer=0))
    seeds, pos, temps = list(range(batch)), [300] * batch, [1.0] * batch
    rows.append(row("sampler sample_rows", lambda: sample_rows(logits, seeds, pos, temps), per_layer=0,
                    capturable=False))

    def total(key, page):
        skip = f"P={16 if page == 64 else 64}"
        chosen = [r for r in rows if skip not in r["op"] and "copy" not in r["op"]]
        # the sampler has no graph time: its eager time stands in (it runs eagerly in vLLM too)
        return sum((r[key] if r[key] is not None else r["eager_ms"]) * (r["per_layer"] * layers if r["per_layer"] else 1)
                   for r in chosen)
    summary = {f"step_{key}_P{page}": total(key, page) for key in ("graph_ms", "eager_ms") for page in (16, 64)}
    print("  step totals (write_kv kernel): " + ", ".join(f"{k} {v:.2f} ms" for k, v in summary.items() if v), flush=True)
    return {"shape": shape, "batch": batch, "rows": rows, **summary}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="1.7b,8b")
    parser.add_argument("--batch", default="64,256")
    parser.add_argument("--json")
    parser.add_argument("--dry", action="store_true", help="check the script on the CPU (TRITON_INTERPRET=1)")
    args = parser.parse_args(argv)
    global DEVICE, DRY
    if args.dry:
        DEVICE, DRY = "cpu", True
        args.shape, args.batch = "tiny", "3"
    cuda = create_backend("cuda")
    results = [measure(s, int(b), cuda) for s in args.shape.split(",") for b in args.batch.split(",")]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if not DRY else "cpu", "torch": torch.__version__,
                       "triton": triton.__version__, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
