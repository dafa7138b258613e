"""Where a prefill step's time goes, op by op, on the cuda backend (issues #19 and #20).

The HAL-bound vLLM engine's prefill steps cost 71-78 ms against stock vLLM's 33-66 ms (Qwen3-1.7B
shape, 8192 batched tokens; bench/results/h200-2026-12-01-session5): this times one such step's ops
next to the stock ones. A step: ``--tokens`` new tokens of fresh prompts with 64..512 tokens each (as
bench/vllm_gpu.py draws them; the last one cut to fill the step, as chunked prefill does), in vLLM's
cache layout with 64-key pages. Per layer: RMSNorm (+ residual), the QKV / O / gate-up / down
linears, q/k RMSNorm, rotary, ``write_kv``, paged attention, SiLU*up; the logits GEMM of the
prompts' last tokens. Times: CUDA-graph replays (device time) and eager calls (device or host
time, whichever is larger: what an op costs between vLLM's graph pieces, and prefill steps of
8192 tokens run outside vLLM's captured sizes). Stock: cuBLAS, torch's fused RMSNorm, and
FlashAttention-2 varlen (``aten._flash_attention_forward``, K/V expanded to the query heads).

    python3 bench/prefill_step.py --json $OUT/prefill_step.json [--shape 1.7b,8b] [--tokens 8192] [--attention-sweep]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F
import triton

import decode_step as ds
from decode_step import SHAPES, row
from hal.api import create_backend
from hal.backend import AttentionMetadata

PAGE = 64


def prompts(tokens: int, gen: torch.Generator) -> list[int]:
    """Prompt lengths of 64..512 filling ``tokens`` (the last one cut, as a chunked prefill)."""
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(int(torch.randint(64, 513, (1,), generator=gen)))
    lengths[-1] -= sum(lengths) - tokens
    return lengths


def prefill_problem(lengths, hkv, d, gen):
    width = -(-max(lengths) // PAGE)
    num_pages = len(lengths) * width
    table = torch.randperm(num_pages, generator=gen).view(len(lengths), width).to(torch.int32)
    _, k_cache, v_cache = ds.vllm_cache(num_pages, PAGE, hkv, d)
    starts = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    slots = torch.cat([table[b, torch.arange(n) // PAGE].long() * PAGE + torch.arange(n) % PAGE
                       for b, n in enumerate(lengths)])
    meta = AttentionMetadata(query_start_loc=starts.to(ds.DEVICE),
                             seq_lens=torch.tensor(lengths, dtype=torch.int32, device=ds.DEVICE),
                             block_table=table.to(ds.DEVICE))
    return k_cache, v_cache, meta, slots.to(ds.DEVICE)


def flash_varlen(q, k, v, starts, max_len, scale):
    """FlashAttention-2 varlen causal (torch's bundled kernel), GQA by expanding K/V; None where unavailable."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    try:
        torch.ops.aten._flash_attention_forward(q, k, v, starts, starts, max_len, max_len, 0.0, True, False,
                                                scale=scale)
    except Exception as exc:   # noqa: BLE001 (a missing stock kernel is reported, not fatal)
        print(f"  (no stock varlen attention: {type(exc).__name__}: {str(exc)[:120]})", flush=True)
        return None
    return lambda: torch.ops.aten._flash_attention_forward(q, k, v, starts, starts, max_len, max_len, 0.0, True,
                                                           False, scale=scale)


def measure(shape: str, tokens: int, cuda, sweep: bool = False) -> dict:
    hidden, inter, layers, hq, hkv, d, vocab = SHAPES[shape]
    gen = torch.Generator().manual_seed(tokens)
    dt = torch.bfloat16
    lengths = prompts(tokens, gen)
    print(f"== {shape} T={tokens} in {len(lengths)} prompts of {min(lengths)}..{max(lengths)} tokens", flush=True)
    rows = []
    x = torch.randn(tokens, hidden, device=ds.DEVICE, dtype=dt)
    res = torch.randn_like(x)
    w_norm = torch.randn(hidden, device=ds.DEVICE, dtype=dt)
    rows.append(row("rms_norm+residual", lambda: cuda.rms_norm(x, w_norm, 1e-6, res),
                    lambda: F.rms_norm(x + res, (hidden,), w_norm, 1e-6), per_layer=2))
    for name, n, k in (("linear qkv", (hq + 2 * hkv) * d, hidden), ("linear o", hidden, hq * d),
                       ("linear gate_up", 2 * inter, hidden), ("linear down", hidden, inter)):
        a = torch.randn(tokens, k, device=ds.DEVICE, dtype=dt)
        w = torch.randn(n, k, device=ds.DEVICE, dtype=dt) * k ** -0.5
        r = row(f"{name} N={n} K={k}", lambda a=a, w=w: cuda.linear(a, w), lambda a=a, w=w: F.linear(a, w))
        if r["graph_ms"]:
            r["TFLOPs"] = 2 * tokens * n * k / r["graph_ms"] / 1e9
            print(f"    {r['TFLOPs']:.0f} TFLOP/s (stock {2 * tokens * n * k / r['stock_graph_ms'] / 1e9:.0f})", flush=True)
        rows.append(r)
        del a, w
    q = torch.randn(tokens, hq, d, device=ds.DEVICE, dtype=dt)
    k = torch.randn(tokens, hkv, d, device=ds.DEVICE, dtype=dt)
    v = torch.randn(tokens, hkv, d, device=ds.DEVICE, dtype=dt)
    w_head = torch.randn(d, device=ds.DEVICE, dtype=dt)
    rows.append(row("q/k rms_norm", lambda: (cuda.rms_norm(q.view(-1, d), w_head, 1e-6),
                                              cuda.rms_norm(k.view(-1, d), w_head, 1e-6)),
                    lambda: (F.rms_norm(q.view(-1, d), (d,), w_head, 1e-6), F.rms_norm(k.view(-1, d), (d,), w_head, 1e-6))))
    from hal.rope import cos_sin_cache
    table = cos_sin_cache(d, 1024, 1e6).to(ds.DEVICE)
    positions = torch.cat([torch.arange(n) for n in lengths]).to(ds.DEVICE)
    rows.append(row("rotary", lambda: cuda.rotary(positions, q, k, table)))
    gate_up = torch.randn(tokens, 2 * inter, device=ds.DEVICE, dtype=dt)
    rows.append(row("silu_mul", lambda: cuda.silu_mul(gate_up), lambda: F.silu(gate_up[:, :inter]) * gate_up[:, inter:]))
    del gate_up
    k_cache, v_cache, meta, slots = prefill_problem(lengths, hkv, d, gen)
    from hal.kernels import kv_write
    rows.append(row("write_kv kernel", lambda: kv_write.write_kv(k, v, k_cache, v_cache, slots)))
    kv_write.write_kv(k, v, k_cache, v_cache, slots)
    scale = d ** -0.5
    cuda.attention(q, k_cache, v_cache, meta, scale=scale)     # the value check once, as in a vLLM step
    stock = None if ds.DRY else flash_varlen(q, k, v, meta.query_start_loc, max(lengths), scale)
    r = row("attention (causal prefill)", lambda: cuda.attention(q, k_cache, v_cache, meta, scale=scale), stock)
    flops = sum(2 * 2 * n * (n + 1) / 2 * d * hq for n in lengths)
    if r["graph_ms"]:
        r["TFLOPs"] = flops / r["graph_ms"] / 1e9
        print(f"    {r['TFLOPs']:.0f} TFLOP/s", flush=True)
    rows.append(r)
    if sweep and not ds.DRY:
        # launch shapes of the prefill attention (free: tile freedom, bench/tile_freedom.py): device time each
        from hal.kernels import attention as attention_kernels
        for block_q, warps, stages in ((16, 4, 2), (64, 4, 2), (64, 8, 2), (32, 8, 3), (64, 8, 3)):
            call = lambda b=block_q, w=warps, st=stages: attention_kernels.paged_attention(  # noqa: E731
                q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_table, scale,
                cuda.contract.attention, policy=cuda._launch, block_q=b, num_warps=w, num_stages=st)
            try:
                same = torch.equal(call(), cuda.attention(q, k_cache, v_cache, meta, scale=scale))
                rows.append(row(f"attention BLOCK_Q={block_q} w{warps} s{stages}", call, sweep=True,
                                same_bits=same))
            except Exception as exc:   # noqa: BLE001 (out of resources: reported)
                print(f"  attention BLOCK_Q={block_q} w{warps} s{stages}: {type(exc).__name__}", flush=True)
    h = torch.randn(len(lengths), hidden, device=ds.DEVICE, dtype=dt)
    emb = torch.randn(vocab, hidden, device=ds.DEVICE, dtype=dt) * hidden ** -0.5
    rows.append(row("logits GEMM (last tokens)", lambda: cuda.linear(h, emb, out_dtype=torch.float32),
                    lambda: F.linear(h, emb).float(), per_layer=0))

    def total(key):
        return sum((r[key] if r.get(key) is not None else r["eager_ms"]) * (r["per_layer"] * layers or 1)
                   for r in rows if not r.get("sweep"))     # the sweep's variants are not part of the step
    summary = {"step_graph_ms": total("graph_ms"), "step_eager_ms": total("eager_ms")}
    stock_rows = [r for r in rows if r.get("stock_graph_ms") and not r.get("sweep")]
    summary["stock_ops_ms"] = sum(r["stock_graph_ms"] * (r["per_layer"] * layers or 1) for r in stock_rows)
    summary["ours_same_ops_ms"] = sum(r["graph_ms"] * (r["per_layer"] * layers or 1) for r in stock_rows)
    print("  step totals: " + ", ".join(f"{k} {v:.2f} ms" for k, v in summary.items()), flush=True)
    return {"shape": shape, "tokens": tokens, "prompts": lengths, "rows": rows, **summary}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="1.7b,8b")
    parser.add_argument("--tokens", default="8192")
    parser.add_argument("--json")
    parser.add_argument("--dry", action="store_true", help="check the script on the CPU (TRITON_INTERPRET=1)")
    parser.add_argument("--attention-sweep", action="store_true", help="also time prefill attention launch shapes")
    args = parser.parse_args(argv)
    if args.dry:
        ds.DEVICE, ds.DRY = "cpu", True
        args.shape, args.tokens = "tiny", "300"
    cuda = create_backend("cuda")
    results = [measure(s, int(t), cuda, args.attention_sweep) for s in args.shape.split(",")
               for t in args.tokens.split(",")]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if not ds.DRY else "cpu", "torch": torch.__version__,
                       "triton": triton.__version__, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
