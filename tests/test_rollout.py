"""Rollout harness vs training forward: bitwise-equal logprobs on ``reference``, not on ``torch``.

Each case generates the same requests under several harness schedules (seeded admission order,
preemption, chunk cuts, page sizes, page scrambling, a page pool small enough to force preemption
for lack of pages) and recomputes the logprobs with the training forward under several packings
and page sizes. On the contract backend every response token's logprob must be bitwise equal
everywhere; the stock ``torch`` backend (negative control) must show mismatches.
"""

from __future__ import annotations

import dataclasses
import random
import warnings

import pytest
import torch
from conftest import HostFact, assert_schedules_and_trainer_agree

from hal.backends.reference import ReferenceBackend
from hal.backends.reference.attention import paged_attention
from hal.backends.stock import TorchBackend
from hal.contract import load_contract
from hal.errors import HalError
from hal.metrics import compare_logprobs
from hal.model import DecoderLM, tiny_config
from hal.rollout import HarnessConfig, Request, RolloutHarness, gumbel_noise, recompute_logprobs, sample_token

REF = ReferenceBackend(load_contract())


pytestmark = pytest.mark.usefixtures("one_torch_thread")

SCHEDULES = [
    # small pages, a pool too small for all requests at once, random preemption, short chunks
    HarnessConfig(page_size=3, num_pages=20, max_num_seqs=4, max_batch_tokens=12, max_chunk=5,
                  preempt_prob=0.15, seed=1),
    HarnessConfig(page_size=16, max_num_seqs=6, max_batch_tokens=64, seed=2),
    HarnessConfig(page_size=5, max_num_seqs=2, max_batch_tokens=7, max_chunk=3, preempt_prob=0.3, seed=3),
]
PACKINGS = [dict(seed=0, max_batch_sequences=None, page_size=16), dict(seed=1, max_batch_sequences=2, page_size=5)]


def make_requests(seed: int, count: int = 5, vocab: int = 128) -> list[Request]:
    rng = random.Random(seed)
    requests = [Request(tuple(rng.randrange(vocab) for _ in range(rng.randint(2, 16))), max_new_tokens=10,
                        seed=100 * seed + i, temperature=rng.choice([1.0, 0.7]))
                for i in range(count)]
    # one greedy request that may stop early
    requests.append(Request(tuple(rng.randrange(vocab) for _ in range(6)), 10, seed=7, temperature=0.0,
                            stop_token_ids=(3, 5, 7, 11)))
    return requests


def rollout_and_train(backend, arch, dtype, schedules=SCHEDULES, packings=PACKINGS):
    model = DecoderLM.random(tiny_config(arch, dtype), seed=11, backend=backend)
    requests = make_requests(seed=len(arch))
    runs, stats = [], []
    for cfg in schedules:
        harness = RolloutHarness(model, cfg)
        runs.append(harness.generate(requests))
        stats.append(harness.stats)
    trains = []
    with torch.no_grad():
        for packing in packings:
            trains.append(recompute_logprobs(model, runs[0], **packing))
    return requests, runs, stats, trains


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_training_logprobs_equal_rollout_logprobs_bitwise(arch, dtype):
    requests, runs, stats, trains = rollout_and_train(REF, arch, dtype)
    # the schedules really exercised what they claim
    assert stats[0].preemptions > 0 and stats[2].preemptions > 0
    assert all(s.cut_prefills > 0 for s in stats) and all(s.mixed_steps > 0 for s in stats)
    assert max(stats[1].rows) > 12 and min(stats[2].rows) < 7
    first = runs[0]
    assert sum(len(c.tokens) for c in first) >= 40
    # every schedule: the same tokens and bitwise the same logprobs; every training packing: bitwise
    # the rollout's logprobs, for every response token
    assert_schedules_and_trainer_agree(runs, trains)
    for train in trains:
        report = compare_logprobs(train, [c.logprobs for c in first])
        assert report.identical and report.max_abs_diff == 0.0 and report.k3_kl == 0.0


def test_qwen2_bias_model_training_equals_rollout():
    _, runs, _, trains = rollout_and_train(REF, "qwen2", "float32", SCHEDULES[:1], PACKINGS[1:])
    for c, lp in zip(runs[0], trains[0]):
        assert torch.equal(lp, c.logprobs)


def test_host_fact_stock_torch_backend_train_vs_rollout():
    """Informational: whether this host's stock kernels (GEMM rows by batch position, SDPA prefill vs
    decode) make training and rollout disagree. The project's own negative control is the planted
    decode-split backend of the long-context test."""
    stock = TorchBackend(None, "cpu")
    _, runs, _, trains = rollout_and_train(stock, "llama", "float32", SCHEDULES[:2], PACKINGS[:1])
    report = compare_logprobs(trains[0], [c.logprobs for c in runs[0]])
    warnings.warn(HostFact(f"stock torch kernels on this host: train vs rollout {report.mismatches} mismatching "
                           f"tokens, max |dlogp| {report.max_abs_diff:.3g}"))


def test_greedy_and_stop_tokens():
    model = DecoderLM.random(tiny_config("llama"), seed=5, backend=REF)
    req = Request((1, 2, 3, 4), max_new_tokens=12, temperature=0.0)
    (greedy,) = RolloutHarness(model).generate([req])
    assert greedy.finish_reason == "length" and len(greedy.tokens) == 12
    with torch.no_grad():
        logits = model.forward_train(torch.tensor(greedy.sequence[:-1]), [len(greedy.sequence) - 1])
    assert greedy.tokens == logits[3:].argmax(-1).tolist()          # greedy = argmax of the training logits
    stop = greedy.tokens[4]
    (stopped,) = RolloutHarness(model).generate([Request(req.prompt, 12, temperature=0.0, stop_token_ids=(stop,))])
    assert stopped.finish_reason == "stop" and stopped.tokens == greedy.tokens[:greedy.tokens.index(stop) + 1]
    assert torch.equal(stopped.logprobs, greedy.logprobs[:len(stopped.tokens)])


def test_batched_sampler_picks_the_row_by_row_tokens():
    """``sample_rows`` (what an accelerator's logits are sampled with: all rows at once, on their device)
    picks ``sample_token``'s token for every row, at every temperature, greedy included, across more
    rows than one chunk of ``ROWS_AT_ONCE``; ties go to the lower id as row by row. Run here on the CPU
    (the GPU run is in bench/vllm_gpu.py). Negative control: positions off by one change the draws."""
    from hal.rollout import sampler

    g = torch.Generator().manual_seed(5)
    rows, vocab = sampler.ROWS_AT_ONCE + 9, 997
    logits = torch.randn(rows, vocab, generator=g) * 3
    logits[3] = 0.0                                       # a row of ties
    seeds = torch.randint(0, 2**62, (rows,), generator=g).tolist()
    positions = torch.randint(0, 5000, (rows,), generator=g).tolist()
    temperatures = [(0.0, 0.7, 1.0, 1.3)[i % 4] for i in range(rows)]
    temperatures[3] = 1.0
    expected = [sampler.sample_token(logits[i], seeds[i], positions[i], temperatures[i]) for i in range(rows)]
    assert sampler.sample_rows(logits, seeds, positions, temperatures).tolist() == expected
    assert sampler.sample_rows(logits[3:4].clone().fill_(0), [1], [1], [0.0]).tolist() == [0]
    shifted = sampler.sample_rows(logits, seeds, [p + 1 for p in positions], temperatures).tolist()
    assert sum(a != b for a, b in zip(shifted, expected)) > rows // 2
    with pytest.raises(ValueError, match="temperature"):
        sampler.sample_rows(logits[:1], [1], [1], [-1.0])


def test_sampler_depends_only_on_seed_and_position():
    logits = torch.randn(64)
    assert torch.equal(gumbel_noise(3, 10, 64), gumbel_noise(3, 10, 64))
    assert not torch.equal(gumbel_noise(3, 10, 64), gumbel_noise(3, 11, 64))
    assert not torch.equal(gumbel_noise(3, 10, 64), gumbel_noise(4, 10, 64))
    torch.manual_seed(123)   # the global RNG plays no part
    a = sample_token(logits, 3, 10, 1.0)
    torch.manual_seed(456)
    assert sample_token(logits, 3, 10, 1.0) == a
    # a request alone and inside a batch of others: the same completion
    model = DecoderLM.random(tiny_config("qwen3"), seed=6, backend=REF)
    others = make_requests(seed=9, count=3)
    alone = RolloutHarness(model).generate(others[:1])[0]
    together = RolloutHarness(model, HarnessConfig(seed=4)).generate(others)[0]
    assert alone.tokens == together.tokens and torch.equal(alone.logprobs, together.logprobs)


def test_harness_rejects_impossible_requests():
    model = DecoderLM.random(tiny_config("llama", max_position=32), seed=0, backend=REF)
    with pytest.raises(HalError, match="exceeds max_position"):
        RolloutHarness(model).generate([Request(tuple(range(30)), 8)])
    with pytest.raises(HalError, match="outside the vocabulary"):
        RolloutHarness(model).generate([Request((1, 500), 2)])
    with pytest.raises(HalError, match="raise num_pages"):
        RolloutHarness(model, HarnessConfig(page_size=2, num_pages=3)).generate([Request((1, 2, 3, 4), 4)])


# -- long context: every chunking of the contract split at least once -------------------------------

class PlantedDecodeBackend(ReferenceBackend):
    """Planted non-conformance: a single-query sequence (decode) runs attention under
    ``decode_attention(contract's [attention])``, every other query as the contract says."""

    def decode_attention(self, spec):
        raise NotImplementedError

    def attention(self, q, k_cache, v_cache, meta, *, scale):
        out = super().attention(q, k_cache, v_cache, meta, scale=scale)
        other = paged_attention(q, k_cache, v_cache, meta, scale, self.decode_attention(self.contract.attention))
        starts, _, _ = meta.host_lists()
        for b in range(len(starts) - 1):
            if starts[b + 1] - starts[b] == 1:
                out[starts[b]] = other[starts[b]]
        return out


class DecodeSplitBackend(PlantedDecodeBackend):
    """Decode with kv_split 1024 instead of the contract's 512. Below 513 keys both have one split and
    give the same bits, so only a sequence decoded past kv_split can show it."""

    name = "decode-split"

    def decode_attention(self, spec):
        return dataclasses.replace(spec, kv_split=2 * spec.kv_split)


LONG_PROMPT, LONG_NEW = 500, 30


def long_context_rollout_and_train(backend):
    """Hidden 576 and intermediate 640 (> k_chunk 512: two K chunks in every GEMM but o_proj),
    vocab 4224 (> vocab_chunk 4096: two chunks in the logprob sum), one request of 500 + 30 tokens
    (its decode crosses kv_split 512) and two shorter batch-mates, prefill cut into chunks."""
    c = backend.contract
    config = tiny_config("qwen3", "bfloat16", vocab_size=4224, hidden_size=576, intermediate_size=640,
                         num_layers=1, num_heads=4, num_kv_heads=2, head_dim=32, max_position=1024)
    # the shapes really reach a second chunk of every reduction the contract chunks
    assert min(config.hidden_size, config.intermediate_size) > c.gemm.k_chunk
    assert config.vocab_size > c.logprobs.vocab_chunk
    assert LONG_PROMPT < c.attention.kv_split < LONG_PROMPT + LONG_NEW - 1
    model = DecoderLM.random(config, seed=3, backend=backend)
    rng = random.Random(5)
    requests = [Request(tuple(rng.randrange(config.vocab_size) for _ in range(n)), new, seed=i, temperature=t)
                for i, (n, new, t) in enumerate([(LONG_PROMPT, LONG_NEW, 1.0), (37, 25, 0.7), (90, 12, 1.0)])]
    harness = RolloutHarness(model, HarnessConfig(page_size=16, max_num_seqs=3, max_batch_tokens=128,
                                                  max_chunk=100, seed=1))
    completions = harness.generate(requests)
    assert harness.stats.cut_prefills > 0 and harness.stats.mixed_steps > 0
    with torch.no_grad():
        trains = [recompute_logprobs(model, completions, seed=s, max_batch_sequences=m) for s, m in ((0, None), (1, 1))]
    return completions, trains


def test_long_context_training_logprobs_equal_rollout_bitwise():
    completions, trains = long_context_rollout_and_train(REF)
    assert len(completions[0].tokens) == LONG_NEW
    for train in trains:
        for c, lp in zip(completions, train):
            assert torch.equal(lp, c.logprobs), f"request {completions.index(c)}: train {lp} vs rollout {c.logprobs}"


def test_long_context_negative_control_decode_with_another_kv_split():
    planted = DecodeSplitBackend(load_contract())
    # the short-context cases above cannot see it: no sequence there reaches kv_split keys
    _, runs, _, short_trains = rollout_and_train(planted, "llama", "float32", SCHEDULES[:1], PACKINGS[:1])
    assert all(torch.equal(lp, c.logprobs) for c, lp in zip(runs[0], short_trains[0]))
    completions, trains = long_context_rollout_and_train(planted)
    kv_split = REF.contract.attention.kv_split
    for train in trains:
        differ = (train[0] != completions[0].logprobs).nonzero().flatten().tolist()
        # response token j is sampled by the decode of position LONG_PROMPT + j - 1 over LONG_PROMPT + j keys:
        # only those with more than kv_split keys can differ, and they do
        assert differ and min(differ) >= kv_split + 1 - LONG_PROMPT
        assert all(torch.equal(lp, c.logprobs) for c, lp in zip(completions[1:], train[1:]))


# -- speculative decoding: the same tokens and bits as plain decoding (issue #24) ----------------------

class DecodeChunkBackend(PlantedDecodeBackend):
    """Decode over KV chunks of 16 keys instead of the contract's 64; a chunk of several queries (a prefill
    chunk, a draft verification) as the contract says. Plain decoding then differs from a verification
    of the same positions."""

    name = "decode-chunk"

    def decode_attention(self, spec):
        return dataclasses.replace(spec, kv_chunk=16)


SPEC_REQUESTS = [  # repetitive prompts (prompt lookup finds drafts), greedy and sampled
    Request(tuple([5, 9, 2] * 4), 16, seed=1, temperature=0.0),
    Request((7, 7, 7, 7, 3), 16, seed=2, temperature=0.0, stop_token_ids=(13,)),
    Request((4, 1, 4, 1, 4), 16, seed=3, temperature=1.0),
    Request(tuple(range(20, 30)), 16, seed=4, temperature=0.7),
]


def plain_and_speculative(backend):
    model = DecoderLM.random(tiny_config("llama", "float32"), seed=11, backend=backend)
    plain = RolloutHarness(model, HarnessConfig(page_size=4, max_num_seqs=4, max_batch_tokens=24, seed=0))
    spec = RolloutHarness(model, HarnessConfig(page_size=4, num_pages=24, max_num_seqs=4, max_batch_tokens=24,
                                               speculative_tokens=3, preempt_prob=0.1, seed=5))
    return model, plain.generate(SPEC_REQUESTS), spec.generate(SPEC_REQUESTS), spec.stats


def assert_plain_tokens_and_bits(model, plain, spec):
    """``spec``'s completions have plain decoding's tokens and logprob bits, and the trainer's recomputation."""
    for a, b in zip(plain, spec):
        assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
        assert torch.equal(a.logprobs, b.logprobs)
    with torch.no_grad():
        for c, lp in zip(spec, recompute_logprobs(model, spec)):
            assert torch.equal(lp, c.logprobs)


def test_speculative_decoding_gives_plain_decodings_tokens_and_logprob_bits():
    """Prompt-lookup drafts verified as one chunk of queries, each position's target token sampled with
    its (seed, position) noise, a draft accepted iff it equals the target before it: the same tokens as
    plain decoding and bitwise the same logprobs (greedy, T = 1 and 0.7, a stop token, preemption, a
    small page pool), equal to the trainer's recomputation. The run accepted drafts and rejected some."""
    model, plain, spec, stats = plain_and_speculative(REF)
    assert stats.draft_tokens > stats.accepted_tokens > 0 and stats.preemptions > 0
    assert 0 < stats.acceptance_rate < 1
    assert_plain_tokens_and_bits(model, plain, spec)


def plain_and_drafted(backend, draft: str):
    """Plain decoding, and speculative decoding with drafts from a draft model: the target model itself
    (its greedy drafts are accepted often) or another, smaller random model (rarely)."""
    model = DecoderLM.random(tiny_config("llama", "float32"), seed=11, backend=backend)
    small = tiny_config("llama", "float32", num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1)
    draft_model = model if draft == "target" else DecoderLM.random(small, seed=99, backend=backend)
    plain = RolloutHarness(model, HarnessConfig(page_size=4, max_num_seqs=4, max_batch_tokens=24, seed=0))
    spec = RolloutHarness(model, HarnessConfig(page_size=4, num_pages=24, max_num_seqs=4, max_batch_tokens=24,
                                               speculative_tokens=3, preempt_prob=0.1, seed=5),
                          draft_model=draft_model)
    return model, plain.generate(SPEC_REQUESTS), spec.generate(SPEC_REQUESTS), spec


@pytest.mark.parametrize("draft", ["target", "other"])
def test_draft_model_speculation_gives_plain_decodings_tokens_and_logprob_bits(draft):
    """Drafts from a draft model's greedy decoding (its own paged cache, kept between steps) verified
    as prompt-lookup drafts are: plain decoding's tokens and logprob bits, equal to the trainer's
    recomputation, whatever the drafter proposes (the target itself: most drafts accepted; another
    model: few)."""
    model, plain, spec, harness = plain_and_drafted(REF, draft)
    stats = harness.stats
    assert harness.drafter.forwards > 0 and stats.draft_tokens > 0 and stats.preemptions > 0
    if draft == "target":
        # Greedy requests: the target's own greedy drafts are its tokens, so every one is accepted (a
        # stale or misplaced draft cache would propose others).
        greedy = [r for r in SPEC_REQUESTS if r.temperature == 0]
        harness.generate(greedy)
        assert harness.stats.draft_tokens > 0 and harness.stats.acceptance_rate == 1.0, harness.stats
    assert_plain_tokens_and_bits(model, plain, spec)


def test_draft_model_speculation_negative_control_decode_with_other_kv_chunks():
    """The same backend as the prompt-lookup negative control (single-query attention over other KV
    chunks): verifying the draft model's accepted drafts in a chunk gives other bits than decoding."""
    _, plain, spec, harness = plain_and_drafted(DecodeChunkBackend(load_contract()), "target")
    assert harness.stats.accepted_tokens > 0
    assert any(a.tokens != b.tokens or not torch.equal(a.logprobs, b.logprobs) for a, b in zip(plain, spec))


def test_draft_model_is_checked():
    model = DecoderLM.random(tiny_config("llama", "float32"), seed=11, backend=REF)
    other_vocab = DecoderLM.random(tiny_config("llama", "float32", vocab_size=64), seed=1, backend=REF)
    with pytest.raises(HalError, match="speculative_tokens > 0"):
        RolloutHarness(model, HarnessConfig(), draft_model=model)
    with pytest.raises(HalError, match="vocabulary 64 differs from the target model's 128"):
        RolloutHarness(model, HarnessConfig(speculative_tokens=2), draft_model=other_vocab)


def test_speculative_decoding_negative_control_decode_with_other_kv_chunks():
    """A backend whose single-query attention reduces in other chunks than its multi-query attention:
    verifying drafts in a chunk then gives other logprob bits than decoding one token at a time."""
    _, plain, spec, stats = plain_and_speculative(DecodeChunkBackend(load_contract()))
    assert stats.accepted_tokens > 0
    assert any(a.tokens != b.tokens or not torch.equal(a.logprobs, b.logprobs) for a, b in zip(plain, spec))


def test_propose_ngram_drafts_from_the_latest_earlier_occurrence():
    from hal.rollout.harness import propose_ngram

    assert propose_ngram([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2) == [7, 1]      # latest occurrence of 1 2 3
    assert propose_ngram([5, 6, 7, 6], 3) == [7, 6]                          # falls back to the last token
    assert propose_ngram([1, 2, 3], 4) == [] and propose_ngram([4, 4], 0) == []
    with pytest.raises(HalError, match="speculative_tokens"):
        HarnessConfig(speculative_tokens=-1)


# -- prefix caching: a kept page holds the recomputed bits (issue #24) ---------------------------------

GROUP_PROMPTS = [tuple(range(3, 3 + 13)), tuple([9, 4] * 7)]


def group_requests():
    """GRPO-style groups: every prompt sampled 4 times (other seeds), one request sharing only a prefix."""
    requests = [Request(p, 8, seed=10 * g + j, temperature=1.0) for g, p in enumerate(GROUP_PROMPTS) for j in range(4)]
    requests.append(Request(GROUP_PROMPTS[0][:9] + (60, 61), 8, seed=99, temperature=0.7))
    return requests


def cached_and_uncached(backend, **extra):
    model = DecoderLM.random(tiny_config("llama", "float32"), seed=11, backend=backend)
    plain = RolloutHarness(model, HarnessConfig(page_size=4, max_num_seqs=2, max_batch_tokens=24, seed=0))
    cached = RolloutHarness(model, HarnessConfig(page_size=4, num_pages=22, max_num_seqs=2, max_batch_tokens=24,
                                                 prefix_caching=True, preempt_prob=0.1, seed=3, **extra))
    requests = group_requests()
    return model, plain.generate(requests), cached.generate(requests), cached.stats


@pytest.mark.parametrize("speculative_tokens", [0, 3])
def test_prefix_caching_gives_the_recomputed_tokens_and_logprob_bits(speculative_tokens):
    """Groups of requests with one prompt: later members start from the kept pages of earlier ones (and a
    request sharing only a prefix from those of its prefix); a small page pool gives kept pages back
    and preemption drops holders. Tokens and logprobs equal the run without the cache (and with
    speculation on as well), and the trainer's recomputation."""
    model, plain, cached, stats = cached_and_uncached(REF, speculative_tokens=speculative_tokens)
    assert stats.cached_tokens > 0 and sum(c.cached_prompt_tokens for c in cached) > 0
    assert cached[-1].cached_prompt_tokens in (0, 4, 8)          # the shared 9-token prefix: 2 full pages
    for a, b in zip(plain, cached):
        assert a.tokens == b.tokens and torch.equal(a.logprobs, b.logprobs)
    with torch.no_grad():
        for c, lp in zip(cached, recompute_logprobs(model, cached)):
            assert torch.equal(lp, c.logprobs)


def test_prefix_caching_negative_control_batch_dependent_kv():
    """A backend whose linears reduce K otherwise in batches of more than 8 rows: a kept page was computed
    in another batch than a recomputation, and the cached run differs from the uncached one."""
    class BatchDependentLinear(ReferenceBackend):
        name = "planted-batch-linear"

        def linear(self, x, weight, bias=None, *, out_dtype=None):
            if x.numel() // x.shape[-1] <= 8:
                return super().linear(x, weight, bias, out_dtype=out_dtype)
            split = dataclasses.replace(self.contract.gemm, k_chunk=16)
            return ReferenceBackend(dataclasses.replace(self.contract, gemm=split)).linear(x, weight, bias,
                                                                                          out_dtype=out_dtype)

    _, plain, cached, stats = cached_and_uncached(BatchDependentLinear(load_contract()))
    assert stats.cached_tokens > 0
    assert any(a.tokens != b.tokens or not torch.equal(a.logprobs, b.logprobs) for a, b in zip(plain, cached))


def test_vectorised_position_seeds_equal_the_integer_specification():
    """``position_seeds`` (int64 tensor ops, what the GPU sampler's keys come from) gives
    ``position_seed``'s bits (exact Python integers) for seeds across the 64-bit range, negative and
    wider ones included; negative control: positions off by one give other keys."""
    from hal.rollout import sampler

    g = torch.Generator().manual_seed(11)
    seeds = torch.randint(0, 2**62, (200,), generator=g).tolist() + [0, 1, 2**63 - 1, 2**63, 2**64 - 1, -1, -2**63,
                                                                       3 * 2**64 + 5]
    positions = torch.randint(0, 2**20, (len(seeds),), generator=g).tolist()
    expected = [sampler.position_seed(s, p) for s, p in zip(seeds, positions)]
    assert sampler.position_seeds(seeds, positions).tolist() == expected
    shifted = sampler.position_seeds(seeds, [p + 1 for p in positions]).tolist()
    assert all(a != b for a, b in zip(shifted, expected))
