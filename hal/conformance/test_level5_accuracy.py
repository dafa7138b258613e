"""Level 5: accuracy against an fp64 oracle within the bounds in hal/conformance/bounds.py."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hal.conformance.kit import dtypes_for, run_check, run_examples, skip_unless_in_contract, widths

OPS = ["linear", "attention", "write_kv", "rms_norm", "silu_mul", "rotary", "log_softmax", "token_logprobs", "sum",
       "mean", "topk", "moe_route", "moe_experts", "fp8_linear", "fp8_attention"]


@pytest.mark.hal(level=5)
@pytest.mark.parametrize("op", OPS)
def test_accuracy(hal_backend, hal_depth, op):
    skip_unless_in_contract(hal_backend, op)
    head_dim_op = op in ("attention", "write_kv", "fp8_attention")     # width is a head dim
    width_strategy = st.sampled_from([64, 128]) if head_dim_op else widths(hal_depth)

    @given(size=st.sampled_from([1, 3, 17] + ([] if hal_depth == "tiny" else [65])), width=width_strategy,
           dtype=st.sampled_from(dtypes_for(hal_backend, op)), seed=st.integers(0, 2 ** 16))
    def check(size, width, dtype, seed):
        run_check("accuracy", hal_backend, op=op, size=size, width=width, dtype=dtype, seed=seed)

    run_examples(hal_backend, check)
