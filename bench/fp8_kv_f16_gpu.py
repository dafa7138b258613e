"""bf16-fp8-v2's FP8 KV cache on the GPU (issue #22): the f16-operand read ([fp8].kv_dequant = "f16_operands",
fixed scales) checked bitwise and timed against the bf16 cache.

Sections (``--only``), each printing a table; every number goes to --json:

  bits    every launch choice gives the default launch's bits (in-kernel and parallel splits, splits per
          program, warps, stages, register caps, head splits, packed and padded GQA rows) on decode and
          prefill shapes (pages of 16-128, GQA 1, 4, 5, head dims 64 / 128, contexts across the 512-key
          splits); prefill == chunked prefill == decode through the cache; accuracy against an fp64 oracle
          over the cache's exact values. Negative controls: K or V scale 2**-6 larger, and v1's read rule over
          the same cache (its fp32 multiply by the fixed scale, bf16 operands), give other bits.
  speed   decode device time under CUDA-graph replay: the v2 FP8 cache against a bf16 cache of the same
          values, and v1's FP8 cache (per-(token, head) scales) beside them; the FP8 launch rule of v1 (one
          split, 128 registers, 3 stages) as an alternative launch for v2. Target: >= 1.5x the bf16 cache at
          long contexts.

Exit status 1 if a bitwise check fails or a negative control does not differ.

    python3 bench/fp8_kv_f16_gpu.py --json fp8_kv_f16_gpu.json      # on the GPU (PYTHONPATH=/tmp/site)
    TRITON_INTERPRET=1 python3 bench/fp8_kv_f16_gpu.py --small --device cpu     # the script's logic, on the CPU
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from hal.kernels.tuning import do_bench_cudagraph_synced  # noqa: E402  (waits for queued input writes)
from hal import fp8
from hal.api import create_backend
from hal.contract import load_contract
from hal.kvcache import build_metadata, pages_needed, slot_mapping

V1, V2 = load_contract("bf16-fp8-v1"), load_contract("bf16-fp8-v2")
SCALES = (0.05, 0.0625)   # the layer's fixed K and V scales (K rows reach ~4, V ~4: e4m3 covers them)


def log(msg: str) -> None:
    print(msg, flush=True)


def rows(tokens, heads, d, seed, device):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, heads, d, generator=g).bfloat16().to(device)


def filled_cache(spec, seq_lens, hkv, d, page, device, backend, seed=0):
    """A cache (v1 or v2 by ``spec``) holding the K/V of sequences of ``seq_lens`` on shuffled pages."""
    need = [pages_needed(n, page) for n in seq_lens]
    perm = torch.randperm(sum(need), generator=torch.Generator().manual_seed(seed)).tolist()
    lists, at = [], 0
    for n in need:
        lists.append(perm[at:at + n])
        at += n
    cache = fp8.Fp8KVCache(sum(need), page, hkv, d, spec, device=device, fixed_scales=SCALES)
    for b, n in enumerate(seq_lens):
        slots = slot_mapping(lists[b], range(n), page).to(device)
        cache.write(rows(n, hkv, d, 10 + b, device), rows(n, hkv, d, 20 + b, device), slots, backend=backend)
    return cache, lists


def attend(backend, cache, q, meta, scale, **launch):
    """v2's read with launch overrides and, for the controls, other scales (``{}``: the backend's own call)."""
    if not launch:
        return cache.attention(backend, q, meta, scale=scale)
    launch = dict(dict(k_scale=cache.k_scale, v_scale=cache.v_scale, f16_operands=True), **launch)
    return backend._attention.paged_attention(
        q, cache.k, cache.v, meta.query_start_loc.int(), meta.seq_lens.int(), meta.block_table.int(), scale,
        backend.contract.attention, policy=backend._launch, **launch)


DECODE_LAUNCHES = [dict(split_parallel=False), dict(split_parallel=True, splits_per_program=1),
                   dict(split_parallel=True, splits_per_program=2), dict(num_warps=8),
                   dict(splits_per_program=1, maxnreg=128, num_stages=3), dict(num_stages=3), dict(head_split=2)]
PREFILL_LAUNCHES = [dict(split_parallel=True), dict(block_q=8, num_warps=4), dict(nested_splits=False),
                    dict(num_stages=3), dict(packed_heads=False)]
# (seq_lens, q_lens, hq, hkv, d, page)
BIT_CASES = [([8192], [1], 32, 8, 128, 64), ([2048] * 16, [1] * 16, 32, 8, 128, 16), ([700] * 64, [1] * 64, 16, 16, 64, 128),
             ([4096] * 4, [1] * 4, 40, 8, 128, 32), ([2048], [2048], 32, 8, 128, 64), ([1500], [1500], 40, 8, 128, 16),
             ([300, 1100, 513], [300, 60, 513], 16, 8, 128, 32)]
SMALL_CASES = [([530], [1], 4, 2, 64, 16), ([530], [40], 6, 2, 64, 64)]     # --small: the interpreter


def oracle(cache, lists, seq_len, q, hkv):
    """fp64 causal attention of one sequence's queries (the last len(q)) over the cache's exact values."""
    page = cache.page_size
    slots = slot_mapping(lists[0], range(seq_len), page).to(cache.k.device)
    k = cache.k.flatten(0, 1)[slots].double() * float(cache.k_scale)
    v = cache.v.flatten(0, 1)[slots].double() * float(cache.v_scale)
    group = q.shape[1] // hkv
    n = q.shape[0]
    scores = torch.einsum("thd,shd->hts", q.double(), k.repeat_interleave(group, 1)) * q.shape[-1] ** -0.5
    causal = torch.arange(seq_len, device=q.device)[None, :] > torch.arange(seq_len - n, seq_len, device=q.device)[:, None]
    probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
    return torch.einsum("hts,shd->thd", probs, v.repeat_interleave(group, 1))


def bits_section(device, budget_s, small):
    cuda = create_backend("cuda", V2)
    out, failures, t0 = [], 0, time.time()
    for seq_lens, q_lens, hq, hkv, d, page in SMALL_CASES if small else BIT_CASES:
        if time.time() - t0 > budget_s:
            log("bits: budget spent, later cases skipped")
            break
        cache, lists = filled_cache(V2.fp8, seq_lens, hkv, d, page, device, cuda)
        meta = build_metadata(q_lens, seq_lens, lists, device)
        q = rows(sum(q_lens), hq, d, 5, device)
        scale = d ** -0.5
        default = attend(cuda, cache, q, meta, scale)
        launches = DECODE_LAUNCHES if max(q_lens) == 1 else PREFILL_LAUNCHES
        differing = []
        for launch in launches:
            if launch.get("head_split", 1) > 1 and hq // hkv % launch["head_split"]:
                continue
            if not torch.equal(attend(cuda, cache, q, meta, scale, **launch), default):
                differing.append(launch)
        nudged = [not torch.equal(attend(cuda, cache, q, meta, scale, k_scale=cache.k_scale * (1 + 2 ** -6)), default),
                  not torch.equal(attend(cuda, cache, q, meta, scale, v_scale=cache.v_scale * (1 + 2 ** -6)), default),
                  not torch.equal(attend(cuda, cache, q, meta, scale, f16_operands=False), default)]
        row = dict(seq_lens=len(seq_lens), ctx=max(seq_lens), queries=sum(q_lens), hq=hq, hkv=hkv, d=d, page=page,
                   launches=len(launches), differing_launches=[str(x) for x in differing],
                   controls_differ=dict(zip(("k_scale", "v_scale", "v1_read"), nudged)), finite=bool(torch.isfinite(default.float()).all()))
        if len(seq_lens) == 1:
            want = oracle(cache, lists, seq_lens[0], q, hkv)
            err = (default.double() - want).abs()
            row["max_err"], row["within_bf16_tolerance"] = float(err.max()), bool((err <= 2 ** -8 * (1 + want.abs())).all())
            failures += not row["within_bf16_tolerance"]
        failures += bool(differing) + (not all(nudged)) + (not row["finite"])
        out.append(row)
        log(f"bits B={len(seq_lens):3} ctx={max(seq_lens):5} q={sum(q_lens):5} {hq}/{hkv}x{d} page {page:3}: "
            f"{len(launches) - len(differing)}/{len(launches)} launches equal to the default; controls "
            f"{'differ' if all(nudged) else 'DO NOT ALL DIFFER ' + str(nudged)}"
            + (f"; oracle max err {row['max_err']:.2e}" if "max_err" in row else ""))
    # prefill == chunked prefill == decode (GQA 4 and the packed GQA 5)
    for hq, hkv, d, page in ((6, 2, 64, 16),) if small else ((32, 8, 128, 64), (40, 8, 128, 16)):
        n = 530 if small else 1300
        q, k, v = rows(n, hq, d, 30, device), rows(n, hkv, d, 31, device), rows(n, hkv, d, 32, device)
        results = {}
        for label, steps in (("prefill", [n]), ("chunked", [n // 3, n - n // 3]), ("decode", [n - 40] + [1] * 40)):
            cache = fp8.Fp8KVCache(pages_needed(n, page), page, hkv, d, V2.fp8, device=device, fixed_scales=SCALES)
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
        out.append(dict(phases=list(results), tokens=n, hq=hq, hkv=hkv, d=d, page=page, equal_across_phases=phases))
        log(f"phases {hq}/{hkv}x{d} page {page}: prefill == chunked prefill == decode ({n} tokens): {phases}")
    return out, failures


SPEED_SHAPES = [(1, 4096, 32, 8, 128, 64), (1, 16384, 32, 8, 128, 64), (1, 32768, 32, 8, 128, 64),
                (4, 8192, 32, 8, 128, 64), (16, 4096, 32, 8, 128, 64), (16, 16384, 32, 8, 128, 64),
                (64, 8192, 32, 8, 128, 64), (256, 4096, 32, 8, 128, 64), (16, 8192, 40, 8, 128, 32),
                (64, 4096, 16, 8, 64, 16), (64, 8192, 32, 8, 128, 16)]


def speed_section(device, budget_s, small):
    cuda, v1 = create_backend("cuda", V2), create_backend("cuda", V1)
    out, failures, t0 = [], 0, time.time()
    log(f"{'B':>4} {'ctx':>6} {'heads':>9} {'pg':>3} {'bf16 us':>8} {'v2 us':>8} {'v2 x':>6} {'v2 alt us':>9} "
        f"{'v1 us':>8} {'v1 x':>6}")
    for batch, ctx, hq, hkv, d, page in SPEED_SHAPES:
        if time.time() - t0 > budget_s:
            log("speed: budget spent, later shapes skipped")
            break
        cache, lists = filled_cache(V2.fp8, [ctx] * batch, hkv, d, page, device, cuda)
        meta = build_metadata([1] * batch, [ctx] * batch, lists, device)
        q = rows(batch, hq, d, 5, device)
        scale = d ** -0.5
        k_bf16, v_bf16 = cache.read(torch.bfloat16)      # the same values in a bf16 cache
        alt = dict(splits_per_program=1, maxnreg=128, num_stages=3)     # v1's FP8 launch rule
        same_alt = torch.equal(attend(cuda, cache, q, meta, scale, **alt), attend(cuda, cache, q, meta, scale))
        failures += not same_alt

        def bench(fn):
            return do_bench_cudagraph_synced(fn, rep=50, return_mode="median") * 1e3
        t_bf16 = bench(lambda: cuda.attention(q, k_bf16, v_bf16, meta, scale=scale))
        t_v2 = bench(lambda: attend(cuda, cache, q, meta, scale))
        t_alt = bench(lambda: attend(cuda, cache, q, meta, scale, **alt))
        del k_bf16, v_bf16
        v1_cache, v1_lists = filled_cache(V1.fp8, [ctx] * batch, hkv, d, page, device, v1)
        v1_meta = build_metadata([1] * batch, [ctx] * batch, v1_lists, device)
        t_v1 = bench(lambda: v1_cache.attention(v1, q, v1_meta, scale=scale))
        del v1_cache, cache
        row = dict(batch=batch, ctx=ctx, hq=hq, hkv=hkv, d=d, page=page, bf16_us=t_bf16, v2_us=t_v2, v2_alt_us=t_alt,
                   v1_us=t_v1, v2_speedup=t_bf16 / t_v2, v2_alt_speedup=t_bf16 / t_alt, v1_speedup=t_bf16 / t_v1,
                   alt_equal_default=same_alt, kv_TBps_v2=batch * ctx * hkv * d * 2 / (t_v2 * 1e-6) / 1e12)
        out.append(row)
        log(f"{batch:4} {ctx:6} {f'{hq}/{hkv}x{d}':>9} {page:3} {t_bf16:8.1f} {t_v2:8.1f} {row['v2_speedup']:5.2f}x "
            f"{t_alt:9.1f} {t_v1:8.1f} {row['v1_speedup']:5.2f}x{'' if same_alt else '  (alt bits DIFFER)'}")
    return out, failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--only", default="bits,speed")
    parser.add_argument("--small", action="store_true", help="small bit checks, no speed (the interpreter)")
    parser.add_argument("--budget-s", type=float, default=400, help="stop starting new cases after this (per section)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    only = set(args.only.split(","))
    name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    result, failures, t0 = {"device": name, "torch": torch.__version__}, 0, time.time()
    for section, fn in (("bits", bits_section), ("speed", speed_section)):
        if section in only and not (section == "speed" and args.small):
            result[section], f = fn(args.device, args.budget_s, args.small)
            failures += f
    result["failures"], result["seconds"] = failures, time.time() - t0
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    log(f"{failures} failing checks, {result['seconds']:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
