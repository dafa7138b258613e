"""The cuda backend's FP8 KV cache (``fp8_write_kv``, ``fp8_attention``) under Triton's CPU interpreter.

Properties, for e4m3 and e5m2 with per-(token, head) scales and for a fixed scale:
  * the write kernel stores the reference's bits (fp8 values and scales) on loud, quiet, all-zero and
    subnormal-heavy vectors, and skips padding slots (-1);
  * attention over the FP8 cache gives the bits of the same backend's bf16 attention over the
    dequantised cache (the one read path), on every launch path (in-kernel and parallel splits, query
    tiles, head splits), across the contract's KV chunk (64) and split (512) boundaries, with pages
    that hold a chunk and pages that do not;
  * prefill == chunked prefill == decode, batch-mates or not;
  * it stays within bf16 attention's tolerance of the fp64 oracle over the dequantised values.
Negative controls: the same comparison against caches dequantised with scales one ulp off differs
(the equality reads the scale), and a per-call KV scale makes the early tokens' bits depend on the
phase. No BLAS is involved (the interpreter's dots are numpy's over exact bf16 values, the oracle
fp64). The H200 side (bits, and speed against the bf16 cache): bench/fp8_kv_gpu.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import backend_for_tests

from hal import fp8
from hal.contract import load_contract
from hal.errors import UnsupportedError
from hal.kvcache import PageAllocator, build_metadata, pages_needed, slot_mapping

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FP8 = load_contract("bf16-fp8-v1")
SPECS = {"e4m3 per token-head": FP8.fp8, "e5m2 per token-head": dataclasses.replace(FP8.fp8, kv_format="e5m2"),
         "e4m3 fixed scale": dataclasses.replace(FP8.fp8, kv_scale="fixed")}
HQ, HKV, D = 4, 2, 64
SEQ = 530                       # crosses kv_chunk 64 and kv_split 512
TAIL = 40                       # the tokens whose attention is computed (positions 490..529)


@pytest.fixture(scope="module")
def cuda():
    backend_for_tests("cuda")          # the interpreter runs the kernels (conftest)
    from hal.api import create_backend

    return create_backend("cuda", FP8)


@pytest.fixture(scope="module")
def reference():
    from hal.api import create_backend

    return create_backend("reference", FP8)


def with_spec(backend, spec):
    """The backend under a contract whose [fp8] is ``spec`` (the KV format and scale rule vary by test)."""
    from hal.api import create_backend

    return create_backend(backend.name, dataclasses.replace(FP8, fp8=spec))


def kv_rows(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (T, HQ, D), k, v (T, HKV, D) bf16: ordinary rows, then loud, quiet, all-zero and tiny ones."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(tokens, h, D, generator=g) for h in (HQ, HKV, HKV))
    k[3::7] *= 300.0
    v[5::11] *= 1e-3
    k[4], v[4] = 0.0, 0.0
    k[6, 0] *= 1e-6
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


def new_cache(spec, pages: int, page_size: int) -> fp8.Fp8KVCache:
    return fp8.Fp8KVCache(pages, page_size, HKV, D, spec, fixed_scales=(0.05, 0.0625))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


@pytest.mark.parametrize("name", SPECS)
def test_write_kernel_stores_the_reference_bits_and_skips_padding(cuda, reference, name):
    spec = SPECS[name]
    _, k, v = kv_rows(40, seed=1)
    slots = torch.randperm(64, generator=torch.Generator().manual_seed(2))[:40]
    slots[[0, 9, 17]] = -1                       # vLLM's padding tokens
    got, want = new_cache(spec, 8, 8), new_cache(spec, 8, 8)
    got.write(k, v, slots, backend=with_spec(cuda, spec))
    want.write(k, v, slots, backend=with_spec(reference, spec))
    for a, b in ((got.k, want.k), (got.v, want.v), (got.k_scale, want.k_scale), (got.v_scale, want.v_scale)):
        assert torch.equal(bits(a), bits(b))    # NaN slots (never written) compare by their bits too
    written = slots[slots >= 0]
    assert bool(torch.isfinite(got.k.float().flatten(0, 1)[written]).all())
    assert int(torch.isnan(got.k.float().flatten(0, 1)).any(-1).any(-1).sum()) == 64 - written.numel()


def run(backend, spec, steps, page_size, *, fp8_read=True, mates=0, seed=0):
    """Attention outputs (TAIL, HQ, D) of the last TAIL tokens of one SEQ-token sequence, fed in ``steps``
    (query counts per call) after its first SEQ - TAIL tokens' K/V were written (a prefix already in the
    cache: only the tail's queries are computed, which keeps the interpreter fast while every query still
    reads keys across the 512-key split). The tail's K/V written into the FP8 cache by ``backend``; ``fp8_read``:
    attention through ``fp8_attention``, else through ``attention`` over the dequantised cache;
    ``mates``: other sequences sharing each call."""
    q, k, v = kv_rows(SEQ, seed=7)
    mq, mk, mv = kv_rows(24, seed=8)
    alloc = PageAllocator(128, torch.Generator().manual_seed(seed + page_size))
    pages = alloc.take(pages_needed(SEQ, page_size))
    mate_pages = [alloc.take(pages_needed(24, page_size)) for _ in range(mates)]
    cache = new_cache(spec, 128, page_size)
    # the prefix and the mates by the exact rule (the write kernel gives its bits: the test above; under
    # the interpreter it takes ~50 ms per token), the tail by ``backend``
    for j in range(mates):
        cache.write(mk, mv, slot_mapping(mate_pages[j], range(24), page_size))
    done = SEQ - TAIL
    cache.write(k[:done], v[:done], slot_mapping(pages, range(done), page_size))
    outs = []
    for q_len in steps:
        cache.write(k[done:done + q_len], v[done:done + q_len], slot_mapping(pages, range(done, done + q_len), page_size),
                    backend=backend)
        meta = build_metadata([8] * mates + [q_len], [24] * mates + [done + q_len], mate_pages + [pages])
        qs = torch.cat([mq[-8:]] * mates + [q[done:done + q_len]])
        if fp8_read:
            out = cache.attention(backend, qs, meta, scale=D ** -0.5)
        else:
            out = backend.attention(qs, *cache.read(torch.bfloat16), meta, scale=D ** -0.5)
        outs.append(out[8 * mates:])
        done += q_len
    return torch.cat(outs), cache, pages


@pytest.mark.parametrize("name", SPECS)
def test_fp8_attention_is_the_bf16_attention_over_the_read_path_in_every_phase(cuda, name):
    spec = SPECS[name]
    backend = with_spec(cuda, spec)
    full, _, _ = run(backend, spec, [TAIL], 64)
    assert torch.isfinite(full.float()).all()
    assert torch.equal(full, run(backend, spec, [TAIL], 64, fp8_read=False)[0])
    # chunked prefill with a batch-mate; decode across the split at 512 (positions 510..529) on pages that
    # do not hold a chunk; chunks with a one-token step between them
    schedules = ((64, [13, 27], 1), (5, [20] + [1] * 20, 1), (16, [20, 1, 19], 0))
    for page_size, steps, mates in schedules if spec is FP8.fp8 else schedules[1:2]:
        assert torch.equal(run(backend, spec, steps, page_size, mates=mates)[0], full), (page_size, steps)


def test_every_launch_path_reads_the_fp8_cache_alike_and_the_scale_reaches_the_bits(cuda):
    from hal.backends.cuda.launch import CUDA_LAUNCH
    from hal.kernels import attention

    spec = FP8.fp8
    backend = with_spec(cuda, spec)
    _, cache, pages = run(backend, spec, [TAIL], 16)
    q = kv_rows(SEQ, seed=7)[0][-TAIL:].contiguous()
    meta = build_metadata([TAIL], [SEQ], [pages])
    common = (meta.query_start_loc, meta.seq_lens, meta.block_table, D ** -0.5, FP8.attention)
    k_read, v_read = cache.read(torch.bfloat16)
    plain = attention.paged_attention(q, k_read, v_read, *common, policy=CUDA_LAUNCH)
    launches = [dict(split_parallel=sp, block_q=bq, head_split=hs, splits_per_program=g)
                for sp, bq, hs, g in ((False, 32, 1, 1), (True, 1, 1, 1), (True, 4, 2, 2), (False, 8, 2, 1))]
    for launch in launches:
        out = attention.paged_attention(q, cache.k, cache.v, *common, policy=CUDA_LAUNCH, k_scale=cache.k_scale,
                                        v_scale=cache.v_scale, **launch)
        assert torch.equal(out, plain), launch
    # Negative control: caches dequantised with every K scale one ulp larger give other bits.
    nudged = fp8.dequantise_kv(cache.k, torch.nextafter(cache.k_scale, torch.tensor(float("inf"))), torch.bfloat16)
    assert not torch.equal(attention.paged_attention(q, nudged, v_read, *common, policy=CUDA_LAUNCH), plain)
    with pytest.raises(ValueError, match="need k_scale"):
        attention.paged_attention(q, cache.k, cache.v, *common, policy=CUDA_LAUNCH)


def test_fp8_attention_is_accurate_against_the_fp64_oracle_over_the_dequantised_cache(cuda):
    spec = FP8.fp8
    out, cache, pages = run(with_spec(cuda, spec), spec, [TAIL], 16)
    slots = slot_mapping(pages, range(SEQ), 16)
    k_read, v_read = (t.flatten(0, 1)[slots].double() for t in cache.read(torch.bfloat16))   # (SEQ, HKV, D)
    q = kv_rows(SEQ, seed=7)[0][-TAIL:].double()
    group = HQ // HKV
    scores = torch.einsum("thd,shd->hts", q, k_read.repeat_interleave(group, 1)) * D ** -0.5
    causal = torch.arange(SEQ)[None, :] > torch.arange(SEQ - TAIL, SEQ)[:, None]
    scores = scores.masked_fill(causal, float("-inf"))
    want = torch.einsum("hts,shd->thd", scores.softmax(-1), v_read.repeat_interleave(group, 1))
    err = (out.double() - want).abs()
    assert bool((err <= 2 ** -7 * (1 + want.abs())).all()), float(err.max())


class PerCallScaleCache(fp8.Fp8KVCache):
    """Negative control: one scale per write call from the amax of everything written in it."""

    def _quantise(self, x, fixed):
        scale = fp8.scale_of(x.float().abs().amax(), self.spec, self.spec.kv_format)
        return fp8.quantise(x, scale, self.spec, self.spec.kv_format), scale.expand(x.shape[:-1]).contiguous()


def test_negative_control_a_per_call_scale_makes_the_phases_differ_on_cuda(cuda):
    spec = FP8.fp8
    q, k, v = kv_rows(80, seed=3)
    k[40:] *= 50
    outs = []
    for steps in ([80], [40, 40]):
        cache = PerCallScaleCache(16, 16, HKV, D, spec)
        pages = list(range(5))
        out, done = [], 0
        for q_len in steps:
            cache.write(k[done:done + q_len], v[done:done + q_len], slot_mapping(pages, range(done, done + q_len), 16))
            meta = build_metadata([q_len], [done + q_len], [pages])
            out.append(cache.attention(cuda, q[done:done + q_len], meta, scale=D ** -0.5))
            done += q_len
        outs.append(torch.cat(out))
    assert not torch.equal(outs[0][:40], outs[1][:40])


def test_refusals_name_what_is_wrong(cuda):
    from hal.api import create_backend

    cache = new_cache(FP8.fp8, 4, 16)
    meta = build_metadata([2], [2], [[0]])
    q = torch.zeros(2, HQ, D, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedError, match="k_scale must be fp32 of shape"):
        cuda.fp8_attention(q, cache.k, cache.v, cache.k_scale[0], cache.v_scale, meta, scale=1.0)
    with pytest.raises(UnsupportedError, match="kv_format"):
        cuda.fp8_attention(q, cache.k.float().bfloat16(), cache.v, cache.k_scale, cache.v_scale, meta, scale=1.0)
    with pytest.raises(UnsupportedError, match="no \\[fp8\\] section"):
        create_backend("cuda").fp8_attention(q, cache.k, cache.v, cache.k_scale, cache.v_scale, meta, scale=1.0)
    with pytest.raises(UnsupportedError, match="does not realise an FP8 KV cache"):
        create_backend("torch").fp8_write_kv(q[:, :HKV], q[:, :HKV], cache.k, cache.v, cache.k_scale, cache.v_scale,
                                             torch.zeros(2, dtype=torch.long))


def test_fp8_decode_takes_the_register_capped_launch_only_once_its_programs_fill_the_gpu():
    """The launch rule (``attention._decode_launch``; its bits are the default's on the GPU:
    bench/decode_launch_gpu.py): an FP8 cache's decode programs, once more than the multiprocessors, run
    one split each under a 128-register cap with 3 stages (four programs a multiprocessor); fewer
    programs keep 4 warps and no cap at head dim 64."""
    from hal.kernels.attention import _decode_launch

    sms = 132
    for programs in (133, 512, 4096, 16 * sms + 1):
        for head_dim in (64, 128):
            launch = _decode_launch(programs, sms, kv_fp8=True, max_splits=4, head_dim=head_dim, page=16)
            assert (launch["splits_per_program"], launch["num_stages"], launch["maxnreg"]) == (1, 3, 128)
            assert launch["split_parallel"] and launch["num_warps"] == 4
    for programs in (1, 64, sms):
        launch = _decode_launch(programs, sms, kv_fp8=True, max_splits=4, head_dim=64, page=16)
        assert launch["maxnreg"] == 0 and launch["num_stages"] == 5
    assert _decode_launch(10**5, 0, kv_fp8=True, max_splits=4, head_dim=64, page=16) == \
        dict(splits_per_program=1, num_stages=5, maxnreg=0)