"""RMSNorm of narrow rows (Qwen3's per-head q/k norms: rows of head_dim = 64..256) on the GPU: the
one-row-per-program kernel (``rows.rms_norm`` with ``num_warps``) against the many-rows kernel with the
layout-free pairwise tree (``rows.rms_norm_rows``), and torch's.

Checks, bitwise: ``rms_norm_rows`` gives the same bits for every rows-per-program and warp count tried
(the tree is fixed by the width alone), a row alone equals the row in a batch at a random position; and
reports whether its bits equal the one-row kernel's (the contract leaves the in-block order to the
backend: they need not). Times by CUDA-graph replay.

    python3 bench/norm_rows.py --json norm_rows.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from family_sweep import graph_ms
from hal.api import create_backend
from hal.kernels import rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True)
    args = ap.parse_args(argv)
    spec = create_backend("cuda").contract.rms_norm
    g = torch.Generator(device="cuda").manual_seed(0)
    results, failures = [], 0
    for tokens, heads, d in ((1, 32, 128), (64, 32, 128), (256, 32, 128), (256, 8, 128), (2048, 16, 128),
                             (8192, 32, 128), (256, 14, 64), (4096, 16, 256)):
        x = torch.randn(tokens * heads, d, generator=g, device="cuda").to(torch.bfloat16) * 3
        w = torch.randn(d, generator=g, device="cuda").to(torch.bfloat16)
        base, _ = rows.rms_norm_rows(x, w, 1e-6, None, spec)
        variants_equal = all(torch.equal(rows.rms_norm_rows(x, w, 1e-6, None, spec, rows_per_program=r,
                                                            num_warps=nw)[0], base)
                             for r in (1, 4, 8, 32, 64) for nw in (1, 2, 4, 8) if r * d <= 2048)
        i = int(torch.randint(0, x.shape[0], (1,), generator=g, device="cuda"))
        alone_equal = torch.equal(rows.rms_norm_rows(x[i:i + 1].clone(), w, 1e-6, None, spec)[0][0], base[i])
        old, _ = rows.rms_norm(x, w, 1e-6, None, spec, num_warps=4)
        ref = (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * w.double())
        row = dict(rows=x.shape[0], width=d, variants_equal=variants_equal, alone_equal=alone_equal,
                   equal_to_one_row_kernel=torch.equal(base, old),
                   max_err_new=float((base.double() - ref).abs().max()),
                   max_err_old=float((old.double() - ref).abs().max()))
        row["old_us"] = graph_ms([lambda: rows.rms_norm(x, w, 1e-6, None, spec, num_warps=4)]) * 1e3
        for r, nw in ((8, 4), (16, 4), (32, 4), (16, 2), (32, 8), (64, 8)):
            if r * d > 2048:     # 65536 x 256 rows in tiles of 4096+ elements ran out of 10 minutes (session 11)
                continue
            row[f"new_r{r}_w{nw}_us"] = graph_ms(
                [lambda r=r, nw=nw: rows.rms_norm_rows(x, w, 1e-6, None, spec, r, nw)]) * 1e3
        row["torch_us"] = graph_ms([lambda: F.rms_norm(x, (d,), w, 1e-6)]) * 1e3
        failures += not (variants_equal and alone_equal)
        results.append(row)
        best = min((v, k) for k, v in row.items() if k.startswith("new_"))
        print(f"{x.shape[0]:7} x {d:3}: one-row {row['old_us']:7.1f} us, many-rows best {best[0]:7.1f} us ({best[1]}), "
              f"torch {row['torch_us']:6.1f} us | variants equal {variants_equal}, alone == in batch {alone_equal}, "
              f"== one-row kernel {row['equal_to_one_row_kernel']}", flush=True)
    with open(args.json, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=results), f, indent=1)
    print(f"{failures} shapes failed a bitwise check", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
