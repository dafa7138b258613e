"""Which contract values the shared Triton kernels can realise, as data (read by the backends'
``Capabilities``; no triton import).

A vendor's tiles may narrow these further (the cuda tile table's BLOCK_K, Ascend's unified buffer);
its backend declares that next to its launch policy.
"""

from __future__ import annotations

from hal.backend import Allowed

#: Head dims the attention kernel is built and checked for (HEAD_DIM is one tl.arange: a power of two).
HEAD_DIMS = (64, 128)

#: Triton's largest tensor (TRITON_MAX_TENSOR_NUMEL): a row block or vocabulary chunk is one tile.
_MAX_TILE = 1 << 20

#: The enumerated choices the kernels' source implements; a schema that adds a choice is refused
#: until a kernel implements it.
_CHOICES = {
    "gemm.accumulate_dtype": "float32", "gemm.chunk_order": "ascending", "gemm.bias": "fp32_before_rounding",
    "gemm.output_rounding": "nearest_even", "gemm.logits_dtype": "float32",
    "attention.score_dtype": "float32", "attention.scale": "folded_log2e", "attention.exp": "exp2",
    "attention.split_merge": "ascending_rescale", "attention.mask": "select_before_max",
    "attention.p_dtype": "activation", "attention.row_sum": "sum_of_rounded_p",
    "attention.online_update": "rescale_then_add", "attention.output": "divide_rn_then_round",
    "attention.gqa": "head_div_group",
    "rms_norm.compute_dtype": "float32", "rms_norm.residual_add": "fp32_add_round_to_activation",
    "rms_norm.inv_rms": "div_rn_sqrt_rn", "rms_norm.weight_multiply": "fp32_round_once",
    "silu_mul.formula": "x_div_1p_exp_neg_x", "silu_mul.exp": "exp", "silu_mul.rounding": "fp32_round_once",
    "rope.style": "neox", "rope.table": "fp64_scalar_libm_fp32", "rope.fma": "none",
    "rope.rounding": "fp32_round_once",
    "logprobs.dtype": "float32", "logprobs.temperature": "divide_first", "logprobs.exp": "exp", "logprobs.log": "log",
    "reduce.accumulate_dtype": "float32", "reduce.mean": "div_rn",
    "topk.ties": "lower_index", "topk.order": "value_desc_index_asc",
}

CONTRACT_VALUES = {
    **{key: Allowed.one_of(value) for key, value in _CHOICES.items()},
    # The KV chunk is the attention kernel's key tile: the row sum P @ ones reduces over it inside an
    # MMA, which needs at least 16. Above 128 keys the K and V tiles of a 128-wide head grow past what
    # the kernel's pipelined launch shapes were sized for: not offered until built and checked.
    "attention.kv_chunk": Allowed.powers_of_two(16, 128),
    # A row block or vocabulary chunk is one loaded tile (tl.arange): a power of two.
    "rms_norm.row_block": Allowed.powers_of_two(16, _MAX_TILE),
    "reduce.row_block": Allowed.powers_of_two(16, _MAX_TILE),
    "logprobs.vocab_chunk": Allowed.powers_of_two(16, _MAX_TILE),
}
