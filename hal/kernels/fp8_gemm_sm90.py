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
2-11 %), 0.62-1.33x the Triton kernel's default launch depending on the shape.

Two kernels share that loop (scales are loaded when their block's MMAs are issued, so their latency passes
under the MMAs: Gluon does not pipeline loads):
  ``_fp8_gemm_sm90_kernel``  every warp refills the ring; a refill is a CTA-wide barrier, so a tile's math
                             warpgroups run in lockstep. One tile per program.
  ``_fp8_gemm_ws_kernel``    warp-specialised and persistent: a loader warp fills the ring (TMA), each math
                             warpgroup (64 rows of a 128-row tile) is its own partition and frees a stage with an
                             mbarrier arrive, and a grid of one program per SM walks the tiles, the loader running
                             into the next tile while the math stores this one. 128 or 256 columns (256: two
                             weight blocks, a half at a time). The default on Hopper from 1024 rows
                             (``fp8_gemm._WS_DEFAULT``): 1.04-1.33x the Triton kernel's launch at M >= 4096 on an
                             H100, 0.73-0.84x cuBLAS's block-scaled GEMM (bench/results/h100-2026-12-06-ws/).

The arithmetic is the Triton kernel's, operation for operation: the same fp8 wgmma chain per block
(one 128-deep K block = four k32 instructions, accumulated from zero), the same scale product, the same
ascending adds without FMA (``LAUNCH``); only *when* the add runs changes. So the bits are the Triton
kernel's, and the GPU checks (bench/fp8_sm90_gpu.py; bench/fp8_gpu.py's ``tiles``: every candidate, this
kernel's included, against one launch) are what prove it; the tuner checks it again before it picks a launch.

Scope: tiles of BLOCK_M = 64 x warpgroups rows and BLOCK_N <= 128 columns inside one weight block (one
weight scale per block and tile; the ws kernel also 256 = two blocks), operands by tensor descriptor (K-major rows, 16-byte aligned), e4m3.
Gluon kernels do not run under Triton's interpreter, so CI runs the Triton kernel, whose bits this one
equals; ``available`` says when it can be offered (a Hopper GPU and Triton's Gluon).
"""

from __future__ import annotations

import functools

import torch

try:    # Triton >= 3.5 ships Gluon; without it (or under the interpreter) this kernel is not offered
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    # The TMA load's name: Triton 3.6 (the H200's) has async_copy_global_to_shared, later releases async_load.
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    # warp_specialize([(function, args), ...], warps, registers), as in Triton 3.6-3.9; Triton 3.5 took another
    # argument list, which the warp-specialised kernel does not speak: no Gluon kernel is offered there.
    import inspect
    HAVE_GLUON = next(iter(inspect.signature(gl.warp_specialize).parameters)) == "functions_and_args"
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
    def _scales(xs_ptr, ws_row, offs_m, m_ok, kb, stride_xsm, stride_xsk, stride_wsk):
        """K block kb's activation scales (one per row) and weight scale. Loaded when the block's MMAs are
        issued, so that the loads' latency passes under them: Gluon does not pipeline loads itself."""
        a_s = gl.load(xs_ptr + offs_m * stride_xsm + kb * stride_xsk, mask=m_ok, other=0.0)
        w_s = gl.load(ws_row + kb * stride_wsk)
        return a_s, w_s

    @gluon.jit
    def _scaled_add(acc, part, a_s, w_s):
        """acc = fl32(acc + fl32(part * fl32(a_scale * w_scale_inv))) (FMA off: ``LAUNCH``)."""
        return acc + part * (a_s * w_s)[:, None]

    @gluon.jit
    def _tile(tile, M, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
        """Tile ``tile``'s first row and column: GROUP_M row tiles share each column tile (the Triton kernel's
        order; the order is free, only the sums decide the bits)."""
        tiles_m = gl.cdiv(M, BLOCK_M)
        tiles_n = gl.cdiv(N, BLOCK_N)
        group = tile // (GROUP_M * tiles_n)
        first_m = group * GROUP_M
        rows_in_group = gl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (tile % (GROUP_M * tiles_n)) % rows_in_group
        pid_n = (tile % (GROUP_M * tiles_n)) // rows_in_group
        return pid_m * BLOCK_M, pid_n * BLOCK_N

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
        off_m, off_n = _tile(gl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

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
            a_s, w_s = _scales(xs_ptr, ws_row, offs_m, m_ok, first, stride_xsm, stride_xsk, stride_wsk)
            for j in gl.static_range(1, UNROLL):
                nxt = _issue(x_smem, w_smem, ready, first + j, STAGES, zero)
                a_nxt, w_nxt = _scales(xs_ptr, ws_row, offs_m, m_ok, first + j, stride_xsm, stride_xsk, stride_wsk)
                done, nxt = warpgroup_mma_wait(num_outstanding=1, deps=(part, nxt))
                acc = _scaled_add(acc, done, a_s, w_s)
                _refill(x_desc, w_desc, x_smem, w_smem, ready, first + j - 1, blocks, off_m, off_n, GROUP, STAGES,
                        stage_bytes)
                part, a_s, w_s = nxt, a_nxt, w_nxt
            done = warpgroup_mma_wait(num_outstanding=0, deps=(part, ))
            acc = _scaled_add(acc, done, a_s, w_s)
            _refill(x_desc, w_desc, x_smem, w_smem, ready, first + UNROLL - 1, blocks, off_m, off_n, GROUP, STAGES,
                    stage_bytes)
        for kb in range(blocks // UNROLL * UNROLL, blocks):   # the last blocks % UNROLL, one at a time
            part = _issue(x_smem, w_smem, ready, kb, STAGES, zero)
            a_s, w_s = _scales(xs_ptr, ws_row, offs_m, m_ok, kb, stride_xsm, stride_xsk, stride_wsk)
            done = warpgroup_mma_wait(num_outstanding=0, deps=(part, ))
            acc = _scaled_add(acc, done, a_s, w_s)
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


if HAVE_GLUON:
    # -- the warp-specialised kernel: a loader warp and one partition per math warpgroup ------------------
    #
    # Why. In the kernel above every warp refills the shared-memory ring, so each refill is a CTA-wide
    # barrier: the two math warpgroups of a 128-row tile run in lockstep and do their scaled adds at the
    # same time, while the tensor cores idle. Here one warp only issues TMA loads, and each math warpgroup
    # is its own partition that frees a stage (an mbarrier arrive) once its MMAs on it have finished: the
    # warpgroups drift out of phase, and one's adds run under the other's MMAs. Each warpgroup runs the
    # loop above (UNROLL blocks a step) over its 64 rows of the tile. Same arithmetic, same bits.

    @gluon.jit
    def _ws_loader(x_desc, w_desc, x_smem, w_smem, ready, empty, M, N, blocks, GROUP: gl.constexpr,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
        """The loader warp: the blocks of this program's tiles, one after another, into the ring. Ring position
        ``it`` counts blocks across tiles; a stage is refilled once both math warpgroups have freed it (a fresh
        mbarrier counts as having completed the phase before its first, so the first round waits for nothing)."""
        stage_bytes: gl.constexpr = (BLOCK_M + BLOCK_N) * GROUP   # one byte per e4m3 value
        tiles = gl.cdiv(M, BLOCK_M) * gl.cdiv(N, BLOCK_N)
        it = 0
        for tile in range(gl.program_id(0), tiles, gl.num_programs(0)):
            off_m, off_n = _tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            for kb in range(blocks):
                s = it % STAGES
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(s), stage_bytes)
                _tma_load(x_desc, [off_m, kb * GROUP], ready.index(s), x_smem.index(s))
                _tma_load(w_desc, [off_n, kb * GROUP], ready.index(s), w_smem.index(s))
                it += 1

    @gluon.jit
    def _ws_issue(x_smem, w_smem, ready, it, STAGES: gl.constexpr, HALF: gl.constexpr, zero):
        """This warpgroup's 64 rows of the partial in ring position ``it``, from zero, issued once the stage
        has arrived."""
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        return warpgroup_mma(x_smem.index(s).slice(HALF * 64, 64), w_smem.index(s).permute((1, 0)), zero,
                             use_acc=False, is_async=True)

    @gluon.jit
    def _ws_math(x_smem, w_smem, ready, empty, xs_ptr, ws_ptr, bias_ptr, out_ptr, M, N, blocks,
                 stride_xsm, stride_xsk, stride_wsn, stride_wsk, stride_om, stride_on, GROUP: gl.constexpr,
                 HAS_BIAS: gl.constexpr, OUT_BF16: gl.constexpr, HALF: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, UNROLL: gl.constexpr):
        """One math warpgroup: rows 64 * HALF ..+63 of each of this program's tiles, ``_fp8_gemm_sm90_kernel``'s
        loop with each finished block's stage freed by an arrive instead of refilled."""
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BLOCK_N, 32])
        zero = gl.zeros((64, BLOCK_N), dtype=gl.float32, layout=acc_layout)
        tiles = gl.cdiv(M, BLOCK_M) * gl.cdiv(N, BLOCK_N)
        it = 0
        for tile in range(gl.program_id(0), tiles, gl.num_programs(0)):
            off_m, off_n = _tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            offs_m = off_m + HALF * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, acc_layout))
            offs_n = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
            m_ok = offs_m < M
            ws_row = ws_ptr + (off_n // GROUP) * stride_wsn
            acc = gl.zeros((64, BLOCK_N), dtype=gl.float32, layout=acc_layout)
            for step in range(0, blocks // UNROLL):
                first = step * UNROLL
                part = _ws_issue(x_smem, w_smem, ready, it, STAGES, HALF, zero)
                a_s, w_s = _scales(xs_ptr, ws_row, offs_m, m_ok, first, stride_xsm, stride_xsk, stride_wsk)
                for j in gl.static_range(1, UNROLL):
                    nxt = _ws_issue(x_smem, w_smem, ready, it + j, STAGES, HALF, zero)
                    a_nxt, w_nxt = _scales(xs_ptr, ws_row, offs_m, m_ok, first + j, stride_xsm, stride_xsk,
                                           stride_wsk)
                    done, nxt = warpgroup_mma_wait(num_outstanding=1, deps=(part, nxt))
                    mbarrier.arrive(empty.index((it + j - 1) % STAGES))
                    acc = _scaled_add(acc, done, a_s, w_s)
                    part, a_s, w_s = nxt, a_nxt, w_nxt
                done = warpgroup_mma_wait(num_outstanding=0, deps=(part, ))
                mbarrier.arrive(empty.index((it + UNROLL - 1) % STAGES))
                acc = _scaled_add(acc, done, a_s, w_s)
                it += UNROLL
            for kb in range(blocks // UNROLL * UNROLL, blocks):   # the last blocks % UNROLL, one at a time
                part = _ws_issue(x_smem, w_smem, ready, it, STAGES, HALF, zero)
                a_s, w_s = _scales(xs_ptr, ws_row, offs_m, m_ok, kb, stride_xsm, stride_xsk, stride_wsk)
                done = warpgroup_mma_wait(num_outstanding=0, deps=(part, ))
                mbarrier.arrive(empty.index(it % STAGES))
                acc = _scaled_add(acc, done, a_s, w_s)
                it += 1
            _ws_store(acc, offs_m, offs_n, m_ok, bias_ptr, out_ptr, N, stride_om, stride_on, HAS_BIAS, OUT_BF16)

    @gluon.jit
    def _ws_math_wide(x_smem, w_smem, ready, empty, xs_ptr, ws_ptr, bias_ptr, out_ptr, M, N, blocks,
                      stride_xsm, stride_xsk, stride_wsn, stride_wsk, stride_om, stride_on, GROUP: gl.constexpr,
                      HAS_BIAS: gl.constexpr, OUT_BF16: gl.constexpr, HALF: gl.constexpr, BLOCK_M: gl.constexpr,
                      BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
        """``_ws_math`` for tiles two weight blocks wide (BLOCK_N = 2 x GROUP): a shared-memory stage then feeds
        twice the MMAs, so a tile reads a quarter less from L2 per product. Two accumulators of GROUP columns
        and one partial (two partials would not fit the registers): per K block, the low half's partial is
        issued, waited for and added, then the high half's; this warpgroup's adds run under the other one's
        MMAs, not under its own. Each half lies in one weight block, so it has its own weight scale."""
        HALF_N: gl.constexpr = BLOCK_N // 2
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, HALF_N, 32])
        zero = gl.zeros((64, HALF_N), dtype=gl.float32, layout=acc_layout)
        tiles = gl.cdiv(M, BLOCK_M) * gl.cdiv(N, BLOCK_N)
        it = 0
        for tile in range(gl.program_id(0), tiles, gl.num_programs(0)):
            off_m, off_n = _tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            offs_m = off_m + HALF * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, acc_layout))
            offs_lo = off_n + gl.arange(0, HALF_N, layout=gl.SliceLayout(0, acc_layout))
            offs_hi = offs_lo + HALF_N
            m_ok = offs_m < M
            hi_in = off_n + HALF_N < N          # the high half's weight block exists
            ws_lo = ws_ptr + (off_n // GROUP) * stride_wsn
            ws_hi = ws_lo + stride_wsn
            acc_lo = gl.zeros((64, HALF_N), dtype=gl.float32, layout=acc_layout)
            acc_hi = gl.zeros((64, HALF_N), dtype=gl.float32, layout=acc_layout)
            for kb in range(blocks):
                s = it % STAGES
                mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                x_half = x_smem.index(s).slice(HALF * 64, 64)
                part = warpgroup_mma(x_half, w_smem.index(s).slice(0, HALF_N).permute((1, 0)), zero,
                                     use_acc=False, is_async=True)
                a_s = gl.load(xs_ptr + offs_m * stride_xsm + kb * stride_xsk, mask=m_ok, other=0.0)
                w_lo = gl.load(ws_lo + kb * stride_wsk)
                w_hi = gl.load(ws_hi + kb * stride_wsk, mask=hi_in, other=0.0)
                part = warpgroup_mma_wait(num_outstanding=0, deps=(part, ))
                acc_lo = _scaled_add(acc_lo, part, a_s, w_lo)
                part = warpgroup_mma(x_half, w_smem.index(s).slice(HALF_N, HALF_N).permute((1, 0)), zero,
                                     use_acc=False, is_async=True)
                part = warpgroup_mma_wait(num_outstanding=0, deps=(part, ))
                mbarrier.arrive(empty.index(s))
                acc_hi = _scaled_add(acc_hi, part, a_s, w_hi)
                it += 1
            _ws_store(acc_lo, offs_m, offs_lo, m_ok, bias_ptr, out_ptr, N, stride_om, stride_on, HAS_BIAS, OUT_BF16)
            _ws_store(acc_hi, offs_m, offs_hi, m_ok, bias_ptr, out_ptr, N, stride_om, stride_on, HAS_BIAS, OUT_BF16)

    @gluon.jit
    def _ws_store(acc, offs_m, offs_n, m_ok, bias_ptr, out_ptr, N, stride_om, stride_on, HAS_BIAS: gl.constexpr,
                  OUT_BF16: gl.constexpr):
        """The tile's epilogue: bias in fp32, one rounding, masked store."""
        n_ok = offs_n < N
        if HAS_BIAS:
            acc = acc + gl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(gl.float32)[None, :]
        if OUT_BF16:
            out = acc.to(gl.bfloat16)   # round to nearest even
        else:
            out = acc
        ptrs = out_ptr + offs_m.to(gl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
        gl.store(ptrs, out, mask=m_ok[:, None] & n_ok[None, :])

    @gluon.jit
    def _fp8_gemm_ws_kernel(x_desc, w_desc, xs_ptr, ws_ptr, bias_ptr, out_ptr, M, N, K,
                            stride_xsm, stride_xsk, stride_wsn, stride_wsk, stride_om, stride_on,
                            GROUP: gl.constexpr, HAS_BIAS: gl.constexpr, OUT_BF16: gl.constexpr,
                            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr,
                            STAGES: gl.constexpr, UNROLL: gl.constexpr, MATH_REGS: gl.constexpr,
                            num_warps: gl.constexpr):
        """``_fp8_gemm_sm90_kernel``'s arguments and arithmetic; BLOCK_M = 128 rows, two math warpgroups
        (the default partition of num_warps = 4, and one worker) and a loader warp. Persistent: a grid of at
        most one program per SM, each taking tiles pid, pid + programs, ... (the loader runs ahead into the
        next tile while the math warpgroups store this one)."""
        x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BLOCK_M, GROUP], x_desc.layout)
        w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, GROUP], w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for stage in gl.static_range(STAGES):
            mbarrier.init(ready.index(stage), count=1)    # the loader's expect; TMA completes the bytes
            mbarrier.init(empty.index(stage), count=2)    # one arrive per math warpgroup
        blocks = K // GROUP
        if BLOCK_N > GROUP:   # two weight blocks wide
            gl.warp_specialize([
                (_ws_math_wide, (x_smem, w_smem, ready, empty, xs_ptr, ws_ptr, bias_ptr, out_ptr, M, N, blocks,
                                 stride_xsm, stride_xsk, stride_wsn, stride_wsk, stride_om, stride_on, GROUP,
                                 HAS_BIAS, OUT_BF16, 0, BLOCK_M, BLOCK_N, GROUP_M, STAGES)),
                (_ws_math_wide, (x_smem, w_smem, ready, empty, xs_ptr, ws_ptr, bias_ptr, out_ptr, M, N, blocks,
                                 stride_xsm, stride_xsk, stride_wsn, stride_wsk, stride_om, stride_on, GROUP,
                                 HAS_BIAS, OUT_BF16, 1, BLOCK_M, BLOCK_N, GROUP_M, STAGES)),
                (_ws_loader, (x_desc, w_desc, x_smem, w_smem, ready, empty, M, N, blocks, GROUP, BLOCK_M, BLOCK_N,
                              GROUP_M, STAGES)),
            ], [4, 1], [MATH_REGS, 24])
            return
        gl.warp_specialize([
            (_ws_math, (x_smem, w_smem, ready, empty, xs_ptr, ws_ptr, bias_ptr, out_ptr, M, N, blocks,
                        stride_xsm, stride_xsk, stride_wsn, stride_wsk, stride_om, stride_on, GROUP, HAS_BIAS,
                        OUT_BF16, 0, BLOCK_M, BLOCK_N, GROUP_M, STAGES, UNROLL)),
            (_ws_math, (x_smem, w_smem, ready, empty, xs_ptr, ws_ptr, bias_ptr, out_ptr, M, N, blocks,
                        stride_xsm, stride_xsk, stride_wsn, stride_wsk, stride_om, stride_on, GROUP, HAS_BIAS,
                        OUT_BF16, 1, BLOCK_M, BLOCK_N, GROUP_M, STAGES, UNROLL)),
            (_ws_loader, (x_desc, w_desc, x_smem, w_smem, ready, empty, M, N, blocks, GROUP, BLOCK_M, BLOCK_N,
                          GROUP_M, STAGES)),
        ], [4, 1], [MATH_REGS, 24])


# The warp-specialised kernel's registers: its 4 + 4 + 1 warps take three warpgroups (384 threads), so a launch may
# give each thread at most 65536 / 384 -> 168; the loader's warpgroup then gives back all but 24 and the two math
# warpgroups take MATH_REGS each (setmaxnreg; 2 x 128 x 240 + 128 x 24 <= 65536).
WS_MAXNREG = 168
WS_MATH_REGS = 240


@functools.cache
def sm_count(device: torch.device) -> int:
    """The GPU's SMs: the persistent kernel's grid is at most one program per SM."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def descriptors(xq: torch.Tensor, wq: torch.Tensor, block_m: int, block_n: int, group: int):
    """The kernel's two tensor descriptors: (block_m, group) blocks of xq and (block_n, group) of wq."""
    x_layout = gl.NVMMASharedLayout.get_default_for([block_m, group], gl.float8e4nv)
    w_layout = gl.NVMMASharedLayout.get_default_for([block_n, group], gl.float8e4nv)
    return (TensorDescriptor.from_tensor(xq, [block_m, group], x_layout),
            TensorDescriptor.from_tensor(wq, [block_n, group], w_layout))


def config_ok(cfg: dict, group: int) -> bool:
    """Launch shapes these kernels take: a warpgroup per 64 rows (``ws``: 128 rows, the default partition's 4
    warps and one worker warpgroup), columns inside one weight block."""
    if cfg.get("ws"):
        rows_ok = cfg["BLOCK_M"] == 128 and cfg["num_warps"] == 4
        if cfg["BLOCK_N"] == 2 * group:   # two weight blocks wide (_ws_math_wide)
            return rows_ok and cfg["num_stages"] >= 2
    else:
        rows_ok = cfg["BLOCK_M"] == 64 * (cfg["num_warps"] // 4) and cfg["num_warps"] in (4, 8)
    return (rows_ok and cfg["BLOCK_N"] in (64, 128) and group % cfg["BLOCK_N"] == 0 and cfg["num_stages"] >= 2)


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
    maxnreg = None
    if cfg.get("ws"):
        constants["MATH_REGS"] = WS_MATH_REGS
        maxnreg = WS_MAXNREG
        kernel = kernel or _fp8_gemm_ws_kernel
    return compile_for_hopper(kernel or _fp8_gemm_sm90_kernel, types, constants, cfg["num_warps"], cfg["num_stages"],
                              not16=("M", "stride_xsk", "stride_wsk", "stride_on"), gluon=True, maxnreg=maxnreg)


def ptxas_report(compiled) -> dict:
    """ptxas (Triton's own, sm_90a) on the compiled PTX: registers, spill bytes, the register counts the
    partitions of a warp-specialised kernel set (``setmaxnreg``), the wgmma waits in the PTX (a wait for 1
    outstanding group is the overlap), and whether ptxas serialised the wgmmas (its C751x performance
    warnings; C7517 is a wait it injected)."""
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
                setmaxnreg=sorted({int(r) for r in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}),
                waits=[int(w) for w in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)],
                serialised="wgmma.mma_async instructions are serialized" in info,
                injected_wait=bool(re.search(r"\(C7517\)", info)),
                ptxas_info=[line for line in info.splitlines() if "C75" in line])
