"""Level 1: the same call twice gives the same bits, and so do the same values in another memory layout."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hal.conformance.kit import (dtypes_for, fit_width, kv_cache_of, row_op_cases, run_check, run_examples,
                                 skip_unless_in_contract)
from hal.conformance.runner import OP_OF


@pytest.mark.hal(level=1)
@pytest.mark.parametrize("op", sorted(set(OP_OF.values())))
def test_row_op_determinism(hal_backend, hal_depth, op):
    @given(**row_op_cases(hal_backend, hal_depth, op))
    def check(row_op, width, out, dtype, seed):
        run_check("determinism", hal_backend, row_op=row_op, width=fit_width(row_op, width), out_features=out,
                  dtype=dtype, seed=seed)

    run_examples(hal_backend, check)


@pytest.mark.hal(level=1)
@pytest.mark.parametrize("op", sorted(set(OP_OF.values())))
def test_row_op_layout_freedom(hal_backend, hal_depth, op):
    """The batch and the op's parameters as strided views (a weight sliced out of a fused one) give the
    contiguous call's bits: a kernel that reads a view as contiguous fails here."""
    @given(**row_op_cases(hal_backend, hal_depth, op))
    def check(row_op, width, out, dtype, seed):
        run_check("layout_freedom", hal_backend, row_op=row_op, width=fit_width(row_op, width), out_features=out,
                  dtype=dtype, seed=seed)

    run_examples(hal_backend, check)


@pytest.mark.hal(level=1)
@pytest.mark.parametrize("op", ["attention", "fp8_attention"])
def test_attention_determinism(hal_backend, hal_depth, op):
    """The same schedule twice, and once more with the queries, slot mapping and metadata as strided views.
    ``fp8_attention``: the same through an FP8 KV cache (``fp8_write_kv`` / ``fp8_attention``; [fp8] only)."""
    skip_unless_in_contract(hal_backend, op)

    @given(seq_len=st.sampled_from([1, 17, 65] + ([] if hal_depth == "tiny" else [130])),
           heads=st.sampled_from([(4, 1), (4, 2), (8, 8)]), head_dim=st.sampled_from([64, 128]), page_size=st.sampled_from([16, 64]),
           dtype=st.sampled_from(dtypes_for(hal_backend, op)), seed=st.integers(0, 2 ** 16))
    def check(seq_len, heads, head_dim, page_size, dtype, seed):
        run_check("attention_determinism", hal_backend, seq_len=seq_len, q_heads=heads[0], kv_heads=heads[1],
                  head_dim=head_dim, dtype=dtype, page_size=page_size, seed=seed,
                  kv_cache=kv_cache_of(op))

    run_examples(hal_backend, check)
