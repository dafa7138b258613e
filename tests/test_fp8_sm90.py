"""The Gluon block-FP8 GEMM for Hopper (hal/kernels/fp8_gemm_sm90.py), on a machine without a GPU.

Gluon kernels do not run under Triton's interpreter, so CI cannot execute this one; its bits are checked on
the H200 against the Triton kernel (bench/fp8_sm90_gpu.py, bench/fp8_gpu.py's tiles section). What CI does
check is what can break without a GPU:
  * it is offered only where it can run, and a launch that asks for it elsewhere is an error, never a
    silent fallback to the other kernel;
  * its schedule survives compilation: compiled for sm_90 here, the PTX waits for one outstanding wgmma group
    (a block's scaled add overlaps the next block's MMAs), ptxas does not serialise the wgmmas (its C7514
    warning, which a register copy of an in-flight accumulator triggers) and nothing spills. Negative
    controls: the one-block-at-a-time launch (unroll 1) has no such wait, and a kernel that carries an
    in-flight accumulator through a loop's back edge is reported as serialised.
"""

from __future__ import annotations

import pytest
import torch

from hal.contract import load_contract
from hal.kernels import fp8_gemm, fp8_gemm_sm90

SPEC = load_contract("bf16-fp8-v1").fp8
DEFAULT = dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=4, unroll=2)

needs_gluon = pytest.mark.skipif(not fp8_gemm_sm90.HAVE_GLUON, reason="this Triton has no Gluon")


def test_not_offered_without_a_hopper_gpu():
    assert not fp8_gemm_sm90.available(torch.device("cpu"))


def test_an_sm90_launch_off_hopper_is_an_error_not_a_fallback():
    xq = torch.zeros(4, 256, dtype=torch.float8_e4m3fn)
    xs = torch.ones(4, 2)
    wq = torch.zeros(128, 256, dtype=torch.float8_e4m3fn)
    ws = torch.ones(1, 2)
    with pytest.raises(ValueError, match="Hopper"):
        fp8_gemm.gemm(xq, xs, wq, ws, None, torch.bfloat16, SPEC, dict(DEFAULT, sm90=True, tma=True, pair=False))


@pytest.mark.parametrize("cfg", [DEFAULT, dict(DEFAULT, BLOCK_M=64, num_warps=4),
                                 dict(DEFAULT, BLOCK_N=64, num_stages=6)])
def test_launch_shape_rule(cfg):
    assert fp8_gemm_sm90.config_ok(cfg, 128)
    assert not fp8_gemm_sm90.config_ok(dict(cfg, BLOCK_M=cfg["BLOCK_M"] * 2), 128)   # one warpgroup per 64 rows
    assert not fp8_gemm_sm90.config_ok(dict(cfg, BLOCK_N=256), 128)                  # inside one weight block


@needs_gluon
@pytest.mark.parametrize("cfg", [DEFAULT, dict(DEFAULT, BLOCK_M=64, num_warps=4)], ids=["128x128", "64x128"])
def test_compiled_schedule_overlaps_and_is_not_serialised(cfg):
    report = fp8_gemm_sm90.ptxas_report(fp8_gemm_sm90.compile_offline(cfg, has_bias=True))
    assert 1 in report["waits"], report                  # a block's add runs while the next block's MMAs do
    assert not report["serialised"] and not report["injected_wait"], report["ptxas_info"]
    assert report["spill_bytes"] == 0, report


@needs_gluon
def test_negative_control_unroll_1_has_no_overlap():
    report = fp8_gemm_sm90.ptxas_report(fp8_gemm_sm90.compile_offline(dict(DEFAULT, unroll=1)))
    assert report["waits"] and 1 not in report["waits"], report


if fp8_gemm_sm90.HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

    @gluon.jit
    def _carried_in_flight_kernel(x_desc, w_desc, xs_ptr, ws_ptr, bias_ptr, out_ptr, M, N, K,
                                  stride_xsm, stride_xsk, stride_wsn, stride_wsk, stride_om, stride_on,
                                  GROUP: gl.constexpr, HAS_BIAS: gl.constexpr, OUT_BF16: gl.constexpr,
                                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr,
                                  STAGES: gl.constexpr, UNROLL: gl.constexpr, num_warps: gl.constexpr):
        """The schedule the real kernel avoids: a partial still in flight carried through the loop's back
        edge (the loop-carried value becomes a register copy of in-flight accumulator registers)."""
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_N, 32])
        x_smem = gl.allocate_shared_memory(x_desc.dtype, [BLOCK_M, GROUP], x_desc.layout)
        w_smem = gl.allocate_shared_memory(w_desc.dtype, [BLOCK_N, GROUP], w_desc.layout)
        bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(bar, count=1)
        zero = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=layout)
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=layout)
        prev = warpgroup_mma(x_smem, w_smem.permute((1, 0)), zero, use_acc=False, is_async=True)
        for _ in range(1, K // GROUP):
            part = warpgroup_mma(x_smem, w_smem.permute((1, 0)), zero, use_acc=False, is_async=True)
            done = warpgroup_mma_wait(num_outstanding=1, deps=(prev, ))
            acc = acc + done
            prev = part
        done = warpgroup_mma_wait(num_outstanding=0, deps=(prev, ))
        acc = acc + done
        rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        gl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(gl.bfloat16))


@needs_gluon
def test_negative_control_in_flight_accumulator_copy_is_reported_serialised():
    compiled = fp8_gemm_sm90.compile_offline(DEFAULT, kernel=_carried_in_flight_kernel)
    assert fp8_gemm_sm90.ptxas_report(compiled)["serialised"]
