"""What other FP8 KV-cache read rules would cost the decode kernel, counted offline (sm_90 SASS, no GPU).

Why: over an FP8 cache, decode runs at 1.17-1.28x the bf16 cache's speed on the H100 (issue #22 asks >= 1.5x
at long contexts), and its time follows its instructions (docs/fp8.md). The contract's read rule today,
[fp8].kv_dequant = "fp32_multiply_round_act" (k = round_bf16(fl32(fp32(k_fp8) * scale))), costs a conversion
to fp32, a multiply and a rounding per element. This script compiles the default decode program (16 query
rows, 16-key pages, head dim 128, 1 and 2 splits a program) with the read path edited, in a copy of
hal/kernels/attention.py, to the rules a later contract version could choose, and prints the size of the
unmasked chunk loop (SASS instructions a thread issues per 64-key chunk) beside the bf16 cache's:

  current              the committed rule (per token-head scale multiplied in fp32, rounded to bf16)
  bf16 exact, fp32     no multiply (the scale moved onto the scores and the output): e4m3 -> f16 -> fp32 -> bf16
  bf16 exact, direct   the same, by Triton's own e4m3 -> bf16 conversion
  f16 operands         K and V enter the MMAs as f16 (exact for e4m3), q and P rounded to f16: one
                       conversion instruction per two elements
  f16, no barrier      the same without the operand barrier (docs/fp8.md: Triton then picks another MMA
                       operand layout, which changed the bits between phases on the H200)

"current" is bf16-fp8-v1's rule; the "f16 operands" edit is what bf16-fp8-v2 later wrote into the contract, and
the last row ("v2 kernel (committed)") compiles the committed kernel with F16_OPERANDS, which should match it. Needs the Triton 3.6 venv of bench/sm90_report.py:

    .venv-sm90/bin/python bench/fp8_kv_read_rules_sm90.py [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sm90_report  # noqa: E402
from hal.kernels import attention  # noqa: E402
from hal.kernels.offline import compile_for_hopper  # noqa: E402

_SCALED = ("        y = x.to(tl.float32) * s[:, None]\n    else:\n        y = x.to(tl.float32) * tl.load(scale_ptr)")
_ROUND = "            y = y.to(tl.bfloat16)\n    if OPERAND_BARRIER:"
_BARRIER = ('            y = tl.inline_asm_elementwise("mov.b16 $0, $1;", "=h,h", [y], dtype=tl.bfloat16, '
            'is_pure=False, pack=1)')
_F16 = [(_SCALED, "        y = x.to(tl.float16)\n    else:\n        y = x.to(tl.float16)"),
        (_ROUND, "            y = y.to(tl.float16)\n    if OPERAND_BARRIER:"),
        (_BARRIER, _BARRIER.replace("dtype=tl.bfloat16", "dtype=tl.float16")),
        ("        ones = tl.full((KV_CHUNK, 16), 1.0, dtype=tl.bfloat16)",
         "        ones = tl.full((KV_CHUNK, 16), 1.0, dtype=tl.float16 if KV_FP8 else tl.bfloat16)"),
        ("    if UPCAST:\n        q = q.to(tl.float32)\n",
         "    if UPCAST:\n        q = q.to(tl.float32)\n    if KV_FP8:\n        q = q.to(tl.float16)\n"),
        ("            p = p.to(tl.bfloat16)", "            p = p.to(tl.float16 if KV_FP8 else tl.bfloat16)")]
RULES = {
    "current": [],
    "bf16 exact, fp32": [(_SCALED, "        y = x.to(tl.float32)\n    else:\n        y = x.to(tl.float32)")],
    "bf16 exact, direct": [(_SCALED, "        y = x\n    else:\n        y = x")],
    "f16 operands": _F16,
    "f16, no barrier": _F16 + [("    if OPERAND_BARRIER:\n        # Triton picks",
                                "    if False:\n        # Triton picks")],
}


def _edited_module(name: str, edits: list[tuple[str, str]], folder: str):
    source = open(attention.__file__).read()
    for old, new in edits:
        if old not in source:
            raise SystemExit(f"rule {name!r}: the read path changed, update this script's edit: {old[:60]!r}")
        source = source.replace(old, new)
    path = os.path.join(folder, f"attention_{len(os.listdir(folder))}.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _chunk_loop(kernel, fp8: bool, splits_per_program: int, f16: bool = False) -> dict:
    types = dict(sm90_report.ATTENTION_TYPES)
    if fp8:
        types.update(k_cache_ptr="*fp8e4nv", v_cache_ptr="*fp8e4nv")
    constants = dict(PAGE_SIZE=16, KV_SPLIT=512, GROUP_PAD=4, ROWS=16, HEAD_SPLIT=1,
                     SPLITS_PER_PROGRAM=splits_per_program, HEADS_FASTEST=True, BLOCK_Q=4, HEAD_DIM=128,
                     SPLIT_PARALLEL=True, IS_BF16=True, UPCAST=False, KV_CHUNK=64, BLOCK_B=attention.BLOCK_B,
                     TMA=False, EXP2=True, ROUNDED_SUM=True, KV_FP8=fp8, PER_TOKEN_SCALE=fp8 and not f16,
                     OPERAND_BARRIER=fp8, NESTED_SPLITS=False, F16_OPERANDS=f16)
    compiled = compile_for_hopper(kernel, types, constants, 4, 5,
                                  not16=("num_seqs", "num_tiles", "group", "max_splits", "num_q_heads", "stride_sh"))
    row = sm90_report.report(compiled)
    # The unmasked chunk loop is the first loop with MMAs (the sequence search before it has none)
    size, ops = next((n, ops) for n, ops in row["loops"] if ops.get("HMMA"))
    return dict(registers=row["registers"], spill_bytes=row["spill_stack_bytes"], chunk_loop=size,
                top=dict(ops.most_common(6)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the table here too")
    args = ap.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as folder:
        cases = [("bf16 cache", attention._attention_kernel, False, False)]
        cases += [(name, _edited_module(name, edits, folder)._attention_kernel, True, False)
                  for name, edits in RULES.items()]
        cases += [("v2 kernel (committed)", attention._attention_kernel, True, True)]
        print(f"{'read rule':<20} {'1 split/program':>16} {'2 splits/program':>17}   "
              "registers/spills, top opcodes (2 splits)")
        for name, kernel, fp8, f16 in cases:
            rows[name] = {spp: _chunk_loop(kernel, fp8, spp, f16) for spp in (1, 2)}
            one, two = rows[name][1], rows[name][2]
            print(f"{name:<20} {one['chunk_loop']:>16} {two['chunk_loop']:>17}   "
                  f"{two['registers']}/{two['spill_bytes']}, {two['top']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(unit="SASS instructions per 64-key chunk and thread (unmasked chunk loop)", rows=rows),
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
