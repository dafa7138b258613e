"""``hal demo``: the train/rollout mismatch of stock kernels, and the contract backend's fix.

Three situations an RL run meets every step, each computed twice on the same inputs, as a rollout
engine and a trainer would: a token's logprob computed alone (decode) vs inside a large batch
(training forward); a GEMM row alone vs in a batch; the attention output of the last tokens in
full prefill (trainer) vs token-by-token decode from a paged cache (engine).
"""

from __future__ import annotations

import time

import torch

from hal.api import create_backend
from hal.conformance.checks import AttentionCase, compare, random_tensor, run_schedule


def _situations(backend, seed: int):
    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16
    hidden, vocab, batch = 4096, 1024, 64
    x = random_tensor((batch, hidden), dtype, g)
    w = random_tensor((1024, hidden), dtype, g, scale=hidden ** -0.5)
    lm_head = random_tensor((vocab, hidden), dtype, g, scale=hidden ** -0.5)
    tokens = torch.randint(0, vocab, (batch,), generator=g)

    def logprobs(rows, ids):
        return backend.token_logprobs(backend.linear(rows, lm_head, out_dtype=torch.float32), ids)

    def each_alone(fn, *inputs):
        return torch.cat([fn(*(t[i:i + 1] for t in inputs)) for i in range(batch)])

    yield ("64 token logprobs: each alone (decode) vs one batch (training)",
           each_alone(logprobs, x, tokens), logprobs(x, tokens))
    yield ("GEMM 4096->1024 bf16: 64 rows each alone vs one batch",
           each_alone(lambda r: backend.linear(r, w), x), backend.linear(x, w))
    case = AttentionCase(seq_len=160, q_heads=8, kv_heads=2, head_dim=64, dtype=dtype, seed=seed)
    prefill = run_schedule(backend, case, [160], page_size=16)
    decode = run_schedule(backend, case, [128] + [1] * 32, page_size=16, seed=1)
    yield ("attention, last 32 tokens: full prefill vs decode", prefill[128:], decode[128:])


def run_demo(seed: int = 0) -> int:
    print(__doc__.strip().splitlines()[0])
    print("Same inputs, two arrangements; 'bits differ' counts output values that are not bitwise equal.\n")
    results = {}
    for name in ("torch", "reference"):
        backend = create_backend(name)
        start = time.perf_counter()
        results[name] = [(label, compare(label, a, b)) for label, a, b in _situations(backend, seed)]
        results[name + ":time"] = time.perf_counter() - start
    labels = [label for label, _ in results["torch"]]
    width = max(len(label) for label in labels)
    print(f"{'situation':<{width}}  {'torch (stock kernels)':<34}  reference (contract)")
    for i, label in enumerate(labels):
        cells = []
        for name in ("torch", "reference"):
            m = results[name][i][1]
            cells.append("identical (diff = 0)" if m is None
                         else f"{m.differing}/{m.total} differ, max |d| {m.max_abs_diff:.2g}")
        print(f"{label:<{width}}  {cells[0]:<34}  {cells[1]}")
    print(f"\ntime: torch {results['torch:time']:.2f}s, reference {results['reference:time']:.2f}s")
    bad = [label for label, m in results["reference"] if m is not None]
    if bad:
        print(f"FAIL: the reference backend broke its contract in: {', '.join(bad)}")
        return 1
    fixed = sum(m is not None for _, m in results["torch"])
    print(f"The contract backend gives diff = 0 in all {len(labels)} situations; stock kernels differ in {fixed}.")
    return 0
