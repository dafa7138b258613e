"""Block-FP8 GEMM for Hopper (sm_90) in Gluon: ``fp8_gemm._fp8_gemm_kernel``'s reduction, with each K
block's scaled add overlapped with the next block's MMAs.

Why a second kernel. The contract ([fp8], hal/fp8.py) forms one fp32 partial per K block of 128 from
zero, then ``acc = fl32(acc + fl32(partial * fl32(a_scale * w_scale_inv)))`` in ascending block order.
In Triton the partial is a ``tl.dot``, and the scaled add that reads it must wait for that dot's wgmma
group to finish: each block's MMAs and its add run one after the other, and the tensor cores idle
during the add (bench/results/h200-2026-12-04-session17: ~30 % of the time at large M; an ordinary
fp8 GEMM at the same tiles runs at cuBLAS's speed). Triton 3.6 cannot express "issue block k's MMAs,
then add block k-1's partial while they run" (LAG, which tried it with two dots, gave other bits on
the H200). Gluon exposes the asynchronous wgmma and its wait, so this kernel does that, UNROLL (2-4, a
launch choice) blocks a step; with two:

  for each step of blocks k, k+1 (ascending):
      part_k   = wgmma(x_k, w_k^T) from zero, issued asynchronously    # the same MMA chain as tl.dot
      part_k+1 = the same for block k+1, issued behind it
      wait until only part_k+1 is in flight; acc = fl32(acc + fl32(part_k * fl32(a_scale_k * w_scale_k)))
      refill block k's shared-memory stage (TMA) with block k + STAGES
      wait for part_k+1; add it the same way; refill its stage
  the blocks left over one at a time; bias in fp32; one rounding.

The last add of a step runs with the tensor cores idle: carrying a partial in flight into the next step
made ptxas serialise every wgmma (below). Measured on an H100 (bench/results/h100-2026-12-06-fp8sm90-prefill/):
the same bits as the Triton kernel in every cell, the overlap worth 6-11 % (three blocks a step another
2-11 %), 0.62-1.33x the Triton kernel's default launch depending on the shape, so it is one more launch for
the tuner, not the default.

The arithmetic is the Triton kernel's, operation for operation: the same fp8 wgmma chain per block
(one 128-deep K block = four k32 instructions, accumulated from zero), the same scale product, the same
ascending adds without FMA (``LAUNCH``); only *when* the add runs changes. So the bits are the Triton
kernel's, and the GPU checks (bench/fp8_sm90_gpu.py; bench/fp8_gpu.py's ``tiles``: every candidate, this
kernel's included, against one launch) are what prove it; the tuner checks it again before it picks a launch.

Scope: tiles of BLOCK_M = 64 x warpgroups rows and BLOCK_N <= 128 columns inside one weight block (one
weight scale per block and tile), operands by tensor descriptor (K-major rows, 16-byte aligned), e4m3.
Gluon kernels do not run under Triton's interpreter, so CI runs the Triton kernel, whose bits this one
equals; ``available`` says when it can be offered (a Hopper GPU and Triton's Gluon).
"""

from __future__ import annotations

import torch

try:    # Triton >= 3.5 ships Gluon; without it (or under the interpreter) this kernel is not offered
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    # The TMA load's name: Triton 3.6 (the H200's) has async_copy_global_to_shared, later releases async_load.
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    HAVE_GLUON = True
except (ImportError, AttributeError):   # pragma: no cover - a Triton build without Gluon, or another Gluon API
    HAVE_GLUON = False

from hal.kernels.common import INTERPRET


def available(device: torch.device) -> bool:
    """Whether this kernel can run for tensors on ``device``: Gluon importable, not interpreting, and a
    Hopper GPU (its wgmma and TMA are sm_90's)."""
    return (HAVE_GLUON and not INTERPRET and device.type == "cuda"
            and torch.cuda.get_device_capability(device)[0] == 9)


if HAVE_GLUON:
    @gluon.jit
    def _issue(x_smem, w_smem, ready, kb, STAGES: gl.constexpr, zero):
        """Block kb's partial, from zero (use_acc=False: ``zero`` gives the accumulator's shape and layout;
        its values are not read), issued asynchronously once its stage has arrived."""
        s = kb % STAGES
        mbarrier.wait(ready.index(s), (kb // STAGES) & 1)
        return warpgroup_mma(x_smem.index(s), w_smem.index(s).permute((1, 0)), zero, use_acc=False,
                             is_async=True)

    @gluon.jit
    def _scaled_add(acc, part, xs_ptr, ws_row, offs_m, m_ok, kb, stride_xsm, stride_xsk, stride_wsk):
        """acc = fl32(acc + fl32(part * fl32(a_scale * w_scale_inv))) for K block kb (FMA off: ``LAUNCH``)."""
        a_s = gl.load(xs_ptr + offs_m * stride_xsm + kb * stride_xsk, mask=m_ok, other=0.0)
        w_s = gl.load(ws_row + kb * stride_wsk)
        return acc + part * (a_s * w_s)[:, None]

    @gluon.jit
    def _refill(x_desc, w_desc, x_smem, w_smem, ready, done, blocks, off_m, off_n, GROUP: gl.constexpr,
                STAGES: gl.constexpr, stage_bytes: gl.constexpr):
        """Block ``done``'s MMAs have finished: its stage takes block done + STAGES, if there is one."""
        nxt = done + STAGES
        load = nxt < blocks
        s = done % STAGES
        mbarrier.expect(ready.index(s), stage_bytes, pred=load)
        _tma_load(x_desc, [off_m, nxt * GROUP], ready.index(s), x_smem.index(s), pred=load)
        _tma_load(w_desc, [off_n, nxt * GROUP], ready.index(s), w_smem.index(s), pred=load)


if HAVE_GLUON:
    @gluon.jit
    def _fp8_gemm_sm90_kernel(x_desc, w_desc, xs_ptr, ws_ptr, bias_ptr, out_ptr, M, N, K,
                              stride_xsm, stride_xsk, stride_wsn, stride_wsk, stride_om, stride_on,
                              GROUP: gl.constexpr, HAS_BIAS: gl.constexpr, OUT_BF16: gl.constexpr,
                              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr,
                              STAGES: gl.constexpr, UNROLL: gl.constexpr, num_warps: gl.constexpr):
        """x_desc: (M, K) e4m3 activations in (BLOCK_M, GROUP) blocks; w_desc: (N, K) e4m3 weights in
        (BLOCK_N, GROUP) blocks; xs (M, K/GROUP) and ws (ceil(N/GROUP), K/GROUP) fp32 scales."""
        # Tile order: GROUP_M row tiles share each column tile (as the Triton kernel; free).
        pid = gl.program_id(0)
        tiles_m = gl.cdiv(M, BLOCK_M)
        tiles_n = gl.cdiv(N, BLOCK_N)
        group = pid // (GROUP_M * tiles_n)
        first_m = group * GROUP_M
        rows_in_group = gl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % (GROUP_M * tiles_n)) % rows_in_group
        pid_n = (pid % (GROUP_M * tiles_n)) // rows_in_group
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N

        # One warpgroup per 64 rows; one wgmma instruction spans the tile's columns (k = 32 for fp8).
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, BLOCK_N, 32])
        rows_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
        cols_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
        offs_m = off_m + gl.arange(0, BLOCK_M, layout=rows_layout)
        offs_n = off_n + gl.arange(0, BLOCK_N, layout=cols_layout)
        m_ok = offs_m < M
        n_ok = offs_n < N

        x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BLOCK_M, GROUP], x_desc.layout)
        w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, GROUP], w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for stage in gl.static_range(STAGES):
            mbarrier.init(ready.index(stage), count=1)
        stage_bytes: gl.constexpr = (BLOCK_M + BLOCK_N) * GROUP   # one byte per e4m3 value

        blocks = K // GROUP
        # Prologue: blocks 0 .. STAGES-1 in flight (rows past M or N arrive as zeros).
        for pre in gl.static_range(STAGES):
            load = pre < blocks
            mbarrier.expect(ready.index(pre), stage_bytes, pred=load)
            _tma_load(x_desc, [off_m, pre * GROUP], ready.index(pre), x_smem.index(pre), pred=load)
            _tma_load(w_desc, [off_n, pre * GROUP], ready.index(pre), w_smem.index(pre), pred=load)

        zero = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
        # [fp8].weight_block = GROUP >= BLOCK_N and tiles start at multiples of BLOCK_N: one weight scale
        # per (tile, K block), so one fl32(a_scale * w_scale_inv) per row (as the Triton kernel's).
        ws_row = ws_ptr + (off_n // GROUP) * stride_wsn

        # UNROLL blocks a step: inside a step each block's MMAs are issued before the previous block's
        # partial is waited for and added. Nothing is in flight across a step's end (the last block of a
        # step is waited for with 0 outstanding): a partial carried in flight through the loop's back
        # edge becomes a register copy of an in-flight accumulator, for which ptxas serialises every
        # wgmma of the kernel (its C7514 warning). How many blocks a step takes is bounded by registers:
        # two partials and the accumulator are live at once (tests/test_fp8_sm90.py: no spills).
        for step in range(0, blocks // UNROLL):
            first = step * UNROLL
            part = _issue(x_smem, w_smem, ready, first, STAGES, zero)
            for j in gl.static_range(1, UNROLL):
                nxt = _issue(x_smem, w_smem, ready, first + j, STAGES, zero)
                done, nxt = warpgroup_mma_wait(num_outstanding=1, deps=(part, nxt))
                acc = _scaled_add(acc, done, xs_ptr, ws_row, offs_m, m_ok, first + j - 1, stride_xsm, stride_xsk,
                                  stride_wsk)
                _refill(x_desc, w_desc, x_smem, w_smem, ready, first + j - 1, blocks, off_m, off_n, GROUP, STAGES,
                        stage_bytes)
                part = nxt
            done = warpgroup_mma_wait(num_outstanding=0, deps=(part, ))
            acc = _scaled_add(acc, done, xs_ptr, ws_row, offs_m, m_ok, first + UNROLL - 1, stride_xsm, stride_xsk,
                              stride_wsk)
            _refill(x_desc, w_desc, x_smem, w_smem, ready, first + UNROLL - 1, blocks, off_m, off_n, GROUP, STAGES,
                    stage_bytes)
        for kb in range(blocks // UNROLL * UNROLL, blocks):   # the last blocks % UNROLL, one at a time
            part = _issue(x_smem, w_smem, ready, kb, STAGES, zero)
            done = warpgroup_mma_wait(num_outstanding=0, deps=(part, ))
            acc = _scaled_add(acc, done, xs_ptr, ws_row, offs_m, m_ok, kb, stride_xsm, stride_xsk, stride_wsk)
            _refill(x_desc, w_desc, x_smem, w_smem, ready, kb, blocks, off_m, off_n, GROUP, STAGES, stage_bytes)
        for stage in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(stage))

        if HAS_BIAS:
            acc = acc + gl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(gl.float32)[None, :]
        if OUT_BF16:
            out = acc.to(gl.bfloat16)   # round to nearest even
        else:
            out = acc
        ptrs = out_ptr + offs_m.to(gl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
        gl.store(ptrs, out, mask=m_ok[:, None] & n_ok[None, :])


def descriptors(xq: torch.Tensor, wq: torch.Tensor, block_m: int, block_n: int, group: int):
    """The kernel's two tensor descriptors: (block_m, group) blocks of xq and (block_n, group) of wq."""
    x_layout = gl.NVMMASharedLayout.get_default_for([block_m, group], gl.float8e4nv)
    w_layout = gl.NVMMASharedLayout.get_default_for([block_n, group], gl.float8e4nv)
    return (TensorDescriptor.from_tensor(xq, [block_m, group], x_layout),
            TensorDescriptor.from_tensor(wq, [block_n, group], w_layout))


def config_ok(cfg: dict, group: int) -> bool:
    """Launch shapes this kernel takes: a warpgroup per 64 rows, columns inside one weight block."""
    return (cfg["BLOCK_M"] == 64 * (cfg["num_warps"] // 4) and cfg["num_warps"] in (4, 8)
            and cfg["BLOCK_N"] in (64, 128) and group % cfg["BLOCK_N"] == 0 and cfg["num_stages"] >= 2)


# -- offline check: compile for sm_90 without a GPU and read what ptxas made of it --------------------------

def compile_offline(cfg: dict, group: int = 128, has_bias: bool = False, out_bf16: bool = True, kernel=None):
    """The kernel (or ``kernel``, with the same arguments) compiled for Hopper on any machine (no GPU needed),
    with the argument properties real calls have (16-byte aligned pointers, strides and sizes that are
    multiples of 16 except M and the scales' K strides). CI uses it to check the schedule (tests/test_fp8_sm90.py)."""
    from hal.kernels.offline import compile_for_hopper

    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    x_layout = gl.NVMMASharedLayout.get_default_for([bm, group], gl.float8e4nv)
    w_layout = gl.NVMMASharedLayout.get_default_for([bn, group], gl.float8e4nv)
    types = dict(x_desc=f"tensordesc<fp8e4nv[{bm}, {group}],{x_layout!r}>",
                 w_desc=f"tensordesc<fp8e4nv[{bn}, {group}],{w_layout!r}>", xs_ptr="*fp32", ws_ptr="*fp32",
                 bias_ptr="*bf16", out_ptr="*bf16" if out_bf16 else "*fp32", M="i32", N="i32", K="i32",
                 stride_xsm="i32", stride_xsk="i32", stride_wsn="i32", stride_wsk="i32", stride_om="i32",
                 stride_on="i32")
    constants = dict(GROUP=group, HAS_BIAS=has_bias, OUT_BF16=out_bf16, BLOCK_M=bm, BLOCK_N=bn,
                     GROUP_M=cfg["GROUP_M"], STAGES=cfg["num_stages"], UNROLL=cfg.get("unroll", 2),
                     num_warps=cfg["num_warps"])
    return compile_for_hopper(kernel or _fp8_gemm_sm90_kernel, types, constants, cfg["num_warps"], cfg["num_stages"],
                              not16=("M", "stride_xsk", "stride_wsk", "stride_on"), gluon=True)


def ptxas_report(compiled) -> dict:
    """ptxas (Triton's own, sm_90a) on the compiled PTX: registers, spill bytes, the wgmma waits in the PTX
    (a wait for 1 outstanding group is the overlap), and whether ptxas serialised the wgmmas (its C7514 /
    C7515 performance warnings; C7517 is a wait it injected)."""
    import os
    import re
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90).path      # the ptxas Triton itself compiles sm_90 with
    ptx = compiled.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        info = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.path.join(tmp, "kernel.cubin")],
                              capture_output=True, text=True, check=True).stderr
    registers = re.search(r"Used (\d+) registers", info)
    spills = [int(v) for v in re.findall(r"(\d+) bytes spill (?:stores|loads)", info)]
    return dict(registers=int(registers.group(1)) if registers else None, spill_bytes=max(spills, default=0),
                waits=[int(w) for w in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)],
                serialised=bool(re.search(r"\(C751[45]\)", info)), injected_wait=bool(re.search(r"\(C7517\)", info)),
                ptxas_info=[line for line in info.splitlines() if "C75" in line])
