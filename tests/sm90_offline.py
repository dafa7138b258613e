"""Compiles the Gluon FP8 GEMM (hal/kernels/fp8_gemm_sm90.py) for sm_90 on a machine without a GPU and prints
what ptxas made of each case as JSON (one object: case -> ``fp8_gemm_sm90.ptxas_report``).

tests/test_fp8_sm90.py runs it as a subprocess: Gluon kernels must be compiled with Triton's interpreter off
(with TRITON_INTERPRET=1 Triton's own jit library functions, such as ``cdiv`` and ``zeros``, become interpreter
objects that Gluon's code generator cannot call), and the test session runs with it on.

Cases: every launch of ``fp8_gemm._SM90_TILES`` (the tuner's Gluon candidates, the warp-specialised kernel's
included) with a bias, and 128x128 with fp32 output; the one-block-at-a-time launches of both kernels (unroll 1,
negative controls: no wait for one outstanding group); and
``_carried_in_flight_kernel`` (a negative control: a partial carried in flight through a loop's back edge,
which ptxas must report as serialising the wgmmas).
"""

from __future__ import annotations

import json
import os
import sys

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("run with TRITON_INTERPRET unset: Gluon kernels are compiled, not interpreted")

from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait  # noqa: E402

from hal.kernels import fp8_gemm_sm90  # noqa: E402

DEFAULT = dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=4, unroll=3)


@gluon.jit
def _carried_in_flight_kernel(x_desc, w_desc, xs_ptr, ws_ptr, bias_ptr, out_ptr, M, N, K,
                              stride_xsm, stride_xsk, stride_wsn, stride_wsk, stride_om, stride_on,
                              GROUP: gl.constexpr, HAS_BIAS: gl.constexpr, OUT_BF16: gl.constexpr,
                              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr,
                              STAGES: gl.constexpr, UNROLL: gl.constexpr, num_warps: gl.constexpr):
    """The schedule the real kernel avoids: a partial still in flight carried through the loop's back edge
    (the loop-carried value becomes a register copy of in-flight accumulator registers). Same arguments as
    the real kernel, so ``compile_offline`` compiles it the same way."""
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


def main() -> int:
    from hal.kernels import fp8_gemm

    compile_ = fp8_gemm_sm90.compile_offline
    cases = {}
    for bm, bn, warps, stages, unroll, ws in fp8_gemm._SM90_TILES:     # every launch the tuner is offered
        cfg = dict(BLOCK_M=bm, BLOCK_N=bn, GROUP_M=8, num_warps=warps, num_stages=stages, unroll=unroll, ws=ws)
        cases[f"candidate {'ws ' if ws else ''}{bm}x{bn} w{warps} s{stages} u{unroll}"] = compile_(cfg, has_bias=True)
    cases["fp32 out"] = compile_(DEFAULT, out_bf16=False)
    cases["unroll 1"] = compile_(dict(DEFAULT, unroll=1))
    cases["ws unroll 1"] = compile_(dict(fp8_gemm._WS_DEFAULT, unroll=1))
    cases["carried in flight"] = compile_(DEFAULT, kernel=_carried_in_flight_kernel)
    print(json.dumps({name: fp8_gemm_sm90.ptxas_report(compiled) for name, compiled in cases.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
