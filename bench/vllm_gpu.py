"""GPU vLLM (0.26) with the HAL plugin vs stock vLLM vs ``VLLM_BATCH_INVARIANT=1`` (issue #19's measurement).

NOT RUN YET: written for the H200 with the offline vLLM bundle (../shared/tools/vllm-gpu/) unpacked into
PYTHONPATH and this checkout installed next to it. Each engine runs in its own process (vLLM reads
``VLLM_BATCH_INVARIANT`` at import), one after another, on the same random checkpoint and requests:

* ``hal``: ``quantization="hal"`` bound to the ``cuda`` backend, compiled, PIECEWISE CUDA graphs;
* ``stock``: vLLM's defaults (CUDA graphs + torch.compile);
* ``batch-invariant``: stock with ``VLLM_BATCH_INVARIANT=1``.

Then the trainer (``DecoderLM.sequence_logprobs`` on the ``cuda`` backend) recomputes every sampled
token's logprob; the table gives generated tokens/s and mismatching logprobs per engine (0 expected for
``hal``; the stock engines are the negative control). JSON with every number goes to ``--json``.

    python3 bench/vllm_gpu.py --json $OUT/vllm_gpu.json                 # Qwen3-1.7B-shaped, 256 requests
    python3 bench/vllm_gpu.py --shape 8b --requests 256 --new-tokens 256 --json ...
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

SHAPES = {  # random-weight models shaped like these (issue #19)
    "1.7b": dict(architecture="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=28,
                 num_heads=16, num_kv_heads=8, head_dim=128, qk_norm=True, tie_word_embeddings=True),
    "8b": dict(architecture="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
               num_heads=32, num_kv_heads=8, head_dim=128, qk_norm=True),
}
ENGINES = ("hal", "stock", "batch-invariant")


def requests(count: int, new_tokens: int, vocab: int, seed: int = 0):
    from hal.rollout.harness import Request

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(64, 513, (count,), generator=g).tolist()
    return [Request(prompt=tuple(torch.randint(0, vocab, (n,), generator=g).tolist()), max_new_tokens=new_tokens,
                    seed=i) for i, n in enumerate(lengths)]


def run_engine(args) -> None:
    """Child process: one engine, warm-up, one timed generate; tokens and logprobs to ``args.out``."""
    from hal.vllm.binding import resolve_binding
    from hal.vllm.engine import VllmEngine

    model_dir = Path(args.model)
    config = json.loads((model_dir / "bench_meta.json").read_text())
    reqs = requests(args.requests, args.new_tokens, config["vocab_size"])
    binding = resolve_binding({"backend": "cuda"}) if args.engine == "hal" else None
    t0 = time.perf_counter()
    engine = VllmEngine(model_dir, binding=binding, dtype="bfloat16", max_model_len=1024,
                        max_num_seqs=args.requests, max_num_batched_tokens=8192, enforce_eager=False)
    start_s = time.perf_counter() - t0
    try:
        engine.generate(reqs[:8])                                   # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        completions = engine.generate(reqs)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    finally:
        engine.close()
    generated = sum(len(c.tokens) for c in completions)
    torch.save({"engine": args.engine, "start_s": start_s, "seconds": seconds, "generated": generated,
                "tokens": [c.tokens for c in completions], "logprobs": [c.logprobs for c in completions]}, args.out)
    print(f"{args.engine}: {generated / seconds:.0f} generated tok/s ({generated} tokens in {seconds:.1f} s; "
          f"start-up {start_s:.0f} s)", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1.7b")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--workdir", default="/tmp/vllm-gpu-bench")
    parser.add_argument("--json", default=None)
    parser.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)   # child mode
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.engine:
        run_engine(args)
        return 0

    from hal.api import create_backend
    from hal.metrics import compare_logprobs
    from hal.model.checkpoint import load_pretrained, save_pretrained
    from hal.model.config import ModelConfig
    from hal.model.model import DecoderLM

    work = Path(args.workdir)
    model_dir = work / f"model-{args.shape}"
    config = ModelConfig(dtype="bfloat16", **SHAPES[args.shape])
    if not (model_dir / "bench_meta.json").exists():
        print(f"writing a random {args.shape}-shaped checkpoint to {model_dir}", flush=True)
        save_pretrained(DecoderLM.random(config, seed=1, backend=create_backend("reference")), model_dir)
        (model_dir / "bench_meta.json").write_text(json.dumps({"vocab_size": config.vocab_size}))

    results = {}
    for name in args.engines.split(","):
        env = dict(os.environ, VLLM_BATCH_INVARIANT="1" if name == "batch-invariant" else "0")
        out = work / f"{name}.pt"
        cmd = [sys.executable, __file__, "--engine", name, "--model", str(model_dir), "--out", str(out),
               "--requests", str(args.requests), "--new-tokens", str(args.new_tokens)]
        done = subprocess.run(cmd, env=env)
        results[name] = torch.load(out) if done.returncode == 0 and out.exists() else {"failed": done.returncode}

    trainer = load_pretrained(model_dir, backend=create_backend("cuda"))
    reqs = requests(args.requests, args.new_tokens, config.vocab_size)
    rows = []
    for name, r in results.items():
        if "failed" in r:
            rows.append({"engine": name, "failed": r["failed"]})
            continue
        sequences = [list(q.prompt) + list(t) for q, t in zip(reqs, r["tokens"])]
        with torch.no_grad():
            train = []
            for i in range(0, len(sequences), 16):     # bounded activation memory at 151936-wide logits
                train += trainer.sequence_logprobs(sequences[i:i + 16], [len(q.prompt) for q in reqs[i:i + 16]])
        c = compare_logprobs([t.cpu() for t in train], [lp.cpu() for lp in r["logprobs"]])
        rows.append({"engine": name, "tok_s": r["generated"] / r["seconds"], "generated": r["generated"],
                     "seconds": r["seconds"], "start_s": r["start_s"], "tokens": c.num_tokens,
                     "mismatches": c.mismatches, "max_abs_dlogp": c.max_abs_diff})
    stock = next((row["tok_s"] for row in rows if row["engine"] == "stock" and "tok_s" in row), None)
    print(f"\n{'engine':18} {'tok/s':>9} {'vs stock':>9} {'mismatching logprobs':>22} {'max|dlogp|':>11}")
    for row in rows:
        if "failed" in row:
            print(f"{row['engine']:18} failed (rc {row['failed']})")
            continue
        ratio = f"{row['tok_s'] / stock:.3f}" if stock else "-"
        print(f"{row['engine']:18} {row['tok_s']:9.0f} {ratio:>9} {row['mismatches']:>12}/{row['tokens']:<9} "
              f"{row['max_abs_dlogp']:11.3g}")
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": args.shape, "config": SHAPES[args.shape],
                                               "requests": args.requests, "new_tokens": args.new_tokens,
                                               "device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
