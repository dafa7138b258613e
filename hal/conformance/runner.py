"""Named, parameterised conformance checks: what the kit's tests run and what a repro re-runs.

Every check takes a backend and plain parameters (ints, strings) and returns a list of problems
(empty = pass). A failing test prints ``repro_command(...)``: a shell line that re-runs exactly
that check (``python -m hal.conformance.runner CHECK --backend ... --param value ...``).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Callable

import torch

from hal.backend import Backend
from hal.conformance import bounds
from hal.conformance.checks import (AttentionCase, attention_phases, compare, masked_keys, op_row_functions,
                                    random_tensor, row_invariance, run_schedule, strided_copy)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}

ROW_OPS = ["linear", "linear+bias", "linear->fp32 logits", "rms_norm", "rms_norm+residual", "silu_mul", "rotary",
           "log_softmax", "log_softmax T=0.7", "token_logprobs", "sum", "mean", "topk",
           "moe_route", "moe_route grouped", "moe layer", "fp8_linear", "fp8_linear+bias", "fp8_linear->fp32",
           "fp8 moe layer"]

# The op each row function exercises (for the report's op x level table).
OP_OF = {"linear": "linear", "linear+bias": "linear", "linear->fp32 logits": "linear", "rms_norm": "rms_norm",
         "rms_norm+residual": "rms_norm", "silu_mul": "silu_mul", "rotary": "rotary", "log_softmax": "log_softmax",
         "log_softmax T=0.7": "log_softmax", "token_logprobs": "token_logprobs", "sum": "sum", "mean": "mean",
         "topk": "topk", "moe_route": "moe_route", "moe_route grouped": "moe_route", "moe layer": "moe_experts",
         "fp8_linear": "fp8_linear", "fp8_linear+bias": "fp8_linear", "fp8_linear->fp32": "fp8_linear",
         "fp8 moe layer": "fp8_moe_experts"}

# The ops only a contract with [moe] covers, those only a contract with [fp8] covers, and those that
# need both (block-FP8 experts: bf16-moe-fp8-v1).
MOE_OPS = ("moe_route", "moe_experts")
FP8_OPS = ("fp8_linear", "fp8_attention")
FP8_MOE_OPS = ("fp8_moe_experts",)


def _row_fn(backend: Backend, row_op: str, width: int, out_features: int, dtype: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    fns = op_row_functions(backend, width, out_features, DTYPES[dtype], g)
    if row_op not in fns:
        raise ValueError(f"row op {row_op!r} is not defined for width {width}; choose from {sorted(fns)}")
    rows = random_tensor((64, width), DTYPES[dtype], g, device=backend.device)
    return fns[row_op], rows, g


def determinism(backend: Backend, row_op: str, width: int, out_features: int, dtype: str, seed: int) -> list:
    fn, rows, _ = _row_fn(backend, row_op, width, out_features, dtype, seed)
    batch = rows[: 1 + seed % 37]
    m = compare(f"{row_op}: the same call twice", fn(batch), fn(batch), batch=batch.shape[0])
    return [m] if m else []


def layout_freedom(backend: Backend, row_op: str, width: int, out_features: int, dtype: str, seed: int) -> list:
    """The same values in another memory layout give the same bits: the batch and the op's parameters as
    strided views (``checks.strided_copy``) against the contiguous call."""
    fn, rows, _ = _row_fn(backend, row_op, width, out_features, dtype, seed)
    g = torch.Generator().manual_seed(seed)             # the same draws as _row_fn: the same values
    strided_fn = op_row_functions(backend, width, out_features, DTYPES[dtype], g, strided=True)[row_op]
    batch = rows[: 1 + seed % 37]
    m = compare(f"{row_op}: strided input and parameters vs contiguous", fn(batch), strided_fn(strided_copy(batch)),
                batch=batch.shape[0])
    return [m] if m else []


def batch_invariance(backend: Backend, row_op: str, width: int, out_features: int, dtype: str, seed: int,
                     batches: str = "1,2,7,16,17,33,64,65,129") -> list:
    fn, rows, g = _row_fn(backend, row_op, width, out_features, dtype, seed)
    return row_invariance(row_op, fn, rows, [int(b) for b in batches.split(",")], g)


def _case(seq_len, q_heads, kv_heads, head_dim, dtype, seed, kv_cache="auto") -> AttentionCase:
    return AttentionCase(seq_len, q_heads, kv_heads, head_dim, DTYPES[dtype], seed, kv_cache)


def attention_determinism(backend: Backend, seq_len: int, q_heads: int, kv_heads: int, head_dim: int,
                          dtype: str, page_size: int, seed: int, kv_cache: str = "auto") -> list:
    case = _case(seq_len, q_heads, kv_heads, head_dim, dtype, seed, kv_cache)
    steps = [max(1, seq_len // 2), seq_len - max(1, seq_len // 2)] if seq_len > 1 else [1]
    first = run_schedule(backend, case, steps, page_size, mates=2, seed=seed)
    again = run_schedule(backend, case, steps, page_size, mates=2, seed=seed)
    strided = run_schedule(backend, case, steps, page_size, mates=2, seed=seed, strided=True)
    problems = [compare(f"{case.op}: the same schedule twice", first, again),
                compare(f"{case.op}: queries, slots and metadata as strided views vs contiguous", first, strided)]
    return [m for m in problems if m]


def attention_batch_invariance(backend: Backend, seq_len: int, q_heads: int, kv_heads: int, head_dim: int,
                               dtype: str, page_size: int, mates: int, seed: int, kv_cache: str = "auto") -> list:
    case = _case(seq_len, q_heads, kv_heads, head_dim, dtype, seed, kv_cache)
    alone = run_schedule(backend, case, [seq_len], page_size)
    problems = []
    for trial in range(2):
        m = compare(f"{case.op}: prefill alone vs with batch-mates", alone,
                    run_schedule(backend, case, [seq_len], page_size, mates=mates, seed=seed + trial),
                    mates=mates, trial=trial)
        if m:
            problems.append(m)
    return problems


def phase_consistency(backend: Backend, seq_len: int, q_heads: int, kv_heads: int, head_dim: int, dtype: str,
                      page_sizes: str, cuts: str, decode_from: int, mates: int, block: int, seed: int,
                      kv_cache: str = "auto") -> list:
    case = _case(seq_len, q_heads, kv_heads, head_dim, dtype, seed, kv_cache)
    return attention_phases(backend, case, [int(c) for c in cuts.split(",") if c],
                            [int(p) for p in page_sizes.split(",")], decode_from, mates=mates, block=bool(block))


def masked_keys_contribute_nothing(backend: Backend, seq_len: int, q_heads: int, kv_heads: int, head_dim: int,
                                   dtype: str, page_size: int, hidden: int, seed: int) -> list:
    return masked_keys(backend, _case(seq_len, q_heads, kv_heads, head_dim, dtype, seed), page_size, hidden)


def accuracy(backend: Backend, op: str, size: int, width: int, dtype: str, seed: int) -> list:
    return bounds.accuracy_problems(backend, op, size, width, DTYPES[dtype], seed)


def train_equals_infer(backend: Backend, op: str, size: int, width: int, dtype: str, seed: int) -> list:
    from hal.conformance.training import train_equals_infer as check

    return check(backend, op, size, width, DTYPES[dtype], seed)


CHECKS: dict[str, Callable[..., list]] = {
    "determinism": determinism,
    "layout_freedom": layout_freedom,
    "batch_invariance": batch_invariance,
    "attention_determinism": attention_determinism,
    "attention_batch_invariance": attention_batch_invariance,
    "phase_consistency": phase_consistency,
    "masked_keys_contribute_nothing": masked_keys_contribute_nothing,
    "accuracy": accuracy,
    "train_equals_infer": train_equals_infer,
}


def repro_command(check: str, backend: Backend, params: dict) -> str:
    contract = backend.contract.source if backend.contract is not None else None
    words = [sys.executable.rsplit("/", 1)[-1], "-m", "hal.conformance.runner", check, "--backend", backend.name]
    if contract:
        words += ["--contract", contract.removeprefix("contracts/").removesuffix(".toml")
                  if contract.startswith("contracts/") else contract]
    for key, value in params.items():
        words += [f"--{key.replace('_', '-')}", str(value)]
    return shlex.join(words)


def main(argv: list[str] | None = None) -> int:
    from hal.api import create_backend

    parser = argparse.ArgumentParser(prog="python -m hal.conformance.runner",
                                     description="re-run one conformance check and print what differs")
    parser.add_argument("check", choices=sorted(CHECKS))
    parser.add_argument("--backend", required=True)
    parser.add_argument("--contract")
    known, rest = parser.parse_known_args(argv)
    params = {}
    for key, value in zip(rest[::2], rest[1::2]):
        name = key.lstrip("-").replace("-", "_")
        params[name] = int(value) if value.lstrip("-").isdigit() else value
    backend = create_backend(known.backend, known.contract)
    problems = CHECKS[known.check](backend, **params)
    for p in problems:
        print(f"FAIL {p}")
    print(f"{known.check} on {backend.name}: {'FAIL' if problems else 'pass'} ({len(problems)} problems)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
