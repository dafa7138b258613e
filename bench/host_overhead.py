"""Host cost of one ``hal.ops`` call on a backend (issue #20: <= 10 us per op call outside CUDA graphs), and
whether every op can be captured in a CUDA graph with the eager bits.

Each op runs on inputs small enough that the GPU finishes a call long before the host issues the next, so
the wall time of a loop of calls without synchronisation is the host's cost per call (Python, argument
checks, allocation, Triton's launcher, the driver). The GPU's own time per call (CUDA-graph replay) is
printed beside it: where it exceeds the host time the loop measured the GPU, and the row says so. Stock
torch ops of the same shapes are timed the same way, as the yardstick of what a launch costs here.

Each op is timed twice: through Triton's own launch path (``kernel[grid]``, hal.kernels.launcher off) and
through the launcher's fast path (a seen specialisation's compiled kernel called directly); the two
outputs must be bitwise equal.

    python3 bench/host_overhead.py --backend cuda --json host.json [--calls 300] [--profile linear_m64]

``--profile OP``: a cProfile of that op's calls (the top functions by own time), to see where the host
time goes.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import torch
import torch.nn.functional as F

from family_sweep import graph_ms
from hal.api import create_backend
from hal.backend import AttentionMetadata
from hal.kernels import launcher


def host_us(fn, calls: int) -> float:
    """Median over 5 loops of the wall time per call of ``calls`` back-to-back calls (no sync inside)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    loops = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        loops.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return sorted(loops)[2]


def capture(fn):
    """One call of ``fn`` captured in a CUDA graph (warmed on a side stream first, as torch asks) and
    replayed; returns that call's output."""
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return out


def device_us(fn) -> float | None:
    """Device time per call by CUDA-graph replay (family_sweep's timer); None if the op cannot be captured."""
    try:
        return graph_ms([fn]) * 1e3
    except Exception:                      # noqa: BLE001 - the row records that the op is not capturable
        return None


def bits_equal(a, b) -> bool:
    """Two op outputs (a tensor or a tuple of tensors / None) bitwise equal."""
    outs = (a, b) if isinstance(a, tuple) else ((a,), (b,))
    for x, y in zip(*outs):
        if x is None:
            continue
        if not torch.equal(x.view(torch.uint8) if x.dtype.is_floating_point else x,
                           y.view(torch.uint8) if y.dtype.is_floating_point else y):
            return False
    return True


def captured_bits_equal(fn) -> tuple[bool, str]:
    """Capture one call in a CUDA graph, replay it, and compare its output with an eager call's, bitwise."""
    eager = fn()
    try:
        captured = capture(fn)
    except Exception as exc:               # noqa: BLE001
        return False, f"capture failed: {type(exc).__name__}: {str(exc)[:160]}"
    return (True, "") if bits_equal(eager, captured) else (False, "replay bits differ from eager")


def cases(backend, device):
    """(name, hal call, stock call or None); each call returns its output(s)."""
    bf16 = torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape, dtype=bf16):
        return torch.randn(*shape, generator=g, device=device).to(dtype)

    out = []
    for m in (1, 64, 256):
        x, w = rand(m, 1024), rand(512, 1024) * 0.03
        out.append((f"linear_m{m}", lambda x=x, w=w: backend.linear(x, w), lambda x=x, w=w: F.linear(x, w)))
    x, res, nw = rand(4, 1024), rand(4, 1024), rand(1024)
    out.append(("rms_norm", lambda: backend.rms_norm(x, nw, 1e-6),
                lambda: F.rms_norm(x, (1024,), nw, 1e-6)))
    out.append(("rms_norm_residual", lambda: backend.rms_norm(x, nw, 1e-6, res),
                lambda: F.rms_norm(x + res, (1024,), nw, 1e-6)))
    gu = rand(4, 2 * 1024)
    out.append(("silu_mul", lambda: backend.silu_mul(gu), lambda: F.silu(gu[:, :1024]) * gu[:, 1024:]))
    q, k = rand(4, 16, 128), rand(4, 8, 128)
    positions = torch.arange(4, device=device)
    table = torch.randn(4096, 128, generator=g, device=device)
    out.append(("rotary", lambda: backend.rotary(positions, q, k, table), None))
    # decode attention: 4 sequences of 300 keys in 16-key pages
    pages, page = 4 * 19, 16
    kc, vc = rand(pages, page, 8, 128), rand(pages, page, 8, 128)
    meta = AttentionMetadata(query_start_loc=torch.arange(5, device=device, dtype=torch.int32),
                             seq_lens=torch.full((4,), 300, device=device, dtype=torch.int32),
                             block_table=torch.randperm(pages, generator=g, device=device).to(torch.int32).view(4, 19))
    sdpa_k, sdpa_v = rand(4, 8, 300, 128), rand(4, 8, 300, 128)
    out.append(("attention_decode", lambda: backend.attention(q, kc, vc, meta, scale=128 ** -0.5),
                lambda: F.scaled_dot_product_attention(q.unsqueeze(2), sdpa_k, sdpa_v, enable_gqa=True)))
    kv_k, kv_v = rand(4, 8, 128), rand(4, 8, 128)
    slots = torch.tensor([5, 77, 300, 1000], device=device)
    out.append(("write_kv", lambda: backend.write_kv(kv_k, kv_v, kc, vc, slots), None))
    logits, ids = rand(4, 32000, dtype=torch.float32), torch.randint(0, 32000, (4,), generator=g, device=device)
    out.append(("token_logprobs", lambda: backend.token_logprobs(logits, ids),
                lambda: torch.log_softmax(logits, -1).gather(-1, ids[:, None])))
    return out


def launch_floor(device, calls: int) -> dict:
    """What one launch costs this host with nothing around it: a one-line kernel (2 pointers, an int) by
    Triton's ``kernel[grid]``, by its compiled kernel's launcher called with prepared arguments (the least
    any Python launch of a Triton kernel costs), and torch's ``add_`` (the least a torch op costs)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _copy(src, dst, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)

    src, dst = torch.zeros(64, device=device), torch.empty(64, device=device)
    compiled = _copy[(1,)](src, dst, 64, BLOCK=64)
    stream = torch.cuda.current_stream().cuda_stream
    args = (src, dst, 64, 64)

    def prepared():
        compiled.run(1, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, *args)

    return dict(triton_path_us=host_us(lambda: _copy[(1,)](src, dst, 64, BLOCK=64), calls),
                fast_path_us=host_us(lambda: launcher.launch(_copy, (1,), src, dst, 64, BLOCK=64), calls),
                prepared_launcher_us=host_us(prepared, calls), torch_add_us=host_us(lambda: dst.add_(1.0), calls))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--profile", action="append", default=[], help="op names to profile with cProfile")
    ap.add_argument("--json")
    args = ap.parse_args()
    device = torch.device("cuda")
    backend = create_backend(args.backend, device=device)
    rows = []
    fast_default = launcher.ENABLED
    print(f"{'op':22} {'triton path us':>14} {'hal host us':>12} {'device us':>10} {'torch host us':>14} "
          f"{'graph':>6} {'same bits':>9}  note", flush=True)
    for name, ours, stock in cases(backend, device):
        launcher.ENABLED = False                       # Triton's own launch path: kernel[grid](...)
        slow_out = ours()
        row = dict(op=name, triton_path_host_us=host_us(ours, args.calls))
        launcher.ENABLED = fast_default                # the fast path (unless HAL_FAST_LAUNCH=0)
        row["host_us"] = host_us(ours, args.calls)
        row["fast_launch"] = fast_default
        row["same_bits_both_paths"] = bits_equal(slow_out, ours())
        row["device_us"] = device_us(ours)
        row["capturable"], why = captured_bits_equal(ours)
        if why:
            row["capture_note"] = why
        if stock is not None:
            row["torch_host_us"] = host_us(stock, args.calls)
        row["host_bound"] = row["device_us"] is None or row["device_us"] < row["host_us"]
        rows.append(row)
        note = "" if row["host_bound"] else "device-bound: host time hidden"
        print(f"{name:22} {row['triton_path_host_us']:14.1f} {row['host_us']:12.1f} "
              f"{row['device_us'] or float('nan'):10.1f} {row.get('torch_host_us', float('nan')):14.1f} "
              f"{'yes' if row['capturable'] else 'NO':>6} {'yes' if row['same_bits_both_paths'] else 'NO':>9}  "
              f"{note} {why}", flush=True)
        if name in args.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.calls):
                ours()
            prof.disable()
            torch.cuda.synchronize()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(18)
            row["profile"] = text.getvalue()
            print(row["profile"], flush=True)
    floor = launch_floor(device, args.calls)
    print(f"\none launch and nothing else: kernel[grid] {floor['triton_path_us']:.1f} us, hal.kernels.launcher "
          f"{floor['fast_path_us']:.1f} us, the compiled kernel's launcher with prepared arguments "
          f"{floor['prepared_launcher_us']:.1f} us; torch add_ {floor['torch_add_us']:.1f} us", flush=True)
    target = 10.0
    over = [r["op"] for r in rows if r["host_us"] > target]
    print(f"\nops over {target:.0f} us of host time per call: {', '.join(over) or 'none'}; "
          f"not capturable: {', '.join(r['op'] for r in rows if not r['capturable']) or 'none'}; "
          f"other bits on the fast path: {', '.join(r['op'] for r in rows if not r['same_bits_both_paths']) or 'none'}",
          flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, calls=args.calls,
                           target_us=target, launch_verify=launcher.VERIFY, launch_floor=floor, rows=rows), f, indent=1)
    return 0 if all(r["same_bits_both_paths"] and r["capturable"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
