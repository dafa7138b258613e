"""GPU check and speed of hal.digest's fingerprint (the weight-sync check):

* the kernel (``hal.digest.fingerprint`` of a CUDA tensor) equals the torch specification
  (``fingerprint_torch``) on the same GPU tensor, and on its CPU copy where that is small enough to run
  on the host in seconds; for dtypes bf16 / fp32 / fp8 / uint8, odd byte counts and views;
* negative control: one flipped bit at a random position changes both lanes;
* speed: GB/s of one fingerprint of large tensors (CUDA events, median), and ``weights_checksum`` over a
  Qwen3-1.7B-shaped and a Qwen3-8B-shaped set of bf16 parameters, and (1.7B) the host sha256 it replaces.

    python3 bench/digest_gpu.py --json digest_gpu.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from hal import digest
from hal.rl.engines import host_weights_checksum, weights_checksum

CPU_LIMIT = 64 << 20      # bytes: larger tensors are compared on the GPU only (the host torch path is slow)


def cases(g: torch.Generator):
    dev = "cuda"
    yield "bf16 151936x2048 (embedding)", torch.randn(151936, 2048, device=dev, generator=g).to(torch.bfloat16)
    yield "bf16 12288x4096", torch.randn(12288, 4096, device=dev, generator=g).to(torch.bfloat16)
    yield "bf16 7x5x3 (odd bytes)", torch.randn(7, 5, 3, device=dev, generator=g).to(torch.bfloat16)
    yield "fp32 3001", torch.randn(3001, device=dev, generator=g)
    yield "fp8 e4m3 4096x4096", torch.randn(4096, 4096, device=dev, generator=g).to(torch.float8_e4m3fn)
    yield "uint8 13", torch.randint(0, 256, (13,), device=dev, generator=g, dtype=torch.uint8)
    yield "bf16 view [:, 1:129]", torch.randn(512, 130, device=dev, generator=g).to(torch.bfloat16)[:, 1:129]
    yield "bf16 1.2e9 elements (2.4 GB)", torch.randn(1 << 30, device=dev, generator=g).to(torch.bfloat16)


def model_shapes(hidden, layers, heads, kv_heads, head_dim, inter, vocab):
    shapes = [(vocab, hidden)]
    for _ in range(layers):
        shapes += [((heads + 2 * kv_heads) * head_dim, hidden), (hidden, heads * head_dim), (2 * inter, hidden),
                   (hidden, inter), (hidden,), (hidden,), (head_dim,), (head_dim,)]
    return shapes + [(hidden,)]


class Params(torch.nn.Module):
    def __init__(self, shapes, g):
        super().__init__()
        self.p = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(s, device="cuda", generator=g).to(torch.bfloat16), requires_grad=False)
             for s in shapes])


def timed(fn, repeats=5):
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="digest_gpu.json")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows, failures = [], 0
    for name, t in cases(g):
        kernel = digest.fingerprint(t)
        spec_gpu = digest.fingerprint_torch(t)
        nbytes = t.numel() * t.element_size()
        spec_cpu = digest.fingerprint_torch(t.cpu()) if nbytes <= CPU_LIMIT else None
        flipped = t.detach().contiguous().clone()
        raw = flipped.view(-1).view(torch.uint8)
        pos = int(torch.randint(0, raw.numel(), (1,), device="cuda", generator=g))
        raw[pos] ^= 1 << (pos % 8)
        flip = digest.fingerprint(flipped)
        ok = kernel == spec_gpu and (spec_cpu is None or kernel == spec_cpu)
        control = flip[1] != kernel[1] and flip[2] != kernel[2]
        seconds = timed(lambda: digest.fingerprint(t)) if nbytes >= (64 << 20) else None
        row = dict(case=name, bytes=nbytes, kernel_equals_torch_gpu=kernel == spec_gpu,
                   kernel_equals_torch_cpu=None if spec_cpu is None else kernel == spec_cpu,
                   bit_flip_changes_both_lanes=control, seconds=seconds,
                   gb_per_s=None if seconds is None else nbytes / seconds / 1e9)
        failures += (not ok) + (not control)
        rows.append(row)
        print(f"{name:<32} equal gpu {row['kernel_equals_torch_gpu']!s:<5} cpu {row['kernel_equals_torch_cpu']!s:<5} "
              f"flip seen {control!s:<5}" + (f" {row['gb_per_s']:.0f} GB/s" if seconds else ""), flush=True)
        del t, flipped
    models = {"qwen3-1.7b": model_shapes(2048, 28, 16, 8, 128, 6144, 151936),
              "qwen3-8b": model_shapes(4096, 36, 32, 8, 128, 12288, 151936)}
    sums = []
    for label, shapes in models.items():
        model = Params(shapes, g)
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        device_s = timed(lambda: weights_checksum(model), repeats=3)
        host_s = timed(lambda: host_weights_checksum(model), repeats=1) if label == "qwen3-1.7b" else None   # 8B: ~30 s
        sums.append(dict(model=label, bytes=nbytes, weights_checksum_s=device_s, host_sha256_s=host_s,
                         weights_checksum_gb_per_s=nbytes / device_s / 1e9))
        print(f"weights_checksum {label}: {nbytes / 1e9:.2f} GB in {device_s * 1e3:.1f} ms "
              f"({nbytes / device_s / 1e9:.0f} GB/s)" + (f"; host sha256 {host_s:.1f} s" if host_s else ""), flush=True)
        del model
    with open(args.json, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "cases": rows, "weights_checksum": sums,
                   "failures": failures}, f, indent=1)
    print(f"failures: {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
