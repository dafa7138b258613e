"""Level 3: phase consistency. A sequence's attention output (and the rest of the decoder block and
its token logprobs after it) is the same in full prefill, chunked prefill cut anywhere, and
token-by-token decode from a paged cache with scrambled pages of several sizes, with batch-mates.
Context lengths are drawn around the contract's KV chunk and split sizes."""

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from hal.conformance.kit import dtypes_for, kv_cache_of, run_check, run_examples, skip_unless_in_contract
from hal.conformance.plugin import part_settings


def _lengths(backend, depth):
    a = backend.contract.attention if backend.contract else None
    # Without a split (kv_split = 0) the lengths still probe the span of four chunks.
    chunk, split = (a.kv_chunk, a.split_size(4 * a.kv_chunk)) if a else (64, 512)
    around = [1, 2, chunk - 1, chunk, chunk + 1] + ([] if depth == "tiny" else [2 * chunk + 3])
    if depth == "full":
        around += [split - 1, split, split + 1, 2 * split + chunk + 5]
    return sorted(set(n for n in around if n > 0)), chunk, split


def _cuts(seq_len, chunk, split, extra):
    cuts = {1, chunk - 1, chunk, chunk + 1, split - 1, split, split + 1, extra}
    return ",".join(str(c) for c in sorted(cuts) if 0 < c < seq_len)


@pytest.mark.hal(level=3)
@pytest.mark.parametrize("op", ["attention", "fp8_attention", "decoder block"])
def test_phase_consistency(hal_backend, hal_depth, op, hal_part):
    """``hal_part``: at full depth (or with --hal-parts N) the examples run in parts (separate test ids, so
    shards spread them). ``fp8_attention``: through an FP8 KV cache ([fp8] only): [fp8]'s one read path."""
    skip_unless_in_contract(hal_backend, op)
    lengths, chunk, split = _lengths(hal_backend, hal_depth)

    dtypes = dtypes_for(hal_backend, "attention" if op == "decoder block" else op)
    # The decoder block's GEMMs are (4 x hidden, hidden) with hidden = q_heads x head_dim: at tiny depth
    # (kernels run by an interpreter) it keeps hidden <= 256, which still crosses no K chunk anyway;
    # the attention op itself keeps every head layout.
    small = hal_depth == "tiny" and op == "decoder block"
    heads = [(4, 1), (4, 2)] if small else [(4, 1), (4, 2), (8, 8)]
    head_dims = [64] if small else [64, 128]

    @part_settings(hal_part)
    @given(seq_len=st.sampled_from(lengths), heads=st.sampled_from(heads),
           head_dim=st.sampled_from(head_dims), dtype=st.sampled_from(dtypes),
           decode_tokens=st.integers(1, 6 if hal_depth == "tiny" else 24), cut=st.integers(1, 10 ** 6),
           seed=st.integers(0, 2 ** 16))
    def check(seq_len, heads, head_dim, dtype, decode_tokens, cut, seed):
        tiny = hal_depth == "tiny"
        run_check("phase_consistency", hal_backend, seq_len=seq_len, q_heads=heads[0], kv_heads=heads[1],
                  head_dim=head_dim, dtype=dtype, page_sizes="16,5" if tiny else "16,64,5",
                  cuts=_cuts(seq_len, chunk, split, cut % max(seq_len, 1)),
                  decode_from=max(1, seq_len - decode_tokens), mates=1 if tiny else 3,
                  block=int(op == "decoder block"), seed=seed, kv_cache=kv_cache_of(op))

    if hal_depth != "tiny" and hal_part[0] == 0:
        # Every quick run reaches a second KV split (the split merge) at least once, with cuts and decode
        # steps on both sides of the split boundary.
        check = example(seq_len=split + chunk + 1, heads=(4, 2), head_dim=64, dtype=dtypes[0], decode_tokens=3,
                        cut=split - 5, seed=1)(check)
    run_examples(hal_backend, check)


@pytest.mark.hal(level=3, op="attention")
def test_masked_keys_contribute_nothing(hal_backend, hal_depth):
    """NaN/Inf in the K and V of keys a query may not see (later positions, unused page slots) change no bit."""
    dtypes = dtypes_for(hal_backend, "attention")

    @given(seq_len=st.sampled_from([2, 17, 66] + ([] if hal_depth == "tiny" else [130])),
           heads=st.sampled_from([(4, 1), (4, 2)]), head_dim=st.sampled_from([64, 128]),
           page_size=st.sampled_from([5, 16]), hidden=st.integers(1, 40), dtype=st.sampled_from(dtypes),
           seed=st.integers(0, 2 ** 16))
    def check(seq_len, heads, head_dim, page_size, hidden, dtype, seed):
        run_check("masked_keys_contribute_nothing", hal_backend, seq_len=seq_len, q_heads=heads[0],
                  kv_heads=heads[1], head_dim=head_dim, dtype=dtype, page_size=page_size,
                  hidden=min(hidden, seq_len - 1), seed=seed)

    run_examples(hal_backend, check)
