"""The cuda backend's Triton kernels under Triton's CPU interpreter (TRITON_INTERPRET=1), for CI.

Interpreter bits are not GPU bits (numpy dot order, numpy exp): these tests check the kernels'
logic (masking, paging, ragged lengths, causal bounds, chunk and split boundaries) through
invariances within the backend and tolerances against the reference backend. The bitwise GPU
results are in bench/results/ (run on the H200 with bench/h200.sh).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import backend_for_tests
from hal.contract import load_contract

pytest.importorskip("triton")

CONTRACT = load_contract("bf16-dense-v1")


def _gemm_spec(k_chunk):
    return dataclasses.replace(CONTRACT.gemm, k_chunk=k_chunk)


def _attention_spec(kv_chunk, kv_split):
    return dataclasses.replace(CONTRACT.attention, kv_chunk=kv_chunk, kv_split=kv_split)


@pytest.fixture(scope="module")
def cuda():
    """The cuda backend with its kernels run by the interpreter (conftest.backend_for_tests)."""
    return backend_for_tests("cuda")


@pytest.fixture(scope="module")
def reference():
    from hal.api import create_backend

    return create_backend("reference")


def test_probe_reports_the_interpreter_as_emulated_and_automatic_selection_skips_it(cuda):
    from hal.api import resolve_backend_name

    probe = type(cuda).probe()
    assert probe.available and probe.details["emulated"] and "interpreter" in probe.device
    assert resolve_backend_name()[0] == "reference"


def test_gemm_launch_shapes_give_the_same_bits_and_match_the_reference(cuda, reference):
    from hal.backends.cuda.launch import CUDA_LAUNCH
    from hal.conformance.checks import random_tensor
    from hal.kernels import gemm

    g = torch.Generator().manual_seed(0)
    for dtype, (m, n, k) in ((torch.bfloat16, (5, 40, 1100)), (torch.float32, (17, 33, 600))):
        x = random_tensor((m, k), dtype, g, spread=4)
        w = random_tensor((n, k), dtype, g, spread=4, scale=k ** -0.5)
        b = random_tensor((n,), dtype, g)
        # BLOCK_K stays fixed here: the interpreter's dot adds a whole BLOCK_K-wide numpy product to
        # the accumulator, so unlike the GPU's MMA (k16 steps) its bits depend on BLOCK_K.
        outs = [gemm.linear(x, w, b, torch.float32, _gemm_spec(512), cfg, policy=CUDA_LAUNCH) for cfg in (
            dict(split=False), dict(split=True), dict(split=True, chunks_per_program=2),
            dict(BLOCK_M=32, BLOCK_N=16, split=False))]
        assert all(torch.equal(outs[0], o) for o in outs[1:]), "launch shape changed the bits"
        other_chunk = gemm.linear(x, w, b, torch.float32, _gemm_spec(256), dict(split=False), policy=CUDA_LAUNCH)
        assert not torch.equal(outs[0], other_chunk), "k_chunk does not reach the kernel"
        ref = reference.linear(x, w, b, out_dtype=torch.float32)
        magnitude = x.double().abs() @ w.double().abs().T + b.double().abs()
        assert bool(((outs[0].double() - ref.double()).abs() <= 2 ** -18 * magnitude).all())


def test_a_strided_bias_is_read_by_its_strides(cuda, reference):
    # A bias that is a view with stride 2: the GEMM and combine kernels read the bias as contiguous, so the
    # backend must hand them a contiguous copy (a strided view was misread before 2026-12-07).
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(3, 1100, generator=g).bfloat16(), torch.randn(64, 1100, generator=g).bfloat16()
    buffer = torch.randn(128, generator=g).bfloat16()
    strided = buffer[::2]
    assert torch.equal(cuda.linear(x, w, strided), cuda.linear(x, w, strided.contiguous()))
    torch.testing.assert_close(cuda.linear(x, w, strided).float(), reference.linear(x, w, strided).float(),
                               rtol=0.02, atol=0.05)
    parts = cuda.linear_chunk_partials(x, w)         # 3 chunks of the contract's 512 columns
    assert torch.equal(cuda.combine_chunks(parts, strided, out_dtype=torch.bfloat16),
                       cuda.combine_chunks(parts, strided.contiguous(), out_dtype=torch.bfloat16))
    # Negative control: the buffer's first 64 elements read as the bias give other bits.
    assert not torch.equal(cuda.linear(x, w, strided), cuda.linear(x, w, buffer[:64]))


@pytest.mark.parametrize("width", [64, 1100])             # the many-rows kernel (q/k norms) and the one-row kernel
def test_a_strided_norm_weight_is_read_by_its_strides(cuda, width):
    g = torch.Generator().manual_seed(width)
    x, buffer = torch.randn(3, width, generator=g).bfloat16(), torch.randn(2 * width, generator=g).bfloat16()
    strided = buffer[::2]
    assert torch.equal(cuda.rms_norm(x, strided, 1e-6), cuda.rms_norm(x, strided.contiguous(), 1e-6))
    assert not torch.equal(cuda.rms_norm(x, strided, 1e-6), cuda.rms_norm(x, buffer[:width], 1e-6))  # control


def test_strided_attention_metadata_is_read_by_its_strides(cuda):
    # seq_lens, query_start_loc and the block table as strided views (every other element of a buffer, 999
    # between them): the kernel reads metadata as consecutive int32, so the backend must hand it such a copy.
    # Before 2026-12-07 a strided seq_lens or query_start_loc sent the kernel past its pages (a crash or a hang
    # under the interpreter).
    from hal.backend import AttentionMetadata

    g = torch.Generator().manual_seed(21)
    page, d = 16, 64
    k, v = (torch.randn(20, page, 2, d, generator=g).bfloat16() for _ in range(2))
    q = torch.randn(3, 4, d, generator=g).bfloat16()
    block_table = torch.arange(15, dtype=torch.int32).view(3, 5)
    starts, seq_lens = torch.tensor([0, 1, 2, 3], dtype=torch.int32), torch.tensor([40, 75, 23], dtype=torch.int32)

    def strided(t):
        buffer = torch.full((*t.shape[:-1], 2 * t.shape[-1]), 999, dtype=t.dtype)
        buffer[..., ::2] = t
        return buffer[..., ::2]

    want = cuda.attention(q, k, v, AttentionMetadata(starts, seq_lens, block_table), scale=0.125)
    for meta in (AttentionMetadata(strided(starts), seq_lens, block_table),
                 AttentionMetadata(starts, strided(seq_lens), block_table),
                 AttentionMetadata(starts, seq_lens, strided(block_table))):
        assert torch.equal(cuda.attention(q, k, v, meta, scale=0.125), want)
    # Negative control: other pages in the block table give other bits (the check sees what the table names).
    assert not torch.equal(cuda.attention(q, k, v, AttentionMetadata(starts, seq_lens, block_table.flip(0)),
                                          scale=0.125), want)


@pytest.mark.parametrize("page_size", [16, 5])
def test_attention_across_kv_chunks_and_splits(cuda, reference, page_size):
    """One sequence of 530 keys (crossing kv_chunk 64 and kv_split 512) with batch-mates: the
    in-kernel and the parallel split-KV paths, several query-tile sizes, prefill vs decode."""
    from hal.backends.cuda.launch import CUDA_LAUNCH
    from hal.conformance.checks import AttentionCase, run_schedule
    from hal.kernels import attention

    spec = cuda.contract.attention
    case = AttentionCase(530, 2, 1, 64, torch.bfloat16, seed=3)
    full = run_schedule(cuda, case, [530], page_size)
    decode = run_schedule(cuda, case, [508] + [1] * 22, page_size, mates=1, seed=5)
    assert torch.equal(full, decode), "decode across the split boundary differs from prefill"
    ref = run_schedule(reference, case, [530], page_size)
    assert bool(((full.float() - ref.float()).abs() <= 2 ** -6 * (1 + ref.float().abs())).all())

    q, k, v = case.tensors()
    from hal.kvcache import build_metadata

    pages = -(-530 // page_size)
    k_cache = k.new_zeros(pages, page_size, 1, 64).flatten(0, 1)
    v_cache = v.new_zeros(pages, page_size, 1, 64).flatten(0, 1)
    k_cache[:530], v_cache[:530] = k, v
    k_cache, v_cache = k_cache.view(pages, page_size, 1, 64), v_cache.view(pages, page_size, 1, 64)
    meta = build_metadata([40], [530], [list(range(pages))])
    args = (q[-40:].contiguous(), k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_table,
            64 ** -0.5, spec)
    # Launch shapes: split-KV parallelism (one or both splits per program), query tiles, one program
    # per query head of the GQA group (head_split=2) and the program numbering.
    launches = [dict(split_parallel=sp, block_q=bq, head_split=hs, heads_fastest=hf, splits_per_program=g)
                for sp, bq, hs, hf, g in ((False, 32, 1, False, 1), (True, 32, 1, False, 1), (False, 8, 1, True, 1),
                                          (True, 1, 1, False, 1), (True, 4, 2, True, 1), (False, 16, 2, False, 1),
                                          (True, 8, 2, False, 2), (True, 1, 1, True, 3))]
    outs = [attention.paged_attention(*args, policy=CUDA_LAUNCH, **launch) for launch in launches]
    assert all(torch.equal(outs[0], o) for o in outs[1:]), "a launch shape changed the bits"
    assert torch.equal(outs[0], full[-40:])
    # Negative control: the contract's split size does reach the bits of these rows.
    half_split = dataclasses.replace(spec, kv_split=spec.kv_split // 2)
    other_split = attention.paged_attention(*args[:-1], half_split, policy=CUDA_LAUNCH, **launches[0])
    assert not torch.equal(outs[0], other_split), "kv_split does not reach the kernel"
    with pytest.raises(ValueError, match="head_split"):
        attention.paged_attention(*args, policy=CUDA_LAUNCH, head_split=4)  # a group of 2 query heads cannot be cut in 4
    with pytest.raises(ValueError, match="splits_per_program"):
        attention.paged_attention(*args, policy=CUDA_LAUNCH, split_parallel=True, splits_per_program=-1)


def test_cache_memory_order_is_free_and_a_misread_order_is_caught(cuda, reference):
    """The same keys in an NHD cache (vLLM's order) and an HND cache (one head's page contiguous):
    write_kv and attention go through the strides, so both backends give the same bits in both
    orders. Negative control: HND memory read as if it were NHD gives other bits."""
    from hal.conformance.checks import random_tensor
    from hal.errors import HalError, UnsupportedError
    from hal.kvcache import PagedKVCache, build_metadata, cache_tensor, slot_mapping

    g = torch.Generator().manual_seed(4)
    seq_lens, q_lens, page, hkv, d = [150, 70], [1, 3], 16, 2, 64
    page_lists = [[9, 2, 5, 0, 7, 11, 3, 1, 12, 4], [6, 8, 10, 13, 14]]
    k = [random_tensor((n, hkv, d), torch.bfloat16, g) for n in seq_lens]
    v = [random_tensor((n, hkv, d), torch.bfloat16, g) for n in seq_lens]
    q = random_tensor((sum(q_lens), 2 * hkv, d), torch.bfloat16, g)
    meta = build_metadata(q_lens, seq_lens, page_lists)
    outs = {}
    for layout in ("NHD", "HND"):
        cache = PagedKVCache.allocate(15, page, hkv, d, torch.bfloat16, layout=layout)
        assert cache.k.shape == (15, page, hkv, d)
        assert cache.k.is_contiguous() == (layout == "NHD")
        for b in range(2):
            cuda.write_kv(k[b], v[b], cache.k, cache.v, slot_mapping(page_lists[b], range(seq_lens[b]), page))
        outs[layout] = {name: be.attention(q, cache.k, cache.v, meta, scale=d ** -0.5)
                        for name, be in (("cuda", cuda), ("reference", reference))}
        if layout == "HND":  # its memory, unwritten slots zeroed, viewed as if it were NHD
            misread = [t.permute(0, 2, 1, 3).nan_to_num(0.0).contiguous().view(15, page, hkv, d)
                       for t in (cache.k, cache.v)]
    for name in ("cuda", "reference"):
        assert torch.equal(outs["NHD"][name], outs["HND"][name]), f"{name}: the cache's memory order changed the bits"
    wrong = cuda.attention(q, *misread, meta, scale=d ** -0.5)
    assert bool(wrong.isfinite().all()) and not torch.equal(wrong, outs["HND"]["cuda"])
    with pytest.raises(UnsupportedError, match="contiguous"):
        cuda.attention(q, misread[0].transpose(2, 3).contiguous().transpose(2, 3), misread[1], meta, scale=d ** -0.5)
    with pytest.raises(HalError, match="layout"):
        cache_tensor(1, 16, 2, 64, torch.bfloat16, layout="HDN")


def test_attention_finds_each_tile_sequence_on_the_device(cuda, reference):
    """No host metadata: each program finds its sequence in query_start_loc. 130 ragged sequences
    (more than one 128-wide scan step), some without queries; a sequence's rows must be the same
    alone as in the batch, in-kernel or with parallel splits."""
    from hal.backends.cuda.launch import CUDA_LAUNCH
    from hal.kernels import attention
    from hal.kvcache import build_metadata

    g = torch.Generator().manual_seed(1)
    n, page, heads, d = 130, 8, (2, 1), 64
    seq_lens = torch.randint(1, 40, (n,), generator=g).tolist()
    q_lens = [0 if b % 7 == 3 else min(s, 1 + b % 3) for b, s in enumerate(seq_lens)]
    page_lists, at = [], 0
    for s in seq_lens:
        page_lists.append(list(range(at, at + -(-s // page))))
        at += -(-s // page)
    k = torch.randn(at, page, heads[1], d, generator=g).to(torch.bfloat16)
    v = torch.randn(at, page, heads[1], d, generator=g).to(torch.bfloat16)
    q = torch.randn(sum(q_lens), heads[0], d, generator=g).to(torch.bfloat16)
    meta = build_metadata(q_lens, seq_lens, page_lists)
    batch = cuda.attention(q, k, v, meta, scale=d ** -0.5)
    # 16-key chunks and 32-key splits: several splits per sequence at these lengths
    chunks_16_splits_32 = _attention_spec(16, 32)
    parallel = attention.paged_attention(q, k, v, meta.query_start_loc, meta.seq_lens, meta.block_table, d ** -0.5,
                                         chunks_16_splits_32, policy=CUDA_LAUNCH, split_parallel=True)
    per_head = attention.paged_attention(q, k, v, meta.query_start_loc, meta.seq_lens, meta.block_table, d ** -0.5,
                                         chunks_16_splits_32, policy=CUDA_LAUNCH, split_parallel=True, head_split=2,
                                         heads_fastest=True)
    assert torch.equal(parallel, per_head), "one program per query head changed the bits"
    # 16-key splits (up to 3 per sequence): programs of 1, 2 or 3 consecutive splits, and the in-kernel walk,
    # on the first 24 sequences (the scan across 128 is the whole batch's; this is about the splits)
    starts = meta.query_start_loc.tolist()
    few = build_metadata(q_lens[:24], seq_lens[:24], page_lists[:24])
    few_rows = slice(0, starts[24])
    by_split = [attention.paged_attention(q[few_rows], k, v, few.query_start_loc, few.seq_lens, few.block_table,
                                          d ** -0.5, _attention_spec(16, 16), policy=CUDA_LAUNCH, split_parallel=sp,
                                          splits_per_program=g)
                for sp, g in ((True, 1), (True, 2), (True, 3), (False, 1))]
    assert all(torch.equal(by_split[0], o) for o in by_split[1:]), "splits per program changed the bits"
    assert not torch.equal(by_split[0], parallel[few_rows]), "kv_split does not reach the kernel"  # negative control
    for b in (0, 1, 2, 64, 127, 128, 129):
        alone = build_metadata([q_lens[b]], [seq_lens[b]], [page_lists[b]])
        rows = slice(starts[b], starts[b + 1])
        assert torch.equal(cuda.attention(q[rows], k, v, alone, scale=d ** -0.5), batch[rows]), b
        serial = attention.paged_attention(q[rows], k, v, alone.query_start_loc, alone.seq_lens, alone.block_table,
                                           d ** -0.5, chunks_16_splits_32, policy=CUDA_LAUNCH, split_parallel=False)
        assert torch.equal(serial, parallel[rows]), b
    ref = reference.attention(q, k, v, meta, scale=d ** -0.5)
    assert bool(((batch.float() - ref.float()).abs() <= 2 ** -6 * (1 + ref.float().abs())).all())


HOPPER_SHARED_BYTES = 227 * 1024  # per block, sm_90


def _launch_problems(cfg: dict, k_chunk: int, tma_allowed: bool) -> list[str]:
    """What would make a GEMM launch shape fail on an H100/H200 or break the contract."""
    problems = []
    if k_chunk % cfg["BLOCK_K"]:
        problems.append(f"BLOCK_K {cfg['BLOCK_K']} does not divide k_chunk {k_chunk}")
    if cfg["tma"] and not tma_allowed:
        problems.append("descriptor loads for operands that cannot have them")
    for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
        if cfg[name] & (cfg[name] - 1):
            problems.append(f"{name} {cfg[name]} is not a power of two")
    if cfg["tma"]:
        if max(cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]) > 256:
            problems.append("a descriptor box dimension above 256")
        # descriptor loads keep num_stages (BLOCK_M + BLOCK_N) x BLOCK_K bf16 tiles in shared memory
        shared = cfg["num_stages"] * (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * cfg["BLOCK_K"] * 2
        if shared > HOPPER_SHARED_BYTES:
            problems.append(f"{shared} bytes of shared memory")
    return problems


def test_gpu_gemm_launch_shapes_fit_hopper_and_the_contract(monkeypatch):
    """The GPU branch of gemm._config (not run by the interpreter): every shape class, with and
    without descriptor loads. A launch shape that breaks these fails on the GPU at compile time
    or changes the K chunking; the checker itself must flag a bad shape (negative control)."""
    from hal.kernels import gemm

    monkeypatch.setattr(gemm, "INTERPRET", False)
    seen = 0
    for m in (1, 16, 17, 32, 33, 64, 65, 128, 256, 257, 1024, 8192):
        for n, k in ((40, 1100), (4096, 4096), (14336, 4096), (4096, 14336), (152064, 4096)):
            for tma in (True, False):
                for sms in (78, 132):
                    cfg = gemm._config(m, n, k, _gemm_spec(512), tma=tma, sms=sms)
                    assert _launch_problems(cfg, 512, tma) == [], (m, n, k, tma, cfg)
                    seen += 1
    assert seen == 12 * 5 * 2 * 2
    bad = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=96, tma=True, num_stages=5)
    assert len(_launch_problems(bad, 512, tma_allowed=False)) == 4


def test_masked_nan_keys_contribute_nothing_on_every_launch_path(cuda):
    """[attention].mask through the split paths: 20 query tokens at positions 180..199 of 200 keys
    (chunks of 64, splits of 128, pages of 48: the last page part-filled, one spare page). NaN/Inf
    in V of key 190 (head dims 0..11 only) and in the slots past seq_len: queries before 190 keep the
    clean bits on the in-kernel split walk and on parallel splits + merge, unmasked (below-diagonal)
    chunks included; queries from 190 on are non-finite in exactly dims 0..11 and keep the clean bits
    in the others (an output element is poisoned by the V entries of its own column only). Every launch
    gives the clean bits on the clean caches: 64-row tiles (block_q 32 of a group of 2; nested and flat
    loop) take the masked chunk's finite-V fast path there (``_chunk``), 16-row tiles always the repair;
    planted, the 64-row tile's chunk 128..191 falls back to the repair (its V holds the NaN)."""
    from hal.backends.cuda.launch import CUDA_LAUNCH
    from hal.conformance.checks import random_tensor
    from hal.kernels import attention
    from hal.kvcache import build_metadata

    g = torch.Generator().manual_seed(11)
    page, seq_len, q_len, bad = 48, 200, 20, 190
    pages = [4, 1, 3, 0, 2]                                        # 5 pages of 48: 40 slots past seq_len
    k_cache = random_tensor((6, page, 1, 64), torch.bfloat16, g)
    v_cache = random_tensor((6, page, 1, 64), torch.bfloat16, g)
    q = random_tensor((q_len, 2, 64), torch.bfloat16, g)
    meta = build_metadata([q_len], [seq_len], [pages + [5]])       # page 5: in the table, never written
    launches = [dict(split_parallel=False, block_q=8), dict(split_parallel=True, block_q=8),
                dict(split_parallel=True, block_q=4, splits_per_program=2),
                dict(split_parallel=False, block_q=32, nested_splits=True),
                dict(split_parallel=False, block_q=32, nested_splits=False)]

    def run(k, v, launch):
        return attention.paged_attention(q, k, v, meta.query_start_loc, meta.seq_lens, meta.block_table,
                                         64 ** -0.5, _attention_spec(64, 128), policy=CUDA_LAUNCH, **launch)

    clean = run(k_cache, v_cache, launches[0])
    k, v = k_cache.clone(), v_cache.clone()
    v[pages[bad // page], bad % page, 0, :7] = float("nan")
    v[pages[bad // page], bad % page, 0, 7:12] = float("inf")
    last = pages[(seq_len - 1) // page]
    k[last, seq_len % page:], v[last, seq_len % page:] = float("nan"), float("-inf")
    k[5], v[5] = float("inf"), float("nan")
    first_seeing = bad - (seq_len - q_len)
    for launch in launches:
        assert torch.equal(run(k_cache, v_cache, launch), clean), launch
        planted = run(k, v, launch)
        assert torch.equal(planted[:first_seeing], clean[:first_seeing]), launch
        assert not torch.isfinite(planted[first_seeing:, :, :12].float()).any(), launch
        assert torch.equal(planted[first_seeing:, :, 12:], clean[first_seeing:, :, 12:]), launch


@pytest.mark.parametrize("page_size", [16, 5])
def test_write_kv_kernel_stores_what_the_indexed_copy_stores_and_skips_padding(cuda, reference, page_size):
    """The write_kv kernel (hal/kernels/kv_write.py: the cuda backend's, no host synchronisation) into
    vLLM's layout (K and V side by
    side per head: strided views of one buffer), scrambled slots, padding tokens at -1: the caches equal
    the default indexed copy's bit for bit and padding slots keep their old contents. A slot past the
    cache is refused. Negative control: other slots give other caches."""
    from hal.errors import UnsupportedError
    from hal.kernels import kv_write

    g = torch.Generator().manual_seed(4)
    pages, heads, d, tokens = 12, 2, 64, 40
    slots = torch.randperm(pages * page_size, generator=g)[:tokens]
    slots[::9] = -1                                           # vLLM's padding tokens
    k = torch.randn(tokens, heads, d, generator=g).to(torch.bfloat16)
    v = torch.randn(tokens, heads, d, generator=g).to(torch.bfloat16)
    start = torch.randn(pages, heads, page_size, 2 * d, generator=g).to(torch.bfloat16)

    def written(write, slot_mapping):
        cache = start.clone()
        # vLLM's cache (pages, Hkv, P, 2D) as the HAL's (pages, P, Hkv, D) views (hal.vllm.attention.hal_cache_views)
        k_cache, v_cache = cache[..., :d].transpose(1, 2), cache[..., d:].transpose(1, 2)
        write(k, v, k_cache, v_cache, slot_mapping)
        return cache

    kernel, indexed = written(kv_write.write_kv, slots), written(reference.write_kv, slots)
    assert torch.equal(kernel, indexed)
    assert torch.equal(written(cuda.write_kv, slots), kernel)        # the backend's write_kv is this kernel
    untouched = torch.ones(pages * page_size, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    as_slots = kernel.transpose(1, 2).reshape(pages * page_size, heads, 2 * d)
    assert torch.equal(as_slots[untouched], start.transpose(1, 2).reshape(pages * page_size, heads, 2 * d)[untouched])
    assert not torch.equal(written(kv_write.write_kv, torch.roll(slots, 1)), kernel)         # negative control
    with pytest.raises(UnsupportedError, match="outside the caches"):
        written(kv_write.write_kv, torch.full((tokens,), pages * page_size))


def test_sampling_kernel_picks_the_torch_samplers_tokens(cuda):
    """The fused sampling kernel (hal/kernels/sampling.py, what sample_rows runs on a CUDA GPU) picks
    the torch sampler's token for every row: temperatures 0 (greedy), 0.7, 1, 1.3, a vocabulary that
    is not a multiple of the kernel's block and crosses several blocks, a row of ties (the lowest id)
    and a row whose maximum repeats across two blocks (the first). Negative control: other positions'
    keys pick other tokens. (On the H200: bench/sampler_check.py, bitwise against sample_rows_torch.)"""
    from hal.kernels import sampling
    from hal.rollout import sampler

    g = torch.Generator().manual_seed(6)
    rows, vocab = 12, 2 * sampling.BLOCK + 357
    logits = torch.randn(rows, vocab, generator=g) * 3
    logits[3] = 0.0                                             # every id ties
    logits[5, 7] = logits[5, sampling.BLOCK + 7] = 1e4          # the same maximum in two blocks
    seeds = torch.randint(0, 2**62, (rows,), generator=g).tolist()
    positions = torch.randint(0, 5000, (rows,), generator=g).tolist()
    temperatures = [(0.0, 0.7, 1.0, 1.3)[i % 4] for i in range(rows)]
    temperatures[3] = temperatures[5] = 0.0                    # greedy: the lowest id, the first block

    def kernel(pos):
        keys = torch.tensor([sampler.position_seed(s, p) for s, p in zip(seeds, pos)], dtype=torch.int64)
        return sampling.sample(logits, keys, torch.tensor(temperatures, dtype=torch.float64)).tolist()

    expected = sampler.sample_rows_torch(logits, seeds, positions, temperatures).tolist()
    assert kernel(positions) == expected
    assert expected[3] == 0 and expected[5] == 7
    shifted = kernel([p + 1 for p in positions])
    sampled = [i for i, t in enumerate(temperatures) if t > 0 and i != 3]
    assert sum(shifted[i] != expected[i] for i in sampled) > len(sampled) // 2


@pytest.mark.parametrize("split_parallel", [True, False])
def test_attention_rows_no_sequence_owns_change_nothing(cuda, split_parallel):
    """vLLM's full CUDA graphs pad a decode batch to the captured size: padding requests with no queries
    (seq_len 0) and q rows past query_start_loc[-1] that no sequence owns. The owned rows' outputs are
    bitwise those of the unpadded call, in-kernel and with parallel splits (whose merge reads no partial
    for an unowned row and writes 0 there). Negative control: another query changes its row."""
    from hal.backends.cuda.launch import CUDA_LAUNCH
    from hal.kernels import attention
    from hal.kvcache import build_metadata

    g = torch.Generator().manual_seed(8)
    page, d, seq_lens = 16, 64, [40, 75, 23]
    pages = [list(range(i * 5, i * 5 + -(-s // page))) for i, s in enumerate(seq_lens)]
    k = torch.randn(16, page, 1, d, generator=g).to(torch.bfloat16)
    v = torch.randn(16, page, 1, d, generator=g).to(torch.bfloat16)
    q = torch.randn(3, 2, d, generator=g).to(torch.bfloat16)
    spec = _attention_spec(16, 32)

    def run(q, meta):
        return attention.paged_attention(q, k, v, meta.query_start_loc, meta.seq_lens, meta.block_table, d ** -0.5,
                                         spec, policy=CUDA_LAUNCH, split_parallel=split_parallel)

    plain = run(q, build_metadata([1, 1, 1], seq_lens, pages))
    padded_q = torch.cat([q, torch.randn(5, 2, d, generator=g).to(torch.bfloat16)])
    padded = run(padded_q, build_metadata([1, 1, 1, 0, 0], seq_lens + [0, 0], pages + [[0], [0]]))
    assert torch.equal(padded[:3], plain)
    if split_parallel:
        assert not padded[3:].any()
    other = q.clone()
    other[1] = -other[1]
    assert not torch.equal(run(other, build_metadata([1, 1, 1], seq_lens, pages))[1], plain[1])


def test_every_autotuner_candidate_gives_the_same_gemm_bits(cuda):
    """The autotuner's whole candidate set (hal/kernels/gemm.py ``candidates``: tiles, warps, stages,
    split-K) for shapes crossing K-chunk boundaries, bf16 and fp32, small and larger M: every configuration
    gives the bits of the kernel's own. Negative control: another k_chunk gives other bits."""
    from hal.backends.cuda.launch import CUDA_LAUNCH
    from hal.conformance.checks import random_tensor
    from hal.kernels import gemm

    g = torch.Generator().manual_seed(12)
    spec = _gemm_spec(512)
    for dtype, (m, n, k) in ((torch.bfloat16, (3, 40, 1100)), (torch.float32, (70, 33, 600))):
        x = random_tensor((m, k), dtype, g, spread=4)
        w = random_tensor((n, k), dtype, g, spread=4)
        own = gemm.linear(x, w, None, torch.float32, spec, policy=CUDA_LAUNCH)
        configs = gemm.candidates(m, n, k, spec, tma_ok=False)
        assert len(configs) >= 8 and any(c["split"] for c in configs) == (m <= 64)
        # BLOCK_K held at the interpreter's 128: its dot adds a whole BLOCK_K-wide numpy product, so unlike
        # the GPU's MMA its bits depend on BLOCK_K (the GPU check of the whole set: bench/tile_freedom.py)
        for config in {tuple(sorted(dict(c, BLOCK_K=128).items())): dict(c, BLOCK_K=128) for c in configs}.values():
            out = gemm.linear(x, w, None, torch.float32, spec, config, policy=CUDA_LAUNCH)
            assert torch.equal(out, own), config
        assert not torch.equal(gemm.linear(x, w, None, torch.float32, _gemm_spec(256), policy=CUDA_LAUNCH), own)


def test_tuner_keeps_the_fastest_bit_equal_candidate_and_refuses_one_that_changes_bits(cuda, tmp_path, monkeypatch):
    """``tune_gemm`` (here under the interpreter, with a stand-in timer): the cache holds the fastest
    candidate per shape class, survives a save and load, and is what the lookup returns for every M of the
    class; a candidate whose output differs stops tuning with an error naming it."""
    from hal.errors import HalError
    from hal.kernels import gemm, tuning

    spec = _gemm_spec(512)
    # the candidates at the interpreter's BLOCK_K (see the test above)
    every = gemm.candidates
    monkeypatch.setattr(gemm, "candidates", lambda *a: [dict(c, BLOCK_K=128) for c in every(*a)])
    timings = iter(range(1000, 0, -1))                      # each timing faster than the one before
    cache = tuning.TuneCache("cpu (interpreter)", "x")
    tuning.tune_gemm([(5, 24, 600)], spec, dtype=torch.float32, device="cpu", cache=cache,
                     timer=lambda fn: (fn(), next(timings))[1], progress=None)
    key = tuning.shape_class(5, 24, 600, torch.float32, torch.float32, 512)
    assert key == tuning.shape_class(8, 24, 600, torch.float32, torch.float32, 512)      # M 5..8: one class
    last = gemm.candidates(5, 24, 600, spec, False)[-1]                          # timed fastest
    assert cache.config(key) == last and cache.entries[key]["candidates"] == len(gemm.candidates(5, 24, 600, spec, False))
    assert cache.entries[key]["ms"] < cache.entries[key]["default_ms"]
    path = tmp_path / "tune.json"
    cache.save(path)
    monkeypatch.setenv("HAL_TUNE_CACHE", str(path))
    tuning.runtime_cache.cache_clear()
    assert tuning.runtime_cache("cpu (interpreter)", "x").config(key) == last
    assert tuning.runtime_cache("another GPU", "x") is None                               # made elsewhere: ignored
    tuning.runtime_cache.cache_clear()

    real = gemm.linear

    def planted(x, w, bias, out_dtype, spec, config=None, *, policy):
        out = real(x, w, bias, out_dtype, spec, config, policy=policy)
        if config and config.get("split"):
            out[0, 0] = torch.nextafter(out[0, 0], torch.tensor(float("inf")))
        return out
    monkeypatch.setattr(gemm, "linear", planted)
    with pytest.raises(HalError, match="gives other bits than the kernel's own"):
        tuning.tune_gemm([(5, 24, 600)], spec, dtype=torch.float32, device="cpu", cache=tuning.TuneCache("c", "x"),
                         timer=lambda fn: 1.0, progress=None)


def test_gemm_tuner_reads_copies_of_small_inputs_in_turn(cuda, monkeypatch):
    """Inputs smaller than twice the L2 are timed over copies read in turn (a model's forward reads each
    linear's weight from memory, not from the L2), ours and cuBLAS's alike; the bit checks read copy 0."""
    from hal.kernels import gemm, tuning

    spec = _gemm_spec(512)
    every = gemm.candidates
    monkeypatch.setattr(gemm, "candidates", lambda *a: [dict(c, BLOCK_K=128) for c in every(*a)][:2])
    real, timed_calls, untimed, in_timer = gemm.linear, [], [], [False]

    def spy(x, *a, **kw):
        (timed_calls if in_timer[0] else untimed).append(x.data_ptr())
        return real(x, *a, **kw)
    monkeypatch.setattr(gemm, "linear", spy)
    stock = []

    def timer(fn):
        start, in_timer[0] = len(timed_calls), True
        for _ in range(4):
            fn()
        in_timer[0] = False
        turns.append(timed_calls[start:] or stock[-4:])
        return 1.0
    turns = []
    nbytes = (5 + 24) * 600 * 4
    tuning.tune_gemm([(5, 24, 600)], spec, dtype=torch.float32, device="cpu", cache=tuning.TuneCache("c", "x"),
                     timer=timer, progress=None, baseline=lambda x, w, o: stock.append(x.data_ptr()),
                     l2_bytes=nbytes)                                            # twice the L2: two copies
    assert len(turns) == 2 + 2 and all(t[0] == t[2] != t[1] == t[3] for t in turns)
    assert untimed and set(untimed) == {turns[0][0]}


def test_hal_tune_refuses_clearly_without_a_gpu_or_a_config(tmp_path, monkeypatch, capsys):
    """`hal tune` times launches on a GPU: on Triton's interpreter, or given no readable config.json, it says
    so in one line (exit 2) and writes no cache."""
    import json

    from hal.cli import main

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("HAL_TUNE_CACHE", str(tmp_path / "tune.json"))
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "qwen3", "vocab_size": 1000, "hidden_size": 256,
                                  "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "head_dim": 64}))
    assert main(["tune", "--model", str(config)]) == 2
    assert "times launches on a GPU" in capsys.readouterr().err
    assert main(["tune", "--model", str(tmp_path / "nothing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "tune.json").exists()
    from hal.kernels.tuning import model_gemm_shapes
    from hal.model.config import ModelConfig

    shapes, out_dtypes = model_gemm_shapes(ModelConfig.from_hf(json.loads(config.read_text())), [1, 8])
    assert sorted({(n, k) for _, n, k in shapes}) == [(256, 256), (256, 512), (512, 256), (1000, 256), (1024, 256)]
    assert len(shapes) == 10 and out_dtypes == {(1000, 256): torch.float32}      # the logits GEMM in fp32


def test_rotary_views_and_one_launch_equal_the_reference(cuda, reference):
    """Rotary reads q and k through their strides (views of a fused QKV output, no copy) in one launch:
    the same bits as the reference for contiguous and strided inputs, full and partial rotary, head
    counts that leave the last head block part-full."""
    from hal.conformance.checks import random_tensor
    from hal.rope import cos_sin_cache

    g = torch.Generator().manual_seed(3)
    for dtype, q_heads, k_heads, head_dim, rotary_dim in ((torch.bfloat16, 20, 4, 64, 64),
                                                           (torch.float32, 3, 1, 48, 32)):
        tokens = 7
        qkv = random_tensor((tokens, (q_heads + 2 * k_heads) * head_dim), dtype, g, spread=4)
        q = qkv[:, :q_heads * head_dim].view(tokens, q_heads, head_dim)           # strided views
        k = qkv[:, q_heads * head_dim:(q_heads + k_heads) * head_dim].view(tokens, k_heads, head_dim)
        assert not q.is_contiguous()
        table = cos_sin_cache(rotary_dim, 64, 1e4)
        positions = torch.randint(0, 64, (tokens,), generator=g)
        want_q, want_k = reference.rotary(positions, q.contiguous(), k.contiguous(), table)
        for got_q, got_k in (cuda.rotary(positions, q, k, table),
                             cuda.rotary(positions, q.contiguous(), k.contiguous(), table)):
            assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
        # negative control: the kernel sees the rotation (a wrong position changes the bits)
        moved_q, _ = cuda.rotary(positions + 1, q, k, table)
        assert not torch.equal(moved_q, want_q)


@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_one_block_path_equals_the_two_pass_path(residual):
    """A row of one block is read once (``ONE_BLOCK``): the same bits as the two-pass loop over the
    same block width, at widths below, at and across one block; a changed eps changes them."""
    import triton

    from hal.conformance.checks import random_tensor
    from hal.kernels import rows
    from hal.kernels.common import LAUNCH

    g = torch.Generator().manual_seed(4)

    def run(x, w, res, block, one_block, eps=1e-6):
        out, res_out = torch.empty_like(x), torch.empty_like(x)
        r = res if res is not None else x
        rows._rms_norm_kernel[(x.shape[0],)](x, r, w, out, res_out, x.shape[1], x.stride(0), r.stride(0),
                                             out.stride(0), res_out.stride(0), eps, HAS_RESIDUAL=res is not None,
                                             IS_BF16=x.dtype == torch.bfloat16, BLOCK=block,
                                             MEAN_RECIPROCAL=False, ONE_BLOCK=one_block, **LAUNCH)
        return out, res_out if res is not None else None

    for n in (100, 128):
        x = random_tensor((3, n), torch.bfloat16, g, spread=4)
        res = random_tensor((3, n), torch.bfloat16, g, spread=4) if residual else None
        w = random_tensor((n,), torch.bfloat16, g)
        block = triton.next_power_of_2(n)
        one, two = run(x, w, res, block, True), run(x, w, res, block, False)
        assert torch.equal(one[0], two[0]) and (not residual or torch.equal(one[1], two[1]))
        assert not torch.equal(run(x, w, res, block, True, eps=0.5)[0], one[0])


def _pairwise_tree_rms_norm(x, w, eps, residual=None):
    """The narrow-row RMSNorm written out in torch fp32 elementwise ops (IEEE on every host, no BLAS): the
    residual add rounded to bf16, the sum of squares by the fixed pairwise tree (adjacent pairs, then pairs
    of those sums, ... over the row zero-padded to a power of two), +0 first, div_rn by n, 1 / sqrt_rn,
    then (x * inv) * w rounded once."""
    import triton

    xf = x.float()
    if residual is not None:
        xf = (xf + residual.float()).to(torch.bfloat16).float()
    n = x.shape[-1]
    sq = torch.nn.functional.pad(xf * xf, (0, triton.next_power_of_2(n) - n))
    while sq.shape[-1] > 1:
        sq = sq[..., 0::2] + sq[..., 1::2]
    sum_sq = torch.zeros_like(sq[..., 0]) + sq[..., 0]
    inv = _fp32_inverse_rms(sum_sq, n, eps)
    return ((xf * inv[..., None]) * w.float()).to(x.dtype), (xf.to(x.dtype) if residual is not None else None)


def _fp32_inverse_rms(sum_sq, n, eps):
    """div_rn(1, sqrt_rn(div_rn(sum_sq, n) + eps)) in fp32: each step in fp64, then rounded to fp32 (for +, /
    and sqrt that is the correctly rounded fp32 result; torch's own fp32 ``1.0 / t`` was not, on this CPU)."""
    def fp32(t):
        return t.float().double()
    mean = fp32(sum_sq.double() / n)
    root = fp32(torch.sqrt(fp32(mean + fp32(torch.tensor(eps)))))
    return (1.0 / root).float()


@pytest.mark.parametrize("residual", [False, True])
def test_narrow_rms_norm_is_the_pairwise_tree_for_every_launch(cuda, residual):
    """Rows of 2..128 elements (per-head q/k norms) go many to a program (``rows.rms_norm_rows``): the
    result is the pairwise tree written out in torch (bitwise), for every rows-per-program and warp
    count, a row alone equals it inside a batch; across the dispatch boundary (128 / 129 wide) both
    kernels stay within the fp64 oracle's bound. Negative control: a left-to-right sum of squares
    gives other bits for some rows (the check sees the order)."""
    from hal.conformance.checks import random_tensor
    from hal.kernels import rows

    spec = CONTRACT.rms_norm
    g = torch.Generator().manual_seed(12)
    for n in (2, 3, 64, 96, 128, 129):
        x = random_tensor((37, n), torch.bfloat16, g, spread=4)
        res = random_tensor((37, n), torch.bfloat16, g, spread=4) if residual else None
        w = random_tensor((n,), torch.bfloat16, g)
        out, res_out = cuda.rms_norm(x, w, 1e-6, res) if residual else (cuda.rms_norm(x, w, 1e-6), None)
        xf = (x.float() + res.float()).to(torch.bfloat16).double() if residual else x.double()  # r = round(x + res)
        oracle = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
        assert bool(((out.double() - oracle).abs() <= 2 ** -7 * oracle.abs() + 1e-30).all()), n
        if n > rows.NARROW:
            continue
        want, want_res = _pairwise_tree_rms_norm(x, w, 1e-6, res)
        assert torch.equal(out, want), n
        if residual:
            assert torch.equal(res_out, want_res)
        for per_program, warps in ((1, 1), (4, 2), (16, 8)):
            got, _ = rows.rms_norm_rows(x, w, 1e-6, res, spec, rows_per_program=per_program, num_warps=warps)
            assert torch.equal(got, want), (n, per_program, warps)
        alone = cuda.rms_norm(x[20:21], w, 1e-6, res[20:21]) if residual else cuda.rms_norm(x[20:21], w, 1e-6)
        assert torch.equal(alone[0] if residual else alone, want[20:21])
    # negative control: on fp32 rows (no bf16 output rounding to hide it) the kernel equals the tree and a
    # left-to-right sum of squares gives other bits: the equality above sees the order
    x = random_tensor((64, 128), torch.float32, g, spread=4)
    w = torch.ones(128)
    tree, _ = _pairwise_tree_rms_norm(x, w, 1e-6)
    assert torch.equal(cuda.rms_norm(x, w, 1e-6), tree)
    serial = torch.zeros(64)
    for j in range(128):
        serial = serial + x[:, j] * x[:, j]
    assert not torch.equal(x * _fp32_inverse_rms(serial, 128, 1e-6)[:, None], tree)


def _scrambled_batch_with_bad_v(seed, seq_lens, q_lens, hq, hkv, d, *, planted, kv_head, page=16):
    """A bf16 batch on 16-key pages in scrambled order: (q, k_cache, v_cache, metadata, block tables). V of the
    first sequence holds NaN at key ``planted[0]`` and +Inf at ``planted[1]`` (dims 3..8 of ``kv_head``), keys
    that the later rows of that sequence see and the earlier ones do not."""
    from hal.conformance.checks import random_tensor
    from hal.kvcache import build_metadata

    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // page) for n in seq_lens]
    order = torch.randperm(sum(pages), generator=g).tolist()
    tables, at = [], 0
    for n in pages:
        tables.append(order[at: at + n])
        at += n
    k_cache = random_tensor((sum(pages), page, hkv, d), torch.bfloat16, g)
    v_cache = random_tensor((sum(pages), page, hkv, d), torch.bfloat16, g)
    for pos, value in zip(planted, (float("nan"), float("inf"))):
        v_cache[tables[0][pos // page], pos % page, kv_head, 3:9] = value
    q = random_tensor((sum(q_lens), hq, d), torch.bfloat16, g)
    return q, k_cache, v_cache, build_metadata(q_lens, seq_lens, tables), tables


def test_nested_split_loop_gives_the_flat_loops_bits(cuda):
    """``nested_splits`` (a loop over the splits with the chunk loops inside, the structure a wgmma tile needs
    for ptxas to keep its MMAs pipelined) against the flat chunk loop: the same bits for prefill, chunked
    prefill and decode rows in one batch, contexts crossing chunk (32) and split (96) boundaries, on the
    in-kernel walk and on parallel splits (one and two a program), with 16- and 64-row tiles (the 64-row tile
    finds the rows that see a non-finite V by each column's first bad key, the 16-row one by a 0/1 dot), and
    NaN / Inf planted in V of keys that some rows of a tile see and others do not. Negative control: another
    split size gives other bits (the comparison can fail)."""
    from hal.backends.cuda.launch import CUDA_LAUNCH
    from hal.kernels import attention

    d = 32
    q, k_cache, v_cache, meta, _ = _scrambled_batch_with_bad_v(5, [230, 97, 40], [70, 1, 40], 8, 2, d,
                                                               planted=(200, 215), kv_head=0)

    def run(kv_split, **launch):
        return attention.paged_attention(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_table,
                                         d ** -0.5, _attention_spec(32, kv_split), policy=CUDA_LAUNCH, **launch)

    launches = [dict(split_parallel=False, block_q=4), dict(split_parallel=False, block_q=16),
                dict(split_parallel=True, block_q=4), dict(split_parallel=True, block_q=16, splits_per_program=2)]
    for launch in launches:
        flat = run(96, nested_splits=False, **launch)
        nested = run(96, nested_splits=True, **launch)
        assert torch.equal(nested.view(torch.int16), flat.view(torch.int16)), launch
    assert torch.isnan(flat.float()).any() and torch.isfinite(flat.float()).any()   # the planted values reached rows
    assert not torch.equal(run(64, nested_splits=True, **launches[1]).view(torch.int16), flat.view(torch.int16))


@pytest.mark.parametrize("group", [3, 5])
def test_packed_gqa_rows_give_the_padded_rows_bits(cuda, group, monkeypatch):
    """A GQA group that is not a power of two, packed unpadded into the tile's rows (prefill's default: 12 tokens
    x 5 heads fill 60 of 64 rows, against 8 x 8 padded with 40 useful) against the padded layout: the same bits
    for prefill, chunked prefill and decode rows in one batch, contexts crossing chunk (32) and split (96)
    boundaries, tiles that straddle a chunk boundary, on the in-kernel walk and on parallel splits, NaN / Inf
    planted in V of keys some rows of a tile see and others do not. (The idle rows of a packed tile, 64 - 60, are
    masked: unmasked they would redo the next tile's first token, the same bits, so no output shows it.)
    Negative control: another split size."""
    from hal.backends.cuda.launch import CUDA_LAUNCH
    from hal.kernels import attention
    from hal.kernels.common import next_power_of_2
    from hal.kvcache import build_metadata

    d = 32
    q, k_cache, v_cache, meta, tables = _scrambled_batch_with_bad_v(group, [200, 97, 20], [30, 1, 20], 2 * group, 2,
                                                                    d, planted=(180, 190), kv_head=1)

    def run(kv_split=96, **launch):
        return attention.paged_attention(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_table,
                                         d ** -0.5, _attention_spec(32, kv_split), policy=CUDA_LAUNCH,
                                         **launch).view(torch.int16)

    padded = run(packed_heads=False, split_parallel=False)
    assert torch.equal(run(packed_heads=False, split_parallel=True, block_q=2), padded)
    for launch in (dict(block_q=16 // group), dict(block_q=64 // group), dict(block_q=64 // group, nested_splits=False),
                   dict(block_q=16 // group, split_parallel=True, splits_per_program=2)):
        launch.setdefault("split_parallel", False)
        assert torch.equal(run(packed_heads=True, **launch), padded), launch
    assert torch.isnan(padded.view(torch.bfloat16).float()).any()   # the planted values reached rows
    assert not torch.equal(run(64, packed_heads=True, block_q=64 // group, split_parallel=False), padded)

    # Prefill launches pack by default (the kernel sees the unpadded group), decode-like ones pad.
    seen = []
    real_launch = attention.launch
    monkeypatch.setattr(attention, "launch", lambda kernel, grid, *a, **kw: (
        seen.append(kw.get("GROUP_PAD")), real_launch(kernel, grid, *a, **kw))[1])
    assert torch.equal(run(split_parallel=False), padded)
    decode_meta = build_metadata([1, 1], [97, 40], tables[1:])
    attention.paged_attention(q[:2], k_cache, v_cache, decode_meta.query_start_loc, decode_meta.seq_lens,
                              decode_meta.block_table, d ** -0.5, _attention_spec(32, 96), policy=CUDA_LAUNCH)
    assert seen[0] == group and seen[1] == next_power_of_2(group)
    with pytest.raises(ValueError, match="packed_heads"):
        run(packed_heads=True, head_split=2)


def test_a_row_seeing_an_infinite_v_is_nan_whatever_its_tile(cuda, reference):
    """[attention].mask: an output element whose row sees a non-finite V entry is NaN. An unmasked chunk has no
    guard (its arithmetic makes p * Inf = Inf), a masked chunk's repair selects NaN; which one a row's chunk is
    depends on its tile (a chunk is unmasked for a tile whose first query sees all of it). So the output maps
    every non-finite element to NaN: the row at position 165 below sees the +Inf key 140 in an unmasked chunk
    with 16-token tiles (first query 160) and in a masked one with 64-token tiles (first query 136). Before the
    map the two tilings differed there: +Inf against NaN on the H100 (2026-12-07), two NaNs of different bits
    under the interpreter (numpy's default NaN is negative). The reference gives NaN too. Negative control:
    another split size gives other bits (the comparison can fail)."""
    from hal.backends.cuda.launch import CUDA_LAUNCH
    from hal.conformance.checks import random_tensor
    from hal.kernels import attention
    from hal.kvcache import build_metadata

    g = torch.Generator().manual_seed(11)
    page, d, n, q_len = 16, 16, 200, 64
    pages = -(-n // page)
    k_cache = random_tensor((pages, page, 1, d), torch.bfloat16, g)
    v_cache = random_tensor((pages, page, 1, d), torch.bfloat16, g)
    v_cache[140 // page, 140 % page, 0, 3] = float("inf")
    q = random_tensor((q_len, 1, d), torch.bfloat16, g)
    meta = build_metadata([q_len], [n], [list(range(pages))])
    spec = _attention_spec(32, 96)

    def run(**launch):
        return attention.paged_attention(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_table,
                                         d ** -0.5, spec, policy=CUDA_LAUNCH, **launch)
    small, large = run(block_q=16, split_parallel=False), run(block_q=64, split_parallel=False)
    row = 165 - (n - q_len)
    assert torch.isnan(small[row, 0, 3].float()) and torch.isnan(large[row, 0, 3].float())
    assert torch.equal(small.view(torch.int16), large.view(torch.int16))
    assert torch.isfinite(small[row, 0, :3].float()).all()        # only the column that holds the Inf
    assert torch.equal(run(block_q=16, split_parallel=True).view(torch.int16), small.view(torch.int16))  # merge
    assert not torch.isinf(small.float()).any()
    other_split = attention.paged_attention(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_table,
                                            d ** -0.5, _attention_spec(32, 64), policy=CUDA_LAUNCH, block_q=16)
    assert not torch.equal(other_split.view(torch.int16), small.view(torch.int16))
    ref = reference.attention(q, k_cache, v_cache, meta, scale=d ** -0.5)
    assert torch.isnan(ref[row, 0, 3].float()) and torch.equal(torch.isnan(ref.float()), torch.isnan(small.float()))
