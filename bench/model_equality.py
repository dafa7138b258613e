"""Rollout vs training logprobs of a realistic-width random model on the GPU, cuda vs torch backends.

A random Qwen3-style model (hidden 2048, 4 layers, 16 query / 4 KV heads of 128, vocab 32000, bf16)
generates for 64 concurrent requests through the built-in rollout harness (continuous batching,
scrambled pages, chunked prefill, seeded sampler); the trainer recomputes the logprobs of every
response token with the packed training forward. With the ``cuda`` backend they must be bitwise
equal; the ``torch`` backend is the baseline. Also times rollout tokens/s and training
forward+backward tokens/s of both.

    python bench/model_equality.py --json model_equality.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time

import torch

from hal.api import create_backend
from hal.metrics import compare_logprobs
from hal.model.config import tiny_config
from hal.model.model import DecoderLM
from hal.rollout.harness import HarnessConfig, Request, RolloutHarness
from hal.rollout.recompute import recompute_logprobs


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(backend_name: str, model: DecoderLM, requests, harness_cfg) -> dict:
    model.backend = create_backend(backend_name)
    # The first rollout also compiles every Triton kernel it meets (seconds): timed apart as "cold";
    # the second, on the same requests, is the throughput ("rollout"). Same for training below.
    sync()
    start = time.perf_counter()
    RolloutHarness(model, harness_cfg).generate(requests)
    sync()
    cold_rollout_s = time.perf_counter() - start
    start = time.perf_counter()
    completions = RolloutHarness(model, harness_cfg).generate(requests)
    sync()
    rollout_s = time.perf_counter() - start
    generated = sum(len(c.tokens) for c in completions)
    with torch.no_grad():
        train = recompute_logprobs(model, completions, seed=2, max_batch_sequences=16)
    cmp = compare_logprobs(train, [c.logprobs for c in completions])
    # training forward + backward throughput on the same sequences
    sequences = [c.sequence for c in completions]
    starts = [len(c.request.prompt) for c in completions]
    def train_pass() -> float:
        sync()
        start = time.perf_counter()
        for group in range(0, len(sequences), 16):
            logprobs = model.sequence_logprobs(sequences[group:group + 16], starts[group:group + 16])
            (-torch.cat(logprobs).sum()).backward()
        sync()
        return time.perf_counter() - start

    cold_train_s = train_pass()
    train_s = train_pass()
    model.zero_grad(set_to_none=True)
    return dict(backend=backend_name, generated_tokens=generated, rollout_s=rollout_s,
                rollout_tokens_per_s=generated / rollout_s, cold_rollout_s=cold_rollout_s,
                train_tokens=sum(map(len, sequences)), train_fwd_bwd_s=train_s,
                train_tokens_per_s=sum(map(len, sequences)) / train_s, cold_train_fwd_bwd_s=cold_train_s,
                comparison=cmp.as_dict())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--dry-run", action="store_true", help="tiny model on the CPU, reference vs torch")
    args = parser.parse_args()
    if args.dry_run:
        config = tiny_config("qwen3", "bfloat16", head_dim=64)
        contract_backend, device, args.requests, args.new_tokens = "reference", "cpu", 4, 4
    else:
        config = tiny_config("qwen3", "bfloat16", hidden_size=2048, num_layers=4, num_heads=16, num_kv_heads=4,
                             head_dim=128, intermediate_size=5632, vocab_size=32000, max_position=1024,
                             tie_word_embeddings=False)
        contract_backend, device = "cuda", "cuda"
    model = DecoderLM.random(config, seed=0, backend=create_backend(contract_backend), device=device)
    rng = random.Random(0)
    requests = [Request(tuple(rng.randrange(config.vocab_size) for _ in range(rng.randint(8, 40 if args.dry_run else 300))),
                        max_new_tokens=args.new_tokens, seed=i, temperature=1.0) for i in range(args.requests)]
    harness_cfg = HarnessConfig(page_size=16, max_num_seqs=args.requests, max_batch_tokens=2048, seed=1)
    results = {}
    for name in (contract_backend, "torch"):
        results[name] = run(name, model, requests, harness_cfg)
        r = results[name]
        print(f"{name:<6} mismatching tokens {r['comparison']['mismatches']}/{r['comparison']['num_tokens']}, "
              f"max |dlogp| {r['comparison']['max_abs_diff']:.3g}, k3 {r['comparison']['k3_kl']:.3g}, "
              f"rollout {r['rollout_tokens_per_s']:.0f} tok/s (first run {r['cold_rollout_s']:.1f} s, this {r['rollout_s']:.1f} s), "
              f"train fwd+bwd {r['train_tokens_per_s']:.0f} tok/s (first pass {r['cold_train_fwd_bwd_s']:.1f} s)",
              flush=True)
    ours = results[contract_backend]
    results["ratios"] = dict(rollout=ours["rollout_tokens_per_s"] / results["torch"]["rollout_tokens_per_s"],
                             train=ours["train_tokens_per_s"] / results["torch"]["train_tokens_per_s"])
    results["config"] = dict(model=dataclasses.asdict(config),
                             requests=args.requests, new_tokens=args.new_tokens,
                             device=torch.cuda.get_device_name() if device == "cuda" else "cpu")
    with open(args.json, "w") as f:
        json.dump(results, f, indent=2, default=str)
    print(f"ratios {contract_backend}/torch: rollout {results['ratios']['rollout']:.2f}, train {results['ratios']['train']:.2f}")
    return 0 if ours["comparison"]["mismatches"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
