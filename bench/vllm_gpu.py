"""GPU vLLM (0.26) with the HAL plugin vs stock vLLM vs ``VLLM_BATCH_INVARIANT=1`` (issue #19's measurement).

For the H200 with the offline vLLM bundle (../shared/tools/vllm-gpu/) unpacked into PYTHONPATH and this
checkout installed next to it (``bash bench/h200.sh vllm``). Each engine runs in its own process (vLLM
reads ``VLLM_BATCH_INVARIANT`` at import), one after another, on the same random checkpoint and requests:

* ``hal``: ``quantization="hal"`` bound to the ``cuda`` backend, torch.compile + CUDA graphs (vLLM's
  default compilation; decode steps as full graphs), async scheduling *off* (``VllmEngine``'s default on
  CUDA is on: ``hal-async`` is what a user gets, 0.94x stock on the H200);
* ``hal-eager``: the same with ``enforce_eager=True`` (no compile, no graphs): the compile path's control;
* ``hal-async``: ``hal`` with vLLM's async scheduling (the ``VllmEngine`` default); its tokens must
  equal ``hal``'s (the same seeds, positions and logits), which the table reports when both ran;
* ``stock``: vLLM's defaults (CUDA graphs + torch.compile, FlashAttention, V2 model runner);
* ``batch-invariant``: stock with ``VLLM_BATCH_INVARIANT=1``, vLLM's own deterministic mode.

Every engine does one warm-up generate (as many requests with other random prompts, 8 new tokens each),
then one timed generate of all requests (generated tok/s); ``--profile`` adds a profiled generate of a
third set of prompts (tables in the workdir, one line in the log). A
HAL-bound engine then also: generates for the first requests again, once with prompt logprobs and once
from its prefix cache (vLLM computes prompt logprobs without the cache); times an in-place weight sync
to a trainer model with other weights (GB/s of parameter bytes; the digest check timed apart); and
serves the first requests once more, which the trainer with the new weights must agree with.

Then the trainer (``DecoderLM.sequence_logprobs`` on the ``cuda`` backend, the checkpoint's weights)
recomputes every sampled token's logprob (and the prompt logprobs): the table gives tok/s and
mismatching logprobs per engine (0 expected for ``hal``; the stock engines are the negative control).
JSON with every number goes to ``--json``; a failed engine's last output lines go there too.

    python3 bench/vllm_gpu.py --json $OUT/vllm_gpu.json                 # Qwen3-1.7B-shaped, 256 requests
    python3 bench/vllm_gpu.py --shape tiny --requests 16 --new-tokens 16 --engines hal,hal-eager
    python3 bench/vllm_gpu.py --shape 8b --requests 256 --new-tokens 256 --json ...
    python3 bench/vllm_gpu.py --engines hal,stock --profile      # where the time goes (WORKDIR/*.profile.txt)
    python3 bench/vllm_gpu.py --block-size 16                    # every engine with 16-key KV pages
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

SHAPES = {  # random-weight models shaped like these (issue #19); tiny: a quick check of the whole path
    "tiny": dict(architecture="qwen3", vocab_size=4096, hidden_size=256, intermediate_size=768, num_layers=2,
                 num_heads=4, num_kv_heads=2, head_dim=128, qk_norm=True, tie_word_embeddings=True),
    "1.7b": dict(architecture="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=28,
                 num_heads=16, num_kv_heads=8, head_dim=128, qk_norm=True, tie_word_embeddings=True),
    "8b": dict(architecture="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
               num_heads=32, num_kv_heads=8, head_dim=128, qk_norm=True),
    # issue #21: Qwen3-30B-A3B's layers (128 experts, top-8, expert width 768), 3 of its 48
    "30b-a3b-3l": dict(architecture="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                       num_layers=3, num_heads=32, num_kv_heads=4, head_dim=128, qk_norm=True, num_experts=128,
                       num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True),
}
# issue #22: the same shapes as DeepSeek-style block-FP8 checkpoints (every linear but the embedding / lm_head:
# e4m3 weights with one fp32 scale per 128 x 128 block, ``quantization_config.quant_method "fp8"``)
FP8_SHAPES = ("tiny", "1.7b", "8b", "30b-a3b-3l")   # the MoE one: FP8 experts too (bf16-moe-fp8-v1)
SHAPES.update({f"{name}-fp8": dict(SHAPES[name], fp8=True) for name in FP8_SHAPES})
# the contract a shape's model needs (MoE layers: one with [moe], FP8 linears: one with [fp8]); others the default
CONTRACTS = {"qwen3_moe": "bf16-moe-v1"}
FP8_CONTRACT = "bf16-fp8-v1"
FP8_MOE_CONTRACT = "bf16-moe-fp8-v1"     # an FP8 MoE checkpoint's: [moe] and [fp8]


def contract_for(model_dir: Path, kv_cache_dtype: str = "auto") -> str | None:
    """The contract both sides run: the checkpoint's, or with an FP8 KV cache bf16-fp8-v1 (its [fp8])."""
    contract = json.loads((model_dir / "bench_meta.json").read_text()).get("contract")
    if kv_cache_dtype == "auto" or contract in (FP8_CONTRACT, FP8_MOE_CONTRACT):
        return contract
    if contract is not None:
        raise SystemExit(f"--kv-cache-dtype {kv_cache_dtype}: only for dense shapes (this one runs {contract})")
    return "bf16-fp8-v1"


def trainer_for(model_dir: Path, kv_cache_dtype: str):
    """The trainer model on the cuda backend, with the engine's KV cache kind (a run-time choice)."""
    import dataclasses

    from hal.api import create_backend
    from hal.model.checkpoint import load_pretrained

    trainer = load_pretrained(model_dir, backend=create_backend("cuda", contract_for(model_dir, kv_cache_dtype)),
                              device="cuda")
    trainer.config = dataclasses.replace(trainer.config, kv_cache_dtype=kv_cache_dtype)
    return trainer


ENGINES = ("hal", "hal-eager", "hal-async", "stock", "batch-invariant")
PROMPT_CHECK_REQUESTS = 16     # requests a HAL-bound engine serves again: with prompt logprobs, then from its prefix cache
GPU_MEMORY_UTILIZATION = 0.6   # every engine: leaves room for the trainer model in the same process


def requests(count: int, new_tokens: int, vocab: int, seed: int = 0):
    from hal.rollout.harness import Request

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(64, 513, (count,), generator=g).tolist()
    return [Request(prompt=tuple(torch.randint(0, vocab, (n,), generator=g).tolist()), max_new_tokens=new_tokens,
                    seed=i) for i, n in enumerate(lengths)]


def run_engine(args) -> None:
    """Child process: one engine; warm-up, one timed generate; for HAL-bound engines the prompt-logprob /
    prefix-cache pass and the timed weight sync. Results to ``args.out``."""
    from hal.vllm.binding import resolve_binding
    from hal.vllm.engine import VllmEngine

    model_dir = Path(args.model)
    config = json.loads((model_dir / "bench_meta.json").read_text())
    reqs = requests(args.requests, args.new_tokens, config["vocab_size"])
    hal_bound = args.engine.startswith("hal")
    contract = contract_for(model_dir, args.kv_cache_dtype)
    binding = resolve_binding({"backend": "cuda", "contract": contract}) if hal_bound else None
    t0 = time.perf_counter()
    engine = VllmEngine(model_dir, binding=binding, dtype="bfloat16", max_model_len=1024,
                        max_num_seqs=args.requests, max_num_batched_tokens=8192,
                        enforce_eager=args.engine == "hal-eager", gpu_memory_utilization=GPU_MEMORY_UTILIZATION,
                        block_size=args.block_size, async_scheduling=args.engine == "hal-async",
                        kv_cache_dtype=args.kv_cache_dtype)
    result = {"engine": args.engine, "start_s": time.perf_counter() - t0,
              "block_size": engine.llm.llm_engine.vllm_config.cache_config.block_size}
    print(f"{args.engine}: KV pages of {result['block_size']} keys", flush=True)
    print(f"{args.engine}: engine up in {result['start_s']:.0f} s", flush=True)
    try:
        # warm-up: as many other random prompts (64-512 tokens), a few new tokens each: the timed run's prefill
        # chunks and decode batch sizes compile their kernels here, and its prompts are not in the cache yet
        engine.generate(requests(args.requests, 8, config["vocab_size"], seed=1))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with step_times(engine) as steps, jit_compiles() as compiles, gpu_samples() as samples:
            completions = engine.generate(reqs)
            torch.cuda.synchronize()
        result["seconds"] = time.perf_counter() - t0
        result["step_ms"] = [ms for _, ms in steps]
        result["step_start_s"] = [start for start, _ in steps]   # time.time() at each step's start
        result["jit_compiles"] = compiles
        result["gpu_samples"] = samples
        report_timed_run(args.engine, steps, compiles, samples)
        if args.profile:   # a third set of prompts, profiled (slower: not the speed figure)
            threads = sorted(f"{t.name}{' (daemon)' if t.daemon else ''}" for t in threading.enumerate())
            print(f"{args.engine}: {len(threads)} Python threads in the engine process: {', '.join(threads)}", flush=True)
            with profiled(Path(args.out).with_suffix(".profile.txt")), step_times(engine) as profiled_steps:
                engine.generate(requests(args.requests, args.new_tokens, config["vocab_size"], seed=2))
            print(f"{args.engine}: profiled generate's steps (ms): "
                  f"{' '.join(f'{ms:.0f}' for _, ms in profiled_steps)}", flush=True)
            with python_profiled(Path(args.out).with_suffix(".python.profile.txt")):
                engine.generate(requests(args.requests, 32, config["vocab_size"], seed=3))
        result["generated"] = sum(len(c.tokens) for c in completions)
        result["tokens"] = [c.tokens for c in completions]
        result["logprobs"] = [c.logprobs for c in completions]
        print(f"{args.engine}: {result['generated'] / result['seconds']:.0f} generated tok/s "
              f"({result['generated']} tokens in {result['seconds']:.1f} s)", flush=True)
        if hal_bound:
            # vLLM computes a request with prompt logprobs without its prefix cache: the prompt-logprob pass
            # is one pass, the prefix-cache pass another (its prompts were all served above: cache hits)
            check = [r.__class__(prompt=r.prompt, max_new_tokens=4, seed=r.seed) for r in reqs[:PROMPT_CHECK_REQUESTS]]
            passes = [engine.generate(check, prompt_logprobs=True), engine.generate(check)]
            result["prompt_check"] = [{"tokens": c.tokens, "logprobs": c.logprobs, "prompt_logprobs": c.prompt_logprobs,
                                       "cached_prompt_tokens": c.cached_prompt_tokens} for c in passes[0]]
            result["cache_check"] = [{"tokens": c.tokens, "logprobs": c.logprobs,
                                      "cached_prompt_tokens": c.cached_prompt_tokens} for c in passes[1]]
            trainer = synced_trainer(model_dir, args.kv_cache_dtype)
            nbytes = sync_bytes(trainer)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            digest = engine.sync_weights(trainer)
            result["sync_total_s"] = time.perf_counter() - t0
            result["sync_reload_s"] = engine.last_sync_seconds["reload"]
            result["sync_bytes"] = nbytes
            result["sync_digest"] = digest
            print(f"{args.engine}: weight sync {nbytes / 1e9:.2f} GB in place in {result['sync_reload_s']:.3f} s "
                  f"({nbytes / 1e9 / result['sync_reload_s']:.0f} GB/s), verified by digest in "
                  f"{result['sync_total_s'] - result['sync_reload_s']:.1f} s more", flush=True)
            # the synced engine serves the check requests again: the trainer with the new weights must agree
            result["post_sync_check"] = [{"tokens": c.tokens, "logprobs": c.logprobs} for c in engine.generate(check)]
    finally:
        engine.close()
        torch.save(result, args.out)


@contextlib.contextmanager
def profiled(table: Path):
    """torch.profiler over a generate: GPU-busy share of the wall time, then the top ops by GPU time and
    by host time, to ``table`` (a profiled run is slower: its tok/s is not a speed figure)."""
    from torch.profiler import ProfilerActivity, profile

    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        yield
        torch.cuda.synchronize()
    wall_us = (time.perf_counter() - t0) * 1e6
    averages = prof.key_averages()
    # device time of kernels and copies (their self device time; CPU-side ops have none of their own)
    busy_us = sum(e.self_device_time_total for e in averages if e.device_type == torch.autograd.DeviceType.CUDA)
    head = (f"wall {wall_us / 1e6:.2f} s, GPU busy {busy_us / 1e6:.2f} s ({busy_us / wall_us:.0%}): the rest is "
            f"the GPU waiting for the host\n\n")
    print(f"profile: {head.strip()}", flush=True)
    timeline = device_timeline(prof.events())
    print("profile: GPU time per 250 ms of the profiled generate:\n" + timeline, flush=True)
    table.write_text(head + "by GPU time\n" + averages.table(sort_by="self_device_time_total", row_limit=50)
                     + "\n\nby host time\n" + averages.table(sort_by="self_cpu_time_total", row_limit=50)
                     + "\n\nGPU time per 250 ms window\n" + timeline)


def device_timeline(events, window_us: float = 250e3, top: int = 4) -> str:
    """Per window of the profile's wall time: the GPU's busy share and its top kernels (ms, launches):
    a kernel that slows down mid-run shows here, where the whole-run table averages it away."""
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    if not kernels:
        return "(no device events)"
    origin = min(e.time_range.start for e in kernels)
    windows: dict[int, dict[str, list]] = {}
    for e in kernels:
        per_name = windows.setdefault(int((e.time_range.start - origin) // window_us), {})
        slot = per_name.setdefault(e.name[:60], [0.0, 0])
        slot[0] += e.time_range.elapsed_us()
        slot[1] += 1
    lines = []
    for index in sorted(windows):
        per_name = windows[index]
        busy = sum(v[0] for v in per_name.values())
        ranked = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:top]
        lines.append(f"  {index * window_us / 1e6:5.2f} s: busy {busy / window_us:4.0%}; " + "; ".join(
            f"{name} {v[0] / 1e3:.1f} ms/{v[1]}" for name, v in ranked))
    return "\n".join(lines)


@contextlib.contextmanager
def step_times(engine):
    """(time.time() at its start, wall milliseconds) of every engine step (vLLM's LLMEngine.step:
    schedule, forward, sample, outputs)."""
    llm_engine = engine.llm.llm_engine
    step, times = llm_engine.step, []

    def timed_step(*a, **k):
        start, t0 = time.time(), time.perf_counter()
        try:
            return step(*a, **k)
        finally:
            times.append((start, (time.perf_counter() - t0) * 1e3))
    llm_engine.step = timed_step
    try:
        yield times
    finally:
        del llm_engine.step


@contextlib.contextmanager
def jit_compiles():
    """Every Triton compile while the block runs: [time.time(), kernel name, its constexprs and the
    specialised signature]. A compile in a timed run is a launch variant the warm-up did not reach
    (vLLM's own monitor warns once per kernel name; this names each variant). Chained to vLLM's hook."""
    from triton import knobs

    events, previous = [], knobs.runtime.jit_post_compile_hook

    def hook(**kwargs):
        info = kwargs.get("compile") if isinstance(kwargs.get("compile"), dict) else {}
        fn = kwargs.get("fn")
        events.append([time.time(), getattr(fn, "name", "?"), repr(info.get("constants"))[:600],
                       repr(info.get("signature"))[:600]])
        return previous(**kwargs) if previous is not None else None
    knobs.runtime.jit_post_compile_hook = hook
    try:
        yield events
    finally:
        knobs.runtime.jit_post_compile_hook = previous


GPU_QUERY = "timestamp,utilization.gpu,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"


@contextlib.contextmanager
def gpu_samples(period_ms: int = 50):
    """nvidia-smi's utilisation, SM clock, power, temperature and throttle reasons every ``period_ms``
    while the block runs (a separate process: the engine's own threads are not slowed). Rows:
    [time.time(), util %, SM MHz, W, C, throttle bitmask]; empty where nvidia-smi is missing."""
    import datetime
    import shutil
    import tempfile

    rows: list = []
    if shutil.which("nvidia-smi") is None:
        yield rows
        return
    log = tempfile.NamedTemporaryFile("w+", suffix=".csv", delete=False)
    proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={GPU_QUERY}", "--format=csv,noheader,nounits",
                             f"-lms={period_ms}"], stdout=log, stderr=subprocess.DEVNULL)
    try:
        yield rows
    finally:
        proc.terminate()
        proc.wait()
        log.seek(0)
        for line in log.read().splitlines():
            parts = [p.strip() for p in line.split(",")]
            try:
                stamp = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                rows.append([stamp, float(parts[1]), float(parts[2]), float(parts[3]), float(parts[4]), parts[5]])
            except (ValueError, IndexError):
                continue
        os.unlink(log.name)


def report_timed_run(engine: str, steps, compiles, samples) -> None:
    """One line of step times, then the GPU's state in windows of 25 steps (median utilisation, SM clock,
    power; throttle reasons seen) and every Triton compile with the step it fell in: where a step's time
    changes, these say whether the GPU slowed down, waited for the host, or compiled."""
    ms = [t for _, t in steps]
    decode = sorted(ms[len(ms) // 4:])          # past the prefill chunks (all requests arrive at once)
    print(f"{engine}: {len(ms)} engine steps; first 12 (ms): {' '.join(f'{t:.1f}' for t in ms[:12])}; "
          f"later steps median {decode[len(decode) // 2]:.1f} ms", flush=True)
    print(f"{engine}: every step (ms): {' '.join(f'{t:.0f}' for t in ms)}", flush=True)

    def median(xs):
        xs = sorted(xs)
        return xs[len(xs) // 2] if xs else float("nan")
    for first in range(0, len(steps), 25):
        window = steps[first:first + 25]
        begin, end = window[0][0], window[-1][0] + window[-1][1] / 1e3
        inside = [r for r in samples if begin <= r[0] <= end]
        reasons = sorted({r[5] for r in inside})
        print(f"{engine}: steps {first}-{first + len(window) - 1}: median {median([t for _, t in window]):.1f} ms; "
              f"GPU util {median([r[1] for r in inside]):.0f}%, SM {median([r[2] for r in inside]):.0f} MHz, "
              f"{median([r[3] for r in inside]):.0f} W, throttle {','.join(reasons) or '-'} ({len(inside)} samples)",
              flush=True)
    starts = [start for start, _ in steps]
    for stamp, name, constants, signature in compiles:
        index = max((i for i, s in enumerate(starts) if s <= stamp), default=-1)
        print(f"{engine}: Triton compile in step {index}: {name} constants={constants} signature={signature}",
              flush=True)


@contextlib.contextmanager
def python_profiled(table: Path):
    """cProfile (this thread's Python: the engine core runs in-process) over a generate; the functions
    with the most own time and the most cumulative time go to ``table``."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out)
        stats.sort_stats("tottime").print_stats(45)
        stats.sort_stats("cumulative").print_stats(60)
        table.write_text(out.getvalue())


SYNC_SCALE = 1.0078125   # the weight sync's new model: every weight times 1 + 2**-7 (rounded to bf16)


def synced_trainer(model_dir: Path, kv_cache_dtype: str):
    """The trainer model a HAL-bound engine is synced to: the checkpoint's weights times SYNC_SCALE."""
    trainer = trainer_for(model_dir, kv_cache_dtype)
    with torch.no_grad():
        for p in trainer.parameters():
            p.mul_(SYNC_SCALE)
    trainer.refresh_fp8_weights()   # an FP8 model's linears: requantised from the new master weights, as a sync does
    return trainer


def sync_bytes(trainer) -> int:
    """What a weight sync sends: the parameters, or for an FP8 model its fp8 weights, scales and the rest."""
    if trainer.config.fp8 is None:
        return sum(p.numel() * p.element_size() for p in trainer.parameters())
    from hal.model.fp8 import weight_sync_tensors

    return sum(t.numel() * t.element_size() for _, t in weight_sync_tensors(trainer))


def make_checkpoint(shape: str, model_dir: Path) -> None:
    from hal.api import create_backend
    from hal.model.checkpoint import save_pretrained
    from hal.model.config import Fp8Quantization, ModelConfig
    from hal.model.model import DecoderLM

    fields = dict(SHAPES[shape])
    fp8 = Fp8Quantization() if fields.pop("fp8", False) else None
    config = ModelConfig(dtype="bfloat16", fp8=fp8, **fields)
    print(f"writing a random {shape}-shaped checkpoint to {model_dir}", flush=True)
    if fp8 is not None:
        contract = FP8_MOE_CONTRACT if config.is_moe else FP8_CONTRACT
    else:
        contract = CONTRACTS.get(config.architecture)
    save_pretrained(DecoderLM.random(config, seed=1, backend=create_backend("reference", contract)), model_dir)
    (model_dir / "bench_meta.json").write_text(json.dumps({"vocab_size": config.vocab_size, "contract": contract}))


def trainer_logprobs(trainer, sequences, starts, batch: int = 16) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for i in range(0, len(sequences), batch):     # bounded activation memory at 151936-wide logits
            out += [t.cpu() for t in trainer.sequence_logprobs(sequences[i:i + batch], starts[i:i + batch])]
    return out


def compare(trainer, reqs, r: dict, model_dir: Path) -> dict:
    """Sampled-token logprobs of the timed run (and a HAL engine's prompt check) against the trainer's."""
    from hal.metrics import compare_logprobs

    sequences = [list(q.prompt) + list(t) for q, t in zip(reqs, r["tokens"])]
    c = compare_logprobs(trainer_logprobs(trainer, sequences, [len(q.prompt) for q in reqs]), list(r["logprobs"]))
    row = {"tokens": c.num_tokens, "mismatches": c.mismatches, "max_abs_dlogp": c.max_abs_diff}
    if "prompt_check" in r:
        checks, cached = r["prompt_check"], r["cache_check"]
        full = [list(q.prompt) + list(p["tokens"]) for q, p in zip(reqs, checks)]
        train = trainer_logprobs(trainer, full, [1] * len(full))
        p = compare_logprobs(train, [torch.cat([p["prompt_logprobs"], p["logprobs"]]) for p in checks])
        c = compare_logprobs([t[len(q.prompt) - 1:] for t, q in zip(train, reqs)], [p["logprobs"] for p in cached])
        row.update(prompt_check_tokens=p.num_tokens, prompt_check_mismatches=p.mismatches,
                   prefix_cache_hit_tokens=sum(p["cached_prompt_tokens"] for p in cached),
                   prefix_cache_tokens=c.num_tokens, prefix_cache_mismatches=c.mismatches,
                   prefix_cache_same_tokens=all(a["tokens"] == b["tokens"] for a, b in zip(checks, cached)))
    if "post_sync_check" in r:
        post = r["post_sync_check"]
        sequences = [list(q.prompt) + list(p["tokens"]) for q, p in zip(reqs, post)]
        new_weights = synced_trainer(Path(model_dir), trainer.config.kv_cache_dtype)
        s = compare_logprobs(trainer_logprobs(new_weights, sequences, [len(q.prompt) for q in reqs[:len(post)]]),
                             [p["logprobs"] for p in post])
        del new_weights
        row.update(post_sync_tokens=s.num_tokens, post_sync_mismatches=s.mismatches)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1.7b")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--engines", default="hal,stock,batch-invariant",
                        help=f"comma-separated, from {', '.join(ENGINES)}")
    parser.add_argument("--engine-timeout", type=int, default=420, help="seconds per engine process")
    parser.add_argument("--profile", action="store_true",
                        help="after the timed generate, profile another (torch.profiler; tables next to its results)")
    parser.add_argument("--block-size", type=int, default=None,
                        help="KV-cache page size of every engine (default: each attention backend's preference)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"),
                        help="fp8: the contract's FP8 KV cache in the engine and the trainer (bf16-fp8-v1)")
    parser.add_argument("--workdir", default="/tmp/vllm-gpu-bench")
    parser.add_argument("--json", default=None)
    parser.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)   # child mode
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.engine:
        run_engine(args)
        return 0
    engines = args.engines.split(",")
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        parser.error(f"unknown engines {unknown}; choose from {', '.join(ENGINES)}")

    work = Path(args.workdir)
    model_dir = work / f"model-{args.shape}"
    meta = model_dir / "bench_meta.json"
    if not meta.exists() or "contract" not in json.loads(meta.read_text()):   # (older checkpoints lack the contract)
        make_checkpoint(args.shape, model_dir)
    vocab = json.loads((model_dir / "bench_meta.json").read_text())["vocab_size"]

    results = {}
    for name in engines:
        env = dict(os.environ, VLLM_BATCH_INVARIANT="1" if name == "batch-invariant" else "0")
        out, log = work / f"{args.shape}-{name}.pt", work / f"{args.shape}-{name}.log"
        out.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "--engine", name, "--model", str(model_dir), "--out", str(out),
               "--requests", str(args.requests), "--new-tokens", str(args.new_tokens),
               "--kv-cache-dtype", args.kv_cache_dtype] + (["--profile"] if args.profile else [])
        if args.block_size:
            cmd += ["--block-size", str(args.block_size)]
        print(f"== engine {name}", flush=True)
        with open(log, "w") as f:
            try:
                rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=args.engine_timeout).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        tail = log.read_text(errors="replace").splitlines()
        print("\n".join(line for line in tail if line.startswith(name + ":")), flush=True)
        r = torch.load(out, weights_only=False) if out.exists() else {}
        if rc != 0 or "seconds" not in r:
            r["failed"] = rc
            r["log_tail"] = tail[-60:]
            print(f"{name}: FAILED (rc {rc}); last lines:\n" + "\n".join(tail[-40:]), flush=True)
        results[name] = r

    trainer = trainer_for(model_dir, args.kv_cache_dtype)
    reqs = requests(args.requests, args.new_tokens, vocab)
    rows = []
    for name, r in results.items():
        row = {"engine": name, "start_s": r.get("start_s"), "block_size": r.get("block_size")}
        if "seconds" in r:
            row.update(tok_s=r["generated"] / r["seconds"], generated=r["generated"], seconds=r["seconds"])
            row.update(compare(trainer, reqs, r, model_dir))
        for key in ("sync_total_s", "sync_reload_s", "sync_bytes", "failed", "log_tail", "step_ms"):
            if key in r:
                row[key] = r[key]
        if "sync_reload_s" in r:
            row["sync_gb_s"] = r["sync_bytes"] / 1e9 / r["sync_reload_s"]
        rows.append(row)
    hal_tokens = results.get("hal", {}).get("tokens")
    for row in rows:     # another HAL engine's tokens against the hal engine's: the sampler's positions
        r = results[row["engine"]]
        if row["engine"].startswith("hal-") and hal_tokens is not None and "tokens" in r:
            row["tokens_equal_hal"] = sum(a == b for a, b in zip(r["tokens"], hal_tokens))
            print(f"{row['engine']}: {row['tokens_equal_hal']}/{len(hal_tokens)} requests with the hal engine's tokens")
    stock = next((row["tok_s"] for row in rows if row["engine"] == "stock" and "tok_s" in row), None)
    print(f"\n{args.shape}-shaped model, {args.requests} requests x {args.new_tokens} new tokens, "
          f"{torch.cuda.get_device_name()}")
    print(f"{'engine':16} {'tok/s':>8} {'vs stock':>8} {'start s':>8} {'sampled lp mismatches':>22} {'max|dlogp|':>10} "
          f"{'prompt lp mism.':>16} {'prefix-cache hits':>20} {'sync GB/s':>9}")
    for row in rows:
        if "tok_s" not in row:
            print(f"{row['engine']:16} failed ({row.get('failed')})")
            continue
        ratio = f"{row['tok_s'] / stock:.3f}" if stock else "-"
        prompt = f"{row['prompt_check_mismatches']}/{row['prompt_check_tokens']}" if "prompt_check_tokens" in row else "-"
        hits = (f"{row['prefix_cache_hit_tokens']} ({row['prefix_cache_mismatches']} mism.)"
                if "prefix_cache_hit_tokens" in row else "-")
        sync = f"{row['sync_gb_s']:.0f}" if "sync_gb_s" in row else "-"
        if "post_sync_tokens" in row:
            sync += f" (then {row['post_sync_mismatches']}/{row['post_sync_tokens']} mism.)"
        print(f"{row['engine']:16} {row['tok_s']:8.0f} {ratio:>8} {row['start_s']:8.0f} "
              f"{row['mismatches']:>12}/{row['tokens']:<9} {row['max_abs_dlogp']:10.3g} {prompt:>16} {hits:>20} {sync:>9}")
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": args.shape, "config": SHAPES[args.shape],
                                               "requests": args.requests, "new_tokens": args.new_tokens,
                                               "gpu_memory_utilization": GPU_MEMORY_UTILIZATION,
                                               "device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0 if all("tok_s" in row for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
