"""The numerical contract: the data that decides the bits, its loader, validator and fingerprint.

A contract is a TOML file in ``contracts/`` (installed as ``hal.contracts``). It pins only what
changes bits: reduction chunk sizes and their order, where values are rounded, which exp/log/sqrt
variant is used, how softmax chunks and KV splits are merged, how ties are broken. Tiling,
warps and parallelisation are *not* in the contract: a backend may choose them freely.

Every section below is a frozen dataclass; each field carries the values it accepts. Loading
checks that every key is known, present, of the right type and allowed, then checks the
combinations (``_check_combinations``). The fingerprint is the sha256 of a canonical JSON
serialisation of the validated values, so comments and key order in the file do not matter and
it is the same in every process and on every platform.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import struct
import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Callable

from hal.errors import ContractError, UnknownContractError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

SCHEMA = "hal-contract/1"  # the schema of the file itself; bump when sections/keys change meaning


# ---------------------------------------------------------------------------------------------
# Field helpers: each field says which Python type it has and which values it accepts.
# ---------------------------------------------------------------------------------------------

def _choice(*allowed: str, doc: str) -> Any:
    return field(metadata={"type": str, "check": lambda v: v in allowed,
                           "expected": " or ".join(repr(a) for a in allowed), "doc": doc})


def _int(check: Callable[[int], bool], expected: str, doc: str) -> Any:
    return field(metadata={"type": int, "check": check, "expected": expected, "doc": doc})


def _str(doc: str) -> Any:
    return field(metadata={"type": str, "check": lambda v: bool(v.strip()),
                           "expected": "a non-empty string", "doc": doc})


def _float(check: Callable[[float], bool], expected: str, doc: str) -> Any:
    return field(metadata={"type": float, "check": check, "expected": expected, "doc": doc})


def _str_list(allowed: tuple[str, ...] | None, doc: str) -> Any:
    expected = ("a non-empty list of " + ", ".join(repr(a) for a in allowed)) if allowed \
        else "a list of strings"

    def check(v: list) -> bool:
        if allowed is None:
            return True
        return bool(v) and all(x in allowed for x in v) and len(set(v)) == len(v)

    return field(metadata={"type": list, "item_type": str, "check": check,
                           "expected": expected, "doc": doc})


def _positive_multiple_of(m: int) -> Callable[[int], bool]:
    return lambda v: v > 0 and v % m == 0


def _power_of_two(v: int) -> bool:
    return v > 0 and (v & (v - 1)) == 0


DTYPES = ("bfloat16", "float32")


def _ranges(n: int, size: int) -> list[tuple[int, int]]:
    """[start, end) of the pieces of ``size`` at absolute offsets 0, size, 2 size, ... covering 0..n
    (the last may be short)."""
    return [(start, min(start + size, n)) for start in range(0, n, size)]


# ---------------------------------------------------------------------------------------------
# The sections.
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Header:
    name: str = _str("short name used to select the contract")
    version: int = _int(lambda v: v >= 1, "an integer >= 1", "bumped whenever any bit-deciding value changes")
    description: str = _str("one paragraph for people")
    activation_dtypes: list = _str_list(DTYPES, "dtypes of weights/activations this contract covers")
    implementation_defined: list = _str_list(None, "what a backend may choose (no cross-vendor bit equality)")


@dataclass(frozen=True)
class Gemm:
    accumulate_dtype: str = _choice("float32", doc="dtype of every partial sum")
    k_chunk: int = _int(_positive_multiple_of(16), "a positive multiple of 16",
                        "K is reduced in chunks of k_chunk at absolute offsets 0, k_chunk, ...")
    chunk_order: str = _choice("ascending", doc="each chunk accumulated from zero; chunk sums added in "
                                                "ascending order in fp32")
    bias: str = _choice("fp32_before_rounding", doc="bias added in fp32 to the combined sum, before the output rounding")
    output_rounding: str = _choice("nearest_even", doc="the single rounding to the output dtype")
    logits_dtype: str = _choice("float32", doc="dtype of lm_head outputs (no rounding to the activation dtype)")

    # The rules derived from these values, written once for every backend and the kit.

    def chunk_count(self, k: int) -> int:
        """How many K chunks a reduced dim of ``k`` has (the last may be short; 0 when k = 0)."""
        return -(-k // self.k_chunk)

    def chunk_ranges(self, k: int) -> list[tuple[int, int]]:
        """[start, end) of each K chunk of a reduced dim of ``k``, in the order their sums are added."""
        return _ranges(k, self.k_chunk)


@dataclass(frozen=True)
class Attention:
    score_dtype: str = _choice("float32", doc="q.k is accumulated and rounded to this dtype")
    scale: str = _choice("folded_log2e", "multiply",
                         doc="folded_log2e: s = fl32(score * fl32(scale * log2(e))), with exp2; multiply: "
                             "s = fl32(score * fl32(scale)), with exp (what Ascend's native attention kernels do)")
    exp: str = _choice("exp2", "exp", doc="p = exp2(s - m) (scale = folded_log2e) or exp(s - m) (scale = multiply); "
                                          "alpha and the split merge use the same function")
    kv_chunk: int = _int(_power_of_two, "a power of two",
                         "online softmax over KV chunks at absolute key positions 0, C, 2C, ...")
    kv_split: int = _int(lambda v: v >= 0, "0 (no split) or a multiple of kv_chunk",
                         "keys are split at absolute positions 0, S, 2S, ...; each split runs its own online "
                         "softmax and splits are merged in ascending order (a fixed size, never a count)")
    split_merge: str = _choice("ascending_rescale", doc="M'=max(M,m); a=exp2(M-M'); b=exp2(m-M'); "
                                                        "L'=fl(fl(L*a)+fl(l*b)); A'=fl(fl(A*a)+fl(acc*b))")
    mask: str = _choice("select_before_max", doc="masked keys (causally later, past seq_len in the last page, "
                        "never-written page slots) are selected out before the max and contribute exactly nothing "
                        "whatever their K and V hold (NaN, Inf): selected, never multiplied by zero (0 * NaN = "
                        "NaN); only a visible key's non-finite K or V makes an output non-finite (which "
                        "non-finite value is implementation-defined)")
    p_dtype: str = _choice("activation", doc="P is rounded to the activation dtype before P@V")
    row_sum: str = _choice("sum_of_rounded_p", "sum_of_fp32_p",
                           doc="sum_of_rounded_p: the softmax denominator sums the same rounded P that multiplies V; "
                               "sum_of_fp32_p: it sums the fp32 P before the rounding (as Ascend's native kernels "
                               "do), in an order fixed per backend and chunk width")
    online_update: str = _choice("rescale_then_add", doc="alpha=exp2(m_old-m_new); l=fl(fl(l*alpha)+rowsum); "
                                                         "acc=fl(fl(acc*alpha)+pv)")
    output: str = _choice("divide_rn_then_round", doc="out = round(fl32(acc / l)) to the activation dtype")
    gqa: str = _choice("head_div_group", doc="query head h reads KV head h // (num_q_heads // num_kv_heads)")

    # The rules derived from these values, written once for every backend and the kit.

    def split_size(self, context: int) -> int:
        """Keys per KV split for a context of ``context`` keys: kv_split; kv_split = 0 means no split,
        i.e. one split over the whole context, counted in whole KV chunks (at least one chunk), so a
        split is always a multiple of kv_chunk and covers the context."""
        if self.kv_split:
            return self.kv_split
        return max(1, -(-context // self.kv_chunk)) * self.kv_chunk

    def split_count(self, context: int) -> int:
        """How many KV splits a context of ``context`` keys has (at least one)."""
        return max(1, -(-context // self.split_size(context)))

    def score_factor(self, scale: float) -> float:
        """The fp32 factor every score is multiplied by: ``folded_scale`` for scale = "folded_log2e",
        fl32(scale) for scale = "multiply" (returned as the Python float holding that fp32 value)."""
        if self.scale == "multiply":
            return struct.unpack("<f", struct.pack("<f", scale))[0]
        return self.folded_scale(scale)

    def folded_scale(self, scale: float) -> float:
        """The factor every score is multiplied by ([attention].scale = "folded_log2e"):
        fl32(scale * log2 e), computed as scale / ln 2 in fp64 and rounded once to fp32 (nearest
        even). Returned as the Python float that holds that fp32 value exactly."""
        return struct.unpack("<f", struct.pack("<f", scale / math.log(2.0)))[0]


@dataclass(frozen=True)
class RmsNorm:
    compute_dtype: str = _choice("float32", doc="x is upcast before any arithmetic")
    residual_add: str = _choice("fp32_add_round_to_activation",
                                doc="residual_out = round_act(fl32(x + residual)); the norm reads residual_out")
    row_block: int = _int(_positive_multiple_of(16), "a positive multiple of 16",
                          "the sum of squares is reduced in blocks of row_block at absolute offsets, "
                          "block sums added in ascending order")
    inv_rms: str = _choice("div_rn_sqrt_rn", "mul_reciprocal_div_rn_sqrt_rn",
                           doc="div_rn_sqrt_rn: inv = fl32(1 / sqrt_rn(fl32(fl32(ss / n) + eps))); "
                               "mul_reciprocal_div_rn_sqrt_rn: the mean is fl32(ss * fl32(1 / n)) (as "
                               "torch_npu.npu_rms_norm computes it), then the same")
    weight_multiply: str = _choice("fp32_round_once", doc="out = round_act(fl32(fl32(x * inv) * w))")


@dataclass(frozen=True)
class SiluMul:
    formula: str = _choice("x_div_1p_exp_neg_x", doc="silu(g) = fl32(g / fl32(1 + exp(-g)))")
    exp: str = _choice("exp", doc="natural exp")
    rounding: str = _choice("fp32_round_once", doc="out = round_act(fl32(silu(g) * u))")


@dataclass(frozen=True)
class Rope:
    style: str = _choice("neox", doc="rotate halves: o1 = x1*c - x2*s, o2 = x2*c + x1*s")
    table: str = _choice("fp64_scalar_libm_fp32", doc="cos/sin computed element by element in fp64 with the "
                                                      "C library, rounded to fp32, one table shared by all")
    fma: str = _choice("none", doc="each product rounded to fp32 before the add (no FMA contraction)")
    rounding: str = _choice("fp32_round_once", doc="rotated values rounded once to the activation dtype")


@dataclass(frozen=True)
class Logprobs:
    dtype: str = _choice("float32", doc="logits are upcast; every step is fp32")
    temperature: str = _choice("divide_first", doc="x = fl32(logit / T) before the max (skipped when T == 1)")
    vocab_chunk: int = _int(_positive_multiple_of(16), "a positive multiple of 16",
                            "sum of exp(x - max) in chunks of vocab_chunk at absolute offsets, ascending")
    exp: str = _choice("exp", doc="natural exp of fl32(x - max)")
    log: str = _choice("log", doc="logp = fl32(fl32(x - max) - log(sum))")

    def chunk_ranges(self, vocab: int) -> list[tuple[int, int]]:
        """[start, end) of each vocabulary chunk, in the order their sums are added."""
        return _ranges(vocab, self.vocab_chunk)


@dataclass(frozen=True)
class Reduce:
    accumulate_dtype: str = _choice("float32", doc="sum and mean accumulate and return fp32")
    row_block: int = _int(_positive_multiple_of(16), "a positive multiple of 16",
                          "reduced in blocks of row_block at absolute offsets, block sums added ascending")
    mean: str = _choice("div_rn", doc="mean = fl32(sum / n)")

    def block_ranges(self, width: int) -> list[tuple[int, int]]:
        """[start, end) of each row block of a reduced dim of ``width``, in the order their sums are added."""
        return _ranges(width, self.row_block)


@dataclass(frozen=True)
class TopK:
    ties: str = _choice("lower_index", doc="equal values: the lower index wins")
    order: str = _choice("value_desc_index_asc", doc="outputs sorted by value descending, then index ascending")


@dataclass(frozen=True)
class Moe:
    """Mixture-of-experts layers (only in contracts for MoE models; see ``OPTIONAL_SECTIONS``).

    Which scoring function, how many experts per token, whether weights are renormalised, the group
    limits and the scaling factor are the model's (its config.json); how each is computed is here."""

    router_logits: str = _choice("fp32_gemm", doc="router logits = [gemm] linear of the normed hidden state with "
                                                  "fp32 output (logits_dtype), never rounded to the activation dtype")
    softmax: str = _choice("max_exp_sum_div_rn", doc="p_e = fl32(exp(fl32(x_e - max)) / S), S = the [reduce] sum of "
                                                     "the exps over experts; exp as in [logprobs]")
    sigmoid: str = _choice("one_div_1p_exp_neg_x", doc="s_e = fl32(1 / fl32(1 + exp(-x_e)))")
    selection: str = _choice("topk_lower_index", doc="the top_k experts by choice score (score + correction bias, "
                                                     "fl32 add, when the model has one), ties to the lower expert "
                                                     "index, ranked by value descending then index ascending")
    group_score: str = _choice("sum_top2", doc="group-limited routing: a group's score is fl32(a + b) of its two best "
                                               "choice scores; the topk_group best groups are kept, ties to the lower "
                                               "group index; experts of other groups are never chosen")
    weights: str = _choice("unbiased_score", doc="an expert's weight is its score without the correction bias")
    renormalize: str = _choice("sum_by_rank_div_rn", doc="w_r = fl32(w_r / S), S = fl32 sum of w_0 .. w_{k-1} "
                                                         "added in rank order (when the model renormalises)")
    scaling: str = _choice("fp32_multiply_last", doc="w_r = fl32(w_r * routed_scaling_factor), after renormalising")
    expert_gemm: str = _choice("per_token_dense_rule", doc="every expert GEMM is a [gemm] linear of one token's row: "
                                                           "its bits do not depend on which tokens share the expert, "
                                                           "their order, or where the expert is placed")
    expert_rounding: str = _choice("gate_up_act_round_down_fp32", doc="gate_up is rounded to the activation dtype, "
                                                                     "silu_mul as in [silu_mul]; the down projection "
                                                                     "stays fp32 (not rounded) until the combine")
    combine: str = _choice("fp32_by_rank_round_once", doc="out = round_act(fl32(... fl32(fl32(w_0 y_0) + fl32(w_1 y_1)) "
                                                          "... + shared)): products rounded to fp32 (no FMA), added "
                                                          "in rank order 0..k-1, then the shared experts' output "
                                                          "(activation dtype) added in fp32, one rounding")


#: The finite maximum of each FP8 format (float8_e4m3fn has no infinity; its 0x7f/0xff are NaN).
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}


@dataclass(frozen=True)
class Fp8:
    """Block-scaled FP8 linears and the FP8 KV cache (only in contracts for FP8 models; see
    ``OPTIONAL_SECTIONS``). ``hal/fp8.py`` writes each rule once; ``docs/fp8.md`` explains them.

    Scale rule (activations per 1 x group, weights per block x block when the trainer quantises its
    master weights, KV per token and head): amax = max |x| over the piece (exact in any order);
    scale = fl32(max(amax, fl32(amax_floor)) / FMAX) with a correctly rounded division, FMAX the
    format's finite maximum (448 for e4m3); q = rne_fp8(clamp(fl32(x / scale), -FMAX, FMAX)): a
    correctly rounded division (never a multiply by a reciprocal), then one round-to-nearest-even
    cast (subnormals kept). A checkpoint's weight scales are used as stored (``weight_scale_inv``)."""

    weight_format: str = _choice("e4m3", doc="weights are float8_e4m3fn")
    activation_format: str = _choice("e4m3", doc="activations are quantised to float8_e4m3fn")
    activation_group: int = _int(lambda v: v == 128, "128",
                                 "activations are quantised per 1 x activation_group piece of a row along K, at "
                                 "absolute offsets 0, G, 2G, ...; each piece's scale comes from that piece alone")
    weight_block: int = _int(lambda v: v == 128, "128 (= activation_group)",
                             "weights carry one fp32 scale_inv per weight_block x weight_block block (N, K), "
                             "DeepSeek-style: w = fp32(w_fp8) * scale_inv")
    scale: str = _choice("amax_div_max_rn", doc="scale = fl32(max(amax, fl32(amax_floor)) / FMAX), division "
                                                 "correctly rounded; stored fp32")
    amax_floor: float = _float(lambda v: 0.0 < v < 1.0, "a float in (0, 1)",
                               "the smallest amax a scale is computed from (an all-zero piece gets scale "
                               "fl32(amax_floor) / FMAX and quantises to exact zeros, never 0/0)")
    quantise: str = _choice("div_rn_clamp_rne", doc="q = rne_fp8(clamp(fl32(x / scale), -FMAX, FMAX)): correctly "
                                                    "rounded division, clamp, one nearest-even cast")
    gemm_partial: str = _choice("fp32_per_k_block", doc="per K block of activation_group (absolute offsets): "
                                                        "partial = the fp32 dot of the fp8 values, accumulated from "
                                                        "zero (products are exact in fp32; the order inside a "
                                                        "block is implementation-defined, as a [gemm] chunk's)")
    gemm_scale: str = _choice("partial_times_scale_product", doc="acc = fl32(acc + fl32(partial * "
                                                                 "fl32(a_scale * w_scale_inv))): the two scales "
                                                                 "multiplied first, then the partial, then the add "
                                                                 "(no FMA)")
    gemm_order: str = _choice("ascending", doc="acc starts at +0 and takes the K blocks in ascending order; the "
                                               "bias is added in fp32, then one nearest-even rounding to the "
                                               "output dtype")
    kv_format: str = _choice("e4m3", "e5m2", doc="the KV cache's fp8 format (float8_e4m3fn or float8_e5m2)")
    kv_scale: str = _choice("per_token_head", "fixed",
                            doc="per_token_head: each (token, KV head) vector of D values gets its own scale by "
                                "the scale rule, stored fp32 beside the cache; fixed: one fp32 scale per layer "
                                "and K/V given by the model (1.0 when it gives none)")
    kv_dequant: str = _choice("fp32_multiply_round_act", "f16_operands",
                              doc="the one read path (prefill, chunked prefill, decode, training). "
                                  "fp32_multiply_round_act: each element dequantised, k = round_act(fl32(fp32(q) * "
                                  "scale)), then [attention] unchanged. f16_operands (kv_scale fixed only): K and V "
                                  "enter the dots as f16 (exact for e4m3 and e5m2), q is rounded to f16, the scores "
                                  "take fl32(score_factor * k_scale), P is rounded to f16 (for P @ V and the row sum), "
                                  "and out = round_act(fl32(fl32(A / L) * v_scale)) (hal/backends/reference/attention.py)")

    # The rules derived from these values, written once for every backend and the kit.

    def fmax(self, fmt: str) -> float:
        """The finite maximum of FP8 format ``fmt`` ("e4m3" or "e5m2")."""
        return FP8_MAX[fmt]

    def group_count(self, k: int) -> int:
        """How many activation groups (= K blocks of the FP8 GEMM) a reduced dim of ``k`` has."""
        return -(-k // self.activation_group)

    def group_ranges(self, k: int) -> list[tuple[int, int]]:
        """[start, end) of each activation group / K block, in the order the GEMM adds them."""
        return _ranges(k, self.activation_group)


@dataclass(frozen=True)
class Parallel:
    """Tensor parallelism (only in contracts that cover sharded models; see ``OPTIONAL_SECTIONS``).
    ``hal/parallel.py`` realises each rule once; ``docs/parallel.md`` explains them.

    Every cross-rank reduction is part of the contract and none depends on the parallel degree: a
    rank's shard of a reduced dim is made of whole contract chunks at their absolute offsets, the
    ranks exchange the per-chunk fp32 values, and every rank combines them exactly as one device
    combines its chunks. So TP = 1, 2, 4, ... give the same bits, and a plain all-reduce sum (whose
    tree depends on the degree and the transport) is never used for a value that decides bits."""

    shards: str = _choice("whole_chunks", doc="the ranks hold equal contiguous shards, in rank order, of every "
                                              "reduced dim that is split (a row-parallel linear's K, the "
                                              "vocabulary), each a whole number of the contract's chunks "
                                              "([gemm].k_chunk, [logprobs].vocab_chunk); any other layout is "
                                              "refused")
    row_parallel: str = _choice("gather_chunk_partials_ascending",
                                doc="a row-parallel linear (o_proj, down_proj): each rank computes the fp32 "
                                    "sums of its K chunks (each from zero, as in [gemm]); the partials of all "
                                    "ranks are all-gathered and every rank adds them in ascending global chunk "
                                    "order into an fp32 total from +0, adds the bias in fp32 and rounds once: "
                                    "exactly the one-device [gemm] rule")
    vocab_parallel: str = _choice("gather_chunk_max_then_chunk_sums",
                                  doc="vocab-parallel logprobs: each rank computes the max of x = fl32(logit / T) "
                                      "over each of its vocab chunks; the chunk maxes are all-gathered and M = "
                                      "their max (exact in any order); each rank computes, per chunk, the sum "
                                      "of exp(fl32(x - M)) as [logprobs] does on one device; the chunk sums are "
                                      "all-gathered and added in ascending global chunk order from +0; logp = "
                                      "fl32(fl32(x_token - M) - log(S)) with the token's logit from its owner")
    embedding: str = _choice("owner_row_copy", doc="vocab-parallel embedding: the rank that holds a token's row "
                                                  "looks it up and the row is copied to every rank (an exact "
                                                  "gather, no arithmetic)")
    column_parallel: str = _choice("local", doc="column-parallel linears (qkv, gate_up, lm_head) and "
                                                "head-parallel attention compute whole outputs on one rank: "
                                                "no cross-rank arithmetic; their outputs are exchanged by "
                                                "exact copies (all-gather) where a full row is needed")


SECTIONS: dict[str, type] = {
    "contract": Header, "gemm": Gemm, "attention": Attention, "rms_norm": RmsNorm,
    "silu_mul": SiluMul, "rope": Rope, "logprobs": Logprobs, "reduce": Reduce, "topk": TopK,
    "moe": Moe, "fp8": Fp8, "parallel": Parallel,
}
#: Sections a contract may leave out: a contract without [moe] covers dense models only, and an MoE
#: layer refuses to run under it. An absent section is absent from the fingerprint too, so adding an
#: optional section to the schema changes no existing contract's fingerprint. Likewise [fp8]: a contract
#: without it has no FP8 linears or FP8 KV cache, and those refuse to run under it. And [parallel]: a
#: contract without it covers one device only, and a tensor-parallel model refuses to run under it.
OPTIONAL_SECTIONS = ("moe", "fp8", "parallel")


@dataclass(frozen=True)
class Contract:
    """A validated contract. Read its numbers through the sections (``contract.gemm.k_chunk``)."""

    header: Header
    gemm: Gemm
    attention: Attention
    rms_norm: RmsNorm
    silu_mul: SiluMul
    rope: Rope
    logprobs: Logprobs
    reduce: Reduce
    topk: TopK
    moe: Moe | None = None
    fp8: Fp8 | None = None
    parallel: Parallel | None = None
    source: str = field(compare=False, default="<memory>")

    @property
    def name(self) -> str:
        return self.header.name

    @property
    def version(self) -> int:
        return self.header.version

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """The validated values, section by section (what the fingerprint hashes)."""
        out: dict[str, dict[str, Any]] = {"schema": {"id": SCHEMA}}
        for section in SECTIONS:
            value = getattr(self, "header" if section == "contract" else section)
            if value is not None:
                out[section] = dataclasses.asdict(value)
        return out

    def canonical_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=True)

    @property
    def fingerprint(self) -> str:
        """sha256 of the canonical JSON serialisation: stable across processes and platforms."""
        return hashlib.sha256(self.canonical_json().encode("ascii")).hexdigest()

    @property
    def short_fingerprint(self) -> str:
        return self.fingerprint[:16]

    def __str__(self) -> str:
        return f"{self.name} v{self.version} ({self.short_fingerprint})"


# ---------------------------------------------------------------------------------------------
# Loading and validation.
# ---------------------------------------------------------------------------------------------

def _type_name(t: type) -> str:
    return {str: "a string", int: "an integer", float: "a float", list: "a list"}.get(t, t.__name__)


def _validate_section(source: str, section: str, cls: type, raw: Any) -> Any:
    if not isinstance(raw, dict):
        raise ContractError(source, f"[{section}]", raw, "a table")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            raise ContractError(source, f"[{section}].{key}", raw[key],
                                f"no such key; known keys of [{section}]: {', '.join(fields)}")
    values = {}
    for name, f in fields.items():
        key = f"[{section}].{name}"
        if name not in raw:
            raise ContractError(source, key, "<missing>", f"{f.metadata['expected']} ({f.metadata['doc']})")
        value = raw[name]
        want = f.metadata["type"]
        # bool is an int in Python; a contract never means True when it says 1.
        if not isinstance(value, want) or isinstance(value, bool):
            raise ContractError(source, key, value, _type_name(want))
        if want is list:
            bad = [x for x in value if not isinstance(x, f.metadata["item_type"])]
            if bad:
                raise ContractError(source, key, value, f"a list of {_type_name(f.metadata['item_type'])}s")
        if not f.metadata["check"](value):
            raise ContractError(source, key, value, f.metadata["expected"])
        values[name] = value
    return cls(**values)


def _check_combinations(source: str, c: Contract) -> None:
    """Values that are fine alone but impossible together."""
    a = c.attention
    # The exp goes with its scale: exp2 needs log2(e) folded into the scale, exp must not have it.
    if (a.scale == "folded_log2e") != (a.exp == "exp2"):
        raise ContractError(source, "[attention].exp", a.exp,
                            "'exp2' with scale = 'folded_log2e', 'exp' with scale = 'multiply' "
                            f"(scale is {a.scale!r})")
    # f16 operands take the scale off the elements (onto the scores and the output), which one scale per layer
    # allows; per-(token, head) V scales would have to scale P before its f16 rounding (into f16's subnormals).
    if c.fp8 is not None and c.fp8.kv_dequant == "f16_operands" and c.fp8.kv_scale != "fixed":
        raise ContractError(source, "[fp8].kv_dequant", c.fp8.kv_dequant,
                            f"'f16_operands' with kv_scale = 'fixed' (kv_scale is {c.fp8.kv_scale!r})")
    if a.kv_split and a.kv_split % a.kv_chunk:
        raise ContractError(source, "[attention].kv_split", a.kv_split,
                            f"0 or a multiple of [attention].kv_chunk ({a.kv_chunk})")


def parse_contract(text: str, source: str = "<string>") -> Contract:
    """Validate TOML text and return a Contract. Errors name ``source``."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ContractError(source, "<file>", "invalid TOML", f"valid TOML ({exc})") from exc
    if not raw:   # an empty (or comments-only) file: say so, not just that [contract] is missing
        raise ContractError(source, "<file>", "an empty file (no sections)",
                            f"the sections {', '.join(f'[{s}]' for s in SECTIONS)}; see `hal contract show "
                            f"{DEFAULT_CONTRACT}`")
    for section in raw:
        if section not in SECTIONS:
            raise ContractError(source, f"[{section}]", "<table>",
                                f"one of the sections {', '.join(f'[{s}]' for s in SECTIONS)}")
    parts = {}
    for section, cls in SECTIONS.items():
        if section not in raw:
            if section in OPTIONAL_SECTIONS:
                continue
            raise ContractError(source, f"[{section}]", "<missing>", "the section to be present")
        parts["header" if section == "contract" else section] = _validate_section(source, section, cls, raw[section])
    contract = Contract(**parts, source=source)
    _check_combinations(source, contract)
    return contract


def load_contract_file(path: str | Path) -> Contract:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise UnknownContractError(f"cannot read contract file {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ContractError(str(path), "<file>", f"bytes that are not UTF-8 (byte 0x{exc.object[exc.start]:02x} "
                                                 f"at offset {exc.start})",
                            "a UTF-8 TOML contract file (is this a contract? see `hal contract show "
                            f"{DEFAULT_CONTRACT}`)") from exc
    return parse_contract(text, source=str(path))


def _shipped() -> dict[str, Any]:
    """Contract name -> resource of every contract shipped in hal.contracts."""
    found = {}
    for entry in resources.files("hal.contracts").iterdir():
        if entry.name.endswith(".toml"):
            found[entry.name[: -len(".toml")]] = entry
    return dict(sorted(found.items()))


def available_contracts() -> list[str]:
    return list(_shipped())


DEFAULT_CONTRACT = "bf16-dense-v1"


def load_contract(name_or_path: str | Path | None = None) -> Contract:
    """Load a shipped contract by name (``bf16-dense-v1``) or any contract file by path."""
    if name_or_path is None:
        name_or_path = DEFAULT_CONTRACT
    if isinstance(name_or_path, Path) or str(name_or_path).endswith(".toml"):
        return load_contract_file(name_or_path)
    shipped = _shipped()
    if name_or_path not in shipped:
        raise UnknownContractError(
            f"no contract named {name_or_path!r}; shipped contracts: {', '.join(shipped) or 'none'} "
            f"(or give a path to a .toml file)")
    entry = shipped[name_or_path]
    source = f"contracts/{entry.name}"
    contract = parse_contract(entry.read_text(encoding="utf-8"), source=source)
    if contract.name != name_or_path:
        raise ContractError(source, "[contract].name", contract.name, f"{name_or_path!r} (the file's name)")
    return contract


def describe_fields() -> dict[str, dict[str, str]]:
    """Section -> key -> documentation, for ``hal contract show`` and the docs."""
    return {section: {f.name: f.metadata["doc"] for f in dataclasses.fields(cls)}
            for section, cls in SECTIONS.items()}
