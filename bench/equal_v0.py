"""Check on the GPU that the current cuda kernels give bitwise the same outputs as an older version
of them (by default the first measured one), over varied batch sizes, lengths and launch shapes.

The speed work may change tiles, warps, stages, loop structure and launches, never the
contract's reduction structure; ``torch.equal`` against the old kernels on the same random
inputs is the direct check (the conformance kit checks the contract's properties themselves).
The old kernels come from git history: ``bash bench/old_kernels.sh [REF] [DIR]`` writes them into
DIR (default .old_kernels/, REF default b7c66ae) on a machine with the history; carry DIR to the GPU.

    python bench/equal_v0.py --json equal_v0.json [--base .old_kernels]
    TRITON_INTERPRET=1 python bench/equal_v0.py --json equal.json --device cpu --small   # dry run, no GPU
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import old_kernels
from hal.api import create_backend
from hal.backends.cuda.launch import CUDA_LAUNCH
from hal.kernels import attention, gemm, logprobs, rows as row_kernels
from hal.conformance.checks import random_tensor
from hal.kvcache import build_metadata


def gemm_cases(contract, base, g, device, small):
    k_chunk = contract.gemm.k_chunk
    rows = []
    shapes = [(4096, 4096, torch.bfloat16, False, torch.bfloat16), (1000, 1100, torch.bfloat16, True, torch.float32),
              (32000, 2048, torch.bfloat16, False, torch.float32), (1536, 2048, torch.float32, True, torch.float32)]
    # Every M class of gemm._config on the first shape; one M per class on the others (compiles).
    ms = [(1, 2, 7, 16, 17, 33, 64, 65, 129, 256, 257, 1000, 4096)] + [(1, 17, 65, 257, 1000)] * 3
    if small:
        shapes, ms = [(40, 1100, torch.bfloat16, True, torch.float32), (33, 600, torch.float32, False, torch.float32)], [(1, 17)] * 2
    for (n, k, dtype, has_bias, out_dtype), m_list in zip(shapes, ms):
        w = random_tensor((n, k), dtype, g, device=device, spread=4, scale=k ** -0.5)
        bias = random_tensor((n,), dtype, g, device=device) if has_bias else None
        for m in m_list:
            x = random_tensor((m, k), dtype, g, device=device, spread=4)
            same = torch.equal(gemm.linear(x, w, bias, out_dtype, contract.gemm, policy=CUDA_LAUNCH),
                               base.gemm.linear(x, w, bias, out_dtype, k_chunk))
            rows.append(dict(op="gemm", case=f"M={m} N={n} K={k} {dtype} bias={has_bias} out={out_dtype}", equal=same))
    return rows


def _paged(seq_lens, q_lens, hq, hkv, d, page, dtype, g, device):
    pages = [-(-n // page) for n in seq_lens]
    total = sum(pages)
    perm = torch.randperm(total, generator=g).tolist()  # scrambled pages
    lists, at = [], 0
    for p in pages:
        lists.append(perm[at: at + p])
        at += p
    k = random_tensor((total, page, hkv, d), dtype, g, device=device)
    v = random_tensor((total, page, hkv, d), dtype, g, device=device)
    q = random_tensor((sum(q_lens), hq, d), dtype, g, device=device)
    return q, k, v, build_metadata(q_lens, seq_lens, lists, device)


def attention_cases(contract, base, g, device, small):
    spec = contract.attention
    rows = []
    cases = [([n], [n], 32, 8, 128, 64, torch.bfloat16) for n in (1, 63, 64, 65, 511, 512, 513, 1500, 4096)]
    cases += [([1500], [1500], 32, 8, 128, 16, torch.bfloat16), ([777], [777], 24, 8, 128, 16, torch.bfloat16)]
    lens = torch.randint(1, 5000, (64,), generator=g).tolist()
    cases += [(lens[:b], [1] * b, 32, 8, 128, 16, torch.bfloat16) for b in (1, 3, 8, 17, 64)]
    cases += [([32768], [1], 32, 8, 128, 16, torch.bfloat16),
              ([2100, 600, 17], [300, 1, 17], 32, 8, 128, 16, torch.bfloat16),
              ([2100, 600], [300, 1], 16, 2, 64, 16, torch.float32),
              ([530, 90], [40, 90], 16, 16, 64, 5, torch.bfloat16)]
    if small:
        cases = [([530, 90], [40, 90], 4, 2, 64, 5, torch.bfloat16), ([600, 70, 3], [1, 1, 1], 4, 1, 64, 16, torch.bfloat16),
                 ([130], [130], 6, 2, 64, 64, torch.float32)]
    for seq_lens, q_lens, hq, hkv, d, page, dtype in cases:
        q, k, v, meta = _paged(seq_lens, q_lens, hq, hkv, d, page, dtype, g, device)
        inputs = (q, k, v, meta.query_start_loc, meta.seq_lens, meta.block_table, d ** -0.5)
        ref = base.attention.paged_attention(*inputs, spec.kv_chunk, spec.kv_split)  # the old integer arguments
        launches = [dict(), dict(split_parallel=True), dict(split_parallel=False, block_q=4, num_warps=4)]
        same = [torch.equal(attention.paged_attention(*inputs, spec, policy=CUDA_LAUNCH, **lc), ref) for lc in launches]
        rows.append(dict(op="attention", case=f"seq_lens={seq_lens[:4]}{'...' if len(seq_lens) > 4 else ''} "
                         f"q_lens={q_lens[:4]} B={len(seq_lens)} heads=({hq},{hkv}) D={d} page={page} {dtype}",
                         equal=all(same), launches=len(launches)))
    return rows


def logprob_cases(contract, base, g, device, small):
    chunk = contract.logprobs.vocab_chunk
    rows = []
    for m in (1, 7) if small else (1, 7, 64, 300):
        for vocab in (9000, 1000) if small else (152064, 32000, 1000):
            for t in (1.0, 0.7):
                x = random_tensor((m, vocab), torch.float32, g, device=device, scale=5.0)
                ids = torch.randint(0, vocab, (m,), generator=g).to(device)
                same_tok = torch.equal(logprobs.token_logprobs(x, ids, t, contract.logprobs),
                                       base.logprobs.token_logprobs(x, ids, t, chunk))
                same_ls = torch.equal(logprobs.log_softmax(x, t, contract.logprobs), base.logprobs.log_softmax(x, t, chunk))
                rows.append(dict(op="logprobs", case=f"M={m} V={vocab} T={t}", equal=same_tok and same_ls))
    return rows


def row_cases(contract, base, g, device, small):
    """RMSNorm (+ residual) at widths of one block and of several, and rotary of q and k (strided views
    of a fused QKV output, and contiguous), against the old kernels (whose rotary took one tensor)."""
    from hal.rope import cos_sin_cache

    import inspect

    rows = []
    spec = contract.rms_norm
    # the first measured kernels took the row block itself, later ones the [rms_norm] section
    old_spec = spec if "spec" in inspect.signature(base.rows.rms_norm).parameters else spec.row_block
    tokens = (1, 7) if small else (1, 7, 300, 8192)
    widths = (100, 2 * spec.row_block + 3) if small else (128, 2048, 4096, 2 * spec.row_block + 3)
    for t in tokens:
        for n in widths:
            for dtype in (torch.bfloat16, torch.float32):
                x = random_tensor((t, n), dtype, g, device=device, spread=4)
                res = random_tensor((t, n), dtype, g, device=device, spread=4)
                w = random_tensor((n,), dtype, g, device=device)
                for r in (None, res):
                    new = row_kernels.rms_norm(x, w, 1e-6, r, spec)
                    old = base.rows.rms_norm(x, w, 1e-6, r, old_spec)
                    same = torch.equal(new[0], old[0]) and (r is None or torch.equal(new[1], old[1]))
                    rows.append(dict(op="rms_norm", case=f"T={t} n={n} {dtype} residual={r is not None}", equal=same))
        for q_heads, k_heads, d, rot in ((16, 8, 128, 128), (32, 8, 128, 64), (5, 1, 64, 64)):
            qkv = random_tensor((t, (q_heads + 2 * k_heads) * d), torch.bfloat16, g, device=device, spread=4)
            q = qkv[:, :q_heads * d].view(t, q_heads, d)
            k = qkv[:, q_heads * d:(q_heads + k_heads) * d].view(t, k_heads, d)
            table = cos_sin_cache(rot, 8192, 1e6).to(device)
            pos = torch.randint(0, 8192, (t,), generator=g).to(device)
            old_q, old_k = base.rows.rotary(pos, q.contiguous(), table), base.rows.rotary(pos, k.contiguous(), table)
            same = all(torch.equal(a, old_q) and torch.equal(b, old_k)
                       for a, b in (row_kernels.rotary(pos, q, k, table),
                                    row_kernels.rotary(pos, q.contiguous(), k.contiguous(), table)))
            rows.append(dict(op="rotary", case=f"T={t} heads {q_heads}/{k_heads} d={d} rotary {rot}", equal=same))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="a few small shapes (for the CPU interpreter)")
    parser.add_argument("--only", default="gemm,attention,logprobs,rows",
                        help="case families (the rows cases need a base with the current APIs, e.g. the parent commit)")
    old_kernels.add_argument(parser)
    args = parser.parse_args()
    base = old_kernels.load(args.base)
    contract = create_backend("cuda").contract
    g = torch.Generator().manual_seed(0)
    start = time.time()
    rows = []
    families = dict(gemm=gemm_cases, attention=attention_cases, logprobs=logprob_cases, rows=row_cases)
    for fn in (families[name] for name in args.only.split(",")):
        rows += fn(contract, base, g, args.device, args.small)
        print(f"{fn.__name__} done at {time.time() - start:.0f}s", flush=True)
    ok = all(r["equal"] for r in rows)
    with open(args.json, "w") as f:
        device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
        json.dump(dict(device=device, torch=torch.__version__, base=base.__doc__.strip(), ok=ok, rows=rows), f, indent=2)
    for r in rows:
        if not r["equal"]:
            print("DIFFERENT BITS:", r["op"], r["case"])
    print(f"equal to the old kernels in {args.base}: {sum(r['equal'] for r in rows)}/{len(rows)} cases"
          f" ({'all bitwise equal' if ok else 'MISMATCH'})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
