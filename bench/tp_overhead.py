"""Issue #25 on one GPU: the row-parallel linear's ordered combine against the plain linear.

[parallel] makes a row-parallel linear (o_proj, down_proj) gather every rank's fp32 K-chunk partials and
add them in ascending chunk order, instead of an NCCL all-reduce whose tree depends on the degree. On one
GPU this script measures what that costs, and checks its bits, on an 8B-shaped model's row-parallel
linears (hidden 4096, intermediate 12288) at decode and prefill M:

* bits: ``combine_chunks(partials of n K shards, concatenated in rank order)`` == ``linear`` of the whole
  K, bitwise, for n = 1, 2, 4, 8 shards (the math every rank of a TP = n group does), bf16 and fp32 out;
  negative control: what a plain all-reduce computes from the same partials (each rank adds its own
  chunks, then the ranks' sums are added pairwise, as NCCL's tree does) differs from ``linear`` somewhere;
* time (device time per call, CUDA-graph replay): ``linear``; ``linear_chunk_partials`` + the combine
  (what each rank of a TP > 1 group computes, without communication); and
  ``hal.parallel.row_parallel_linear`` at TP = 1 through a one-rank NCCL group (up to e23415b the whole
  sharded path, its all-gather and concatenation included; since then one rank calls ``linear`` itself,
  bitwise the same, and the column shows the wrapper's cost). The ratios are the sharded code path's
  single-GPU overhead; the combine's cost against an NCCL all-reduce at TP > 1 needs several GPUs;
* vocab-parallel logprobs (vocabularies of 131072 and 163840, so that 8 shards are whole 4096-wide
  chunks): the pieces of n vocab shards (``logprob_chunk_max``, ``logprob_chunk_sums``,
  ``logprob_combine``, as every rank of a TP = n group computes them) == ``token_logprobs`` of the whole
  row, bitwise, at temperatures 1 and 0.7; negative control: per-shard logsumexps merged by
  ``torch.logsumexp`` (a tree of the library's choosing) differ somewhere; time of
  ``hal.parallel.vocab_parallel_token_logprobs`` at TP = 1 against ``token_logprobs``.

    python3 bench/tp_overhead.py --json tp_overhead.json          # on the GPU, from outside the checkout
    TRITON_INTERPRET=1 python bench/tp_overhead.py --small --device cpu --json /tmp/tp.json   # the script's
                                           # checks on small shapes (gloo, Triton's interpreter), no timing
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import triton

from hal.api import create_backend
from hal.parallel import TensorParallel, contract_with_parallel, row_parallel_linear, vocab_parallel_token_logprobs

SHAPES = {"o_proj": (4096, 4096), "down_proj": (4096, 12288)}   # (N, K) of an 8B-shaped model
MS = (1, 16, 256, 2048, 8192)
VOCABS = (131072, 163840)                                       # 8 shards of whole 4096-key chunks
LOGPROB_MS = (1, 256, 2048)


TIMERS: dict[str, str] = {}      # what timed each op: CUDA-graph replay, or plain launches where capture failed


def device_us(fn, what: str) -> float | None:
    if not torch.cuda.is_available():
        return None
    try:
        us = triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e3
        TIMERS.setdefault(what, "cuda graph")
    except Exception as error:   # capture refused (a host read in the path): time the launches instead
        torch.cuda.synchronize()
        us = triton.testing.do_bench(fn, rep=50, return_mode="median") * 1e3
        TIMERS[what] = f"do_bench (graph capture failed: {type(error).__name__}: {str(error)[:120]})"
    return us


def ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def fmt(us) -> str:
    return f"{us:8.1f} us" if us is not None else "       - us"


def sharded(backend, x, w, bias, n, out_dtype):
    ks = x.shape[-1] // n
    parts = torch.cat([backend.linear_chunk_partials(x[:, r * ks:(r + 1) * ks], w[:, r * ks:(r + 1) * ks], r * ks)
                       for r in range(n)])
    return backend.combine_chunks(parts, bias, out_dtype=out_dtype), parts


def all_reduce_style(parts, n, bias, out_dtype):
    """The negative control: each of n ranks sums its own chunks (ascending), then the rank sums are
    added pairwise (a tree over ranks, as a plain all-reduce does): a grouping that depends on n."""
    per_rank = parts.shape[0] // n
    sums = []
    for r in range(n):
        acc = parts[r * per_rank].clone()
        for c in range(r * per_rank + 1, (r + 1) * per_rank):
            acc += parts[c]
        sums.append(acc)
    while len(sums) > 1:
        sums = [sums[i] + sums[i + 1] for i in range(0, len(sums), 2)]
    return (sums[0] + (bias.float() if bias is not None else 0)).to(out_dtype)


def vocab_sharded(backend, logits, ids, n, temperature):
    """What every rank of a TP = n group computes from its vocab shard, gathered in rank order."""
    vs = logits.shape[-1] // n
    shards = [logits[:, r * vs:(r + 1) * vs] for r in range(n)]
    chunk_max = torch.cat([backend.logprob_chunk_max(s, temperature, r * vs) for r, s in enumerate(shards)], -1)
    row_max = chunk_max.amax(-1)
    sums = torch.cat([backend.logprob_chunk_sums(s, row_max, temperature, r * vs) for r, s in enumerate(shards)], -1)
    token_logits = logits.float().gather(-1, ids.long().view(-1, 1)).squeeze(-1)
    return backend.logprob_combine(token_logits, row_max, sums, temperature)


def tree_merged(logits, ids, n, temperature):
    """The negative control: each shard's logsumexp, merged by torch.logsumexp (the library's tree)."""
    x = logits.float() / temperature
    lse = torch.logsumexp(torch.stack([torch.logsumexp(s, -1) for s in x.chunk(n, -1)], -1), -1)
    return x.gather(-1, ids.long().view(-1, 1)).squeeze(-1) - lse


def logprob_rows(backend, tp, g, failures, vocabs, ms) -> list[dict]:
    rows = []
    device = backend.device
    for vocab in vocabs:
        for m in ms:
            logits = (torch.randn(m, vocab, device=device, generator=g) * 4).to(torch.bfloat16)
            ids = torch.randint(0, vocab, (m,), device=device, generator=g)
            row = dict(op="token_logprobs", m=m, vocab=vocab, chunks=vocab // backend.contract.logprobs.vocab_chunk)
            differs = False
            for t in (1.0, 0.7):
                want = backend.token_logprobs(logits, ids, t)
                for shards in (1, 2, 4, 8):
                    ok = torch.equal(vocab_sharded(backend, logits, ids, shards, t), want)
                    row[f"equal_{shards}_T{t}"] = ok
                    if not ok:
                        failures.append(f"token_logprobs V={vocab} M={m} {shards} shards T={t}")
                differs |= any(not torch.equal(tree_merged(logits, ids, s, t), want) for s in (2, 4, 8))
            row["tree_merge_differs"] = differs
            row["token_logprobs_us"] = device_us(lambda: backend.token_logprobs(logits, ids), "token_logprobs")
            row["vocab_parallel_tp1_us"] = device_us(lambda: vocab_parallel_token_logprobs(backend, tp, logits, ids),
                                                     "vocab_parallel_token_logprobs")
            rows.append(row)
            print(f"logprobs  M={m:<5} V={vocab}  token_logprobs {fmt(row['token_logprobs_us'])}  vocab-parallel "
                  f"TP=1 {fmt(row['vocab_parallel_tp1_us'])} ({ratio(row['vocab_parallel_tp1_us'], row['token_logprobs_us'])})  "
                  f"bits: shards 1/2/4/8 equal={all(v for key, v in row.items() if key.startswith('equal'))}, "
                  f"tree merge differs={differs}", flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", required=True)
    parser.add_argument("--ms", default=",".join(map(str, MS)))
    parser.add_argument("--device", default="cuda", help="cuda (default), or cpu with --small under TRITON_INTERPRET=1")
    parser.add_argument("--small", action="store_true", help="small shapes (still 8 shards of whole chunks), no timing")
    args = parser.parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=0, world_size=1)
    tp = TensorParallel.current()
    backend = create_backend("cuda", contract_with_parallel(source="bf16-dense-v1 + [parallel] (bench/tp_overhead.py)"),
                             device=args.device)
    k_chunk = backend.contract.gemm.k_chunk
    vocab_chunk = backend.contract.logprobs.vocab_chunk
    shapes = {"down_proj (small)": (96, 8 * k_chunk)} if args.small else SHAPES
    ms = (1, 5) if args.small else [int(v) for v in args.ms.split(",")]
    vocabs, logprob_ms = ((8 * vocab_chunk, 16 * vocab_chunk), (1, 3)) if args.small else (VOCABS, LOGPROB_MS)
    device = backend.device
    g = torch.Generator(device=device).manual_seed(0)
    rows, failures = [], []
    for name, (n, k) in shapes.items():
        w = (torch.randn(n, k, device=device, generator=g) * k ** -0.5).to(torch.bfloat16)
        bias = torch.randn(n, device=device, generator=g).to(torch.bfloat16)
        for m in ms:
            x = torch.randn(m, k, device=device, generator=g).to(torch.bfloat16)
            row = dict(op=name, m=m, n=n, k=k, chunks=k // k_chunk)
            for out_dtype, b in ((torch.bfloat16, bias), (torch.float32, None)):
                want = backend.linear(x, w, b, out_dtype=out_dtype)
                differs = False
                for shards in (1, 2, 4, 8):
                    got, parts = sharded(backend, x, w, b, shards, out_dtype)
                    ok = torch.equal(got, want)
                    row[f"equal_{shards}_{str(out_dtype)[6:]}"] = ok
                    if not ok:
                        failures.append(f"{name} M={m} {shards} shards {out_dtype}")
                    if shards > 1:
                        differs |= not torch.equal(all_reduce_style(parts, shards, b, out_dtype), want)
                row[f"all_reduce_differs_{str(out_dtype)[6:]}"] = differs
            row["linear_us"] = device_us(lambda: backend.linear(x, w, bias), "linear")
            row["partials_combine_us"] = device_us(
                lambda: backend.combine_chunks(backend.linear_chunk_partials(x, w), bias, out_dtype=torch.bfloat16),
                "linear_chunk_partials + combine_chunks")
            row["row_parallel_tp1_us"] = device_us(lambda: row_parallel_linear(backend, tp, x, w, bias),
                                                   "row_parallel_linear")
            row["partials_mb"] = row["chunks"] * m * n * 4 / 1e6
            rows.append(row)
            print(f"{name:9} M={m:<5} linear {fmt(row['linear_us'])}  partials+combine {fmt(row['partials_combine_us'])} "
                  f"({ratio(row['partials_combine_us'], row['linear_us'])})  row_parallel TP=1 {fmt(row['row_parallel_tp1_us'])} "
                  f"({ratio(row['row_parallel_tp1_us'], row['linear_us'])})  partials {row['partials_mb']:.0f} MB  "
                  f"bits: shards 1/2/4/8 equal={all(v for key, v in row.items() if key.startswith('equal'))}, "
                  f"all-reduce order differs={row['all_reduce_differs_bfloat16']}/{row['all_reduce_differs_float32']}",
                  flush=True)
    controls = any(r["all_reduce_differs_float32"] or r["all_reduce_differs_bfloat16"] for r in rows)
    lp_rows = logprob_rows(backend, tp, g, failures, vocabs, logprob_ms)
    controls = controls and any(r["tree_merge_differs"] for r in lp_rows)
    summary = dict(device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu (Triton interpreter)",
                   torch=torch.__version__, triton=triton.__version__, small=args.small, k_chunk=k_chunk,
                   vocab_chunk=vocab_chunk, timers=TIMERS, rows=rows, logprob_rows=lp_rows, failures=failures,
                   negative_control_differs=controls)
    with open(args.json, "w") as f:
        json.dump(summary, f, indent=1)
    dist.destroy_process_group()
    print(f"bits: {'all equal' if not failures else 'FAILED: ' + '; '.join(failures)}; negative control "
          f"(all-reduce order, logsumexp tree) {'differs somewhere' if controls else 'never differed: a control FAILED'}")
    return 0 if not failures and controls else 1


if __name__ == "__main__":
    sys.exit(main())
