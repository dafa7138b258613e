"""Prove on the GPU that each cuda kernel's launch shape does not change its bits.

The contract fixes the reduction structure; tiles, warps, stages, split-K / split-KV parallelism,
query-tile sizes and the KV cache's memory order are left free. This script runs every kernel of
the cuda backend under many launch shapes on the same random inputs and checks that every output
is bitwise equal (``torch.equal``) to the first one. As a negative control it also changes a
contract number (k_chunk, kv_chunk, row block) and checks that the bits *do* change.

    python bench/tile_freedom.py --json results.json [--contract bf16-ascend-v1]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import torch
from triton.runtime.errors import OutOfResources

from hal.api import create_backend
from hal.conformance.checks import random_tensor
from hal.kvcache import PageAllocator, PagedKVCache, build_metadata, cache_tensor, pages_needed, slot_mapping


def gemm_cases(backend, g):
    from hal.backends.cuda.launch import CUDA_LAUNCH
    from hal.kernels import gemm

    spec = backend.contract.gemm
    results = []
    # Each launch shape is a separate compilation (~1.5 s): a few shapes that straddle the
    # direct/split-K choice, both MMA families (BLOCK_M 16 -> mma.sync, 64/128 -> wgmma) and
    # pointer vs TMA loads.
    for m, n, k, dtype in [(1, 4096, 4096, torch.bfloat16), (16, 1000, 1100, torch.bfloat16),
                           (257, 1536, 2048, torch.bfloat16), (16, 1000, 1100, torch.float32)]:
            x = random_tensor((m, k), dtype, g, device="cuda", spread=4)
            w = random_tensor((n, k), dtype, g, device="cuda", spread=4, scale=k ** -0.5)
            bias = random_tensor((n,), dtype, g, device="cuda")
            configs, outs = [], []
            # tma: tensor-descriptor loads where the tensors allow them (bf16, K a multiple of 8). A hand list
            # of shapes, then the autotuner's whole candidate set for this GEMM (hal/kernels/tuning.py: the
            # launches `hal tune` may choose from must give these bits too).
            hand = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages, split=split, tma=tma)
                    for bm, bn, bk, warps, stages, split, tma in [
                        (16, 64, 128, 4, 4, True, False), (16, 64, 128, 4, 4, False, False),
                        (64, 64, 64, 4, 4, False, False), (64, 128, 32, 4, 3, True, False),
                        (128, 128, 64, 8, 3, False, False), (128, 64, 128, 8, 2, False, False),
                        (128, 128, 64, 8, 4, False, True), (128, 256, 64, 8, 3, False, True)]]
            tuned = gemm.candidates(m, n, k, spec, gemm._tma_ok(x) and gemm._tma_ok(w))
            for cfg in hand + tuned:
                try:
                    outs.append(gemm.linear(x, w, bias, torch.float32, spec, cfg, policy=CUDA_LAUNCH))
                except OutOfResources:  # a tile that does not fit in shared memory: not a launch shape
                    continue
                configs.append(cfg)
            same = [torch.equal(outs[0], o) for o in outs]
            half = dataclasses.replace(spec, k_chunk=spec.k_chunk // 2)
            other = gemm.linear(x, w, bias, torch.float32, half, configs[0], policy=CUDA_LAUNCH)
            results.append(dict(kernel="gemm", shape=f"M={m} N={n} K={k}", dtype=str(dtype), launches=len(configs),
                                autotuner_candidates=len(tuned), identical=sum(same), contract_change_changes_bits=not torch.equal(outs[0], other)))
    return results


def attention_cases(backend, g):
    from hal.backends.cuda.launch import CUDA_LAUNCH
    from hal.kernels import attention
    from hal.kernels.common import next_power_of_2

    spec = backend.contract.attention
    results = []
    for seq_lens, q_lens, heads, head_dim, page, dtype in [
            ([1500], [1500], (32, 8), 128, 64, torch.bfloat16),
            ([700, 1300, 90], [1, 1, 1], (32, 8), 128, 64, torch.bfloat16),
            ([2100, 600], [300, 1], (16, 2), 64, 16, torch.float32)]:
            hq, hkv = heads
            total = sum(seq_lens)
            cache = PagedKVCache.allocate(pages_needed(total, page) + 2 * len(seq_lens), page, hkv, head_dim,
                                          dtype, "cuda")
            alloc = PageAllocator(cache.num_pages, g)
            page_lists = [alloc.take(pages_needed(n, page)) for n in seq_lens]
            for n, pages in zip(seq_lens, page_lists):
                slots = slot_mapping(pages, range(n), page, "cuda")
                backend.write_kv(random_tensor((n, hkv, head_dim), dtype, g, device="cuda"),
                                 random_tensor((n, hkv, head_dim), dtype, g, device="cuda"), cache.k, cache.v, slots)
            q = random_tensor((sum(q_lens), hq, head_dim), dtype, g, device="cuda")
            meta = build_metadata(q_lens, seq_lens, page_lists, "cuda")
            args = (q, cache.k, cache.v, meta.query_start_loc, meta.seq_lens, meta.block_table, head_dim ** -0.5)
            group_pad = next_power_of_2(hq // hkv)  # as paged_attention pads the GQA group
            launches = [dict(split_parallel=sp, block_q=bq, num_warps=w, num_stages=st, head_split=hs, heads_fastest=hf,
                             splits_per_program=spp)
                        for sp, bq, w, st, hs, hf, spp in [(False, 16, 4, 2, 1, False, 1), (True, 4, 4, 5, 1, False, 1),
                                                           (False, 4, 8, 3, 1, True, 1), (True, 1, 8, 2, 1, False, 1),
                                                           (True, 16, 4, 5, group_pad, True, 1),
                                                           (False, 16, 4, 2, group_pad, True, 1),
                                                           (True, 4, 4, 5, 1, True, 2), (True, 2, 8, 4, 1, False, 3)]]
            # The autotuner's candidate set for this call (``hal tune``: the launches it may choose must give these
            # bits too): prefill's for prompts, decode's for one token a sequence.
            tuned = (attention.prefill_candidates(hq // hkv) if max(q_lens) > 16 else
                     attention.decode_candidates(spec.split_count(meta.block_table.shape[1] * page), group_pad))
            outs = [attention.paged_attention(*args, spec, policy=CUDA_LAUNCH, **lc) for lc in launches + tuned]
            # The caches' memory order (hal.kvcache): the same keys stored head-major (HND).
            hnd = [cache_tensor(cache.num_pages, page, hkv, head_dim, dtype, "cuda", "HND").copy_(t)
                   for t in (cache.k, cache.v)]
            for lc in (launches[1], launches[6]):
                outs.append(attention.paged_attention(q, *hnd, *args[3:], spec, policy=CUDA_LAUNCH, **lc))
            # K/V by tensor descriptor (64-key pages, bf16): both orders, in-kernel and parallel splits.
            if page % spec.kv_chunk == 0 and dtype == torch.bfloat16:
                for caches, lc in (((cache.k, cache.v), launches[0]), ((cache.k, cache.v), launches[6]),
                                   (hnd, launches[1]), (hnd, launches[2])):
                    outs.append(attention.paged_attention(q, *caches, *args[3:], spec, policy=CUDA_LAUNCH,
                                                          **lc, tma=True))
            same = [torch.equal(outs[0], o) for o in outs]
            half = dataclasses.replace(spec, kv_chunk=spec.kv_chunk // 2)
            other = attention.paged_attention(*args, half, policy=CUDA_LAUNCH, **launches[0])
            results.append(dict(kernel="attention", shape=f"seq_lens={seq_lens} q_lens={q_lens} heads={heads} "
                                f"D={head_dim} page={page} (+ HND order, + TMA at 64-key pages)", dtype=str(dtype),
                                launches=len(outs), autotuner_candidates=len(tuned),
                                identical=sum(same), contract_change_changes_bits=not torch.equal(outs[0], other)))
    return results


def row_cases(backend, g):
    """Row kernels reduce a 1-D tile with tl.sum. Measured here (2026-11-29, H200, triton 3.6): the
    tl.sum tree of a 4096-wide tile changes with num_warps (elements per thread), unlike the MMA-layout
    and 2-D cases above. So the row kernels pin num_warps as a function of the block width only
    (rows.py, logprobs.py); this records that warps are *not* free there, and checks the contract's
    row-block size still decides the bits."""
    from hal.kernels import logprobs, rows

    results = []
    norm, reduce = backend.contract.rms_norm, backend.contract.reduce
    block = norm.row_block
    for rows_n, width in [(77, 5120), (1024, 8192)]:
        x = random_tensor((rows_n, width), torch.float32, g, device="cuda", spread=3)
        w = random_tensor((width,), torch.float32, g, device="cuda")
        for kernel, run in (("rms_norm", lambda blk, nw: rows.rms_norm(
                                x, w, 1e-6, None, dataclasses.replace(norm, row_block=blk), num_warps=nw)[0]),
                            ("sum", lambda blk, nw: rows.reduce_last(
                                x, False, dataclasses.replace(reduce, row_block=blk), num_warps=nw))):
            outs = [run(block, nw) for nw in (2, 8)]
            results.append(dict(kernel=kernel, shape=f"rows={rows_n} width={width}", dtype="torch.float32",
                                launches=2, identical=sum(torch.equal(outs[0], o) for o in outs), free=False,
                                contract_change_changes_bits=not torch.equal(outs[0], run(block // 4, 2))))
    spec = backend.contract.logprobs
    for rows_n, vocab in [(64, 152064), (256, 32000)]:
        logits = random_tensor((rows_n, vocab), torch.float32, g, device="cuda", scale=5.0)
        outs = [logprobs.log_softmax(logits, 0.8, spec, num_warps=nw) for nw in (4, 8)]
        half = dataclasses.replace(spec, vocab_chunk=spec.vocab_chunk // 2)
        other = logprobs.log_softmax(logits, 0.8, half, num_warps=4)
        results.append(dict(kernel="log_softmax", shape=f"rows={rows_n} vocab={vocab}", dtype="torch.float32",
                            launches=len(outs), identical=sum(torch.equal(outs[0], o) for o in outs), free=False,
                            contract_change_changes_bits=not torch.equal(outs[0], other)))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--contract", default=None, help="contract name (default: the cuda backend's first); "
                                                         "e.g. bf16-ascend-v1 for its natural-exp, fp32-row-sum attention")
    parser.add_argument("--kernels", default="gemm,attention,rows", help="which case groups (comma-separated)")
    args = parser.parse_args()
    backend = create_backend("cuda", args.contract)
    g = torch.Generator().manual_seed(0)
    start = time.time()
    results = []
    groups = {"gemm": gemm_cases, "attention": attention_cases, "rows": row_cases}
    for fn in (groups[name] for name in args.kernels.split(",")):
        results += fn(backend, g)
        print(f"{fn.__name__} done at {time.time() - start:.0f}s", flush=True)
    # Launch parameters marked free must not change the bits; the contract's numbers must.
    ok = all((r["identical"] == r["launches"] or not r.get("free", True)) and r["contract_change_changes_bits"]
             for r in results)
    with open(args.json, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, contract=str(backend.contract),
                       ok=ok, results=results), f,
                  indent=2)
    print(f"{'kernel':<12} {'dtype':<15} {'identical':>10} {'contract change':>16}  shape")
    for r in results:
        note = "" if r.get("free", True) else "  (num_warps varied: not free for 1-D tl.sum, pinned per width)"
        print(f"{r['kernel']:<12} {r['dtype']:<15} {r['identical']:>4}/{r['launches']:<5} "
              f"{'changes bits' if r['contract_change_changes_bits'] else 'SAME BITS!':>16}  {r['shape']}{note}")
    print("tile freedom:", "PROVEN for every case" if ok else "VIOLATED (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
