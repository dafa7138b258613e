"""The fused sampling kernel (hal/kernels/sampling.py) against the torch sampler on the GPU: the same token
for every row (temperatures 0, 0.7, 1, 1.3; vocabularies of Qwen3 / Llama 3 / a small model), and both
timed. ``sample_rows`` runs the kernel on CUDA; the harness and vLLM both sample through it: its tokens are
checked too, and its host cost per call (keys from the seeds and positions, the pinned copy, the launch:
what a decode step's host pays for sampling) is measured without synchronising.

    python3 bench/sampler_check.py --json $OUT/sampler.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import triton

from hal.kernels import sampling
from hal.rollout import sampler


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    g = torch.Generator(device="cuda").manual_seed(0)
    rows_out, ok = [], True
    for vocab in (151936, 128256, 4096):
        for batch in (1, 64, 256):
            logits = torch.randn(batch, vocab, device="cuda", generator=g) * 4
            seeds = list(range(1000, 1000 + batch))
            positions = [300 + 7 * i for i in range(batch)]
            temps = [(0.0, 0.7, 1.0, 1.3)[i % 4] for i in range(batch)]
            keys = torch.tensor([sampler.position_seed(s, p) for s, p in zip(seeds, positions)], device="cuda")
            t = torch.tensor(temps, dtype=torch.float64, device="cuda")
            fused = sampling.sample(logits, keys, t)
            reference = sampler.sample_rows_torch(logits, seeds, positions, temps)
            via_api = sampler.sample_rows(logits, seeds, positions, temps)
            equal = int((fused == reference).sum())
            api_equal = int((via_api == reference).sum())
            ok &= equal == batch and api_equal == batch
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(50):
                sampler.sample_rows(logits, seeds, positions, temps)
            host_us = (time.perf_counter() - start) / 50 * 1e6
            torch.cuda.synchronize()
            fused_ms = triton.testing.do_bench(lambda: sampling.sample(logits, keys, t), return_mode="median")
            torch_ms = triton.testing.do_bench(lambda: sampler.sample_rows_torch(logits, seeds, positions, temps),
                                               return_mode="median")
            rows_out.append(dict(vocab=vocab, batch=batch, equal=equal, sample_rows_equal=api_equal, fused_ms=fused_ms,
                                 torch_ms=torch_ms, sample_rows_host_us=host_us))
            print(f"V={vocab:6} B={batch:3}: {equal}/{batch} tokens equal (sample_rows {api_equal}/{batch}); fused "
                  f"{fused_ms * 1e3:7.1f} us, torch {torch_ms * 1e3:8.1f} us; sample_rows host {host_us:6.1f} us per call",
                  flush=True)
    print("all equal" if ok else "DIFFERENT TOKENS")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows_out, "all_equal": ok}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
