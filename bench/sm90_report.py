"""Compile the cuda backend's GEMM and attention kernels for Hopper (sm_90) on a machine without a
GPU, and report what the compiler made of each launch shape: registers per thread, spill stack,
shared memory, wgmma instructions and the wgmma wait depths in the PTX.

This is how the configs in gemm.py and attention.py were screened before spending GPU time
(e.g. "TMA loads at M = 64: 44 registers instead of 228, and the MMAs overlap"; "128 x 256 GEMM
tiles spill 48 bytes"). Numbers depend on the Triton version: the H200 image has Triton 3.6.0,
so install that version for numbers that match the GPU (a separate venv is enough: it needs
torch, triton 3.6.0 and this package; ptxas and cuobjdump come with Triton's wheel):

    python -m venv .venv-sm90 && .venv-sm90/bin/pip install torch==2.13.0 triton==3.6.0 stevedore pyyaml
    .venv-sm90/bin/pip install --no-deps -e . && .venv-sm90/bin/python bench/sm90_report.py

Arguments get the 16-divisibility the JIT infers from real calls (aligned pointers, strides and
sizes that are multiples of 16), except those named as not divisible per kernel below; without
it the compiler cannot vectorise loads and the report would describe a kernel nobody runs.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import subprocess
import sys
import tempfile

import triton

from hal.contract import load_contract
from hal.kernels import attention, fp8_gemm_sm90, gemm
from hal.kernels.offline import compile_for_hopper

TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def loop_sizes(sass: str) -> list[tuple[int, collections.Counter]]:
    """Every loop of the SASS (a backward branch and the instructions it jumps over): (instructions, opcode
    counts), in address order. A kernel's main loop is one of them; its size is the per-iteration cost."""
    code = [(int(a, 16), text.strip()) for a, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    index = {address: i for i, (address, _) in enumerate(code)}
    loops = []
    for i, (address, text) in enumerate(code):
        target = re.search(r"BRA (0x[0-9a-f]+)", text)
        if target and int(target.group(1), 16) < address and int(target.group(1), 16) in index:
            body = code[index[int(target.group(1), 16)]:i + 1]
            ops = collections.Counter((t.split()[1] if t.startswith("@") else t.split()[0]).split(".")[0]
                                      for _, t in body)
            loops.append((len(body), ops))
    return loops


def report(compiled) -> dict:
    ptx = compiled.asm["ptx"]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([os.path.join(TOOLS, "cuobjdump"), "--dump-resource-usage", cubin.name],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([os.path.join(TOOLS, "cuobjdump"), "-sass", cubin.name],
                              capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+).*?STACK:(\d+)", usage)
    waits = " ".join(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)) or "-"
    if fp8_gemm_sm90.ptxas_report(compiled)["serialised"]:   # every wgmma of the kernel waits for the one before
        waits += " serialised"
    return dict(registers=int(found.group(1)), spill_stack_bytes=int(found.group(2)),
                shared_bytes=compiled.metadata.shared, wgmma=len(re.findall(r"wgmma\.mma_async", ptx)),
                wgmma_waits=waits, loops=loop_sizes(sass))


GEMM_TYPES = dict(bias_ptr="*bf16", out_ptr="*bf16", partial_ptr="*fp32", M="i32", N="i32", K="i32",
                  stride_xm="i32", stride_xk="i32", stride_wn="i32", stride_wk="i32", stride_om="i32",
                  stride_on="i32")


GEMM_512 = dataclasses.replace(load_contract().gemm, k_chunk=512)


def gemm_rows(sms: int = 132):
    """The launch shape gemm._config picks for each (M, N, K) of the benchmark, bf16, K chunk 512."""
    seen = set()
    for n, k in [(4096, 4096), (14336, 4096), (4096, 14336), (152064, 4096)]:
        for m in (1, 64, 256, 4096):
            cfg = gemm._config(m, n, k, GEMM_512, tma=True, sms=sms)
            key = tuple(sorted(cfg.items()))
            if key in seen:
                continue
            seen.add(key)
            bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
            types = dict(GEMM_TYPES, x=f"tensordesc<bf16[{bm}, {bk}]>" if cfg["tma"] else "*bf16",
                         w=f"tensordesc<bf16[{bn}, {bk}]>" if cfg["tma"] else "*bf16")
            constants = dict(K_CHUNK=512, SPLIT=False, CHUNKS_PER_PROGRAM=1, HAS_BIAS=False, OUT_BF16=n <= 16384,
                             FP32_INPUTS=False, UPCAST=False, TMA=cfg["tma"], BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                             GROUP_M=cfg["GROUP_M"])
            if n > 16384:
                types["out_ptr"] = "*fp32"
            compiled = compile_for_hopper(gemm._gemm_kernel, types, constants, cfg["num_warps"], cfg["num_stages"],
                                          not16=("M", "stride_xk", "stride_wk", "stride_on"))
            name = f"gemm M={m} N={n} K={k}: {bm}x{bn}x{bk} w{cfg['num_warps']} s{cfg['num_stages']}"
            yield name + (" TMA" if cfg["tma"] else " pointer"), report(compiled)


ATTENTION_TYPES = dict(q_ptr="*bf16", k_cache_ptr="*bf16", v_cache_ptr="*bf16", out_ptr="*bf16",
                       part_m_ptr="*fp32", part_l_ptr="*fp32", part_a_ptr="*fp32", part_pos_ptr="*i32",
                       query_start_ptr="*i32", seq_lens_ptr="*i32", block_table_ptr="*i32", num_seqs="i32",
                       num_tiles="i32", stride_qt="i32", stride_qh="i32", stride_bt="i32", stride_kp="i32",
                       stride_kr="i32", stride_kh="i32", stride_ot="i32", stride_oh="i32", num_q_heads="i32",
                       max_splits="i32", scale_log2e="fp32", group="i32", k_scale_ptr="*fp32", v_scale_ptr="*fp32",
                       stride_sp="i32", stride_sr="i32", stride_sh="i32")


def attention_rows():
    """Prefill (64-key pages) and decode (16-key pages) of 32 query / 8 KV heads of 128, bf16: the
    default launch shapes (prefill also with the flat chunk loop, ``nested_splits=False``), and decode programs
    that walk 2 or 4 consecutive splits; then decode over the FP8 KV cache at the default decode shape, whose
    chunk loop shows what the read path costs against the bf16 cache's (``loop`` below: the unmasked chunk
    loop): "v1" dequantises each element (bf16-fp8-v1, per (token, head) scales), "v2" reads f16 operands
    (bf16-fp8-v2, fixed scales)."""
    for phase, tokens, seqs, page, override, fp8 in [
            ("prefill", 4096, 1, 64, {}, False), ("prefill", 4096, 1, 64, dict(nested_splits=False), False),
            ("decode", 8, 8, 16, {}, False),
            ("decode", 8, 8, 16, dict(splits_per_program=2), False),
            ("decode", 8, 8, 16, dict(splits_per_program=4), False),
            ("prefill", 4096, 1, 64, dict(tma=False), False),
            ("prefill", 4096, 1, 64, dict(tma=False, nested_splits=False), False),
            ("decode", 8, 8, 64, dict(tma=True), False),
            ("decode", 8, 8, 64, dict(tma=True, splits_per_program=2), False),
            ("decode", 8, 8, 16, dict(splits_per_program=2), "v1"),
            ("decode", 8, 8, 16, {}, "v2"), ("decode", 8, 8, 16, dict(splits_per_program=2), "v2"),
            ("prefill", 4096, 1, 64, dict(tma=False), "v2"),
            ("prefill", 4096, 1, 64, dict(group=5), False),
            # L = 512: K/V by pointer (descriptors from 1024 tokens), and the wide tile (``_prefill_wide_tile``)
            ("prefill", 512, 1, 64, dict(tma=False), False),
            ("prefill", 512, 1, 64, dict(tma=False, rows=128, num_warps=8), False)]:
        shape = dict(attention._launch_shape(tokens, seqs, group_pad=4), **override)
        group = shape.get("group", 4)   # 5: a GQA group of 5 packed as paged_attention packs it (12 tokens x 5)
        types = dict(ATTENTION_TYPES)
        if shape["tma"]:  # K/V by descriptors of one head's 64-key chunk of a page
            types.update(k_cache_ptr="tensordesc<bf16[64, 128]>", v_cache_ptr="tensordesc<bf16[64, 128]>")
        if fp8:
            types.update(k_cache_ptr="*fp8e4nv", v_cache_ptr="*fp8e4nv")
        constants = dict(PAGE_SIZE=page, KV_SPLIT=512, GROUP_PAD=group, ROWS=shape["rows"],
                         HEAD_SPLIT=shape["head_split"],
                         SPLITS_PER_PROGRAM=shape["splits_per_program"], HEADS_FASTEST=shape["heads_fastest"],
                         BLOCK_Q=max(1, shape["rows"] // (group // shape["head_split"])), HEAD_DIM=128,
                         SPLIT_PARALLEL=shape["decode"], IS_BF16=True, UPCAST=False, KV_CHUNK=64,
                         BLOCK_B=attention.BLOCK_B, TMA=shape["tma"], EXP2=True, ROUNDED_SUM=True, KV_FP8=bool(fp8),
                         PER_TOKEN_SCALE=fp8 == "v1", OPERAND_BARRIER=bool(fp8),
                         NESTED_SPLITS=shape.get("nested_splits", not shape["decode"]), F16_OPERANDS=fp8 == "v2")
        compiled = compile_for_hopper(attention._attention_kernel, types, constants, shape["num_warps"],
                                      shape["num_stages"],
                                      not16=("num_seqs", "num_tiles", "group", "max_splits", "num_q_heads",
                                             "stride_sh"))
        yield (f"attention {phase}{f' fp8 KV {fp8}' if fp8 else ''}: {shape['rows']} rows, "
               f"{shape['splits_per_program']} split(s)/program, w{shape['num_warps']} s{shape['num_stages']}"
               + (" TMA" if shape["tma"] else "") + ("" if shape.get("nested_splits", not shape["decode"]) == (not shape["decode"]) else
                  " nested splits" if shape["nested_splits"] else " flat loop")
               + (f" GQA {group} packed" if group != 4 else ""),
               report(compiled))


def fp8_gemm_rows():
    """The Gluon block-FP8 GEMM (hal/kernels/fp8_gemm_sm90.py) at its launches: the overlap is the wgmma wait
    for 1 outstanding group; ``serialised`` is ptxas's C751x (every wgmma of the kernel serialised)."""
    from hal.kernels import fp8_gemm

    for bm, bn, warps, stages, unroll, ws in fp8_gemm._SM90_TILES:
        cfg = dict(BLOCK_M=bm, BLOCK_N=bn, GROUP_M=8, num_warps=warps, num_stages=stages, unroll=unroll, ws=ws)
        compiled = fp8_gemm_sm90.compile_offline(cfg)
        row = report(compiled)    # ``serialised`` in its waits: ptxas's C751x notes
        yield f"fp8 gemm sm90 (Gluon{' ws' if ws else ''}) {bm}x{bn} w{warps} s{stages} u{unroll}", row


def main() -> int:
    print(f"triton {triton.__version__} (the H200 image has 3.6.0), target sm_90", flush=True)
    print(f"{'kernel and launch shape':<62} {'regs':>5} {'spill B':>8} {'smem KB':>8} {'wgmma':>6}  {'waits':<12} "
          f"loops (SASS instructions)")
    for name, r in [*gemm_rows(), *attention_rows(), *fp8_gemm_rows()]:
        print(f"{name:<62} {r['registers']:>5} {r['spill_stack_bytes']:>8} {r['shared_bytes'] / 1024:>8.1f} "
              f"{r['wgmma']:>6}  {r['wgmma_waits']:<12} {' '.join(str(n) for n, _ in r['loops'] if n > 20)}",
              flush=True)
        if name.startswith("attention decode"):   # the unmasked chunk loop (the second): what a 64-key chunk costs
            big = [ops for n, ops in r["loops"] if n > 200]
            if big:
                print(f"{'':<62}   chunk loop: " + ", ".join(f"{op} {c}" for op, c in big[0].most_common(10)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
