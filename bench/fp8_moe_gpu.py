"""Block-FP8 MoE experts on the GPU (issue #22): the cuda backend's grouped FP8 expert GEMMs
(hal/kernels/fp8_moe.py) checked and timed.

Checks (bitwise, on the device):
  * grouped == composed: ``hal.moe.fp8_experts`` on the same backend (its ``fp8_linear`` / ``silu_mul`` /
    ``fp8_linear`` one expert at a time, the kernels the kit's fp8_linear cells check), for every launch of
    ``fp8_moe.CANDIDATES`` and both slot layouts (sorted, a tile per slot);
  * batch composition: a slice, the reversed batch and one token alone == their rows of the full batch;
  * train == rollout on a random block-FP8 Qwen3-30B-A3B-shaped model with a few layers (``--model``).
Timing (CUDA-graph replay, median): the FP8 experts (grouped), our bf16 grouped experts on the same
shape (the layer FP8 replaces), and the composed path (eager: it synchronises with the host, so no graph).
The weight bytes an expert call must read over its time give the achieved HBM bandwidth at small batches.

    python3 bench/fp8_moe_gpu.py --json fp8_moe_gpu.json [--tokens 1,4,16,64,512,2048,8192] [--model]
    TRITON_INTERPRET=1 python3 bench/fp8_moe_gpu.py --smoke    # the script itself, tiny, on the CPU
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from hal import fp8
from hal import moe as hal_moe
from hal.api import create_backend
from hal.moe import Routing
from moe_gpu import graph_timed, model_check, timed      # this folder's MoE bench: one copy of the timers

SHAPES = {
    "qwen3-30b-a3b": dict(hidden=2048, experts=128, top_k=8, inter=768),
    "deepseek-v3": dict(hidden=7168, experts=256, top_k=8, inter=2048, groups=8, topk_groups=4, scaling=2.5),
    "smoke": dict(hidden=256, experts=8, top_k=2, inter=128),
}


def routing_of(shape) -> Routing:
    if "groups" in shape:
        return Routing(shape["experts"], shape["top_k"], scoring="sigmoid", renormalize=True,
                       num_groups=shape["groups"], topk_groups=shape["topk_groups"], scaling=shape["scaling"])
    return Routing(shape["experts"], shape["top_k"], renormalize=True)


def layer(shape, spec, device, seed=0):
    """Router (bf16), bf16 expert stacks and their block-FP8 quantisation (one expert at a time: a
    DeepSeek-V3 stack in fp32 would take 30 GB)."""
    g = torch.Generator(device=device).manual_seed(seed)      # drawn on the device: 11 GB of DeepSeek-V3 experts
    h, e, i = shape["hidden"], shape["experts"], shape["inter"]
    out = dict(router=(torch.randn(e, h, generator=g, device=device) * h ** -0.5).bfloat16(),
               bias=torch.randn(e, generator=g, device=device) * 0.05)
    for name, (n, k) in (("w13", (2 * i, h)), ("w2", (h, i))):
        bf16 = torch.empty(e, n, k, dtype=torch.bfloat16, device=device)
        q = torch.empty(e, n, k, dtype=torch.float8_e4m3fn, device=device)
        s = torch.empty(e, n // 128, k // 128, dtype=torch.float32, device=device)
        for expert in range(e):
            w = torch.randn(n, k, generator=g, device=device) * k ** -0.5
            bf16[expert] = w.bfloat16()
            q[expert], s[expert] = fp8.quantise_weight_blocks(w, spec)
        out[name], out[name + "_fp8"], out[name + "_scale_inv"] = bf16, q, s
    return out


def route(backend, x, w, routing):
    logits = backend.linear(x, w["router"], out_dtype=torch.float32)
    return backend.moe_route(logits, routing, w["bias"] if routing.scoring == "sigmoid" else None)


def fp8_args(w):
    return w["w13_fp8"], w["w13_scale_inv"], w["w2_fp8"], w["w2_scale_inv"]


def checks(cuda, shape_name, tokens_list, device, candidates):
    """Bitwise checks on one shape; returns (rows for the JSON, failures)."""
    from hal.kernels import fp8_moe

    shape = SHAPES[shape_name]
    spec = cuda.contract.fp8
    w = layer(shape, spec, device)
    routing = routing_of(shape)
    rows, failures = [], []
    for t in tokens_list:
        x = torch.randn(t, shape["hidden"], generator=torch.Generator().manual_seed(t)).bfloat16().to(device)
        weights, ids = route(cuda, x, w, routing)
        composed = hal_moe.fp8_experts(cuda, x, *fp8_args(w), weights, ids)
        grouped = cuda.fp8_moe_experts(x, *fp8_args(w), weights, ids)
        row = dict(shape=shape_name, tokens=t, grouped_equals_composed=torch.equal(grouped, composed))
        launches = 0
        differ = []
        for cfg in candidates or [None]:
            for slot_tiles in (False, True):
                got = fp8_moe.experts(x, *fp8_args(w), weights, ids, None, spec, cfg, slot_tiles=slot_tiles)
                launches += 1
                if not torch.equal(got, composed):
                    differ.append(dict(cfg or {}, slot_tiles=slot_tiles))
        row["launches_checked"], row["launches_differing"] = launches, differ
        batch_ok = True
        for sub in ([slice(t // 3, t // 3 + max(1, t // 4))] + ([torch.arange(t - 1, -1, -1)] if t > 1 else [])
                    + [slice(t - 1, t)]):
            out = cuda.fp8_moe_experts(x[sub], *fp8_args(w), weights[sub], ids[sub])
            batch_ok &= torch.equal(out, grouped[sub])
        row["batch_composition"] = batch_ok
        if not (row["grouped_equals_composed"] and not differ and batch_ok):
            failures.append(row)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows, failures


def vllm_fp8_experts():
    """vLLM's fused MoE (Triton, block-FP8 W8A8 with 128 x 128 weight blocks and per-token-group activation
    scales), or None with the reason printed."""
    try:
        from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts
    except Exception as exc:  # noqa: BLE001 - the bundle may be absent: time ours anyway
        print(f"vLLM fused MoE not importable: {type(exc).__name__}: {exc}", flush=True)
        return None
    try:
        from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config
    except ImportError:
        fp8_w8a8_moe_quant_config = None

    def run(x, w, weights, ids):
        if fp8_w8a8_moe_quant_config is not None:
            config = fp8_w8a8_moe_quant_config(w1_scale=w["w13_scale_inv"], w2_scale=w["w2_scale_inv"],
                                               block_shape=[128, 128])
            return fused_experts(x, w["w13_fp8"], w["w2_fp8"], weights, ids.to(torch.int32), quant_config=config)
        return fused_experts(x, w["w13_fp8"], w["w2_fp8"], weights, ids.to(torch.int32), use_fp8_w8a8=True,
                             w1_scale=w["w13_scale_inv"], w2_scale=w["w2_scale_inv"], block_shape=[128, 128])
    return run


def timing(cuda, shape_name, tokens_list, device):
    shape = SHAPES[shape_name]
    w = layer(shape, cuda.contract.fp8, device)
    routing = routing_of(shape)
    bf16 = create_backend("cuda", "bf16-moe-v1")
    h, i, k = shape["hidden"], shape["inter"], shape["top_k"]
    vllm = vllm_fp8_experts()
    rows = []
    for t in tokens_list:
        x = torch.randn(t, h, generator=torch.Generator().manual_seed(t)).bfloat16().to(device)
        weights, ids = route(cuda, x, w, routing)
        experts_used = int(ids.unique().numel())
        fp8_us, why = graph_timed(lambda: cuda.fp8_moe_experts(x, *fp8_args(w), weights, ids))
        bf16_us, bf16_why = graph_timed(lambda: bf16.moe_experts(x, w["w13"], w["w2"], weights, ids))
        composed_us = timed(lambda: hal_moe.fp8_experts(cuda, x, *fp8_args(w), weights, ids), repeats=5) \
            if t <= 512 else None
        vllm_us = vllm_why = None
        if vllm is not None:
            try:
                vllm_us, vllm_why = graph_timed(lambda: vllm(x, w, weights, ids))
            except Exception as exc:  # noqa: BLE001 - say why, go on with ours
                vllm_why = f"{type(exc).__name__}: {str(exc)[:200]}"
        weight_bytes = experts_used * 3 * h * i          # fp8: one byte per weight, the scales aside
        row = dict(shape=shape_name, tokens=t, experts_used=experts_used, fp8_graph_us=fp8_us, fp8_not_captured=why,
                   vllm_fp8_graph_us=vllm_us, vllm_not_timed=vllm_why,
                   vllm_over_ours=(vllm_us / fp8_us) if fp8_us and vllm_us else None,
                   bf16_graph_us=bf16_us, bf16_not_captured=bf16_why, composed_eager_us=composed_us,
                   fp8_over_bf16=(bf16_us / fp8_us) if fp8_us and bf16_us else None,
                   weight_read_tb_s=(weight_bytes / fp8_us / 1e6) if fp8_us else None,
                   tflops=(2 * t * k * 3 * h * i / fp8_us / 1e6) if fp8_us else None)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def sweep(cuda, shape_name, tokens_list, device, candidates):
    """Every candidate launch timed (CUDA-graph replay) in the layout ``sort_slots`` picks, its bits compared
    with the default launch's; per token count the fastest and its time against the default."""
    from hal.kernels import fp8_moe

    shape = SHAPES[shape_name]
    spec = cuda.contract.fp8
    w = layer(shape, spec, device)
    routing = routing_of(shape)
    rows = []
    for t in tokens_list:
        x = torch.randn(t, shape["hidden"], generator=torch.Generator().manual_seed(t)).bfloat16().to(device)
        weights, ids = route(cuda, x, w, routing)
        default = fp8_moe.experts(x, *fp8_args(w), weights, ids, None, spec)
        default_us, _ = graph_timed(lambda: fp8_moe.experts(x, *fp8_args(w), weights, ids, None, spec))
        times, differ = [], []
        for cfg in candidates:
            if not torch.equal(fp8_moe.experts(x, *fp8_args(w), weights, ids, None, spec, cfg), default):
                differ.append(cfg)
            us, why = graph_timed(lambda: fp8_moe.experts(x, *fp8_args(w), weights, ids, None, spec, cfg))
            times.append(dict(cfg, us=us, not_captured=why))
        timed_ok = [r for r in times if r["us"] is not None]
        best = min(timed_ok, key=lambda r: r["us"]) if timed_ok else None
        row = dict(shape=shape_name, tokens=t, default_us=default_us, best=best,
                   default_over_best=(default_us / best["us"]) if best and default_us else None,
                   candidates=times, differing=differ)
        print(json.dumps({k: v for k, v in row.items() if k != "candidates"}), flush=True)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default="fp8_moe_gpu.json")
    p.add_argument("--shapes", default="qwen3-30b-a3b,deepseek-v3")
    p.add_argument("--check-tokens", default="1,4,64,512")
    p.add_argument("--tokens", default="1,4,16,64,512,2048,8192")
    p.add_argument("--model", action="store_true", help="train == rollout on an FP8 Qwen3-30B-A3B-shaped model")
    p.add_argument("--no-candidates", action="store_true", help="check the default launch only")
    p.add_argument("--sweep", action="store_true", help="only time every candidate launch (bits against the default)")
    p.add_argument("--smoke", action="store_true", help="tiny shape, the interpreter on the CPU: the script itself")
    args = p.parse_args(argv)
    from hal.kernels import fp8_moe

    cuda = create_backend("cuda", "bf16-moe-fp8-v1")
    device = cuda.device
    if args.smoke:
        rows, failures = checks(cuda, "smoke", [1, 5], device, [dict(BLOCK_M=32, GATE_BLOCK_N=64, DOWN_BLOCK_N=128)])
        swept = sweep(cuda, "smoke", [3], device, fp8_moe.CANDIDATES[:2]) if torch.cuda.is_available() else []
        print(f"smoke: {len(rows)} rows, {len(failures)} failures")
        return 1 if failures or any(r["differing"] for r in swept) else 0
    if args.sweep:
        result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, sweep=[])
        for shape in args.shapes.split(","):
            result["sweep"] += sweep(cuda, shape, [int(t) for t in args.tokens.split(",")], device, fp8_moe.CANDIDATES)
            torch.cuda.empty_cache()
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print("\nshape            tokens  default us  best us  default/best  best launch")
        for r in result["sweep"]:
            best = r["best"] or {}
            print(f"{r['shape']:<16} {r['tokens']:>6}  {r['default_us'] or float('nan'):10.1f}  "
                  f"{best.get('us') or float('nan'):7.1f}  {r['default_over_best'] or float('nan'):12.2f}  "
                  f"{ {k: v for k, v in best.items() if k not in ('us', 'not_captured')} }")
        bad = [r for r in result["sweep"] if r["differing"]]
        print(f"FP8 MOE SWEEP BITS {'PASS' if not bad else 'FAIL'}: "
              f"{sum(len(r['candidates']) for r in result['sweep'])} launches timed")
        return 1 if bad else 0
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, checks=[], timing=[])
    failures = []
    candidates = [] if args.no_candidates else fp8_moe.CANDIDATES
    for n, shape in enumerate(args.shapes.split(",")):
        # every candidate launch on the first shape; the default launch (both layouts) on the others
        rows, bad = checks(cuda, shape, [int(t) for t in args.check_tokens.split(",")], device,
                           candidates if n == 0 else [])
        result["checks"] += rows
        failures += bad
        torch.cuda.empty_cache()
        result["timing"] += timing(cuda, shape, [int(t) for t in args.tokens.split(",")], device)
        torch.cuda.empty_cache()
    if args.model:
        result["model"] = model_check(layers=2, requests=16, new_tokens=32, fp8=True)
        if result["model"]["mismatching_logprobs"]:
            failures.append(result["model"])
    result["failures"] = failures
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print("\nCUDA-graph replay, median us; vLLM/ours and bf16/fp8: the other's time over ours (> 1: ours faster)")
    print("shape            tokens  fp8 ours  vLLM fp8  vLLM/ours  bf16 ours  bf16/fp8  weight TB/s  composed eager")
    for r in result["timing"]:
        fmt = lambda v, spec: format(v, spec) if v is not None else "-"
        print(f"{r['shape']:<16} {r['tokens']:>6}  {fmt(r['fp8_graph_us'], '8.1f')}  {fmt(r['vllm_fp8_graph_us'], '8.1f')}"
              f"  {fmt(r['vllm_over_ours'], '9.2f')}  {fmt(r['bf16_graph_us'], '9.1f')}  {fmt(r['fp8_over_bf16'], '8.2f')}"
              f"  {fmt(r['weight_read_tb_s'], '11.2f')}  {fmt(r['composed_eager_us'], '14.1f')}")
    print(f"FP8 MOE CHECKS {'PASS' if not failures else 'FAIL'}: "
          f"{sum(r['launches_checked'] for r in result['checks'])} launches over {len(result['checks'])} cases")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
