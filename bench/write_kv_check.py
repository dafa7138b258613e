"""The write_kv kernel (hal/kernels/kv_write.py) against the default indexed copy on the GPU (bitwise), in vLLM's
side-by-side cache layout and in plain caches, bf16 and fp32, several page sizes, padding slots at -1.
The check to pass before the kernel becomes the cuda backend's write_kv (not run yet: no device time left).

    python3 bench/write_kv_check.py --json $OUT/write_kv.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from hal.api import create_backend
from hal.backend import Backend
from hal.kernels import kv_write


def case(cuda, page_size: int, dtype: torch.dtype, side_by_side: bool, seed: int) -> bool:
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages, heads, d, tokens = 64, 8, 128, 300
    slots = torch.randperm(pages * page_size, generator=g, device="cuda")[:tokens]
    slots[::7] = -1
    k, v = (torch.randn(tokens, heads, d, generator=g, device="cuda").to(dtype) for _ in range(2))
    if side_by_side:
        start = torch.randn(pages, heads, page_size, 2 * d, generator=g, device="cuda").to(dtype)
    else:
        start = torch.randn(2, pages, page_size, heads, d, generator=g, device="cuda").to(dtype)

    def written(write):
        cache = start.clone()
        if side_by_side:
            views = cache[..., :d].transpose(1, 2), cache[..., d:].transpose(1, 2)
        else:
            views = cache[0], cache[1]
        write(k, v, *views, slots)
        return cache

    kernel = written(kv_write.write_kv)
    default = written(lambda *a: Backend.write_kv.__wrapped__(cuda, *a))
    return torch.equal(kernel, default) and not torch.equal(kernel, start)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    cuda = create_backend("cuda")
    rows = []
    for page_size in (16, 32, 5):
        for dtype in (torch.bfloat16, torch.float32):
            for side_by_side in (True, False):
                ok = case(cuda, page_size, dtype, side_by_side, seed=len(rows))
                rows.append({"page_size": page_size, "dtype": str(dtype), "side_by_side": side_by_side, "equal": ok})
                print(f"page {page_size:3} {str(dtype):15} {'side-by-side' if side_by_side else 'plain':13} "
                      f"{'equal' if ok else 'DIFFERENT'}", flush=True)
    print(f"{sum(r['equal'] for r in rows)}/{len(rows)} cases bitwise equal to the indexed copy")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0 if all(r["equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
