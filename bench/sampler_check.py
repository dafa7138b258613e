"""The fused sampling kernel (hal/kernels/sampling.py) against the torch sampler on the GPU: the same token
for every row (temperatures 0, 0.7, 1, 1.3; vocabularies of Qwen3 / Llama 3 / a small model), and both
timed. ``sample_rows`` runs the kernel on CUDA; the harness and vLLM both sample through it.

    python3 bench/sampler_check.py --json $OUT/sampler.json
"""

from __future__ import annotations

import argparse
import json
import sys

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
            equal = int((fused == reference).sum())
            ok &= equal == batch
            fused_ms = triton.testing.do_bench(lambda: sampling.sample(logits, keys, t), return_mode="median")
            torch_ms = triton.testing.do_bench(lambda: sampler.sample_rows_torch(logits, seeds, positions, temps),
                                               return_mode="median")
            rows_out.append(dict(vocab=vocab, batch=batch, equal=equal, fused_ms=fused_ms, torch_ms=torch_ms))
            print(f"V={vocab:6} B={batch:3}: {equal}/{batch} tokens equal; fused {fused_ms * 1e3:7.1f} us, "
                  f"torch {torch_ms * 1e3:8.1f} us", flush=True)
    print("all equal" if ok else "DIFFERENT TOKENS")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows_out, "all_equal": ok}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
