"""Issue #25 on one GPU: the row-parallel linear's ordered combine against the plain linear.

[parallel] makes a row-parallel linear (o_proj, down_proj) gather every rank's fp32 K-chunk partials and
add them in ascending chunk order, instead of an NCCL all-reduce whose tree depends on the degree. On one
GPU this script measures what that costs, and checks its bits, on an 8B-shaped model's row-parallel
linears (hidden 4096, intermediate 12288) at decode and prefill M:

* bits: ``combine_chunks(partials of n K shards, concatenated in rank order)`` == ``linear`` of the whole
  K, bitwise, for n = 1, 2, 4, 8 shards (the math every rank of a TP = n group does), bf16 and fp32 out;
  negative control: the same partials summed by ``torch.sum`` over the chunk axis (a reduction tree of
  the library's choosing, as an all-reduce would be) differ from ``linear`` somewhere;
* time (device time per call, CUDA-graph replay): ``linear``; ``linear_chunk_partials`` + the combine
  (the TP path without communication); and ``hal.parallel.row_parallel_linear`` at TP = 1 through a
  one-rank NCCL group (its all-gather and concatenation included). The ratio is the sharded code path's
  single-GPU overhead; the combine's cost against an NCCL all-reduce at TP > 1 needs several GPUs.

    python3 bench/tp_overhead.py --json tp_overhead.json          # on the GPU, from outside the checkout
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
from hal.parallel import TensorParallel, contract_with_parallel, row_parallel_linear

SHAPES = {"o_proj": (4096, 4096), "down_proj": (4096, 12288)}   # (N, K) of an 8B-shaped model
MS = (1, 16, 256, 2048, 8192)


def device_us(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e3


def sharded(backend, x, w, bias, n, out_dtype):
    ks = x.shape[-1] // n
    parts = torch.cat([backend.linear_chunk_partials(x[:, r * ks:(r + 1) * ks], w[:, r * ks:(r + 1) * ks], r * ks)
                       for r in range(n)])
    return backend.combine_chunks(parts, bias, out_dtype=out_dtype), parts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", required=True)
    parser.add_argument("--ms", default=",".join(map(str, MS)))
    args = parser.parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("nccl", rank=0, world_size=1)
    tp = TensorParallel.current()
    backend = create_backend("cuda", contract_with_parallel(source="bf16-dense-v1 + [parallel] (bench/tp_overhead.py)"))
    k_chunk = backend.contract.gemm.k_chunk
    g = torch.Generator(device="cuda").manual_seed(0)
    rows, failures = [], []
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).to(torch.bfloat16)
        bias = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
        for m in [int(v) for v in args.ms.split(",")]:
            x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
            row = dict(op=name, m=m, n=n, k=k, chunks=k // k_chunk)
            for out_dtype, b in ((torch.bfloat16, bias), (torch.float32, None)):
                want = backend.linear(x, w, b, out_dtype=out_dtype)
                for shards in (1, 2, 4, 8):
                    got, parts = sharded(backend, x, w, b, shards, out_dtype)
                    ok = torch.equal(got, want)
                    row[f"equal_{shards}_{str(out_dtype)[6:]}"] = ok
                    if not ok:
                        failures.append(f"{name} M={m} {shards} shards {out_dtype}")
                tree = parts.sum(0) + (b.float() if b is not None else 0)
                row[f"torch_sum_differs_{str(out_dtype)[6:]}"] = not torch.equal(tree.to(out_dtype), want)
            row["linear_us"] = device_us(lambda: backend.linear(x, w, bias))
            row["partials_combine_us"] = device_us(
                lambda: backend.combine_chunks(backend.linear_chunk_partials(x, w), bias, out_dtype=torch.bfloat16))
            row["row_parallel_tp1_us"] = device_us(lambda: row_parallel_linear(backend, tp, x, w, bias))
            row["partials_mb"] = row["chunks"] * m * n * 4 / 1e6
            rows.append(row)
            print(f"{name:9} M={m:<5} linear {row['linear_us']:8.1f} us  partials+combine {row['partials_combine_us']:8.1f} us "
                  f"({row['partials_combine_us'] / row['linear_us']:.2f}x)  row_parallel TP=1 {row['row_parallel_tp1_us']:8.1f} us "
                  f"({row['row_parallel_tp1_us'] / row['linear_us']:.2f}x)  partials {row['partials_mb']:.0f} MB  "
                  f"bits: shards 1/2/4/8 equal={all(v for key, v in row.items() if key.startswith('equal'))}, "
                  f"torch.sum differs={row['torch_sum_differs_bfloat16']}/{row['torch_sum_differs_float32']}",
                  flush=True)
    controls = any(r["torch_sum_differs_float32"] or r["torch_sum_differs_bfloat16"] for r in rows)
    summary = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                   k_chunk=k_chunk, rows=rows, failures=failures, negative_control_differs=controls)
    with open(args.json, "w") as f:
        json.dump(summary, f, indent=1)
    dist.destroy_process_group()
    print(f"bits: {'all equal' if not failures else 'FAILED: ' + '; '.join(failures)}; negative control "
          f"(torch.sum over chunks) {'differs somewhere' if controls else 'never differed: the control FAILED'}")
    return 0 if not failures and controls else 1


if __name__ == "__main__":
    sys.exit(main())
