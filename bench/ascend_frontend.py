"""Compile the Triton kernels the ascend backend's triton path would launch with triton-ascend, as far
as it goes without an NPU (issue #23, finding 6).

triton-ascend 3.2.0 installs on x86 without CANN: its frontend (Python -> Triton IR) and its
``triton-adapter-opt`` (Triton IR -> Linalg/HIVM) run here; the last stage, ``bishengir-compile``
(Linalg -> NPU binary), is part of CANN and is not installed. This script runs the triton path's ops
(``hal.backends.ascend.triton_ops.TritonOps``: every kernel with the tiles the Ascend launch policy
picks) on small CPU tensors with the kernel launches intercepted: each launch is recorded (its
kernel, argument types, constexprs and options) instead of run, then compiled for an Ascend 910B
target stage by stage. A kernel that fails in the frontend or the adapter cannot run on an NPU as
written; one that reaches the binary stage fails there only for want of CANN.

It needs an environment of its own (triton-ascend replaces the ``triton`` package):

    python3.11 -m venv /tmp/ta-venv
    /tmp/ta-venv/bin/pip install -c constraints.txt torch==2.13.0 numpy stevedore pybind11
    /tmp/ta-venv/bin/pip install --no-deps triton-ascend==3.2.0
    PYTHONPATH=. /tmp/ta-venv/bin/python bench/ascend_frontend.py --json ascend_frontend.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass

import torch
import triton
from triton.runtime.jit import JITFunction


@dataclass
class Launch:
    op: str
    kernel: JITFunction
    signature: dict
    constants: dict
    options: dict


LAUNCHES: list[Launch] = []
CURRENT_OP = ["?"]
_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
          torch.int64: "i64", torch.bool: "i1", torch.uint8: "u8"}
OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")


def _record(self, *args, grid, warmup, **kwargs):
    """JITFunction.run replaced: the launch's argument types and constexprs, recorded, not run."""
    names = [p.name for p in self.params]
    values = dict(zip(names, args))
    values.update({k: v for k, v in kwargs.items() if k in names})
    signature, constants = {}, {}
    for p in self.params:
        v = values.get(p.name, p.default)
        if p.is_constexpr:
            constants[p.name] = v
        elif isinstance(v, torch.Tensor):
            signature[p.name] = "*" + _TYPES[v.dtype]
        elif isinstance(v, bool):
            signature[p.name] = "i1"
        elif isinstance(v, int):
            signature[p.name] = "i64" if abs(v) >= 2 ** 31 else "i32"
        elif isinstance(v, float):
            signature[p.name] = "fp32"
        else:
            raise TypeError(f"{self.__name__}: argument {p.name} of type {type(v).__name__}")
    options = {k: kwargs[k] for k in OPTIONS if k in kwargs}
    LAUNCHES.append(Launch(CURRENT_OP[0], self, signature, constants, options))


def record_launches(contract_name: str) -> None:
    from hal.backend import AttentionMetadata
    from hal.backends.ascend.triton_ops import TritonOps
    from hal.contract import load_contract
    from hal.kvcache import PagedKVCache
    from hal.rope import cos_sin_cache

    contract = load_contract(contract_name)
    ops = TritonOps(contract)
    g = torch.Generator().manual_seed(0)
    bf16 = torch.bfloat16

    def run(op, fn):
        CURRENT_OP[0] = op
        fn()

    for m in (1, 33, 300):   # GEMM tile classes of tiles.gemm_config
        x, w = torch.randn(m, 1024, generator=g).to(bf16), torch.randn(256, 1024, generator=g).to(bf16)
        run(f"linear M={m}", lambda: ops.linear(x, w, None, bf16))
    run("linear -> fp32 logits", lambda: ops.linear(x, w, None, torch.float32))
    x = torch.randn(8, 2048, generator=g).to(bf16)
    run("rms_norm + residual", lambda: ops.rms_norm(x, x[0].clone(), 1e-6, x.clone()))
    run("rms_norm fp32", lambda: ops.rms_norm(x.float(), x[0].float(), 1e-6, None))
    run("silu_mul", lambda: ops.silu_mul(torch.randn(8, 2 * 768, generator=g).to(bf16)))
    q, k = torch.randn(8, 16, 128, generator=g).to(bf16), torch.randn(8, 8, 128, generator=g).to(bf16)
    table = cos_sin_cache(128, 64, 1e6)
    run("rotary", lambda: ops.rotary(torch.arange(8), q, k, table))
    run("sum", lambda: ops.sum(x.float()))
    logits = torch.randn(4, 1000, generator=g)
    run("log_softmax", lambda: ops.log_softmax(logits, 1.0))
    run("token_logprobs", lambda: ops.token_logprobs(logits, torch.arange(4), 1.0))
    page = contract.attention.kv_chunk
    cache = PagedKVCache.allocate(8, page, 8, 128, bf16)
    for name, q_lens, seq_lens in (("attention prefill", [40, 7], [40, 7]), ("attention decode", [1, 1], [300, 90])):
        starts = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
        table_ = torch.arange(8, dtype=torch.int32).view(2, 4)
        meta = AttentionMetadata(query_start_loc=starts, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                                 block_table=table_)
        qq = torch.randn(sum(q_lens), 16, 128, generator=g).to(bf16)
        run(name, lambda: ops.attention(qq, cache.k, cache.v, meta, 128 ** -0.5))


def _first_error(exc: Exception) -> str:
    """The compiler's own message: the first line after "encounters error:" that is not a stack frame."""
    lines = [line.strip() for line in str(exc).splitlines()]
    for i, line in enumerate(lines):
        if line.endswith("encounters error:"):
            for after in lines[i + 1:]:
                if after and not after.startswith("#") and not after.startswith("///"):
                    return after[:300]
    text = " ".join(line for line in lines if line)
    return f"{type(exc).__name__}: {text[:300]}"


def _outcome(stage: str, detail: str) -> str:
    """'needs CANN' where only the last stage failed for want of bishengir-compile (CANN)."""
    if stage == "ConvertLinalgRToBinary" and ("bishengir" in detail or "ASCEND_HOME_PATH" in detail):
        return "needs CANN"
    return "failed"


def compile_for_npu(launch: Launch, arch: str) -> tuple[str, str, str]:
    """(stage, outcome, detail): the Ascend backend's stages run in order (Triton IR, the adapter to
    Linalg, the NPU binary) and the first that fails is named."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compiler

    src = ASTSource(fn=launch.kernel, signature=launch.signature, constants=launch.constants)
    try:
        triton.compile(src, target=GPUTarget("npu", arch, 0), options=dict(launch.options))
        return "all", "ok", ""
    except compiler.MLIRCompilationError as exc:  # a named stage failed
        stage, detail = getattr(exc, "stage_name", "?"), _first_error(exc)
        return stage, _outcome(stage, detail), detail
    except Exception as exc:   # noqa: BLE001 (frontend errors come as many types)
        return "frontend", "failed", _first_error(exc)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contract", default="bf16-ascend-v1")
    parser.add_argument("--arch", default="Ascend910B3")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if "ascend" not in triton.backends.backends:
        raise SystemExit("this is not triton-ascend (no 'ascend' Triton backend): see the module docstring")
    JITFunction.run = _record
    record_launches(args.contract)
    print(f"{len(LAUNCHES)} launches recorded", flush=True)
    seen, rows = set(), []
    for launch in LAUNCHES:
        key = (launch.kernel.__name__, tuple(sorted(launch.signature.items())),
               tuple(sorted((k, str(v)) for k, v in launch.constants.items())), tuple(sorted(launch.options.items())))
        if key in seen:
            continue
        seen.add(key)
        stage, outcome, detail = compile_for_npu(launch, args.arch)
        rows.append(dict(op=launch.op, kernel=launch.kernel.__name__, stage=stage, outcome=outcome, detail=detail,
                         constants={k: str(v) for k, v in launch.constants.items()}, options=launch.options))
        print(f"{launch.op:24} {launch.kernel.__name__:26} {stage:10} {outcome:7} {detail[:140]}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(triton=triton.__version__, arch=args.arch, contract=args.contract, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
