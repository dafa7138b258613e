"""The Gluon block-FP8 GEMM for Hopper (hal/kernels/fp8_gemm_sm90.py), on a machine without a GPU.

Gluon kernels do not run under Triton's interpreter, so CI cannot execute this one; its bits are checked on a
Hopper GPU against the Triton kernel (bench/fp8_sm90_gpu.py, bench/fp8_gpu.py's tiles section). What CI does
check is what can break without a GPU:
  * it is offered only where it can run, and a launch that asks for it elsewhere is an error, never a
    silent fallback to the other kernel;
  * its schedule survives compilation: compiled for sm_90 here (tests/sm90_offline.py, in a subprocess with
    the interpreter off), for every launch the tuner is offered, the PTX waits for one outstanding wgmma
    group (a block's scaled add overlaps the next block's MMAs) and ptxas does not serialise the wgmmas
    (its C7514 warning, which a register copy of an in-flight accumulator triggers). Negative controls: the
    one-block-at-a-time launch (unroll 1) has no such wait, and a kernel that carries an in-flight
    accumulator through a loop's back edge is reported as serialised.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from hal.contract import load_contract
from hal.kernels import fp8_gemm, fp8_gemm_sm90

SPEC = load_contract("bf16-fp8-v1").fp8
DEFAULT = dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=4, unroll=3)

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


@pytest.fixture(scope="module")
def compiled_reports():
    """tests/sm90_offline.py's reports, compiled in a subprocess with the interpreter off (its docstring says
    why); its failure fails every test that uses it, with its output."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(__file__), "sm90_offline.py")
    done = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_warp_specialised_launch_shape_rule():
    ws = fp8_gemm._WS_DEFAULT
    assert fp8_gemm_sm90.config_ok(ws, 128) and fp8_gemm_sm90.config_ok(dict(ws, BLOCK_N=64), 128)
    assert not fp8_gemm_sm90.config_ok(dict(ws, BLOCK_M=64), 128)       # two math warpgroups of 64 rows
    assert not fp8_gemm_sm90.config_ok(dict(ws, num_warps=8), 128)      # the default partition is one of them
    assert fp8_gemm_sm90.config_ok(dict(ws, BLOCK_N=256, unroll=1), 128)   # two weight blocks, a half at a time
    assert not fp8_gemm_sm90.config_ok(dict(ws, BLOCK_N=512), 128)
    assert not fp8_gemm_sm90.config_ok(dict(fp8_gemm._WS_DEFAULT, ws=False, num_warps=8, BLOCK_N=256), 128)


def test_the_tuner_is_offered_the_warp_specialised_launches_only_with_descriptors_on_hopper():
    ws = [c for c in fp8_gemm.candidates(1024, 4096, 4096, 128, True, sm90=True) if c.get("ws")]
    assert len(ws) == sum(1 for t in fp8_gemm._SM90_TILES if t[-1])
    assert all(fp8_gemm_sm90.config_ok(c, 128) for c in ws)
    assert not any(c.get("sm90") for c in fp8_gemm.candidates(1024, 4096, 4096, 128, False, sm90=True))
    assert not any(c.get("sm90") for c in fp8_gemm.candidates(1024, 4096, 4096, 128, True, sm90=False))


@needs_gluon
def test_every_candidate_overlaps_and_is_not_serialised(compiled_reports):
    launches = [name for name in compiled_reports if name.startswith("candidate ") or name == "fp32 out"]
    assert len(launches) == len(fp8_gemm._SM90_TILES) + 1
    for name in launches:
        report = compiled_reports[name]
        if "x256 " not in name:   # the 256-column tile overlaps one warpgroup's adds with the other's MMAs only
            assert 1 in report["waits"], (name, report)  # a block's add runs while the next block's MMAs do
        assert not report["serialised"] and not report["injected_wait"], (name, report["ptxas_info"])
        if name.startswith("candidate ws "):             # the loader warp gives its registers to the math
            assert {24, fp8_gemm_sm90.WS_MATH_REGS} <= set(report["setmaxnreg"]), report
        # Spills are not asserted: they depend on the Triton release (CI's 3.9 spills 204 bytes at 128x128 with
        # three blocks a step, where the GPU image's 3.6 spills none); bench/sm90_report.py reports them for
        # the Triton it runs with, and the GPU benches time what they cost.


@needs_gluon
@pytest.mark.parametrize("name", ["unroll 1", "ws unroll 1"])
def test_negative_control_unroll_1_has_no_overlap(compiled_reports, name):
    report = compiled_reports[name]
    assert report["waits"] and 1 not in report["waits"], report


@needs_gluon
def test_negative_control_in_flight_accumulator_copy_is_reported_serialised(compiled_reports):
    assert compiled_reports["carried in flight"]["serialised"], compiled_reports["carried in flight"]
