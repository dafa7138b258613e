"""The cuda backend's block-FP8 kernels (hal/kernels/fp8_gemm.py) under Triton's CPU interpreter.

Properties: the quantisation kernel gives the reference's bits (scales and fp8 values, e4m3 and e5m2)
on inputs full of rounding midpoints, -0, subnormals and all-zero groups; the GEMM gives the
reference's bits (under the interpreter the in-block partial is an exact fp64 dot rounded once, the
reference's choice: hal/kernels/fp8_gemm.py says why that is exact) at shapes that cross K blocks, N
tiles and M tiles; every tile configuration gives the same bits; a token's output does not depend on
its batch-mates; negative control: per-tensor dynamic scaling through the same kernel changes a
token's bits when a louder batch-mate joins. Interpreter bits are not GPU bits: the H200's fp8 MMA
accumulates differently, so on the GPU only the invariances are claimed (shown on the H200: docs/fp8.md).
"""

from __future__ import annotations

import pytest
import torch
from conftest import backend_for_tests
from test_fp8 import fp8_grid, quantised_layer, wide

from hal import fp8
from hal.contract import load_contract
from hal.errors import UnsupportedError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FP8 = load_contract("bf16-fp8-v1")
SPEC = FP8.fp8


@pytest.fixture(scope="module")
def cuda():
    backend_for_tests("cuda")          # the interpreter runs the kernels (conftest)
    from hal.api import create_backend

    return create_backend("cuda", FP8)


@pytest.fixture(scope="module")
def reference():
    from hal.api import create_backend

    return create_backend("reference", FP8)


def hard_groups(fmt: str, seed: int) -> torch.Tensor:
    """Rows of 128: the format's grid, its midpoints and their fp32 neighbours (the cast's hard cases),
    -0, random groups, an all-zero group and a tiny (subnormal-heavy) one."""
    grid = torch.tensor(fp8_grid(fmt))
    mids = (grid[1:] + grid[:-1]) / 2
    up, down = torch.tensor(float("inf")), torch.tensor(float("-inf"))
    hard = torch.cat([grid, mids, torch.nextafter(mids, up), torch.nextafter(mids, down), torch.tensor([-0.0])])
    hard = hard[: hard.numel() // 128 * 128].reshape(-1, 128)
    return torch.cat([hard, wide((5, 128), seed), torch.zeros(1, 128), wide((1, 128), seed + 1) * 1e-6])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_quantisation_kernel_gives_the_reference_bits(cuda, fmt):
    from hal.kernels import fp8_gemm

    x = hard_groups(fmt, 1)
    q, s = fp8_gemm.quantise(x.contiguous(), 128, fmt, SPEC)
    want_q, want_s = fp8.quantise_pieces(x, SPEC, fmt)
    assert torch.equal(s[:, 0], want_s)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))     # -0 and every midpoint included
    # activations: bf16 input, several groups per row
    xa = wide((3, 384), 2).bfloat16()
    q, s = fp8_gemm.quantise_activations(xa, SPEC)
    want_q, want_s = fp8.quantise_activations(xa, SPEC)
    assert torch.equal(s, want_s) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("m, n, k", [(1, 200, 128), (5, 200, 384), (33, 70, 640)])
def test_fp8_linear_gives_the_reference_bits(cuda, reference, m, n, k):
    x, wq, ws = quantised_layer(m, n, k, m + k)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(n)).bfloat16()
    assert torch.equal(cuda.fp8_linear(x, wq, ws, bias), reference.fp8_linear(x, wq, ws, bias))
    assert torch.equal(cuda.fp8_linear(x, wq, ws, out_dtype=torch.float32),
                       reference.fp8_linear(x, wq, ws, out_dtype=torch.float32))


def test_every_tile_configuration_gives_the_same_bits(cuda):
    from hal.kernels import fp8_gemm

    x, wq, ws = quantised_layer(19, 150, 256, 3)
    xq, xs = fp8_gemm.quantise_activations(x, SPEC)
    base = fp8_gemm.gemm(xq, xs, wq, ws, None, torch.float32, SPEC)
    for config in (dict(BLOCK_M=32, BLOCK_N=32), dict(BLOCK_M=16, BLOCK_N=128, GROUP_M=2),
                   dict(BLOCK_M=64, BLOCK_N=16)):
        assert torch.equal(fp8_gemm.gemm(xq, xs, wq, ws, None, torch.float32, SPEC, config), base), config


def test_every_fp8_autotuner_candidate_gives_the_same_bits(cuda):
    """The tuner's whole candidate set (``fp8_gemm.candidates``: tiles, GROUP_M, PAIR (two K blocks per
    loop step) and HALVES (a wide tile's columns as two MMAs)) at an odd and an even number of K blocks, M
    on both sides of the 64-row tile choice: every configuration gives the kernel's own bits (warps, stages and descriptor loads do nothing under the
    interpreter: bench/fp8_gpu.py checks the same list on the GPU). Negative control: the same block
    partials added in descending order give other bits, so the order PAIR keeps is what the equality needs."""
    from hal.kernels import fp8_gemm

    for m, n, k in ((70, 150, 384), (5, 150, 512)):
        x, wq, ws = quantised_layer(m, n, k, 40 + m)
        xq, xs = fp8_gemm.quantise_activations(x, SPEC)
        own = fp8_gemm.gemm(xq, xs, wq, ws, None, torch.float32, SPEC)
        configs = fp8_gemm.candidates(m, n, k, SPEC.activation_group, tma_ok=False)
        assert any(c["pair"] for c in configs) and any(not c["pair"] for c in configs)
        assert {c["BLOCK_M"] for c in configs} == ({64, 128} if m > 64 else {64})
        assert any(c["halves"] for c in configs) == (m > 64)
        distinct = {(c["BLOCK_M"], c["BLOCK_N"], c["GROUP_M"], c["pair"], c["halves"]): c for c in configs}
        for config in distinct.values():
            assert torch.equal(fp8_gemm.gemm(xq, xs, wq, ws, None, torch.float32, SPEC, config), own), config
    w_scale_cols = ws.repeat_interleave(SPEC.weight_block, 0)[:n]
    descending = torch.zeros(m, n)
    for block, (start, end) in reversed(list(enumerate(SPEC.group_ranges(k)))):
        partial = fp8.matmul_fp32(xq[:, start:end].float(), wq[:, start:end].float().T)
        descending = descending + partial * (xs[:, block, None] * w_scale_cols[None, :, block])
    assert not torch.equal(descending, own)


def test_fp8_gemm_takes_the_policys_launch_and_the_tuner_keeps_the_fastest(cuda, monkeypatch):
    """A launch policy's ``fp8_tiles`` (the tuning cache's choice on a GPU) replaces the kernel's own tiles;
    ``tune_fp8_gemm`` (stand-in timer) keeps the fastest candidate under the FP8 shape class, a key no bf16
    GEMM shares; a candidate that changes a bit stops the tuning with an error naming it."""
    from hal.errors import HalError
    from hal.kernels import fp8_gemm, tuning
    from hal.kernels.policy import LaunchPolicy

    x, wq, ws = quantised_layer(5, 150, 256, 3)
    xq, xs = fp8_gemm.quantise_activations(x, SPEC)
    seen = []
    real_launch = fp8_gemm.launch
    monkeypatch.setattr(fp8_gemm, "launch", lambda kernel, grid, *a, **kw: (seen.append((grid, kw)),
                                                                            real_launch(kernel, grid, *a, **kw)))

    class Tuned(LaunchPolicy):
        def fp8_tiles(self, m, n, k, spec, out_dtype):
            return dict(BLOCK_M=32, BLOCK_N=32, pair=True)
    own = fp8_gemm.gemm(xq, xs, wq, ws, None, torch.float32, SPEC, policy=LaunchPolicy())
    tuned = fp8_gemm.gemm(xq, xs, wq, ws, None, torch.float32, SPEC, policy=Tuned())
    assert torch.equal(tuned, own)
    assert (seen[0][1]["BLOCK_N"], seen[0][1]["PAIR"]) == (64, False)
    assert (seen[1][1]["BLOCK_M"], seen[1][1]["BLOCK_N"], seen[1][1]["PAIR"]) == (32, 32, True)
    assert seen[1][0] == (5,)                                   # ceil(5 / 32) x ceil(150 / 32) programs

    small = [(16, 64, 4, 1), (16, 128, 4, 1)]                   # interpreter-sized tiles through the same rules
    every = fp8_gemm.candidates
    monkeypatch.setattr(fp8_gemm, "candidates", lambda *a, **kw: every(*a, tiles=small, **kw))
    timings = iter(range(1000, 0, -1))                          # each timing faster than the one before
    cache = tuning.TuneCache("cpu (interpreter)", "x")
    tuning.tune_fp8_gemm([(5, 150, 256)], SPEC, device="cpu", cache=cache, timer=lambda fn: (fn(), next(timings))[1],
                         progress=None)
    key = tuning.fp8_shape_class(5, 150, 256, SPEC, torch.bfloat16)
    assert key != tuning.shape_class(5, 150, 256, torch.bfloat16, torch.bfloat16, SPEC.activation_group)
    configs = fp8_gemm.candidates(5, 150, 256, SPEC.activation_group, False)
    assert len(configs) == 4 and cache.config(key) == configs[-1] and cache.entries[key]["candidates"] == 4

    real_gemm = fp8_gemm.gemm

    def planted(*args, **kwargs):
        out = real_gemm(*args, **kwargs)
        config = args[7] if len(args) > 7 else kwargs.get("config")
        if config and config.get("pair"):
            out[0, 0] = -out[0, 0]                              # another bit pattern, even for a zero
        return out
    monkeypatch.setattr(fp8_gemm, "gemm", planted)
    with pytest.raises(HalError, match="FP8 GEMM .* gives other bits than the kernel's own"):
        tuning.tune_fp8_gemm([(5, 150, 256)], SPEC, device="cpu", cache=tuning.TuneCache("c", "x"),
                             timer=lambda fn: 1.0, progress=None)


def test_a_tokens_output_depends_on_that_token_alone_and_per_tensor_scaling_does_not(cuda):
    from hal.kernels import fp8_gemm

    x, wq, ws = quantised_layer(17, 130, 256, 4)
    x[4:] *= 64                                                    # louder batch-mates
    alone = cuda.fp8_linear(x[2:3], wq, ws)[0]
    assert torch.equal(cuda.fp8_linear(x, wq, ws)[2], alone)
    batch = torch.cat([torch.zeros(3, 256, dtype=x.dtype), x.flip(0)])  # zero padding rows, reversed
    assert torch.equal(cuda.fp8_linear(batch, wq, ws)[3 + 14], alone)

    def per_tensor(t):                                             # one scale from the batch's amax
        s = fp8.scale_of(t.float().abs().amax(), SPEC, "e4m3")
        xs = s.expand(t.shape[0], t.shape[1] // 128).contiguous()
        return fp8_gemm.gemm(fp8.quantise(t, s, SPEC, "e4m3"), xs, wq, ws, None, torch.bfloat16, SPEC)

    assert not torch.equal(per_tensor(x)[2], per_tensor(x[2:3])[0])


def test_cuda_refuses_fp8_without_the_section_and_checks_inputs(cuda):
    from hal.api import create_backend

    x, wq, ws = quantised_layer(2, 128, 256, 5)
    with pytest.raises(UnsupportedError, match=r"no \[fp8\] section"):
        create_backend("cuda", "bf16-dense-v1").fp8_linear(x, wq, ws)
    with pytest.raises(UnsupportedError, match="not a multiple of"):
        cuda.fp8_linear(x[:, :192], wq[:, :192], ws)


def test_fp8_model_on_the_cuda_kernels_training_equals_rollout(cuda):
    """A tiny block-FP8 model (tests/test_fp8_model.py's, head dim 64 for the attention kernels) on the
    cuda backend under the interpreter: the trainer's logprobs equal the rollout's bitwise, under a
    schedule that cuts prefills into chunks and mixes phases, and a packing of two sequences at most.
    Kept small (2 requests of 6 tokens, ~30 s interpreted); the negative control of the activation scale
    is the per-tensor test above (same kernel) and tests/test_fp8_model.py (the whole model)."""
    import dataclasses

    from test_fp8_model import rollout_and_train
    from test_rollout import PACKINGS, SCHEDULES

    from hal.model import DecoderLM, tiny_fp8_config
    from hal.rollout import Request

    model = DecoderLM.random(tiny_fp8_config("llama", "bfloat16"), seed=11, backend=cuda)
    requests = [Request((1, 2, 3, 4, 5, 6, 7), 6, seed=1), Request((7, 8, 9), 6, seed=2, temperature=0.7)]
    schedule = dataclasses.replace(SCHEDULES[2], preempt_prob=0.0)
    runs, stats, trains = rollout_and_train(model, requests, [schedule], PACKINGS[1:])
    assert stats[0].cut_prefills > 0 and stats[0].mixed_steps > 0
    assert sum(len(c.tokens) for c in runs[0]) == 12
    for c, lp in zip(runs[0], trains[0]):
        assert torch.equal(lp, c.logprobs), f"request {c.request}: train {lp} vs rollout {c.logprobs}"


def test_fp8_linear_is_refused_on_gpus_it_was_not_verified_on(monkeypatch):
    """On a GPU the FP8 kernels run only on the architectures where their bits were shown batch- and
    tile-invariant (bench/fp8_gpu.py on the H200: compute capability 9.0); another one is refused with
    the reason, the verified one passes the check (the control)."""
    import hal.backends.cuda as cuda_module

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    with pytest.raises(UnsupportedError, match="verified bitwise .* on compute capability 9.0 only, this GPU is 8.9"):
        cuda_module._check_fp8_architecture(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda_module._check_fp8_architecture(torch.device("cuda"))


def test_a_strided_bias_is_read_by_its_strides(cuda, reference):
    # A bias that is a view with stride 2 (every other element of a buffer): the kernels read the bias as
    # contiguous, so the backend must hand them a contiguous copy.
    x, wq, ws = quantised_layer(3, 200, 128, 7)
    buffer = torch.randn(400, generator=torch.Generator().manual_seed(3)).bfloat16()
    strided = buffer[::2]
    assert torch.equal(cuda.fp8_linear(x, wq, ws, strided), reference.fp8_linear(x, wq, ws, strided))
    # Negative control: the buffer's first 200 elements read as the bias give other bits.
    assert not torch.equal(cuda.fp8_linear(x, wq, ws, strided), cuda.fp8_linear(x, wq, ws, buffer[:200]))
