"""Block-FP8 linear on the GPU (issue #22): the cuda kernels of hal/kernels/fp8_gemm.py, checked and timed.

The cuda backend's ``fp8_linear`` refuses on a GPU until this script has shown its claims there, so it
calls the kernel module directly. Sections (``--only``), each with a printed table:

  quant     bitwise: ``fp8_gemm.quantise_activations`` on the device == ``hal.fp8``'s reference quantiser on
            the CPU (fp8 bits as uint8, fp32 scales), on groups built so that x / scale lands exactly on the
            format's grid values, rounding midpoints and their neighbours (normals and subnormals, both
            signs, -0), groups of wide dynamic range, all-zero groups and groups below amax_floor; bf16 and
            fp32 input. e5m2 through the same kernel (``quantise``) too: the contract's activations are
            e4m3 only, e5m2 is the KV cache's other format.
  batch     bitwise: every output row of a batch (slices at several offsets, reversed, probe tokens put at
            the first, middle and last row) == the same token's row computed in another batch / alone, at M
            values that take different tiles of ``fp8_gemm._config`` (m <= 64 and m > 64).
  tiles     bitwise: one input through every launch configuration of the tuner's candidate set
            (``fp8_gemm.candidates``: tiles, GROUP_M, warps, stages, descriptor loads, PAIR) == the kernel's own
            launch; configurations that do not fit (triton OutOfResources) are skipped and counted.
  accuracy  against an fp64 oracle (the quantised activations and weights dequantised in fp64, exact; an
            fp64 matmul): max |y - y64| / max |y64|, the share of outputs equal to fl32(y64), and the worst
            error in units of 2**-24 * (|x| @ |w|.T). The same for the reference backend (CPU, exact per-block
            partials) where M*N*K <= 2e9. GPU bits are not the reference's (Hopper's fp8 MMA accumulates a
            block with fewer bits than fp32): only the invariances above are claimed, accuracy is measured.
  negative  control: per-tensor dynamic scaling (one scale = fl32(amax of the whole batch / 448)) through the
            same GEMM kernel changes a token's output bits when louder batch-mates join; ours does not.
  tune      (GPU only, not with --small) ``hal.kernels.tuning.tune_fp8_gemm`` over the speed shapes: every
            candidate bit-checked against the kernel's own launch and timed (CUDA-graph replay), the fastest kept
            in a tuning cache (--tune-cache) that the speed section then reads.
  ceiling   (GPU only) large M, a diagnosis: our kernel against the same loop without the contract's scales
            (all K blocks chained into one accumulator; each block's partial added unscaled) at our tile and
            wider ones, and cuBLAS's block-scaled GEMM: which part of the gap the promotion, the scales and
            the tile are. Those variants' outputs are not the contract's and are not checked; our kernel
            with the activation scales stored column by column is, against its own launch.
  speed     (GPU only, not with --small) median times by ``triton.testing.do_bench`` (CUDA events per call,
            L2 flushed between calls) of our linear (quantisation + GEMM) and our GEMM (tuned, and the
            kernel's own launch), cuBLAS bf16 (``F.linear``), ``torch._scaled_mm`` (rowwise, tensorwise,
            blockwise 1x128/128x128 scales), and,
            if vLLM imports (the GPU bundle in /tmp/site on PYTHONPATH, with bench/h200.sh's LD_LIBRARY_PATH
            for its _C_stable_libtorch ops), its Triton block-FP8 GEMM (with and without its per-token-group
            quantiser) and its CUTLASS block-FP8 GEMM; DeepSeek-V3-like (N, K) at M = 1..8192. Each
            comparator's output is compared with ours (max |diff| / max |ours|) so that a wrong scale layout
            shows as a large number.

Exit status 1 if a bitwise check fails (quant, batch, tiles, ours in negative) or per-tensor scaling fails
to change the bits; 0 otherwise. Every number goes to --json.

    python bench/fp8_gpu.py --json fp8_gpu.json [--quick] [--no-speed] [--only quant,batch,tiles,...]
    TRITON_INTERPRET=1 python bench/fp8_gpu.py --device cpu --small --json /tmp/fp8.json   # CPU, ~1 min

On the GPU the tiles and tune sections compile every candidate (up to 36 launch shapes, a few seconds
each): with the 10-minute limit of one device call, run ``--only tiles`` and the others as two processes,
or use --quick (a third of the candidates in tiles, fewer speed shapes).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from hal import fp8
from hal.api import create_backend
from hal.backends.cuda.launch import CUDA_LAUNCH, CUDA_LAUNCH_UNTUNED, _tuning_cache
from hal.contract import load_contract
from hal.kernels import fp8_gemm, fp8_gemm_sm90, tuning
from hal.kernels.common import INTERPRET

CONTRACT = load_contract("bf16-fp8-v1")
SPEC = CONTRACT.fp8
G = SPEC.activation_group          # = SPEC.weight_block = 128: the K block of the GEMM
SECTIONS = ("quant", "batch", "tiles", "accuracy", "negative", "tune", "speed", "ceiling")
START = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - START:7.1f}s] {msg}", flush=True)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------

def wide(shape, seed: int, spread: int = 6) -> torch.Tensor:
    """fp32 randn times 2**U{-spread..spread} per element (CPU): a wide dynamic range inside each group,
    so that small values quantise to fp8 subnormals or zero beside the group's amax."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-spread, spread + 1, tuple(shape), generator=g).float())
    return torch.randn(*shape, generator=g) * scale


def fp8_grid(fmt: str) -> torch.Tensor:
    """Every finite value of an fp8 format, ascending, as fp32 (from its 256 bit patterns)."""
    values = torch.arange(256, dtype=torch.uint8).view(fp8.FORMATS[fmt]).float()
    return values[torch.isfinite(values)].unique()


def _midpoints(fmt: str) -> torch.Tensor:
    grid = fp8_grid(fmt).double()
    return ((grid[1:] + grid[:-1]) / 2).float()                            # exact in fp32 (and bf16)


def _steps(v: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """v moved ``steps`` (-2..2) ulps of its own dtype."""
    up, down = torch.tensor(float("inf"), dtype=v.dtype), torch.tensor(float("-inf"), dtype=v.dtype)
    for i in range(2):
        v = torch.where(steps > i, torch.nextafter(v, up), torch.where(steps < -i, torch.nextafter(v, down), v))
    return v


def _with_amax(values: torch.Tensor, amax: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Put +-amax (one per group) at a random place of each group, so it sets the group's scale."""
    sign = torch.where(torch.rand(len(values), generator=g) < 0.5, -1.0, 1.0).to(values.dtype)
    values[:, 0] = sign * amax
    return values.gather(1, torch.rand(values.shape, generator=g).argsort(-1))


def exact_tie_groups(fmt: str, groups: int, g: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """Each group holds +-FMAX * 2**e, so its scale is exactly 2**e and x / scale is exact: the other values
    land on the format's grid values, its rounding midpoints (ties: nearest-even decides) and their
    neighbours one ulp of ``dtype`` either side, normals and subnormals, both signs, and -0."""
    grid, mids = fp8_grid(fmt).to(dtype), _midpoints(fmt).to(dtype)
    pool = torch.cat([grid, mids, _steps(mids, torch.ones_like(mids)), _steps(mids, -torch.ones_like(mids)),
                      torch.tensor([-0.0], dtype=dtype)])
    values = _with_amax(pool[torch.randint(0, len(pool), (groups, G), generator=g)], SPEC.fmax(fmt), g)
    exponent = torch.randint(-10, 11, (groups, 1), generator=g).float()
    return values * torch.exp2(exponent).to(dtype)                         # a power of two: exact


def near_tie_groups(fmt: str, groups: int, g: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """Groups with an arbitrary amax (so an inexact scale) whose values are fl(midpoint * scale) moved -2..2
    ulps: fl32(x / scale) falls on or next to a midpoint, where the correctly rounded division and a
    multiply by the reciprocal part (with fp32 input; bf16 input rarely gets that close)."""
    amax = (torch.rand(groups, generator=g) * 10 + 0.1).to(dtype)
    scale = fp8.scale_of(amax.float(), SPEC, fmt)
    mids = _midpoints(fmt)
    picks = mids[torch.randint(0, len(mids), (groups, G), generator=g)]
    values = _steps((picks * scale[:, None]).to(dtype), torch.randint(-2, 3, (groups, G), generator=g))
    values = torch.minimum(torch.maximum(values, -amax[:, None]), amax[:, None])
    return _with_amax(values, amax, g)


def hard_groups(fmt: str, groups: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """(groups, G) values of ``dtype`` (bf16 or fp32) where the last bit decides the cast: half exact ties
    at power-of-two scales, half near ties at arbitrary scales, interleaved."""
    g = torch.Generator().manual_seed(seed)
    exact, near = exact_tie_groups(fmt, groups - groups // 2, g, dtype), near_tie_groups(fmt, groups // 2, g, dtype)
    out = torch.empty(groups, G, dtype=dtype)
    out[0::2], out[1::2] = exact, near
    return out


def quant_input(fmt: str, hard_rows: int, wide_rows: int, k: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of K: hard groups, then wide-range rows, an all-zero row and a row whose groups' amax lies below
    [fp8].amax_floor (the floor decides their scale)."""
    hard = hard_groups(fmt, hard_rows * k // G, seed, dtype).reshape(hard_rows, k)
    spread = wide((wide_rows, k), seed + 1, spread=12).to(dtype)
    tiny = (wide((1, k), seed + 2, spread=2) * SPEC.amax_floor * 1e-2).to(dtype)
    return torch.cat([hard, spread, torch.zeros(1, k, dtype=dtype), tiny])


def activations(m: int, k: int, seed: int) -> torch.Tensor:
    """(m, k) bf16 activations on the CPU; every fifth row 64x louder (batch-mates of other magnitudes)."""
    x = wide((m, k), seed, spread=4)
    x[::5] *= 64
    return x.bfloat16()


def layer(n: int, k: int, seed: int, bias: bool):
    """A block-FP8 weight from the reference quantiser (128 x 128 blocks) and an optional bf16 bias (CPU)."""
    w = wide((n, k), seed, spread=2) * k ** -0.5
    wq, ws = fp8.quantise_weight_blocks(w, SPEC)
    b = torch.randn(n, generator=torch.Generator().manual_seed(seed + 1)).bfloat16() if bias else None
    return wq, ws, b


def to(device, *tensors):
    return [None if t is None else t.to(device) for t in tensors]


SMALLEST_NORMAL = {"e4m3": 2.0 ** -6, "e5m2": 2.0 ** -14}
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of ``t`` (so -0 != +0 and a comparison is bitwise, not by value)."""
    return t.contiguous().view(_INT_OF_SIZE[t.element_size()])


def same_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per row: are the two (rows, N) tensors' bits identical?"""
    return (bits(a) == bits(b)).all(-1)


# ---------------------------------------------------------------------------------------------
# quant: the device quantiser == the reference quantiser, bit for bit
# ---------------------------------------------------------------------------------------------

def differing_values(x, q, want_q, limit=5):
    """The first few (row, col, x, kernel's value, reference's value) where the fp8 bits differ."""
    where = (bits(q) != bits(want_q)).nonzero()[:limit].tolist()
    return [dict(row=i, col=j, x=float(x[i, j]), got=float(q[i, j].float()), want=float(want_q[i, j].float()))
            for i, j in where]


def quant_section(device, small):
    k, hard_rows, wide_rows = (384, 32, 8) if small else (7168, 64, 4096)
    rows = []
    for fmt, dtype in (("e4m3", torch.bfloat16), ("e4m3", torch.float32), ("e5m2", torch.bfloat16),
                       ("e5m2", torch.float32)):
        x = quant_input(fmt, hard_rows, wide_rows, k, seed=len(rows) + 1, dtype=dtype)
        m = x.shape[0]
        want_q, want_s = fp8.quantise_pieces(x.reshape(m, k // G, G), SPEC, fmt)     # reference, CPU
        want_q = want_q.reshape(m, k)
        if fmt == SPEC.activation_format:          # the linear's own entry point
            q, s = fp8_gemm.quantise_activations(x.to(device), SPEC)
        else:
            q, s = fp8_gemm.quantise(x.to(device), G, fmt, SPEC)
        q, s = q.cpu(), s.cpu()
        row = dict(fmt=fmt, dtype=str(dtype).replace("torch.", ""), shape=[m, k],
                   entry="quantise_activations" if fmt == SPEC.activation_format else "quantise (KV format)",
                   values=q.numel(), values_differing=int((bits(q) != bits(want_q)).sum()),
                   scales=s.numel(), scales_differing=int((bits(s) != bits(want_s)).sum()),
                   subnormal_or_zero_share=float((q.float().abs() < SMALLEST_NORMAL[fmt]).float().mean()))
        row["equal"] = row["values_differing"] == 0 and row["scales_differing"] == 0
        row["first_differing"] = differing_values(x, q, want_q)
        rows.append(row)
        log(f"quant {fmt} {row['dtype']}: equal={row['equal']}")
    print(f"\n{'format':<6} {'input':<9} {'shape':>12} {'fp8 values differing':>22} {'scales differing':>18} "
          f"{'subnormal/0':>12}  entry")
    for r in rows:
        print(f"{r['fmt']:<6} {r['dtype']:<9} {'x'.join(map(str, r['shape'])):>12} "
              f"{r['values_differing']:>10}/{r['values']:<11} {r['scales_differing']:>7}/{r['scales']:<10} "
              f"{r['subnormal_or_zero_share']:>12.3f}  {r['entry']}")
        for d in r["first_differing"]:
            print(f"      differs at {d}")
    return rows, all(r["equal"] for r in rows)


# ---------------------------------------------------------------------------------------------
# batch: a token's output row does not depend on its batch
# ---------------------------------------------------------------------------------------------

def cases(small):
    """The (N, K) layers of the bitwise sections: N crosses BLOCK_N tiles and the 128-row weight-scale
    blocks, K crosses the 128-wide K blocks; one fp32 output without bias, one bf16 output with bias."""
    if small:
        return [dict(n=200, k=384, out=torch.float32, bias=False), dict(n=136, k=256, out=torch.bfloat16, bias=True)]
    return [dict(n=2112, k=7168, out=torch.float32, bias=False), dict(n=4096, k=4096, out=torch.bfloat16, bias=True)]


def tiles_of(m, wq):
    """The kernel's own launch for m rows against wq (on Hopper from 1024 rows the warp-specialised Gluon
    kernel), as linear's contiguous quantised activations would get it."""
    xq = torch.empty((m, wq.shape[1]), dtype=wq.dtype, device=wq.device)
    cfg = fp8_gemm.own_config(xq, wq, G)
    return f"{'ws ' if cfg.get('ws') else ''}{cfg['BLOCK_M']}x{cfg['BLOCK_N']}"


def batch_section(device, small):
    ms = (1, 7, 16, 17, 33, 40) if small else (1, 7, 64, 65, 128, 257, 1024, 4096)
    m_max = ms[-1]
    rows = []
    for ci, case in enumerate(cases(small)):
        n, k = case["n"], case["k"]
        wq, ws, bias = to(device, *layer(n, k, seed=10 + ci, bias=case["bias"]))
        x = activations(m_max, k, seed=20 + ci).to(device)

        def run(batch):
            return fp8_gemm.linear(batch, wq, ws, bias, case["out"], SPEC, policy=CUDA_LAUNCH)

        full = run(x)
        probes = sorted({0, 1, m_max // 2, m_max - 1})
        alone = {p: run(x[p:p + 1])[0] for p in probes}
        for m in ms:
            offset = (m * 7) % (m_max - m + 1)
            part, want = x[offset:offset + m], full[offset:offset + m]
            checked = equal = 0
            if m < m_max:                          # the slice: the same tokens in a batch of m rows
                same = same_rows(run(part), want)
                checked, equal = checked + m, equal + int(same.sum())
            same = same_rows(run(part.flip(0)), want.flip(0))           # every row at another position
            checked, equal = checked + m, equal + int(same.sum())
            batch = part.clone()                   # probe tokens at the first, middle and last row
            positions = sorted({0, m // 2, m - 1})
            for i, pos in enumerate(positions):
                batch[pos] = x[probes[i % len(probes)]]
            out = run(batch)
            for i, pos in enumerate(positions):
                checked += 1
                equal += int(torch.equal(bits(out[pos]), bits(alone[probes[i % len(probes)]])))
            rows.append(dict(n=n, k=k, out=str(case["out"]).replace("torch.", ""), bias=case["bias"], m=m,
                             offset=offset, tiles=tiles_of(m, wq), reference_m=m_max, rows_checked=checked,
                             rows_equal=equal))
        log(f"batch N={n} K={k}: {sum(r['rows_equal'] for r in rows[-len(ms):])}/"
            f"{sum(r['rows_checked'] for r in rows[-len(ms):])} rows equal")
    print(f"\n{'N':>6} {'K':>6} {'out':>9} {'bias':>5} {'M':>6} {'tiles':>8} {'rows equal':>14}  "
          f"(vs the same tokens in the batch of M={m_max}, and probe tokens alone)")
    for r in rows:
        print(f"{r['n']:>6} {r['k']:>6} {r['out']:>9} {str(r['bias']):>5} {r['m']:>6} {r['tiles']:>8} "
              f"{r['rows_equal']:>6}/{r['rows_checked']:<7}")
    return rows, all(r["rows_equal"] == r["rows_checked"] for r in rows)


# ---------------------------------------------------------------------------------------------
# tiles: every launch configuration gives the same bits
# ---------------------------------------------------------------------------------------------

def tile_candidates(m, n, k, quick, tma_ok):
    """The tuner's candidate set (``fp8_gemm.candidates``: the list ``hal tune`` times). The interpreter
    takes 16/32-row tiles (Hopper's fp8 wgmma needs 64) and has no warps, stages or descriptors, so only
    its tiles and PAIR are varied there. --quick: every third candidate (it still varies each choice), and
    every launch of the Gluon kernel (sm90) the set holds."""
    if INTERPRET:
        tiles = [(bm, bn, 4, 1) for bm in (16, 32) for bn in (64, 128, 256)]
        return fp8_gemm.candidates(max(m, 65), n, k, G, False, tiles=tiles)
    configs = fp8_gemm.candidates(m, n, k, G, tma_ok, sm90=fp8_gemm_sm90.available(torch.device("cuda")))
    if not quick:
        return configs
    # every third, and every Gluon launch (hal/kernels/fp8_gemm_sm90.py: its bits are only ever checked here)
    return configs[::3] + [c for c in configs[1::3] + configs[2::3] if c.get("sm90")]


def tiles_section(device, small, quick):
    ms = (33,) if small else (5, 257)
    rows = []
    for ci, case in enumerate(cases(small)):
        n, k = case["n"], case["k"]
        wq, ws, bias = to(device, *layer(n, k, seed=10 + ci, bias=case["bias"]))
        for m in ms:
            xq, xs = fp8_gemm.quantise_activations(activations(m, k, seed=30 + m).to(device), SPEC)

            def run(cfg):
                return fp8_gemm.gemm(xq, xs, wq, ws, bias, case["out"], SPEC, cfg, policy=CUDA_LAUNCH_UNTUNED)

            candidates = tile_candidates(m, n, k, quick, fp8_gemm.tma_ok(xq) and fp8_gemm.tma_ok(wq))
            base = run(None)
            ran, identical, out_of_resources, errors, differing = 0, 0, [], [], []
            for cfg in candidates:
                try:
                    out = run(cfg)
                except OutOfResources:             # does not fit in shared memory: not a launch shape here
                    out_of_resources.append(cfg)
                    continue
                except Exception as exc:  # noqa: BLE001 - any other failure is reported, not hidden
                    errors.append(dict(config=cfg, error=first_line(exc)))
                    continue
                ran += 1
                if torch.equal(bits(out), bits(base)):
                    identical += 1
                else:
                    differing.append(cfg)
            rows.append(dict(n=n, k=k, m=m, out=str(case["out"]).replace("torch.", ""), bias=case["bias"],
                             default=fp8_gemm._config(m, n), candidates=candidates, ran=ran,
                             identical=identical, out_of_resources=out_of_resources, errors=errors,
                             differing=differing))
            log(f"tiles M={m} N={n} K={k}: {identical}/{ran} identical, {len(out_of_resources)} out of resources, "
                f"{len(errors)} errors")
    print(f"\n{'M':>5} {'N':>6} {'K':>6} {'out':>9} {'candidates':>10} {'ran':>5} {'identical':>9} "
          f"{'OutOfRes':>8} {'errors':>6}  default tiles")
    for r in rows:
        d = r["default"]
        print(f"{r['m']:>5} {r['n']:>6} {r['k']:>6} {r['out']:>9} {len(r['candidates']):>10} {r['ran']:>5} "
              f"{r['identical']:>9} {len(r['out_of_resources']):>8} {len(r['errors']):>6}  "
              f"{d['BLOCK_M']}x{d['BLOCK_N']} G{d['GROUP_M']} w{d['num_warps']} s{d['num_stages']}")
        for e in r["errors"]:
            print(f"      error {e['config']}: {e['error']}")
    return rows, all(r["ran"] > 0 and r["identical"] == r["ran"] for r in rows)


# ---------------------------------------------------------------------------------------------
# accuracy: against an fp64 oracle of the quantised values
# ---------------------------------------------------------------------------------------------

REFERENCE_LIMIT = 2e9     # M*N*K above which the CPU reference is skipped (minutes of fp64 on the CPU)


def oracle(xq, xs, wq, ws, bias):
    """fp64 y = deq(x) @ deq(w).T (+ bias) and |deq(x)| @ |deq(w)|.T (+ |bias|). A fp8 value times an fp32
    scale is exact in fp64, so the only roundings are the matmul's (relative 2**-53 per term)."""
    m, k = xq.shape
    n = wq.shape[0]
    xd = (xq.double().view(m, k // G, G) * xs.double().unsqueeze(-1)).view(m, k)
    b = SPEC.weight_block
    wd = wq.double() * ws.double().repeat_interleave(b, 0)[:n].repeat_interleave(b, 1)[:, :k]
    y, magnitude = xd @ wd.T, xd.abs() @ wd.abs().T
    if bias is not None:
        y, magnitude = y + bias.double(), magnitude + bias.double().abs()
    return y, magnitude


def errors_vs(y, y64, magnitude):
    diff = (y.double() - y64).abs()
    return dict(max_rel_err=float(diff.max() / y64.abs().max()),
                share_equal_fl32_oracle=float((y == y64.float()).double().mean()),
                max_err_in_2pow_minus24_of_magnitude=float((diff / (magnitude.clamp_min(1e-300) * 2.0 ** -24)).max()))


def accuracy_section(device, small):
    shapes = ([(3, 200, 384, False), (33, 80, 256, True), (40, 136, 384, False)] if small else
              [(1, 4096, 4096, False), (37, 2112, 7168, True), (100, 7168, 2048, False), (1024, 4096, 4096, True),
               (4096, 7168, 2048, False)])
    reference = create_backend("reference", CONTRACT)           # CPU
    rows = []
    for i, (m, n, k, has_bias) in enumerate(shapes):
        x = activations(m, k, seed=40 + i)
        wq, ws, bias = layer(n, k, seed=50 + i, bias=has_bias)
        xd, wqd, wsd, bd = to(device, x, wq, ws, bias)
        xq, xs = fp8_gemm.quantise_activations(xd, SPEC)
        y = fp8_gemm.gemm(xq, xs, wqd, wsd, bd, torch.float32, SPEC, policy=CUDA_LAUNCH)
        y64, magnitude = oracle(xq, xs, wqd, wsd, bd)
        row = dict(m=m, n=n, k=k, bias=has_bias, out="float32", kernel=errors_vs(y, y64, magnitude))
        if m * n * k <= REFERENCE_LIMIT:
            ref = reference.fp8_linear(x, wq, ws, bias, out_dtype=torch.float32)
            row["reference"] = errors_vs(ref, y64.cpu(), magnitude.cpu())
            row["kernel_bits_equal_reference"] = bool(torch.equal(bits(y.cpu()), bits(ref)))
        else:
            row["reference"] = None
            row["reference_note"] = f"skipped: M*N*K = {m * n * k:.1e} > {REFERENCE_LIMIT:.0e}"
        rows.append(row)
        log(f"accuracy M={m} N={n} K={k}: kernel max rel err {row['kernel']['max_rel_err']:.2e}")
    print(f"\n{'M':>5} {'N':>6} {'K':>6} {'bias':>5} | {'kernel: max rel':>15} {'=fl32(y64)':>10} {'err/2^-24|.|':>12} "
          f"| {'ref: max rel':>12} {'=fl32(y64)':>10} {'err/2^-24|.|':>12} | kernel bits == ref")
    for r in rows:
        kr, rr = r["kernel"], r["reference"]
        ref_cols = (f"{rr['max_rel_err']:>12.2e} {rr['share_equal_fl32_oracle']:>10.4f} "
                    f"{rr['max_err_in_2pow_minus24_of_magnitude']:>12.2f}" if rr else f"{'(skipped: M*N*K > 2e9)':>36}")
        print(f"{r['m']:>5} {r['n']:>6} {r['k']:>6} {str(r['bias']):>5} | {kr['max_rel_err']:>15.2e} "
              f"{kr['share_equal_fl32_oracle']:>10.4f} {kr['max_err_in_2pow_minus24_of_magnitude']:>12.2f} | "
              f"{ref_cols} | {r.get('kernel_bits_equal_reference', 'n/a')}")
    return rows


# ---------------------------------------------------------------------------------------------
# negative: per-tensor dynamic scaling makes a token depend on its batch
# ---------------------------------------------------------------------------------------------

def per_tensor_gemm(x, wq, ws, out_dtype):
    """vLLM-style per-tensor dynamic activation scaling, through our GEMM: one scale from the whole batch's
    amax (the contract's scale rule applied to the batch), passed as per-group scales all equal to it."""
    s = fp8.scale_of(x.float().abs().amax(), SPEC, SPEC.activation_format)
    xs = s.expand(x.shape[0], x.shape[1] // G).contiguous()
    xq = fp8.quantise(x, s, SPEC, SPEC.activation_format)
    return fp8_gemm.gemm(xq, xs, wq, ws, None, out_dtype, SPEC, policy=CUDA_LAUNCH)


def negative_section(device, small):
    m, n, k, token = (17, 200, 384, 2) if small else (257, 2112, 7168, 2)
    wq, ws, _ = to(device, *layer(n, k, seed=60, bias=False))
    x = activations(m, k, seed=61).to(device)
    x[4:] *= 64                                            # louder batch-mates join token 2
    rows = []
    for out_dtype in (torch.bfloat16, torch.float32):
        ours_alone = fp8_gemm.linear(x[token:token + 1], wq, ws, None, out_dtype, SPEC, policy=CUDA_LAUNCH)[0]
        ours_batch = fp8_gemm.linear(x, wq, ws, None, out_dtype, SPEC, policy=CUDA_LAUNCH)[token]
        pt_alone = per_tensor_gemm(x[token:token + 1], wq, ws, out_dtype)[0]
        pt_batch = per_tensor_gemm(x, wq, ws, out_dtype)[token]
        for scaling, alone, batch in (("per-group (ours)", ours_alone, ours_batch),
                                      ("per-tensor dynamic", pt_alone, pt_batch)):
            rows.append(dict(scaling=scaling, out=str(out_dtype).replace("torch.", ""), m=m, n=n, k=k, token=token,
                             changed=not torch.equal(bits(alone), bits(batch)),
                             outputs_changed=int((bits(alone) != bits(batch)).sum())))
    print(f"\n{'scaling':<20} {'out':>9} {'changed':>8} {'outputs changed':>16}  (token {token} alone vs in a batch "
          f"of {m} with 64x louder batch-mates, N={n} K={k})")
    for r in rows:
        print(f"{r['scaling']:<20} {r['out']:>9} {str(r['changed']):>8} {r['outputs_changed']:>10}/{n:<5}")
    ok = all(r["changed"] == (r["scaling"] != "per-group (ours)") for r in rows)
    log(f"negative control: {'as expected' if ok else 'FAILED'}")
    return rows, ok


# ---------------------------------------------------------------------------------------------
# speed
# ---------------------------------------------------------------------------------------------

SPEED_SHAPES = [(4096, 4096), (12288, 4096), (4096, 12288), (7168, 2048), (2112, 7168), (24576, 1536), (7168, 18432)]
SPEED_MS = (1, 16, 64, 256, 1024, 4096, 8192)
QUICK_SHAPES, QUICK_MS = [(4096, 4096), (2112, 7168), (7168, 18432)], (1, 64, 1024, 8192)
TIMING = ("triton.testing.do_bench(warmup=25, rep=100, return_mode='median'): CUDA events per call, "
          "L2 flushed between calls")


def bench_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def vllm_kernels():
    """vLLM's block-FP8 functions, or (None, the reason). 0.26 names the Triton GEMM
    ``w8a8_triton_block_scaled_mm``; older releases ``w8a8_block_fp8_matmul`` (same arguments)."""
    try:
        import vllm
        from vllm import _custom_ops
        from vllm.model_executor.layers.quantization.utils import fp8_utils
    except Exception as exc:  # noqa: BLE001 - report why, time the others
        return None, first_line(exc)
    triton_mm = (getattr(fp8_utils, "w8a8_triton_block_scaled_mm", None)
                 or getattr(fp8_utils, "w8a8_block_fp8_matmul", None))
    if triton_mm is None:
        return None, "vllm imports but has neither w8a8_triton_block_scaled_mm nor w8a8_block_fp8_matmul"
    return dict(version=getattr(vllm, "__version__", "?"), triton_mm=triton_mm,
                group_quant=fp8_utils.per_token_group_quant_fp8, cutlass_mm=_custom_ops.cutlass_scaled_mm), None


def speed_weight(n, k, seed, device):
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(n, k, device=device, generator=g) * k ** -0.5
    wq, ws = fp8.quantise_weight_blocks(w, SPEC)
    w_row_scale = fp8.scale_of(w.abs().amax(1), SPEC, "e4m3")            # (N,): per output channel
    w_tensor_scale = fp8.scale_of(w.abs().amax(), SPEC, "e4m3")
    return dict(wq=wq, ws=ws, bf16=fp8.dequantise_weight_blocks(wq, ws, SPEC).bfloat16(),
                wq_row=fp8.quantise(w, w_row_scale[:, None], SPEC, "e4m3"), w_row_scale=w_row_scale[None, :],
                wq_tensor=fp8.quantise(w, w_tensor_scale, SPEC, "e4m3"), w_tensor_scale=w_tensor_scale)


def comparators(x, w, vllm):
    """name -> a no-argument function computing this M's product (bf16 out). Inputs that are not what is
    timed (another quantisation of x, a column-major copy of the scales) are prepared here, outside."""
    xq, xs = fp8_gemm.quantise_activations(x, SPEC)
    x_row_scale = fp8.scale_of(x.float().abs().amax(1), SPEC, "e4m3")
    xq_row = fp8.quantise(x, x_row_scale[:, None], SPEC, "e4m3")
    x_tensor_scale = fp8.scale_of(x.float().abs().amax(), SPEC, "e4m3")
    xq_tensor = fp8.quantise(x, x_tensor_scale, SPEC, "e4m3")
    xs_col = xs.t().contiguous().t()           # (M, K/128) with stride (1, M): the 1x128 layout cuBLAS/CUTLASS take
    bf16 = torch.bfloat16
    fns = {
        "ours_linear": lambda: fp8_gemm.linear(x, w["wq"], w["ws"], None, bf16, SPEC, policy=CUDA_LAUNCH),
        "ours_gemm": lambda: fp8_gemm.gemm(xq, xs, w["wq"], w["ws"], None, bf16, SPEC, policy=CUDA_LAUNCH),
        "ours_own_gemm": lambda: fp8_gemm.gemm(xq, xs, w["wq"], w["ws"], None, bf16, SPEC, policy=CUDA_LAUNCH_UNTUNED),
        "cublas_bf16": lambda: F.linear(x, w["bf16"]),
        # torch._scaled_mm: mat_b column-major (the weight's transpose); scales multiply (dequantise).
        "scaled_mm_rowwise": lambda: torch._scaled_mm(xq_row, w["wq_row"].t(), scale_a=x_row_scale[:, None],
                                                      scale_b=w["w_row_scale"], out_dtype=bf16),
        "scaled_mm_tensorwise": lambda: torch._scaled_mm(xq_tensor, w["wq_tensor"].t(), scale_a=x_tensor_scale,
                                                         scale_b=w["w_tensor_scale"], out_dtype=bf16),
        # blockwise: scale_a (M, K/128) outer-dim-major, scale_b (K/128, N/128) = ws.t() (ScaledBlas.cpp's checks)
        "scaled_mm_blockwise": lambda: torch._scaled_mm(xq, w["wq"].t(), scale_a=xs_col, scale_b=w["ws"].t(),
                                                        out_dtype=bf16),
    }
    if vllm is not None:
        fns["vllm_triton_gemm"] = lambda: vllm["triton_mm"](xq, w["wq"], xs, w["ws"], [G, G], bf16)

        def vllm_triton_linear():
            q, s = vllm["group_quant"](x, G, dtype=torch.float8_e4m3fn, column_major_scales=False, use_ue8m0=False)
            return vllm["triton_mm"](q, w["wq"], s, w["ws"], [G, G], bf16)
        fns["vllm_triton_linear"] = vllm_triton_linear
        # vLLM's CutlassFp8BlockScaledMMKernel: cutlass_scaled_mm(A, B.T, scale_a=As (column-major), scale_b=Bs.T)
        fns["vllm_cutlass_gemm"] = lambda: vllm["cutlass_mm"](xq, w["wq"].t(), scale_a=xs_col, scale_b=w["ws"].t(),
                                                              out_dtype=bf16)
    return fns


SPEED_COLUMNS = ["ours_linear", "ours_gemm", "ours_own_gemm", "cublas_bf16", "scaled_mm_rowwise",
                 "scaled_mm_tensorwise",
                 "scaled_mm_blockwise", "vllm_triton_gemm", "vllm_triton_linear", "vllm_cutlass_gemm"]


def tune_section(device, quick, cache_path):
    """``tuning.tune_fp8_gemm`` (what ``hal tune`` runs for a block-FP8 model) over the speed section's
    shapes: every candidate checked bit-equal to the kernel's own launch, the fastest kept in the tuning
    cache at ``cache_path``, which the speed section then reads (its "ours" columns are the tuned launch;
    "ours own" the kernel's own table)."""
    shapes, ms = (QUICK_SHAPES, QUICK_MS) if quick else (SPEED_SHAPES, SPEED_MS)
    name = torch.cuda.get_device_name(device)
    cache = tuning.TuneCache(name, triton.__version__)
    rows = []

    def progress(line):
        log("tune" + line)
        cache.save(cache_path)
    tuning.tune_fp8_gemm([(m, n, k) for n, k in shapes for m in ms], SPEC, device=device, cache=cache,
                         progress=progress, report=rows)
    cache.save(cache_path)
    os.environ["HAL_TUNE_CACHE"] = str(cache_path)      # the launch policy reads it from here on
    tuning.runtime_cache.cache_clear()
    _tuning_cache.cache_clear()
    print(f"\n{'M':>5} {'N':>6} {'K':>6} {'own us':>8} {'tuned us':>8} {'gain':>5}  tuned launch")
    for r in rows:
        c = r["config"]
        launch_text = (f"{'gluon ' if c.get('sm90') else ''}{'ws ' if c.get('ws') else ''}"
                       f"{c['BLOCK_M']}x{c['BLOCK_N']} w{c['num_warps']} s{c['num_stages']}"
                       f"{' tma' if c['tma'] else ''}{' pair' if c['pair'] else ''}"
                       f"{' halves' if c.get('halves') else ''}{' u%d' % c['unroll'] if c.get('sm90') else ''}"
                       ) if c else "(own)"
        print(f"{r['m']:>5} {r['n']:>6} {r['k']:>6} {r['default_ms'] * 1e3:>8.1f} {r['best_ms'] * 1e3:>8.1f} "
              f"{r['default_ms'] / r['best_ms']:>5.2f}  {launch_text}")
    return dict(cache=str(cache_path), timing="do_bench_cudagraph(rep=20), median", rows=rows)


def speed_section(device, quick):
    vllm, vllm_reason = vllm_kernels()
    log(f"vLLM: {vllm['version'] if vllm else 'n/a (' + vllm_reason + ')'}")
    shapes, ms = (QUICK_SHAPES, QUICK_MS) if quick else (SPEED_SHAPES, SPEED_MS)
    rows, failures = [], {}
    for si, (n, k) in enumerate(shapes):
        w = speed_weight(n, k, seed=70 + si, device=device)
        for m in ms:
            x = torch.randn(m, k, device=device, generator=torch.Generator(device=device).manual_seed(m)).bfloat16()
            row = dict(m=m, n=n, k=k, us={}, rel_diff_vs_ours_gemm={}, na={})
            ours = None
            for name, fn in comparators(x, w, vllm).items():
                try:
                    out = fn()
                    torch.cuda.synchronize()
                    if name == "ours_gemm":
                        ours = out
                    row["us"][name] = bench_ms(fn) * 1000
                    row[f"out_{name}"] = out
                except Exception as exc:  # noqa: BLE001 - a comparator this torch/vLLM lacks: n/a, with why
                    row["na"][name] = first_line(exc)
                    failures.setdefault(name, {}).setdefault(first_line(exc), []).append([m, n, k])
            for name in list(row["us"]):
                out = row.pop(f"out_{name}")
                if ours is not None:
                    row["rel_diff_vs_ours_gemm"][name] = float((out.float() - ours.float()).abs().max()
                                                               / ours.float().abs().max().clamp_min(1e-30))
            flops = 2.0 * m * n * k
            row["tflops"] = {name: flops / (us * 1e-6) / 1e12 for name, us in row["us"].items()}
            us = row["us"]
            if "ours_gemm" in us:
                for other in ("vllm_triton_gemm", "vllm_cutlass_gemm", "cublas_bf16", "scaled_mm_blockwise"):
                    if other in us:
                        row[f"{other}_over_ours_gemm"] = us[other] / us["ours_gemm"]
            if "ours_linear" in us and "vllm_triton_linear" in us:
                row["vllm_triton_linear_over_ours_linear"] = us["vllm_triton_linear"] / us["ours_linear"]
            rows.append(row)
            log(f"speed M={m} N={n} K={k}: " + ", ".join(f"{name} {t:.1f}us" for name, t in us.items()))
    print_speed(rows, failures)
    return dict(timing=TIMING, vllm=vllm["version"] if vllm else None, vllm_unavailable=vllm_reason, rows=rows,
                not_available=failures)


def print_speed(rows, failures):
    short = dict(ours_linear="ours lin", ours_gemm="ours gemm", ours_own_gemm="ours own", cublas_bf16="cuBLAS bf16", scaled_mm_rowwise="sm row",
                 scaled_mm_tensorwise="sm tensor", scaled_mm_blockwise="sm block", vllm_triton_gemm="vLLM tri",
                 vllm_triton_linear="vLLM tri lin", vllm_cutlass_gemm="vLLM cutlass")
    print(f"\nmicroseconds ({TIMING}); 'lin' = activation quantisation + GEMM, the others the GEMM alone;"
          f" ratios = their time / ours (> 1: ours faster)")
    header = f"{'M':>5} {'N':>6} {'K':>6} " + " ".join(f"{short[c]:>12}" for c in SPEED_COLUMNS)
    print(header + f" {'ours TFLOP/s':>12} {'vLLM/ours':>9} {'cutl/ours':>9} {'cuBLAS/ours':>11} {'lin vLLM/ours':>13}")
    for r in rows:
        cells = " ".join(f"{r['us'][c]:>12.1f}" if c in r["us"] else f"{'n/a':>12}" for c in SPEED_COLUMNS)
        fmt = lambda key, width: f"{r[key]:>{width}.2f}" if key in r else f"{'n/a':>{width}}"  # noqa: E731
        tf = r["tflops"].get("ours_gemm")
        tf = f"{tf:>12.1f}" if tf is not None else f"{'n/a':>12}"
        print(f"{r['m']:>5} {r['n']:>6} {r['k']:>6} {cells} {tf} "
              f"{fmt('vllm_triton_gemm_over_ours_gemm', 9)} {fmt('vllm_cutlass_gemm_over_ours_gemm', 9)} "
              f"{fmt('cublas_bf16_over_ours_gemm', 11)} {fmt('vllm_triton_linear_over_ours_linear', 13)}")
    worst = {}
    for r in rows:
        for name, d in r["rel_diff_vs_ours_gemm"].items():
            worst[name] = max(worst.get(name, 0.0), d)
    print("max |out - ours| / max |ours| over the shapes (quantisation differs for row/tensor-wise; a large value for a"
          " block-scaled one means a wrong layout): " + ", ".join(f"{short[k]} {v:.1e}" for k, v in worst.items()))
    for name, reasons in failures.items():
        for reason, where in reasons.items():
            print(f"n/a {short.get(name, name)} at {len(where)} shape(s), e.g. M,N,K={where[0]}: {reason}")


# ---------------------------------------------------------------------------------------------
# ceiling: where the large-M time goes (a diagnosis, not the contract)

@triton.jit
def _ceiling_kernel(xq, wq, out_ptr, M, N, K, stride_om, PROMOTE: tl.constexpr, GROUP: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Our kernel's loop with descriptor loads and program order, without the contract's scales: PROMOTE=0
    chains every K block's MMAs into one accumulator (an ordinary Triton fp8 GEMM: what the tensor cores
    give at this tile), PROMOTE=1 takes each block's partial from zero and adds it (the per-block wait the
    contract's scaled add needs, without the scale loads and products). Neither output is the contract's."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % rows_in_group
    pid_n = (pid % (GROUP_M * tiles_n)) // rows_in_group
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, K // GROUP):
        a = xq.load([pid_m * BLOCK_M, kb * GROUP])
        b = wq.load([pid_n * BLOCK_N, kb * GROUP]).T
        if PROMOTE:
            acc = acc + tl.dot(a, b)
        else:
            acc = tl.dot(a, b, acc)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :], acc.to(tl.bfloat16),
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


CEILING_TILES = [(64, 128, 4, 3), (128, 128, 8, 3), (128, 256, 8, 3), (128, 256, 8, 4)]


def ceiling_section(device):
    """Large M: our contract kernel (its own launch) against ``_ceiling_kernel`` at our tile and at wider
    ones, and cuBLAS's block-scaled GEMM: how much of the gap is the per-block promotion, how much the
    scales, how much the tile."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows = []
    print(f"\n{'M':>5} {'N':>6} {'K':>6} {'variant':>34} {'us':>9} {'TFLOP/s':>8}  (GEMM alone; {TIMING})", flush=True)
    for si, (n, k) in enumerate(QUICK_SHAPES):
        w = speed_weight(n, k, seed=70 + si, device=device)
        for m in (1024, 8192):
            x = torch.randn(m, k, device=device, generator=torch.Generator(device=device).manual_seed(m)).bfloat16()
            xq, xs = fp8_gemm.quantise_activations(x, SPEC)
            xs_cols = xs.t().contiguous().t()   # one K block's scales of all rows together (session 18, call 2: no faster)
            variants = {"ours (contract, own launch)":
                        lambda: fp8_gemm.gemm(xq, xs, w["wq"], w["ws"], None, torch.bfloat16, SPEC),
                        "ours, column-major scales":
                        lambda: fp8_gemm.gemm(xq, xs_cols, w["wq"], w["ws"], None, torch.bfloat16, SPEC)}
            own = variants["ours (contract, own launch)"]()
            try:
                xs_col = xs.t().contiguous().t()     # the 1x128 scale layout cuBLAS takes (as in ``comparators``)
                variants["cuBLAS block (_scaled_mm)"] = lambda: torch._scaled_mm(
                    xq, w["wq"].t(), scale_a=xs_col, scale_b=w["ws"].t(), out_dtype=torch.bfloat16)
                variants["cuBLAS block (_scaled_mm)"]()
            except Exception as exc:  # noqa: BLE001 - this torch's cuBLAS lacks it here: say so
                variants.pop("cuBLAS block (_scaled_mm)")
                log(f"ceiling: cuBLAS block n/a: {first_line(exc)}")
            out = torch.empty(m, n, device=device, dtype=torch.bfloat16)
            for bm, bn, warps, stages in CEILING_TILES:
                xd = TensorDescriptor.from_tensor(xq, [bm, G])
                wd = TensorDescriptor.from_tensor(w["wq"], [bn, G])
                for promote in (0, 1):
                    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
                    name = f"{'per-block add' if promote else 'chained MMA'} {bm}x{bn} w{warps} s{stages}"
                    variants[name] = (lambda xd=xd, wd=wd, grid=grid, promote=promote, bm=bm, bn=bn, warps=warps,
                                      stages=stages: _ceiling_kernel[grid](xd, wd, out, m, n, k, out.stride(0),
                                                                           PROMOTE=promote, GROUP=G, BLOCK_M=bm,
                                                                           BLOCK_N=bn, GROUP_M=8, num_warps=warps,
                                                                           num_stages=stages))
            for name, fn in variants.items():
                same = None
                try:
                    result = fn()
                    torch.cuda.synchronize()
                    if name.startswith("ours"):
                        same = bool(torch.equal(bits(result), bits(own)))
                    us = bench_ms(fn) * 1000
                except Exception as exc:  # noqa: BLE001 - a tile that does not fit: say so, go on
                    rows.append(dict(m=m, n=n, k=k, variant=name, error=first_line(exc)))
                    print(f"{m:>5} {n:>6} {k:>6} {name:>34} {'n/a':>9} ({first_line(exc)[:60]})", flush=True)
                    continue
                tflops = 2.0 * m * n * k / (us * 1e-6) / 1e12
                rows.append(dict(m=m, n=n, k=k, variant=name, us=us, tflops=tflops, same_bits_as_own=same))
                mark = "" if same is None else ("  same bits" if same else "  OTHER BITS")
                print(f"{m:>5} {n:>6} {k:>6} {name:>34} {us:>9.1f} {tflops:>8.0f}{mark}", flush=True)
    return dict(timing=TIMING, rows=rows)


# ---------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="tiny shapes (for Triton's CPU interpreter)")
    parser.add_argument("--quick", action="store_true", help="a thinned tile grid and fewer speed shapes")
    parser.add_argument("--no-speed", action="store_true")
    parser.add_argument("--tune-cache", default="fp8_tune.json",
                        help="tune: where the tuning cache goes (the speed section after it reads it)")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {SECTIONS}")
    args = parser.parse_args(argv)
    sections = args.only.split(",")
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    if (args.device == "cpu") != INTERPRET:
        parser.error(f"--device {args.device} with TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}: the "
                     f"kernels run on CPU tensors only under Triton's interpreter (TRITON_INTERPRET=1 --device cpu), "
                     f"and on a GPU only without it")
    device = torch.device(args.device)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (triton interpreter)"
    report = dict(device=device_name, torch=torch.__version__, triton=triton.__version__, contract=CONTRACT.name,
                  fingerprint=CONTRACT.fingerprint, fp8=dict(activation_group=G, weight_block=SPEC.weight_block,
                                                             activation_format=SPEC.activation_format,
                                                             weight_format=SPEC.weight_format,
                                                             amax_floor=SPEC.amax_floor),
                  args=vars(args))
    log(f"{device_name}, torch {torch.__version__}, triton {triton.__version__}, sections {sections}")
    checks = {}
    if "quant" in sections:
        report["quant"], checks["quant"] = quant_section(device, args.small)
    if "batch" in sections:
        report["batch"], checks["batch"] = batch_section(device, args.small)
    if "tiles" in sections:
        report["tiles"], checks["tiles"] = tiles_section(device, args.small, args.quick)
    if "accuracy" in sections:
        report["accuracy"] = accuracy_section(device, args.small)
    if "negative" in sections:
        report["negative"], checks["negative"] = negative_section(device, args.small)
    if "tune" in sections:
        if args.no_speed or args.small or device.type != "cuda":
            report["tune"] = "skipped (--no-speed, --small or not a GPU)"
        else:
            report["tune"] = tune_section(device, args.quick, args.tune_cache)
    if "speed" in sections:
        if args.no_speed or args.small or device.type != "cuda":
            report["speed"] = "skipped (--no-speed, --small or not a GPU)"
            log("speed: " + report["speed"])
        else:
            report["speed"] = speed_section(device, args.quick)
    if "ceiling" in sections:
        if args.small or device.type != "cuda":
            report["ceiling"] = "skipped (--small or not a GPU)"
        else:
            report["ceiling"] = ceiling_section(device)
            checks["ceiling"] = all(r.get("same_bits_as_own") is not False for r in report["ceiling"]["rows"])
    report["checks"] = checks
    report["ok"] = all(checks.values())
    report["wall_s"] = time.time() - START
    with open(args.json, "w") as f:
        json.dump(report, f, indent=2, default=str)
    print("\n" + ", ".join(f"{name}: {'PASS' if ok else 'FAIL'}" for name, ok in checks.items()), flush=True)
    print(f"FP8 GPU CHECKS {'PASS' if report['ok'] else 'FAIL'} ({args.json})", flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
