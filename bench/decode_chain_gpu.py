"""Where small-batch decode attention's time goes (issue #20's worst decode cells): time against the number of
64-key chunks one program walks in order.

The contract's online softmax walks a 512-key split's 64-key chunks one after another (each chunk's P depends on
the running max of the chunks before it, and acc = fl(acc * alpha) + P @ V is a rounded recurrence), so at B = 1-4
the kernel's time is a chain of dependent chunks, not bytes. This script measures that chain: B = 1 and 4 (8 KV
heads, GQA 2, head dim 128; GQA 4, head dim 64), contexts 64..4096 keys on 64-key pages, our decode (the kernel's
own launch, and 1 / 2 / 4 / 8 warps walked) against SDPA and, where vLLM imports, FlashAttention-3 on the same
paged cache.
Up to 512 keys one program walks ctx / 64 chunks, so a straight-line fit of time on chunks gives the cost of one
link of the chain (its slope) and of everything else (launch, q load, the output store: its intercept); above
512 keys the splits run side by side and the chain stays 8 chunks long (plus the merge kernel).

``--kv-splits 256,128`` also times what a contract with smaller fixed KV splits would cost and save (the split size
is contract data, [attention].kv_split, so this is a question for a contract version, not a launch choice): the same
kernels bound to the contract with only kv_split changed, on decode cells from B = 1 x 512 to B = 64 x 8k keys and
on causal prefill, against kv_split = 512. Shorter splits give more programs (a shorter chain) at small batch and
more partials to merge at long contexts.

Timing: ``family_sweep.graph_ms`` (CUDA-graph replay) over one input set, so caches smaller than L2 stay there
across replays: this measures the chain's latency, not HBM's, for ours and the stock kernels alike (the family
sweep rotates inputs past L2). Every launch is checked bitwise against the kernel's own launch first (launch
choices never change the bits).

    python3 bench/decode_chain_gpu.py --json decode_chain.json          # on the GPU (PYTHONPATH=/tmp/site)
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from family_sweep import _meta, flash_attention_3, graph_ms, paged  # noqa: E402

from hal.api import create_backend  # noqa: E402
from hal.kernels import attention as attention_kernels  # noqa: E402

CONTEXTS = [64, 128, 192, 256, 320, 384, 448, 512, 1024, 2048, 4096]
HEADS = [(16, 8, 128), (32, 8, 64)]          # (q heads, KV heads, head dim)
VARIANTS = {"default": {}, "walk-1w": dict(split_parallel=False, num_warps=1),
            "walk-2w": dict(split_parallel=False, num_warps=2),
            "walk-4w": dict(split_parallel=False, num_warps=4),
            "walk-8w": dict(split_parallel=False, num_warps=8)}


def log(msg: str) -> None:
    print(msg, flush=True)


def fit(points):
    """Least-squares (intercept, slope) of y on x."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - slope * mx, slope


def stock_decode_us(q, k_cache, v_cache, table, cu_q, lens, ctx, fa3) -> dict:
    """SDPA on the same keys laid out contiguously and, with vLLM importable, FlashAttention-3 on the paged
    cache itself: device us per call."""
    batch, (hkv, d) = q.shape[0], k_cache.shape[2:]

    def contiguous(cache):
        return cache[table.long()].reshape(batch, -1, hkv, d)[:, :ctx].transpose(1, 2).contiguous()
    sk, sv = contiguous(k_cache), contiguous(v_cache)
    out = dict(sdpa_us=graph_ms([lambda: F.scaled_dot_product_attention(q.unsqueeze(2), sk, sv,
                                                                        enable_gqa=True)]) * 1e3)
    if fa3 is not None:
        out["fa3_us"] = graph_ms([lambda: fa3(q, k_cache, v_cache, cu_seqlens_q=cu_q, max_seqlen_q=1, seqused_k=lens,
                                              max_seqlen_k=ctx, softmax_scale=d ** -0.5, causal=True,
                                              block_table=table, fa_version=3)]) * 1e3
    return out


def split_what_if(backend, splits, fa3, cells=None, heads=(16, 8, 128)) -> list[dict]:
    """Decode and prefill time under contracts that differ from ``backend``'s only in [attention].kv_split;
    ``cells``: (phase, batch, keys) triples (default: decode B = 1..64 x 512..32k keys, prefill 2k and 8k)."""
    import dataclasses

    contract = backend.contract
    variants = {s: create_backend("cuda", dataclasses.replace(
        contract, attention=dataclasses.replace(contract.attention, kv_split=s))) for s in splits}
    (hq, hkv, d), page, out = heads, 64, []
    log(f"\nkv_split what-if: time under kv_split = S / time under {contract.attention.kv_split} "
        f"(< 1: S faster); heads {hq}/{hkv} D={d} page={page}")
    log(f"{'cell':>22} {contract.attention.kv_split:>8}us " + " ".join(f"{s:>8}us" for s in splits)
        + f" {'sdpa us':>8} {'fa3 us':>8}")
    if cells is None:
        cells = [("decode", b, ctx) for b in (1, 4, 16, 64) for ctx in (512, 2048, 8192, 32768) if b * ctx <= 2 ** 19]
        cells += [("prefill", 1, length) for length in (2048, 8192)]
    for phase, batch, ctx in cells:
        k_cache, v_cache, table = paged(batch, ctx, hkv, d, page, seed=ctx + batch)
        lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
        if phase == "decode":
            q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
            cu_q = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
        else:
            q = torch.randn(ctx, hq, d, device="cuda", dtype=torch.bfloat16)
            cu_q = torch.tensor([0, ctx], device="cuda", dtype=torch.int32)
        meta = _meta(cu_q, lens, table)
        row = dict(phase=phase, batch=batch, ctx=ctx, hq=hq, hkv=hkv, d=d, page=page)
        for split, b in [(contract.attention.kv_split, backend), *variants.items()]:
            row[f"split{split}_us"] = graph_ms([lambda b=b: b.attention(q, k_cache, v_cache, meta,
                                                                       scale=d ** -0.5)]) * 1e3
        if phase == "decode":
            row.update(stock_decode_us(q, k_cache, v_cache, table, cu_q, lens, ctx, fa3))
        base = row[f"split{contract.attention.kv_split}_us"]
        log(f"{phase + f' B={batch} x {ctx}':>22} {base:10.1f} "
            + " ".join(f"{row[f'split{s}_us']:6.1f} ({row[f'split{s}_us'] / base:4.2f})" for s in splits)
            + f" {row.get('sdpa_us', float('nan')):8.1f} {row.get('fa3_us', float('nan')):8.1f}")
        out.append(row)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    parser.add_argument("--kv-splits", default="", help="also time contracts with these [attention].kv_split "
                        "sizes (comma-separated), e.g. 256,128")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    backend = create_backend("cuda")
    fa3 = flash_attention_3()
    page, rows, fits, failures, t0 = 64, [], [], 0, time.time()
    for hq, hkv, d in HEADS:
        for batch in map(int, args.batches.split(",")):
            log(f"\nB={batch} heads {hq}/{hkv} D={d} page={page}  (us; chunks = ctx / 64 one program walks in order)")
            log(f"{'ctx':>6} {'chunks':>6} " + " ".join(f"{n:>8}" for n in VARIANTS) + f" {'sdpa':>7} {'fa3':>7}")
            scale = d ** -0.5
            for ctx in map(int, args.contexts.split(",")):
                q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
                k_cache, v_cache, table = paged(batch, ctx, hkv, d, page, seed=ctx)
                cu_q = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
                lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
                meta = _meta(cu_q, lens, table)

                def ours(overrides):
                    return attention_kernels.paged_attention(q, k_cache, v_cache, cu_q, lens, table, scale,
                                                             backend.contract.attention, policy=backend._launch,
                                                             **overrides)
                want = backend.attention(q, k_cache, v_cache, meta, scale=scale)
                row = dict(batch=batch, ctx=ctx, hq=hq, hkv=hkv, d=d, page=page, chunks=min(ctx, 512) // 64)
                for name, overrides in VARIANTS.items():
                    try:
                        same = torch.equal(ours(overrides), want)
                    except Exception as exc:  # a launch that cannot compile here is reported, not fatal
                        row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
                        row[f"{name}_equal"], row[f"{name}_us"] = True, float("nan")
                        continue
                    failures += not same
                    row[f"{name}_equal"] = same
                    row[f"{name}_us"] = graph_ms([lambda o=overrides: ours(o)]) * 1e3
                row.update(stock_decode_us(q, k_cache, v_cache, table, cu_q, lens, ctx, fa3))
                rows.append(row)
                bad = "" if all(row[f"{n}_equal"] for n in VARIANTS) else "   bits DIFFER"
                log(f"{ctx:6d} {row['chunks']:6d} " + " ".join(f"{row[n + '_us']:8.1f}" for n in VARIANTS)
                    + f" {row['sdpa_us']:7.1f} {row.get('fa3_us', float('nan')):7.1f}{bad}")
            chain = [r for r in rows if (r["batch"], r["hq"], r["d"]) == (batch, hq, d) and r["ctx"] <= 512]
            if len(chain) >= 3:
                for name in [*VARIANTS, "sdpa"] + (["fa3"] if fa3 is not None else []):
                    points = [(r["chunks"], r.get(f"{name}_us", float("nan"))) for r in chain]
                    if any(y != y for _, y in points):
                        continue
                    a, b = fit(points)
                    log(f"  fit up to 512 keys, {name}: {a:.2f} us + {b:.2f} us a chunk")
                    fits.append(dict(batch=batch, hq=hq, hkv=hkv, d=d, launch=name, intercept_us=a, per_chunk_us=b))
    what_if = split_what_if(backend, [int(x) for x in args.kv_splits.split(",") if x], fa3) if args.kv_splits else []
    result = dict(device=torch.cuda.get_device_name(), fa3=fa3 is not None, rows=rows, fits=fits,
                  kv_split_what_if=what_if, failures=failures, seconds=time.time() - t0)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    log(f"\n{failures} launches differ from the kernel's own launch, {result['seconds']:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
