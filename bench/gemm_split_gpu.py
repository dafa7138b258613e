"""Split-K for narrow, weight-read-bound GEMMs on the GPU (issue #20): the table's split rule
(``gemm._weight_stream_split``, up to 64 rows) and split launches of 16-64 rows, each checked bitwise against
the direct launch and timed against it and cuBLAS.

Cells: every linear of the family sweep's models (bench/family_sweep.py ``MODELS``) whose direct grid at few rows
leaves a quarter or more of the GPU idle (N <= 3/4 x SMs x 32 columns) and whose K has two or more chunks, at
M in --ms. Per cell:

  direct   the table's launch with the split rule switched off
  rule     ``backend.linear`` as it runs now (the split where the rule takes it)
  splitN   split launches at 16 / 32 / 64 rows a tile (BLOCK_N 32-128, pointer or, from 17 rows, descriptor loads;
           each program the fewest chunks that keep the grid within one wave): the data the rule is fitted on
  cuBLAS   ``F.linear``

Every launch must give the direct launch's bits (torch.equal): a launch choice never changes them. Times are
device times under CUDA-graph replay (family_sweep's ``graph_ms``, inputs rotating past the L2). Ratios are
cuBLAS / ours. Exit status 1 if any launch differs.

    python3 bench/gemm_split_gpu.py --json gemm_split.json [--ms 1,4,16,32,64] [--budget-s 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_cuda import copies                                    # noqa: E402
from family_sweep import MODELS, graph_ms, linears, log          # noqa: E402
from hal.api import create_backend                              # noqa: E402
from hal.kernels import gemm                                    # noqa: E402
from hal.kernels.common import cdiv                             # noqa: E402


def cells(ms: list[int], sms: int, k_chunk: int) -> list[tuple[int, int, int, list[str]]]:
    shapes: dict[tuple[int, int], list[str]] = {}
    for model, cfg in MODELS.items():
        for name, n, k in linears(*cfg):
            if name != "lm_head" and 4 * cdiv(n, 32) < 3 * sms and k > k_chunk:
                shapes.setdefault((n, k), []).append(f"{model}.{name}")
    return [(m, n, k, layers) for (n, k), layers in sorted(shapes.items()) for m in ms]


def launch_name(cfg: dict) -> str:
    """A launch's name in a run: "split<rows>x<columns>c<chunks per program>[tma]", or "direct"."""
    if not cfg["split"]:
        return "direct"
    return f"split{cfg['BLOCK_M']}x{cfg['BLOCK_N']}c{cfg['chunks_per_program']}{'tma' if cfg['tma'] else ''}"


def split_variants(m: int, n: int, k: int, spec, sms: int) -> dict[str, dict]:
    """Split launches with 16 / 32 / 64-row tiles (pointer loads) and 64 / 128 columns, and above 64 rows 64 / 128-row
    descriptor tiles, each program taking the fewest chunks that keep the grid within one wave."""
    chunks = spec.chunk_count(k)
    out = {}
    # (rows, columns, K step, warps, stages, descriptor loads): the pointer tiles of the tuner's candidates and,
    # from 17 rows, the table's descriptor (TMA) tiles for 32 and 64 rows
    for block_m, block_n, block_k, warps, stages, tma in (
            (16, 64, 256, 4, 3, False), (16, 128, 128, 4, 4, False), (32, 64, 128, 4, 4, False),
            (32, 128, 128, 4, 4, False), (64, 64, 128, 4, 4, False), (64, 128, 64, 4, 4, False),
            (32, 32, 256, 4, 4, True), (32, 128, 128, 4, 4, True), (64, 32, 128, 4, 6, True), (64, 64, 64, 4, 6, True),
            # above 64 rows (--ms 128,256,512: does a split pay where the wave table's grid is far from full?):
            # the wave table's descriptor tiles; a split program holds one accumulator, not two
            (64, 128, 64, 4, 4, True), (128, 128, 64, 8, 4, True), (128, 256, 64, 8, 2, True)):
        if block_m < min(m, 64) or block_m > max(16, 2 * m) or (tma and m <= 16) or (m > 64 and not tma):
            continue
        if block_m * block_n > 64 * 128 and m <= 64:   # the wide tiles are for --ms 128 and up only
            continue
        tiles = cdiv(m, block_m) * cdiv(n, block_n)
        per = next((c for c in range(1, chunks + 1) if tiles * cdiv(chunks, c) <= sms), chunks)
        if per >= chunks:        # one program per tile: no split, only the chunk sums' traffic
            continue
        cfg = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages, GROUP_M=1,
                   split=True, chunks_per_program=per, tma=tma)
        out[launch_name(cfg)] = cfg
    return out


def _without_split_rule(fn):
    """``fn()`` with ``gemm._weight_stream_split`` switched off: the table's direct launch."""
    rule = gemm._weight_stream_split
    gemm._weight_stream_split = lambda *args, **kwargs: None
    try:
        return fn()
    finally:
        gemm._weight_stream_split = rule


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ms", default="1,4,16,32,64")
    parser.add_argument("--budget-s", type=float, default=240)
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    backend = create_backend("cuda", "bf16-dense-v1")
    spec = backend.contract.gemm
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    todo = cells([int(m) for m in args.ms.split(",")], sms, spec.k_chunk)
    log(f"{len(todo)} cells on {torch.cuda.get_device_name()} ({sms} SMs), budget {args.budget_s:.0f} s")
    rows, failures, t0 = [], 0, time.time()
    for m, n, k, layers in todo:
        if time.time() - t0 > args.budget_s:
            log(f"budget reached after {len(rows)} of {len(todo)} cells")
            break
        sets = [(torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
                 (torch.randn(n, k, device="cuda") * k ** -0.5).to(torch.bfloat16))
                for _ in range(copies(n * k * 2 + m * k * 2))]
        tma = gemm._tma_ok(sets[0][0]) and gemm._tma_ok(sets[0][1])
        table = gemm._config(m, n, k, spec, tma, sms)
        direct_cfg = _without_split_rule(lambda: gemm._config(m, n, k, spec, tma, sms))
        launches = {"direct": direct_cfg, "rule": None, **split_variants(m, n, k, spec, sms)}
        x0, w0 = sets[0]
        want = gemm.linear(x0, w0, None, torch.bfloat16, spec, direct_cfg, policy=backend._launch)
        row = dict(m=m, n=n, k=k, layers=layers, rule=dict(split=table["split"], BLOCK_N=table["BLOCK_N"],
                                                          chunks_per_program=table["chunks_per_program"]),
                   cublas_ms=graph_ms([lambda x=x, w=w: F.linear(x, w) for x, w in sets]), ms={}, same_bits={})
        for name, cfg in launches.items():
            if cfg is None:
                got = backend.linear(x0, w0)
                calls = [lambda x=x, w=w: backend.linear(x, w) for x, w in sets]
            else:
                try:
                    got = gemm.linear(x0, w0, None, torch.bfloat16, spec, cfg, policy=backend._launch)
                except OutOfResources as exc:   # a candidate tile this GPU cannot hold: reported, not timed
                    row.setdefault("not_launchable", {})[name] = str(exc).splitlines()[0][:160]
                    continue
                calls = [lambda x=x, w=w, cfg=cfg: gemm.linear(x, w, None, torch.bfloat16, spec, cfg,
                                                               policy=backend._launch) for x, w in sets]
            row["same_bits"][name] = bool(torch.equal(got.view(torch.int16), want.view(torch.int16)))
            failures += not row["same_bits"][name]
            row["ms"][name] = graph_ms(calls)
        ratios = {name: row["cublas_ms"] / t for name, t in row["ms"].items()}
        row["ratio"] = ratios
        best = min(row["ms"], key=row["ms"].get)
        log(f"M={m:3d} N={n:5d} K={k:5d} cuBLAS {row['cublas_ms'] * 1e3:6.1f} us | direct {ratios['direct']:.2f} "
            f"rule {ratios['rule']:.2f} ({'split' if table['split'] else 'direct'}) | best {best} {ratios[best]:.2f}"
            f" | bits {'ok' if all(row['same_bits'].values()) else 'DIFFER ' + str(row['same_bits'])}")
        rows.append(row)
        del sets
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), sms=sms, rows=rows, failures=failures), f, indent=1)
    for m in sorted({r["m"] for r in rows}):
        at = [r for r in rows if r["m"] == m]
        log(f"M={m}: {len(at)} cells, cuBLAS/ours median direct {statistics.median(r['ratio']['direct'] for r in at):.2f}"
            f" rule {statistics.median(r['ratio']['rule'] for r in at):.2f}"
            f" best split {statistics.median(max((v for key, v in r['ratio'].items() if key.startswith('split')), default=r['ratio']['direct']) for r in at):.2f}")
    log(f"bit checks: {failures} launches differ from the direct launch" if failures else "bit checks: PASS")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
