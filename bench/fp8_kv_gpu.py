"""The FP8 KV cache on the GPU (issue #22): the cuda backend's ``fp8_write_kv`` and ``fp8_attention``,
checked bitwise and timed against the bf16 cache.

Sections (``--only``), each printing a table; every number goes to --json:

  write   bitwise: the write kernel on the device == ``hal.fp8.write_kv_exact`` on the CPU (fp8 bytes and
          fp32 scales), e4m3 / e5m2 per (token, head) and a fixed scale, on loud, quiet, all-zero and
          subnormal-heavy vectors, with padding slots (-1).
  read    bitwise: ``fp8_attention`` over an FP8 cache == ``attention`` over the same cache dequantised
          (``hal.fp8.dequantise_kv``, the one read path) on decode and prefill shapes (pages of 16-128,
          GQA 1-8, head dims 64/128, contexts across the 512-key splits), and prefill == chunked prefill ==
          decode through the FP8 cache. Negative control: K scales 2**-6 larger give other bits.
  speed   decode attention, FP8 cache vs bf16 cache (the same keys dequantised), device time under
          CUDA-graph replay (``triton.testing.do_bench_cudagraph``), B = 1..256 and contexts 4k-32k; the
          target is >= 1.5x at long contexts (half the bytes read). Also the KV bytes each reads per second.

Exit status 1 if a bitwise check fails or the negative control does not differ.

    python3 bench/fp8_kv_gpu.py --json fp8_kv_gpu.json            # on the H200 (PYTHONPATH=/tmp/site)
    TRITON_INTERPRET=1 python3 bench/fp8_kv_gpu.py --small --device cpu --json /tmp/fp8_kv.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import torch

from hal.kernels.tuning import do_bench_cudagraph_synced  # noqa: E402  (waits for queued input writes)
from hal import fp8
from hal.api import create_backend
from hal.contract import load_contract
from hal.kvcache import build_metadata, pages_needed, slot_mapping

FP8 = load_contract("bf16-fp8-v1")
SPECS = {"e4m3/token-head": FP8.fp8, "e5m2/token-head": dataclasses.replace(FP8.fp8, kv_format="e5m2"),
         "e4m3/fixed": dataclasses.replace(FP8.fp8, kv_scale="fixed")}


def log(msg: str) -> None:
    print(msg, flush=True)


def backends(spec, device):
    contract = dataclasses.replace(FP8, fp8=spec)
    return create_backend("cuda", contract), create_backend("reference", contract)


def rows(tokens, heads, d, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, heads, d, generator=g)
    x[3::7] *= 300.0
    x[5::11] *= 1e-3
    x[4::13] = 0.0
    x[6::17] *= 1e-6
    return x.bfloat16().to(device)


def bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def new_cache(spec, pages, page, hkv, d, device):
    return fp8.Fp8KVCache(pages, page, hkv, d, spec, device=device, fixed_scales=(0.05, 0.0625))


def write_section(device, small):
    out, failures = [], 0
    for name, spec in SPECS.items():
        cuda, _ = backends(spec, device)
        for tokens, hkv, d in ((40, 2, 64),) if small else ((40, 2, 64), (4096, 8, 128), (777, 4, 64)):
            k, v = rows(tokens, hkv, d, 1), rows(tokens, hkv, d, 2)
            page = 16
            pages = pages_needed(tokens + 8, page)
            slots = torch.randperm(pages * page, generator=torch.Generator().manual_seed(3))[:tokens]
            slots[::9] = -1
            got, want = new_cache(spec, pages, page, hkv, d, device), new_cache(spec, pages, page, hkv, d, "cpu")
            got.write(k.to(device), v.to(device), slots.to(device), backend=cuda)
            want.write(k, v, slots)
            same = all(torch.equal(bits(a.cpu()), bits(b)) for a, b in
                       ((got.k, want.k), (got.v, want.v), (got.k_scale, want.k_scale), (got.v_scale, want.v_scale)))
            failures += not same
            out.append(dict(spec=name, tokens=tokens, kv_heads=hkv, head_dim=d, equal_reference=same))
            log(f"write {name:16} T={tokens:5} Hkv={hkv} D={d:3}: {'bitwise equal' if same else 'DIFFERS'} "
                f"to the reference")
    return out, failures


def filled_cache(spec, seq_lens, hkv, d, page, device, seed=0):
    """An FP8 cache holding the K/V of sequences of ``seq_lens`` (pages in random order), its block lists."""
    need = [pages_needed(n, page) for n in seq_lens]
    perm = torch.randperm(sum(need), generator=torch.Generator().manual_seed(seed)).tolist()
    lists, at = [], 0
    for n in need:
        lists.append(perm[at:at + n])
        at += n
    cache = new_cache(spec, sum(need), page, hkv, d, device)
    cuda, _ = backends(spec, device)
    for b, n in enumerate(seq_lens):
        slots = slot_mapping(lists[b], range(n), page).to(device)
        cache.write(rows(n, hkv, d, 10 + b, device), rows(n, hkv, d, 20 + b, device), slots, backend=cuda)
    return cache, lists


def read_cases(small):
    if small:
        return [dict(seq_lens=[530], q_lens=[40], hq=4, hkv=2, d=64, page=16)]
    return [dict(seq_lens=[s] * b, q_lens=[1] * b, hq=hq, hkv=hkv, d=d, page=page)
            for b, s in ((1, 8192), (16, 2048), (64, 700)) for hq, hkv, d in ((32, 8, 128), (16, 16, 64), (40, 8, 128))
            for page in (16, 64, 128)] + \
           [dict(seq_lens=[2048], q_lens=[2048], hq=32, hkv=8, d=128, page=64),
            dict(seq_lens=[300, 1100, 513], q_lens=[300, 60, 513], hq=16, hkv=8, d=128, page=32)]


def read_section(device, small):
    out, failures = [], 0
    for name, spec in SPECS.items():
        cuda, _ = backends(spec, device)
        cases = read_cases(small) if name.startswith("e4m3/token") else read_cases(small)[:3]
        for j, case in enumerate(cases):
            cache, lists = filled_cache(spec, case["seq_lens"], case["hkv"], case["d"], case["page"], device)
            meta = build_metadata(case["q_lens"], case["seq_lens"], lists, device)
            q = rows(sum(case["q_lens"]), case["hq"], case["d"], 5, device)
            scale = case["d"] ** -0.5
            fused = cache.attention(cuda, q, meta, scale=scale)
            plain = cuda.attention(q, *cache.read(torch.bfloat16), meta, scale=scale)
            same = torch.equal(fused, plain)
            failures += not same
            row = dict(spec=name, **case, equal_dequantised=same)
            if j == 0 or case["seq_lens"][0] < 4096 and j < 12:    # negative control: K scales 2**-6 larger
                up = cache.k_scale * (1 + 2 ** -6)
                nudged = cuda.attention(q, fp8.dequantise_kv(cache.k, up, torch.bfloat16),
                                        cache.read(torch.bfloat16)[1], meta, scale=scale)
                row["negative_control_differs"] = not torch.equal(nudged, plain)
                failures += not row["negative_control_differs"]
            out.append(row)
            log(f"read  {name:16} B={len(case['seq_lens']):3} ctx={max(case['seq_lens']):5} q={sum(case['q_lens']):5} "
                f"{case['hq']}/{case['hkv']}x{case['d']} page {case['page']:3}: "
                f"{'bitwise equal' if same else 'DIFFERS'}"
                + (f"; control {'differs' if row['negative_control_differs'] else 'DOES NOT DIFFER'}"
                   if "negative_control_differs" in row else ""))
    # prefill == chunked prefill == decode through the FP8 cache
    spec = FP8.fp8
    cuda, _ = backends(spec, device)
    n, hq, hkv, d, page = (530, 4, 2, 64, 16) if small else (1300, 32, 8, 128, 64)
    q, k, v = rows(n, hq, d, 30, device), rows(n, hkv, d, 31, device), rows(n, hkv, d, 32, device)
    results = {}
    for label, steps in (("prefill", [n]), ("chunked", [n // 3, n - n // 3]), ("decode", [n - 40] + [1] * 40)):
        cache = new_cache(spec, pages_needed(n, page), page, hkv, d, device)
        blocks = list(range(pages_needed(n, page)))[::-1]
        outs, done = [], 0
        for q_len in steps:
            cache.write(k[done:done + q_len], v[done:done + q_len],
                        slot_mapping(blocks, range(done, done + q_len), page).to(device), backend=cuda)
            meta = build_metadata([q_len], [done + q_len], [blocks], device)
            outs.append(cache.attention(cuda, q[done:done + q_len], meta, scale=d ** -0.5))
            done += q_len
        results[label] = torch.cat(outs)
    phases = all(torch.equal(results["prefill"], r) for r in results.values())
    failures += not phases
    out.append(dict(spec="e4m3/token-head", phases=list(results), tokens=n, equal_across_phases=phases))
    log(f"phases: prefill == chunked prefill == decode through the FP8 cache ({n} tokens): {phases}")
    return out, failures


def speed_section(device):
    out = []
    spec = FP8.fp8
    cuda, _ = backends(spec, device)
    hq, hkv, d, page = 32, 8, 128, 64
    log(f"{'B':>4} {'ctx':>6} {'bf16 us':>9} {'fp8 us':>9} {'speed-up':>8} {'bf16 TB/s':>9} {'fp8 TB/s':>9}")
    for batch, ctx in ((1, 4096), (1, 16384), (1, 32768), (4, 8192), (16, 4096), (16, 16384), (64, 4096),
                       (64, 8192), (256, 2048), (256, 4096)):
        cache, lists = filled_cache(spec, [ctx] * batch, hkv, d, page, device)
        meta = build_metadata([1] * batch, [ctx] * batch, lists, device)
        q = rows(batch, hq, d, 5, device)
        k_bf16, v_bf16 = cache.read(torch.bfloat16)
        same = torch.equal(cache.attention(cuda, q, meta, scale=d ** -0.5),
                           cuda.attention(q, k_bf16, v_bf16, meta, scale=d ** -0.5))
        t_bf16 = do_bench_cudagraph_synced(lambda: cuda.attention(q, k_bf16, v_bf16, meta, scale=d ** -0.5),
                                                   rep=50, return_mode="median")
        t_fp8 = do_bench_cudagraph_synced(lambda: cache.attention(cuda, q, meta, scale=d ** -0.5), rep=50,
                                                  return_mode="median")

        def fp8_warps(warps):   # the same kernel at another warp count (a launch choice: the same bits)
            return cuda._attention.paged_attention(
                q, cache.k, cache.v, meta.query_start_loc.int(), meta.seq_lens.int(), meta.block_table.int(),
                d ** -0.5, cuda.contract.attention, policy=cuda._launch, k_scale=cache.k_scale, v_scale=cache.v_scale,
                num_warps=warps)
        same_w8 = torch.equal(fp8_warps(8), cache.attention(cuda, q, meta, scale=d ** -0.5))
        t_fp8_w8 = do_bench_cudagraph_synced(lambda: fp8_warps(8), rep=50, return_mode="median")
        keys = batch * ctx * hkv
        bytes_bf16 = keys * d * 2 * 2
        bytes_fp8 = keys * (d + 4) * 2            # fp8 values and one fp32 scale per (token, head), K and V
        row = dict(batch=batch, ctx=ctx, hq=hq, hkv=hkv, d=d, page=page, equal_dequantised=same, bf16_ms=t_bf16,
                   fp8_ms=t_fp8, fp8_w8_ms=t_fp8_w8, equal_w8=same_w8, speedup_w8=t_bf16 / t_fp8_w8,
                   speedup=t_bf16 / t_fp8, bf16_TBps=bytes_bf16 / t_bf16 / 1e9, fp8_TBps=bytes_fp8 / t_fp8 / 1e9)
        out.append(row)
        log(f"{batch:4} {ctx:6} {t_bf16 * 1e3:9.1f} {t_fp8 * 1e3:9.1f} {row['speedup']:7.2f}x "
            f"{row['bf16_TBps']:9.2f} {row['fp8_TBps']:9.2f}  8 warps {t_fp8_w8 * 1e3:8.1f} us "
            f"{row['speedup_w8']:5.2f}x{'' if same else '  (bits DIFFER)'}{'' if same_w8 else '  (8 warps: bits DIFFER)'}")
        del cache, k_bf16, v_bf16
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="small shapes (the interpreter)")
    parser.add_argument("--only", default="write,read,speed")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    only = set(args.only.split(","))
    result, failures, t0 = {"device": torch.cuda.get_device_name() if args.device == "cuda" else args.device}, 0, time.time()
    for section, fn in (("write", write_section), ("read", read_section)):
        if section in only:
            result[section], f = fn(args.device, args.small)
            failures += f
    if "speed" in only and args.device == "cuda" and not args.small:
        result["speed"] = speed_section(args.device)
        failures += sum(not (r["equal_dequantised"] and r["equal_w8"]) for r in result["speed"])
    result["failures"] = failures
    result["seconds"] = time.time() - t0
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    log(f"{failures} failing checks, {result['seconds']:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
