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
    "attention.score_dtype": "float32",
    "attention.split_merge": "ascending_rescale", "attention.mask": "select_before_max",
    "attention.p_dtype": "activation",
    "attention.online_update": "rescale_then_add", "attention.output": "divide_rn_then_round",
    "attention.gqa": "head_div_group",
    "rms_norm.compute_dtype": "float32", "rms_norm.residual_add": "fp32_add_round_to_activation",
    "rms_norm.weight_multiply": "fp32_round_once",
    "silu_mul.formula": "x_div_1p_exp_neg_x", "silu_mul.exp": "exp", "silu_mul.rounding": "fp32_round_once",
    "rope.style": "neox", "rope.table": "fp64_scalar_libm_fp32", "rope.fma": "none",
    "rope.rounding": "fp32_round_once",
    "logprobs.dtype": "float32", "logprobs.temperature": "divide_first", "logprobs.exp": "exp", "logprobs.log": "log",
    "reduce.accumulate_dtype": "float32", "reduce.mean": "div_rn",
    "topk.ties": "lower_index", "topk.order": "value_desc_index_asc",
}

#: [fp8]'s choices that hal/kernels/fp8_gemm.py implements (the KV-cache keys are not listed: no kernel
#: reads an FP8 cache yet, and the cuda backend refuses one per call).
FP8_CHOICES = {
    "fp8.weight_format": "e4m3", "fp8.activation_format": "e4m3", "fp8.scale": "amax_div_max_rn",
    "fp8.quantise": "div_rn_clamp_rne", "fp8.gemm_partial": "fp32_per_k_block",
    "fp8.gemm_scale": "partial_times_scale_product", "fp8.gemm_order": "ascending",
}

CONTRACT_VALUES = {
    **{key: Allowed.one_of(value) for key, value in _CHOICES.items()},
    **{key: Allowed.one_of(value) for key, value in FP8_CHOICES.items()},
    # Choices with more than one implementation in the kernels' source (constexpr switches: EXP2 and
    # ROUNDED_SUM in attention.py, MEAN_RECIPROCAL in rows.py); bf16-ascend-v1 uses the second of each.
    "attention.scale": Allowed.one_of("folded_log2e", "multiply"),
    "attention.exp": Allowed.one_of("exp2", "exp"),
    "attention.row_sum": Allowed.one_of("sum_of_rounded_p", "sum_of_fp32_p"),
    "rms_norm.inv_rms": Allowed.one_of("div_rn_sqrt_rn", "mul_reciprocal_div_rn_sqrt_rn"),
    # The KV chunk is the attention kernel's key tile: the row sum P @ ones reduces over it inside an
    # MMA, which needs at least 16. Above 128 keys the K and V tiles of a 128-wide head grow past what
    # the kernel's pipelined launch shapes were sized for: not offered until built and checked.
    "attention.kv_chunk": Allowed.powers_of_two(16, 128),
    # A row block or vocabulary chunk is one loaded tile (tl.arange): a power of two.
    "rms_norm.row_block": Allowed.powers_of_two(16, _MAX_TILE),
    "reduce.row_block": Allowed.powers_of_two(16, _MAX_TILE),
    "logprobs.vocab_chunk": Allowed.powers_of_two(16, _MAX_TILE),
}
