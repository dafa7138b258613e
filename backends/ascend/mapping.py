"""The contract -> NPU op arguments, as pure functions of the contract (no torch_npu, no device).

Why a separate module: every argument that decides bits on the NPU (layouts, sparse mode, inner
precision, block size, number of splits, scale, GQA heads, HF32, the chunking the host does around
a closed op) is written here once, where it can be read and unit-tested on a CPU. The ops in
``cann_ops.py`` only pass these values on.

Rules:
* every contract value is either realised (it appears in an argument or in the host-side chunking),
  or the function raises ``UnsupportedError`` saying why the NPU op cannot realise it; a value the
  mapping does not know (a contract built with ``dataclasses.replace``) is refused, never ignored;
* what the closed CANN / flash-attention-npu kernels do *inside* (exp vs exp2, where the scale is
  applied, the dtype of P, how the row sum is formed) cannot be pinned through their arguments:
  it is listed in ``assumptions`` of each mapping, to be proven by the conformance kit on an NPU.
  Nothing here has run on NPU hardware.
"""

from __future__ import annotations

from dataclasses import dataclass

from hal.contract import Contract
from hal.errors import UnsupportedError

INT32_MAX = 2 ** 31 - 1
HEAD_DIMS = (64, 128)
#: KV block sizes (keys per block of the kernel's paged cache) the fused-inference-attention op takes
#: with page attention and a query S axis > 1 (api_facts.toml: a multiple of 128 in 128..512). The
#: kernel's online softmax is assumed to step over whole blocks, so block_size = kv_chunk puts the
#: softmax chunk boundaries at the contract's absolute positions (an assumption: ``assumptions``).
FIA_BLOCK_SIZES = (128, 256, 384, 512)
#: flash-attention-npu's softmax steps over 512 keys whatever the page size (api_facts.toml).
FLASH_KEY_STEP = 512

# The contract's enumerated values this backend's cann path realises, per section: the rules of
# Ascend's native kernels (bf16-ascend-v1). bf16-dense-v1's exp2 / rounded-P row sum / div_rn mean
# are not what those kernels compute, so that contract is refused with the reason.
KNOWN = {
    "gemm": {"accumulate_dtype": "float32", "chunk_order": "ascending", "bias": "fp32_before_rounding",
             "output_rounding": "nearest_even", "logits_dtype": "float32"},
    "attention": {"score_dtype": "float32", "scale": "multiply", "exp": "exp",
                  "split_merge": "ascending_rescale", "mask": "select_before_max", "p_dtype": "activation",
                  "row_sum": "sum_of_fp32_p", "online_update": "rescale_then_add",
                  "output": "divide_rn_then_round", "gqa": "head_div_group"},
    "rms_norm": {"compute_dtype": "float32", "residual_add": "fp32_add_round_to_activation",
                 "inv_rms": "mul_reciprocal_div_rn_sqrt_rn", "weight_multiply": "fp32_round_once"},
    "silu_mul": {"formula": "x_div_1p_exp_neg_x", "exp": "exp", "rounding": "fp32_round_once"},
    "rope": {"style": "neox", "table": "fp64_scalar_libm_fp32", "fma": "none", "rounding": "fp32_round_once"},
    "logprobs": {"dtype": "float32", "temperature": "divide_first", "exp": "exp", "log": "log"},
    "reduce": {"accumulate_dtype": "float32", "mean": "div_rn"},
    "topk": {"ties": "lower_index", "order": "value_desc_index_asc"},
}
#: why each cann-path rule is what it is (the refusal says it)
WHY = {
    "attention.scale": "the native attention multiplies the scores by the scale (no log2(e) folding)",
    "attention.exp": "the native attention uses the natural exp",
    "attention.row_sum": "the native attention sums the fp32 probabilities, not the rounded P",
    "rms_norm.inv_rms": "torch_npu.npu_rms_norm forms the mean as sum x fl(1/n), not div_rn",
}


def check_known(contract: Contract, section: str) -> None:
    """Refuse any enumerated value of ``section`` this backend does not know how to realise."""
    spec = getattr(contract, section)
    for key, want in KNOWN[section].items():
        got = getattr(spec, key)
        if got != want:
            why = WHY.get(f"{section}.{key}")
            raise UnsupportedError(f"ascend: [{section}].{key} = {got!r} cannot be realised (only {want!r}"
                                   + (f": {why}" if why else "") + "); use contract bf16-ascend-v1")


def check_contract(contract: Contract) -> None:
    """Everything that does not depend on a call's shapes."""
    for section in KNOWN:
        check_known(contract, section)
    if contract.gemm.k_chunk <= 0 or contract.gemm.k_chunk % 16:
        raise UnsupportedError(f"ascend: [gemm].k_chunk = {contract.gemm.k_chunk} must be a positive multiple "
                               "of 16 (the cube unit's fractal K)")
    for section in ("rms_norm", "reduce"):
        if getattr(contract, section).row_block <= 0:
            raise UnsupportedError(f"ascend: [{section}].row_block must be positive")
    if contract.logprobs.vocab_chunk <= 0:
        raise UnsupportedError("ascend: [logprobs].vocab_chunk must be positive")


# ---------------------------------------------------------------------------------------------
# GEMM (cann path)
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GemmArgs:
    """One ``npu_mm_batch_invariant`` call per K chunk; the chunk sums combined on the host."""

    op: str
    k_chunk: int
    #: operands are upcast to fp32 before the call: exact for bf16, and the op then returns the chunk's
    #: fp32 sum (a bf16 call would round each chunk sum to bf16, which the contract forbids)
    operand_dtype: str
    allow_hf32: bool            # HF32 off: fp32 operands are not rounded to an 11-bit mantissa
    weight_format: str          # ND (row-major), never the private NZ fractal format
    chunk_combine: str
    bias: str
    output_rounding: str
    assumptions: tuple[str, ...]


def gemm_args(contract: Contract) -> GemmArgs:
    check_known(contract, "gemm")
    k_chunk = contract.gemm.k_chunk
    if k_chunk <= 0 or k_chunk % 16:
        raise UnsupportedError(f"ascend: [gemm].k_chunk = {k_chunk} must be a positive multiple of 16")
    return GemmArgs(
        op="torch.ops.batch_invariant_ops.npu_mm_batch_invariant", k_chunk=k_chunk, operand_dtype="float32",
        allow_hf32=False, weight_format="ND", chunk_combine="ascending fp32 adds on the host from +0",
        bias="fp32, added to the combined sum", output_rounding="one cast to the output dtype (nearest even)",
        assumptions=("npu_mm_batch_invariant's order inside one K chunk does not depend on M "
                     "(the op package's claim; the conformance kit checks it)",
                     "the fp32 -> bf16 cast rounds to nearest even"))


# ---------------------------------------------------------------------------------------------
# Attention (cann path)
# ---------------------------------------------------------------------------------------------

ATTENTION_ASSUMPTIONS = (
    "the kernel's online softmax steps over whole KV blocks of block_size keys, in ascending order "
    "(closed kernel: not documented; flash-attention-npu, for one, steps over 512 keys whatever the page size)",
    "scores are fp32, multiplied by the scale; p = exp(s - m); the row sum is of the fp32 p; P is rounded to "
    "bf16 for P @ V (the native rule bf16-ascend-v1 writes down; not pinnable through arguments)",
    "masked keys are selected out before the row max",
    "PromptFlashAttention's bits for one query row do not depend on the query S axis, the row's place in it, "
    "or the batch-mates (the batch-invariant variant's claim; the conformance kit checks it)",
)


def attention_args(contract: Contract, impl: str, *, num_q_heads: int, num_kv_heads: int, head_dim: int,
                   scale: float, max_seq_len: int) -> dict:
    """Keyword arguments of the attention kernel for one call, the same for prefill, chunked prefill,
    decode and the training forward (one phase-consistent path: ``cann_ops.CannOps.attention``)."""
    check_known(contract, "attention")
    spec = contract.attention
    if impl == "flash_attn_npu_3":
        # Its softmax steps over 512 keys whatever the page size, with exp and an fp32-P row sum: it
        # could realise a contract with kv_chunk = 512 only, and no shipped contract (nor the cuda
        # kernels, whose key tile stops at 128) has that.
        raise UnsupportedError(
            f"ascend attention: flash_attn_npu_3 steps its softmax over {FLASH_KEY_STEP} keys whatever the page "
            f"size, so it realises only kv_chunk = {FLASH_KEY_STEP}; [attention].kv_chunk = {spec.kv_chunk}. "
            "Use HAL_ASCEND_ATTENTION=fia_batch_invariant")
    if impl != "fia_batch_invariant":
        raise UnsupportedError(f"ascend attention: unknown implementation {impl!r}")
    if head_dim not in HEAD_DIMS:
        raise UnsupportedError(f"ascend attention: head dim {head_dim} not in {HEAD_DIMS}")
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        raise UnsupportedError(f"ascend attention: {num_q_heads} query heads are not a multiple of "
                               f"{num_kv_heads} KV heads")
    if num_q_heads // num_kv_heads > 64:
        raise UnsupportedError(f"ascend attention: {num_q_heads // num_kv_heads} query heads per KV head > 64, "
                               "the fused-inference-attention limit")
    if num_kv_heads * head_dim > 65535:
        raise UnsupportedError(f"ascend attention: KV heads x head dim = {num_kv_heads * head_dim} > 65535, the "
                               "limit of a (blocks, block_size, H) paged cache")
    if spec.split_count(max_seq_len) > 1:
        # A single-split kernel over more than kv_split keys is not the contract's split merge, and
        # the kernel returns (out, lse), not the (m, l, acc) the contract merges.
        raise UnsupportedError(
            f"ascend attention (cann path): a context of {max_seq_len} keys exceeds [attention].kv_split = "
            f"{spec.kv_split}; the NPU kernel runs one split per call and cannot merge splits as "
            "'ascending_rescale' says")
    block = spec.kv_chunk
    if block not in FIA_BLOCK_SIZES:
        raise UnsupportedError(f"ascend attention: with page attention and query length > 1 the "
                               f"fused-inference-attention block_size must be one of {FIA_BLOCK_SIZES} "
                               f"(a multiple of 128 in 128..512); [attention].kv_chunk = {block}")
    return dict(op="torch.ops.batch_invariant_ops.npu_fused_infer_attention_score_batch_invariant",
                # BSND with the query S axis padded to >= 2: every call, decode included, takes the
                # PromptFlashAttention branch (the op picks IncreFlashAttention when S == 1), so
                # prefill, chunked prefill, decode and training run one kernel with one set of
                # arguments. TND is not used: with head dim != 512 it has no page attention.
                input_layout="BSND", min_query_s=2, sparse_mode=3,
                atten_mask="2048x2048 bool, True above the diagonal (sparse_mode 3: right-down causal)",
                pre_tokens=INT32_MAX, next_tokens=0,
                # bf16 does not distinguish high precision from high performance: 0 (the default) is
                # passed so the call is explicit, but it pins nothing for bf16
                inner_precise=0, block_size=block, num_heads=num_q_heads, num_key_value_heads=num_kv_heads,
                scale=float(scale), softmax_lse_flag=False, antiquant_mode=0,
                kv_cache_layout="(blocks, block_size, num_kv_heads * head_dim)",
                assumptions=ATTENTION_ASSUMPTIONS)


# ---------------------------------------------------------------------------------------------
# Rows (cann path): RMSNorm, SiLU*up, reductions, log-softmax
# ---------------------------------------------------------------------------------------------

def rms_norm_args(contract: Contract, hidden: int, eps: float) -> dict:
    """Residual add first (fp32 add, one rounding), then ``torch_npu.npu_rms_norm`` (never the fused
    ``npu_add_rms_norm``, which is not batch-invariant)."""
    check_known(contract, "rms_norm")
    if hidden > contract.rms_norm.row_block:
        raise UnsupportedError(f"ascend rms_norm (cann path): hidden {hidden} > [rms_norm].row_block = "
                               f"{contract.rms_norm.row_block}; npu_rms_norm reduces a row in one block and "
                               "cannot realise the contract's ascending row blocks (use HAL_ASCEND_PATH=triton)")
    return dict(op="torch_npu.npu_rms_norm", epsilon=float(eps), fused_add=False,
                residual_add="round_act(fl32(x + residual)) with torch ops, before the norm",
                mean="sum x fl(1/n) (the kernel's rule: [rms_norm].inv_rms = mul_reciprocal_div_rn_sqrt_rn)",
                blocks=1, assumptions=("npu_rms_norm computes 1/sqrt correctly rounded (div_rn of sqrt_rn)",
                                       "npu_rms_norm multiplies by the weight in fp32 and rounds once",
                                       "npu_rms_norm's mean is sum x fl(1/n) (source review, not documented)"))


def silu_mul_args(contract: Contract) -> dict:
    check_known(contract, "silu_mul")
    return dict(op="torch ops: g / (1 + exp(-g)) * u in fp32, one cast", fused_swiglu=False)


def reduce_args(contract: Contract, width: int) -> dict:
    check_known(contract, "reduce")
    return dict(op="torch.ops.batch_invariant_ops.npu_reduce_sum_batch_invariant", dim=-1, keepdim=False,
                dtype="float32", blocks=contract.reduce.block_ranges(width), combine="ascending fp32")


def logprobs_args(contract: Contract, vocab: int) -> dict:
    check_known(contract, "logprobs")
    return dict(sum_op="torch.ops.batch_invariant_ops.npu_reduce_sum_batch_invariant", dtype="float32",
                temperature="divide first (skipped when T == 1)",
                chunks=contract.logprobs.chunk_ranges(vocab), combine="ascending fp32")


def describe(contract: Contract, attention_impl: str) -> dict:
    """The whole cann-path mapping for a typical shape, for reports (``numerics_report``)."""
    out = {"gemm": gemm_args(contract).__dict__, "silu_mul": silu_mul_args(contract)}
    try:
        out["attention"] = attention_args(contract, attention_impl, num_q_heads=32, num_kv_heads=8,
                                          head_dim=128, scale=128 ** -0.5,
                                          max_seq_len=contract.attention.split_size(4096))
    except UnsupportedError as exc:
        out["attention"] = {"unsupported": str(exc)}
    return out
