"""Tensor parallelism under the contract's [parallel]: the bits of one device at TP = 1, 2 and 4.

Single-process tests check the contract section and the backend pieces (a rank's K-chunk partials and
vocab-chunk stats, combined in ascending chunk order, equal the one-device ops bitwise). The rest runs
real process groups (torch.distributed gloo, one spawned process per rank, TP = 2 and TP = 4, once per
module): a row-parallel linear, vocab-parallel logprobs, and the sharded model in the rollout harness
and in the trainer's recomputation, each compared with TP = 1 (the unsharded model on one process),
including mixed layouts (rollout at TP = 4, trainer at TP = 1 and the reverse). Negative control: the
plain all-reduce of per-rank partial outputs gives different bits at each degree, on inputs where
fp32 addition order provably matters (independent of the host's BLAS: every K chunk holds one
non-zero product). A K shard that cuts a contract chunk is refused.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import random
from importlib import resources

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import backend_for_tests

from hal import contract as contract_module
from hal import parallel
from hal.backends.reference import ReferenceBackend
from hal.contract import load_contract, parse_contract
from hal.errors import ContractError, UnsupportedError
from hal.model import DecoderLM, tiny_config
from hal.model.parallel import ParallelDecoderLM, shard_config
from hal.parallel import TensorParallel
from hal.rollout import HarnessConfig, Request, RolloutHarness, recompute_logprobs

PARALLEL_TOML = parallel.PARALLEL_SECTION
DENSE_TEXT = resources.files("hal.contracts").joinpath("bf16-dense-v1.toml").read_text()
_parsed = parallel.contract_with_parallel("bf16-dense-v1", source="bf16-dense-v1 + [parallel] (tests)")
# Small chunks so that a tiny model's shards hold several of them at TP = 2 and whole ones at TP = 4.
CONTRACT = dataclasses.replace(_parsed, gemm=dataclasses.replace(_parsed.gemm, k_chunk=16),
                               logprobs=dataclasses.replace(_parsed.logprobs, vocab_chunk=16))
REF = ReferenceBackend(CONTRACT)

# 8 query / 4 KV heads of 16 (q_size 128), intermediate 128, vocab 128: at TP = 4 every rank holds
# K = 32 of o_proj and down_proj and 32 vocab rows (2 chunks each), at TP = 2 four chunks each.
MODELS = {"qwen3-bf16": tiny_config("qwen3", "bfloat16", num_heads=8, num_kv_heads=4),
          "qwen2-fp32": tiny_config("qwen2", "float32", num_heads=8, num_kv_heads=4)}
SCHEDULE = HarnessConfig(page_size=5, max_num_seqs=3, max_batch_tokens=12, max_chunk=5, preempt_prob=0.2, seed=1)
PACKING = dict(seed=1, max_batch_sequences=2, page_size=4)
DEGREES = (2, 4)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_requests() -> list[Request]:
    rng = random.Random(3)
    requests = [Request(tuple(rng.randrange(128) for _ in range(rng.randint(2, 9))), max_new_tokens=6,
                        seed=10 + i, temperature=t) for i, t in enumerate((1.0, 0.7, 1.0))]
    return requests + [Request((5, 6, 7), 6, seed=7, temperature=0.0)]


# ---------------------------------------------------------------------------------------------
# Inputs every rank draws alike (seeded), and the one-device results they must reproduce.
# ---------------------------------------------------------------------------------------------

def linear_inputs(dtype: torch.dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 128, generator=g).to(dtype)
    w = torch.randn(24, 128, generator=g).to(dtype)
    return x, w, torch.randn(24, generator=g).to(dtype)


def logits_inputs():
    g = torch.Generator().manual_seed(2)
    return torch.randn(5, 128, generator=g) * 3, torch.randint(0, 128, (5,), generator=g)


def order_sensitive_inputs():
    """x (2, 128), w (3, 128) fp32 whose 8 K chunks (of 16) each hold one non-zero product c_j (exact on any
    BLAS), c = (2^25, 1, -2^25, 1, 2^25, 1, -2^25, 1) (row 1: -c). Ascending, the contract's order:
    ((2^25 + 1) - 2^25) + 1 ... = 1. Summed per rank first, then across ranks: TP = 2 gives 1 + 1 = 2;
    TP = 4 gives rank sums (2^25, -2^25, 2^25, -2^25) (2^25 + 1 and -2^25 + 1 round to +-2^25), which
    every reduction tree adds to exactly 0."""
    c = torch.tensor([2.0 ** 25, 1.0, -2.0 ** 25, 1.0] * 2)
    x = torch.zeros(2, 128)
    x[0, ::16], x[1, ::16] = c, -c
    w = torch.zeros(3, 128)
    w[:, ::16] = 1.0
    return x, w


def plain_allreduce_linear(tp: TensorParallel, x_local, w_local):
    """The usual row-parallel linear (the negative control): each rank's fp32 partial output, then a
    SUM all-reduce, then one rounding. Its tree depends on the degree (and the transport)."""
    partial = REF.linear(x_local, w_local, out_dtype=torch.float32)
    dist.all_reduce(partial, op=dist.ReduceOp.SUM, group=tp.group)
    return partial.to(x_local.dtype)


def columns(t: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    size = t.shape[-1] // tp.world_size
    return t[..., tp.rank * size:(tp.rank + 1) * size]


# ---------------------------------------------------------------------------------------------
# The per-rank program (spawned), and the fixture that runs it at TP = 2 and 4.
# ---------------------------------------------------------------------------------------------

def _rank_program(tp: TensorParallel, tp1_completions: dict) -> dict:
    out: dict = {}
    for dtype in (torch.bfloat16, torch.float32):
        x, w, bias = linear_inputs(dtype)
        out[f"linear {dtype}"] = parallel.row_parallel_linear(REF, tp, columns(x, tp), columns(w, tp), bias)
        out[f"linear logits {dtype}"] = parallel.row_parallel_linear(REF, tp, columns(x, tp), columns(w, tp),
                                                                     out_dtype=torch.float32)
    logits, ids = logits_inputs()
    for t in (1.0, 0.7):
        out[f"logprobs T={t}"] = parallel.vocab_parallel_token_logprobs(REF, tp, columns(logits, tp), ids, t)
    x, w = order_sensitive_inputs()
    out["ordered on order-sensitive inputs"] = parallel.row_parallel_linear(REF, tp, columns(x, tp), columns(w, tp))
    out["all-reduce on order-sensitive inputs"] = plain_allreduce_linear(tp, columns(x, tp), columns(w, tp))
    # A K shard of 24 per rank cuts the chunks of 16: refused before any collective (on every rank).
    try:
        parallel.row_parallel_linear(REF, tp, torch.ones(2, 24), torch.ones(3, 24))
        out["misaligned"] = None
    except UnsupportedError as exc:
        out["misaligned"] = str(exc)
    requests = make_requests()
    for name, config in MODELS.items():
        model = DecoderLM.random(config, seed=11, backend=REF)
        shard = ParallelDecoderLM.from_full(model, tp)
        completions = RolloutHarness(shard, SCHEDULE).generate(requests)
        with torch.no_grad():
            out[f"{name} train own"] = recompute_logprobs(shard, completions, **PACKING)
            out[f"{name} train on tp1 rollout"] = recompute_logprobs(shard, tp1_completions[name], **PACKING)
        out[f"{name} rollout"] = completions
        try:
            shard.sequence_logprobs([[1, 2, 3]])
            out[f"{name} grad"] = None
        except UnsupportedError as exc:
            out[f"{name} grad"] = str(exc)
    return out


def _spawned(rank: int, world: int, init_file: str, out_dir: str, tp1_completions: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        result = _rank_program(TensorParallel.current(), tp1_completions)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def tp1_rollouts() -> dict:
    requests = make_requests()
    return {name: RolloutHarness(DecoderLM.random(config, seed=11, backend=REF), SCHEDULE).generate(requests)
            for name, config in MODELS.items()}


@pytest.fixture(scope="module")
def tp1():
    return tp1_rollouts()


@pytest.fixture(scope="module")
def runs(tp1, tmp_path_factory):
    """{degree: [rank 0's results, rank 1's, ...]}."""
    results = {}
    for world in DEGREES:
        out_dir = tmp_path_factory.mktemp(f"tp{world}")
        mp.spawn(_spawned, args=(world, str(out_dir / "init"), str(out_dir), tp1), nprocs=world, join=True)
        results[world] = [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]
    return results


def same(a, b) -> bool:
    """Bitwise equality of results (tensors, lists of them, completions)."""
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if hasattr(a, "tokens"):
        return a.tokens == b.tokens and same(a.logprobs, b.logprobs) and a.finish_reason == b.finish_reason
    return a == b


# ---------------------------------------------------------------------------------------------
# The contract section.
# ---------------------------------------------------------------------------------------------

def test_parallel_section_is_optional_and_leaves_shipped_fingerprints_alone(monkeypatch):
    assert _parsed.parallel is not None and "parallel" in _parsed.to_dict()
    assert _parsed.fingerprint != load_contract("bf16-dense-v1").fingerprint
    shipped = {name: load_contract(name) for name in contract_module.available_contracts()}
    assert all(c.parallel is None and "parallel" not in c.to_dict() for c in shipped.values())
    before = {name: c.fingerprint for name, c in shipped.items()}
    monkeypatch.setattr(contract_module, "SECTIONS",
                        {k: v for k, v in contract_module.SECTIONS.items() if k != "parallel"})
    assert {name: c.fingerprint for name, c in shipped.items()} == before


def test_parallel_section_values_are_validated():
    with pytest.raises(ContractError, match=r"\[parallel\]\.row_parallel"):
        parse_contract(DENSE_TEXT + PARALLEL_TOML.replace("gather_chunk_partials_ascending", "all_reduce_sum"))
    with pytest.raises(ContractError, match=r"\[parallel\]\.embedding"):
        parse_contract(DENSE_TEXT + PARALLEL_TOML.replace('embedding = "owner_row_copy"\n', ""))


def test_a_contract_without_parallel_is_refused_for_tensor_parallel_ops():
    plain = ReferenceBackend(load_contract())
    tp = TensorParallel(0, 1)
    with pytest.raises(UnsupportedError, match=r"no \[parallel\] section"):
        parallel.row_parallel_linear(plain, tp, torch.ones(2, 512), torch.ones(3, 512))


def test_shard_config_refuses_what_does_not_divide():
    with pytest.raises(UnsupportedError, match="num_kv_heads = 2 is not a multiple of 4"):
        shard_config(tiny_config("llama"), TensorParallel(0, 4))
    with pytest.raises(UnsupportedError, match="MoE"):
        shard_config(tiny_config("qwen3_moe"), TensorParallel(0, 2))


# ---------------------------------------------------------------------------------------------
# The backend pieces, one process: shards of whole chunks combined in ascending order = one device.
# ---------------------------------------------------------------------------------------------

def _combined(backend, x, w, bias, n, dtype):
    ks = x.shape[-1] // n
    parts = torch.cat([backend.linear_chunk_partials(x[:, r * ks:(r + 1) * ks], w[:, r * ks:(r + 1) * ks], r * ks)
                       for r in range(n)])
    return backend.combine_chunks(parts, bias, out_dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chunk_partials_combined_equal_linear_reference(dtype):
    x, w, bias = linear_inputs(dtype)
    for n in (1, 2, 4, 8):
        assert same(_combined(REF, x, w, bias, n, dtype), REF.linear(x, w, bias)), n
        assert same(_combined(REF, x, w, None, n, torch.float32), REF.linear(x, w, out_dtype=torch.float32)), n
    with pytest.raises(UnsupportedError, match="k_offset 8 is not a multiple"):
        REF.linear_chunk_partials(x[:, 8:24], w[:, 8:24], 8)


def test_chunk_partials_combined_equal_linear_cuda_interpreted():
    """The cuda backend's own pieces (the split-K launch's uncombined chunk sums, its combine kernel), its
    Triton GEMM interpreted on the CPU (k_chunk 256: the cuda backend realises multiples of 256), at M
    inside one 16-row tile and across two; the GPU run is bench/tp_overhead.py."""
    cuda = backend_for_tests("cuda")
    contract = dataclasses.replace(cuda.contract, gemm=dataclasses.replace(cuda.contract.gemm, k_chunk=256))
    cuda = type(cuda)(contract, cuda.device)
    g = torch.Generator().manual_seed(4)
    for dtype in (torch.bfloat16, torch.float32):
        for m in (3, 17):
            x, w = torch.randn(m, 1024, generator=g).to(dtype), torch.randn(70, 1024, generator=g).to(dtype)
            bias = torch.randn(70, generator=g).to(dtype)
            for n in (1, 2, 4):
                assert same(_combined(cuda, x, w, bias, n, dtype), cuda.linear(x, w, bias)), (dtype, m, n)
                assert same(_combined(cuda, x, w, None, n, torch.float32),
                            cuda.linear(x, w, out_dtype=torch.float32)), (dtype, m, n)


def _vocab_combined(backend, logits, ids, n, t):
    vs = logits.shape[1] // n
    shards = [logits[:, r * vs:(r + 1) * vs] for r in range(n)]
    row_max = torch.cat([backend.logprob_chunk_max(s, t, r * vs) for r, s in enumerate(shards)], -1).amax(-1)
    sums = torch.cat([backend.logprob_chunk_sums(s, row_max, t, r * vs) for r, s in enumerate(shards)], -1)
    return backend.logprob_combine(logits.gather(-1, ids.view(-1, 1)).squeeze(-1), row_max, sums, t)


def test_vocab_chunk_stats_combined_equal_token_logprobs():
    logits, ids = logits_inputs()
    for t in (1.0, 0.7):
        for n in (1, 2, 4, 8):
            assert same(_vocab_combined(REF, logits, ids, n, t), REF.token_logprobs(logits, ids, t)), (t, n)


def test_vocab_chunk_stats_combined_equal_token_logprobs_cuda_interpreted():
    """The cuda backend's pieces (its chunk-max kernel, a chunk-sums kernel with token_logprobs' tile, sum
    and warps, a combine kernel with its log) under Triton's interpreter, vocab_chunk 16 so that a
    128-wide row has 8 chunks: every shard count gives token_logprobs' bits. Not a GPU run."""
    cuda = backend_for_tests("cuda")
    contract = dataclasses.replace(cuda.contract, logprobs=dataclasses.replace(cuda.contract.logprobs, vocab_chunk=16))
    cuda = type(cuda)(contract, cuda.device)
    logits, ids = logits_inputs()
    for t in (1.0, 0.7):
        want = cuda.token_logprobs(logits, ids, t)
        for n in (1, 2, 4, 8):
            assert same(_vocab_combined(cuda, logits, ids, n, t), want), (t, n)
    with pytest.raises(UnsupportedError, match="vocab_offset 8 is not a multiple"):
        cuda.logprob_chunk_max(logits[:, 8:24], 1.0, 8)


# ---------------------------------------------------------------------------------------------
# Real process groups: TP = 2 and 4 against TP = 1.
# ---------------------------------------------------------------------------------------------

def test_every_rank_ends_with_the_same_bits(runs):
    for world, ranks in runs.items():
        for r, result in enumerate(ranks[1:], 1):
            for key, value in ranks[0].items():
                assert same(result[key], value), f"TP = {world}: rank {r} differs from rank 0 in {key!r}"


def test_row_parallel_linear_has_the_one_device_bits_at_every_degree(runs):
    for dtype in (torch.bfloat16, torch.float32):
        x, w, bias = linear_inputs(dtype)
        for world, ranks in runs.items():
            assert same(ranks[0][f"linear {dtype}"], REF.linear(x, w, bias)), (world, dtype)
            assert same(ranks[0][f"linear logits {dtype}"], REF.linear(x, w, out_dtype=torch.float32)), (world, dtype)


def test_vocab_parallel_logprobs_have_the_one_device_bits_at_every_degree(runs):
    logits, ids = logits_inputs()
    for t in (1.0, 0.7):
        for world, ranks in runs.items():
            assert same(ranks[0][f"logprobs T={t}"], REF.token_logprobs(logits, ids, t)), (world, t)


def test_negative_control_plain_all_reduce_changes_bits_with_the_degree(runs):
    x, w = order_sensitive_inputs()
    one_device = REF.linear(x, w)
    assert torch.equal(one_device, torch.tensor([[1.0] * 3, [-1.0] * 3]))
    plain = {world: ranks[0]["all-reduce on order-sensitive inputs"] for world, ranks in runs.items()}
    assert torch.equal(plain[2], 2 * one_device) and torch.equal(plain[4], torch.zeros(2, 3))
    for world, ranks in runs.items():   # the contract's order keeps the one-device bits on the same inputs
        assert same(ranks[0]["ordered on order-sensitive inputs"], one_device), world


def test_a_k_shard_that_cuts_a_chunk_is_refused(runs):
    for world, ranks in runs.items():
        message = ranks[0]["misaligned"]
        assert message is not None and "whole chunks of 16" in message and f"{24 * world} split over {world}" in message


@pytest.mark.parametrize("name", list(MODELS))
def test_sharded_rollout_and_trainer_have_the_one_device_bits(runs, tp1, name):
    reference = tp1[name]
    assert sum(len(c.tokens) for c in reference) >= 18
    with torch.no_grad():
        train_tp1 = recompute_logprobs(DecoderLM.random(MODELS[name], seed=11, backend=REF), reference, **PACKING)
    assert same(train_tp1, [c.logprobs for c in reference])                  # TP = 1: train == rollout
    for world, ranks in runs.items():
        result = ranks[0]
        assert same(result[f"{name} rollout"], reference), f"rollout at TP = {world} vs TP = 1"
        assert same(result[f"{name} train own"], [c.logprobs for c in reference]), f"trainer at TP = {world}"
        # mixed layouts: trainer TP = n on the TP = 1 rollout, and trainer TP = 1 on the TP = n rollout
        assert same(result[f"{name} train on tp1 rollout"], [c.logprobs for c in reference]), world
        with torch.no_grad():
            train = recompute_logprobs(DecoderLM.random(MODELS[name], seed=11, backend=REF),
                                       result[f"{name} rollout"], **PACKING)
        assert same(train, [c.logprobs for c in result[f"{name} rollout"]]), f"trainer TP = 1, rollout TP = {world}"
        assert "backward is not implemented" in result[f"{name} grad"]
