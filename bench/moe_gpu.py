"""MoE on the GPU (issue #21): the cuda backend's routing kernel and grouped expert GEMM, checked and timed.

Checks (bitwise, on the GPU):
  * grouped GEMM == the dense GEMM kernel one expert at a time (``hal.moe.experts`` on the same backend);
  * batch composition: a token's output alone, in a slice, in a reversed batch == in the full batch;
  * expert placement: the experts stored in another order give the same bits;
  * routing ids == the ``reference`` backend's (fp64-exact) where no near-tie, weights within 2e-6;
  * train == rollout on a random Qwen3-30B-A3B-shaped model with a few layers (``--model``).
Timing (CUDA events, median of repeats) of the whole MoE layer (route + experts) and of the experts
alone, against vLLM's fused-MoE Triton kernel (``fused_topk`` + ``fused_experts``) when vLLM imports.

    python3 bench/moe_gpu.py --json moe_gpu.json [--tokens 1,8,64,512,2048,8192] [--model] [--sweep]
                             [--kernels 1,512,8192]     # device time per kernel (torch.profiler)
                             [--slot-tiles 1,2,4,8]     # a tile per slot (no sort) against the sorted layout
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from hal.api import create_backend
from hal.moe import Routing
from hal import moe as hal_moe

QWEN3_30B = dict(hidden=2048, experts=128, top_k=8, inter=768)
DEEPSEEK_STYLE = dict(hidden=2048, experts=256, top_k=8, inter=256, groups=8, topk_groups=4, scaling=2.5)


def layer(shape, seed=0, device="cuda"):
    g = torch.Generator(device="cpu").manual_seed(seed)
    h, e, i = shape["hidden"], shape["experts"], shape["inter"]
    mk = lambda *s, fan: (torch.randn(*s, generator=g) * fan ** -0.5).to(torch.bfloat16).to(device)
    return dict(router=mk(e, h, fan=h), w13=mk(e, 2 * i, h, fan=h), w2=mk(e, h, i, fan=i),
                bias=(torch.randn(e, generator=g) * 0.05).to(device))


def routing_of(shape):
    if "groups" in shape:
        return Routing(shape["experts"], shape["top_k"], scoring="sigmoid", renormalize=True,
                       num_groups=shape["groups"], topk_groups=shape["topk_groups"], scaling=shape["scaling"])
    return Routing(shape["experts"], shape["top_k"], renormalize=True)


def run_layer(backend, x, w, routing, cfg=None):
    """The whole layer: router GEMM, routing, experts (``cfg``: {"config": the down GEMM's launch,
    "gate_up_config": the gate/up one} instead of the defaults)."""
    logits = backend.linear(x, w["router"], out_dtype=torch.float32)
    weights, ids = backend.moe_route(logits, routing, w["bias"] if routing.scoring == "sigmoid" else None)
    if cfg is None:
        return backend.moe_experts(x, w["w13"], w["w2"], weights, ids), weights, ids
    from hal.kernels import moe as kernels
    return kernels.experts(x, w["w13"], w["w2"], weights, ids, None, backend.contract.gemm, **cfg), weights, ids


def timed(fn, repeats=20):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def graph_timed(fn, repeats=20):
    """Median replay time (us) of ``fn`` captured in a CUDA graph, as vLLM runs a decode step's layers;
    (None, reason) when it cannot be captured (a host synchronisation inside, for one)."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except Exception as exc:  # noqa: BLE001 - report why it is not capturable, go on
        torch.cuda.synchronize()
        return None, f"{type(exc).__name__}: {str(exc)[:200]}"
    return timed(graph.replay, repeats), None


def checks(cuda, ref, shapes):
    out = []
    for name, shape in shapes.items():
        routing = routing_of(shape)
        w = layer(shape)
        x = torch.randn(512, shape["hidden"], generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).cuda()
        full, weights, ids = run_layer(cuda, x, w, routing)
        per_expert = hal_moe.experts(cuda, x, w["w13"], w["w2"], weights, ids)
        result = {"shape": name, "grouped_equals_per_expert_dense": bool(torch.equal(full, per_expert))}
        batches = {"one token": slice(5, 6), "slice 100:137": slice(100, 137), "reversed": torch.arange(511, -1, -1)}
        result["batch_composition_equal"] = {
            label: bool(torch.equal(run_layer(cuda, x[rows], w, routing)[0], full[rows])) for label, rows in batches.items()}
        perm = torch.randperm(shape["experts"], generator=torch.Generator().manual_seed(2)).cuda()
        slots = torch.empty_like(perm)
        slots[perm] = torch.arange(len(perm), device=perm.device)
        placed = cuda.moe_experts(x, w["w13"][slots], w["w2"][slots], weights, perm[ids.long()].int())
        result["placement_equal"] = bool(torch.equal(placed, full))
        logits = cuda.linear(x, w["router"], out_dtype=torch.float32)
        ref_w, ref_ids = ref.moe_route(logits, routing, w["bias"] if routing.scoring == "sigmoid" else None)
        cu_w, cu_ids = cuda.moe_route(logits, routing, w["bias"] if routing.scoring == "sigmoid" else None)
        same = (ref_ids == cu_ids).all(-1)
        result["routing_rows_equal_to_reference"] = f"{int(same.sum())}/{len(same)}"
        result["routing_weight_max_rel"] = float(((cu_w[same] - ref_w[same]).abs() / ref_w[same]).max())
        print(json.dumps(result), flush=True)
        out.append(result)
    return out


def vllm_moe():
    try:
        from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts
        from vllm.model_executor.layers.fused_moe.router.fused_topk_router import fused_topk
        return fused_topk, fused_experts
    except Exception as exc:  # noqa: BLE001 - report why, time ours anyway
        print(f"vLLM fused MoE not importable: {type(exc).__name__}: {exc}", flush=True)
        return None


def timing(cuda, tokens, shape, best=None):
    """Eager and CUDA-graph times of our layer and vLLM's; ``best``: {tokens: the sweep's fastest
    grouped-GEMM launch}, timed beside the default (same bits: the sweep checked)."""
    routing = routing_of(shape)
    w = layer(shape)
    vllm = vllm_moe()
    rows = []
    print(f"{'T':>6} {'hal layer us':>13} {'hal experts us':>15} {'vllm layer us':>14} {'vllm experts us':>16} "
          f"{'experts ratio':>14} {'graph: hal layer':>17} {'vllm layer':>11} {'ratio':>6} "
          f"(eager: CUDA events around each call; graph: one captured layer replayed; ratio = vLLM time / ours)",
          flush=True)
    for t in tokens:
        x = torch.randn(t, shape["hidden"], generator=torch.Generator().manual_seed(t)).to(torch.bfloat16).cuda()
        logits = cuda.linear(x, w["router"], out_dtype=torch.float32)
        weights, ids = cuda.moe_route(logits, routing)
        row = {"tokens": t,
               "hal_layer_us": timed(lambda: run_layer(cuda, x, w, routing)),
               "hal_experts_us": timed(lambda: cuda.moe_experts(x, w["w13"], w["w2"], weights, ids))}
        row["hal_layer_graph_us"], why = graph_timed(lambda: run_layer(cuda, x, w, routing))
        if why:
            row["hal_graph_error"] = why
        if best and t in best:
            row["best_cfg"] = best[t]
            row["hal_layer_best_us"] = timed(lambda: run_layer(cuda, x, w, routing, best[t]))
            row["hal_layer_best_graph_us"], why = graph_timed(lambda: run_layer(cuda, x, w, routing, best[t]))
            if why:
                row["hal_best_graph_error"] = why
        if vllm is not None:
            fused_topk, fused_experts = vllm

            def vllm_layer():
                lg = torch.nn.functional.linear(x, w["router"])
                tw, ti, _ = fused_topk(x, lg, shape["top_k"], True)
                return fused_experts(x, w["w13"], w["w2"], tw, ti)
            try:
                tw, ti, _ = fused_topk(x, torch.nn.functional.linear(x, w["router"]), shape["top_k"], True)
                row["vllm_layer_us"] = timed(vllm_layer)
                row["vllm_experts_us"] = timed(lambda: fused_experts(x, w["w13"], w["w2"], tw, ti))
                row["experts_ratio"] = row["vllm_experts_us"] / row["hal_experts_us"]
                row["layer_ratio"] = row["vllm_layer_us"] / row["hal_layer_us"]
                row["vllm_layer_graph_us"], why = graph_timed(vllm_layer)
                if why:
                    row["vllm_graph_error"] = why
                if row["hal_layer_graph_us"] and row["vllm_layer_graph_us"]:
                    row["layer_graph_ratio"] = row["vllm_layer_graph_us"] / row["hal_layer_graph_us"]
                if row.get("hal_layer_best_graph_us") and row["vllm_layer_graph_us"]:
                    row["layer_best_graph_ratio"] = row["vllm_layer_graph_us"] / row["hal_layer_best_graph_us"]
            except Exception as exc:  # noqa: BLE001 - the bundle may lack vLLM's MoE ops: say so, go on
                print(f"vLLM fused MoE failed: {type(exc).__name__}: {exc}", flush=True)
                vllm = None
        print(f"{t:>6} {row['hal_layer_us']:>13.1f} {row['hal_experts_us']:>15.1f} "
              f"{row.get('vllm_layer_us', float('nan')):>14.1f} {row.get('vllm_experts_us', float('nan')):>16.1f} "
              f"{row.get('experts_ratio', float('nan')):>14.3f} {row.get('hal_layer_graph_us') or float('nan'):>17.1f} "
              f"{row.get('vllm_layer_graph_us') or float('nan'):>11.1f} {row.get('layer_graph_ratio', float('nan')):>6.3f}",
              flush=True)
        if "best_cfg" in row:
            print(f"  the sweep's fastest launch {row['best_cfg']}: eager {row['hal_layer_best_us']:.1f} us, graph "
                  f"{row['hal_layer_best_graph_us'] or float('nan'):.1f} us, vLLM graph / ours "
                  f"{row.get('layer_best_graph_ratio', float('nan')):.3f}", flush=True)
        for key in ("hal_graph_error", "hal_best_graph_error", "vllm_graph_error"):
            if key in row:
                print(f"  {key}: {row[key]}", flush=True)
        rows.append(row)
    return rows


def sweep(cuda, tokens, shape):
    """Every launch of the gate/up (gated) and the down grouped GEMM (``moe.candidates``, the tuner's set),
    timed apart (CUDA events), for each tile-row count: the bits of every slot must be identical across
    all of them (tile freedom). Then, with the fastest pair, where the time goes (not the contract unless said): the unfused gate/up GEMM +
    the silu_mul row kernel (what the gated epilogue replaced); the same launches with one K chunk
    (k_chunk = K: the cost of the contract's chunk sums); the dense GEMM kernel and cuBLAS on as many
    rows as there are slots (the cost of the gather and the expert tiles)."""
    import dataclasses

    from hal.kernels import moe as kernels

    spec = cuda.contract.gemm
    routing = routing_of(shape)
    w = layer(shape)
    e, i, h = shape["experts"], shape["inter"], shape["hidden"]
    rows = []
    for t in tokens:
        x = torch.randn(t, h, generator=torch.Generator().manual_seed(t)).to(torch.bfloat16).cuda()
        weights, ids = cuda.moe_route(cuda.linear(x, w["router"], out_dtype=torch.float32), routing)
        first = {}        # per GEMM: the first launch's per-slot output, which every other must equal
        times, identical, failed, per_bm = 0, 0, [], {}

        def fastest(label, run, configs, slots):
            """{launch: us} of ``run`` over ``configs``, counting launches and bit-identical ones."""
            nonlocal times, identical
            found = {}
            for cfg in configs:
                try:
                    per_slot = run(cfg)[slots.position]
                    identical += bool(torch.equal(per_slot, first.setdefault(label, per_slot)))
                    found[json.dumps(cfg)] = timed(lambda: run(cfg), repeats=10)
                    times += 1
                except Exception as exc:  # noqa: BLE001 - out of resources: not a candidate here
                    failed.append(f"{label} {cfg}: {type(exc).__name__}")
            return found

        for bm in kernels.TILE_ROWS:
            slots = kernels.sort_slots(ids, e, bm)

            def gate_up(cfg):
                return kernels.gate_up(x, w["w13"], slots, spec, cfg)
            gate_times = fastest("gate", gate_up, kernels.candidates(bm, gated=True), slots)
            if not gate_times:
                continue
            best_gate = json.loads(min(gate_times, key=gate_times.get))
            act = gate_up(best_gate)

            def down_proj(cfg):
                return kernels.grouped_linear(act, w["w2"], slots.token, slots, torch.float32, spec, cfg, x_sorted=True)
            down_times = fastest("down", down_proj, kernels.candidates(bm, gated=False), slots)
            if down_times:
                best_down = min(down_times, key=down_times.get)
                per_bm[bm] = dict(gate=best_gate, gate_us=min(gate_times.values()), down=json.loads(best_down),
                                  down_us=down_times[best_down], sort_us=timed(lambda: kernels.sort_slots(ids, e, bm)))
        bm = min(per_bm, key=lambda b: per_bm[b]["gate_us"] + per_bm[b]["down_us"])
        best = per_bm[bm]
        slots = kernels.sort_slots(ids, e, bm)
        gate, down_cfg = best["gate"], best["down"]
        act = kernels.gate_up(x, w["w13"], slots, spec, gate)
        wide = dict(gate, BLOCK_N=2 * gate["BLOCK_N"])
        gate_up = kernels.grouped_linear(x, w["w13"], slots.token, slots, x.dtype, spec, wide)
        one_chunk = dataclasses.replace(spec, k_chunk=1 << 20)
        valid = t * shape["top_k"]
        xs, acts = torch.randn(valid, h, device="cuda").to(x.dtype), torch.randn(valid, i, device="cuda").to(x.dtype)
        w13_0, w2_0 = w["w13"][0].contiguous(), w["w2"][0].contiguous()
        diagnosis = {
            "unfused_gate_up_us": timed(lambda: kernels.grouped_linear(x, w["w13"], slots.token, slots, x.dtype,
                                                                       spec, wide)),
            "silu_mul_us": timed(lambda: cuda.silu_mul(gate_up)),
            "unfused_bits_equal": bool(torch.equal(cuda.silu_mul(gate_up)[slots.position], act[slots.position])),
            "one_chunk_gate_us": timed(lambda: kernels.gate_up(x, w["w13"], slots, one_chunk, gate)),
            "gather_rows_us": timed(lambda: kernels.gather_rows(x, slots)),
            "one_chunk_down_us": timed(lambda: kernels.grouped_linear(act, w["w2"], slots.token, slots, torch.float32,
                                                                      one_chunk, down_cfg, x_sorted=True)),
            "dense_gate_up_us": timed(lambda: cuda.linear(xs, w13_0)),
            "dense_down_fp32_us": timed(lambda: cuda.linear(acts, w2_0, out_dtype=torch.float32)),
            "cublas_gate_up_us": timed(lambda: torch.mm(xs, w13_0.T)),
            "cublas_down_us": timed(lambda: torch.mm(acts, w2_0.T)),
        }
        down = kernels.grouped_linear(act, w["w2"], slots.token, slots, torch.float32, spec, down_cfg, x_sorted=True)
        combined = kernels.combine(down, slots.position, weights, None, x.dtype)
        combines = {}
        for block in (512, 1024, 2048):
            for warps in (4, 8):
                out = kernels.combine(down, slots.position, weights, None, x.dtype, block, warps)
                combines[f"{block}/{warps}"] = dict(
                    us=timed(lambda: kernels.combine(down, slots.position, weights, None, x.dtype, block, warps)),
                    equal=bool(torch.equal(out, combined)))
        diagnosis["combine_us_by_block_and_warps"] = combines
        identical += sum(c["equal"] for c in combines.values())
        times += len(combines)
        combine_text = ", ".join(f"{key}: {c['us']:.1f}" for key, c in combines.items())
        row = {"tokens": t, "candidates": times, "identical": identical, "failed": failed, "per_block_m": per_bm,
               "best": {"config": down_cfg, "gate_up_config": gate}, "best_us": best["gate_us"] + best["down_us"],
               "default": kernels.grouped_configs(valid, e), "diagnosis": diagnosis}
        print(json.dumps(row), flush=True)
        print(f"  T={t}: gate/up {best['gate_us']:.1f} us + down {best['down_us']:.1f} us at {bm} tile rows "
              f"(sort {best['sort_us']:.1f} us, rows gathered into sorted order {diagnosis['gather_rows_us']:.1f} us); "
              f"unfused gate/up {diagnosis['unfused_gate_up_us']:.1f} + silu_mul "
              f"{diagnosis['silu_mul_us']:.1f}; one K chunk: {diagnosis['one_chunk_gate_us']:.1f} + "
              f"{diagnosis['one_chunk_down_us']:.1f}; dense GEMM on {valid} rows: "
              f"{diagnosis['dense_gate_up_us']:.1f} + "
              f"{diagnosis['dense_down_fp32_us']:.1f}; cuBLAS {diagnosis['cublas_gate_up_us']:.1f} + "
              f"{diagnosis['cublas_down_us']:.1f}; combine (columns/warps: us) {combine_text}", flush=True)
        rows.append(row)
    return rows


def kernel_breakdown(cuda, tokens, shape, repeats=10):
    """Device time per kernel of one layer call (ours, and vLLM's fused MoE when it imports), from
    torch.profiler over ``repeats`` calls: where a layer's time goes, the profile behind a speed miss."""
    from torch.profiler import ProfilerActivity, profile

    routing = routing_of(shape)
    w = layer(shape)
    vllm = vllm_moe()
    rows = []
    for t in tokens:
        x = torch.randn(t, shape["hidden"], generator=torch.Generator().manual_seed(t)).to(torch.bfloat16).cuda()
        layers = {"hal": lambda: run_layer(cuda, x, w, routing)}
        if vllm is not None:
            fused_topk, fused_experts = vllm

            def vllm_layer():
                tw, ti, _ = fused_topk(x, torch.nn.functional.linear(x, w["router"]), shape["top_k"], True)
                return fused_experts(x, w["w13"], w["w2"], tw, ti)
            layers["vllm"] = vllm_layer
        for name, fn in layers.items():
            try:
                fn()
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(repeats):
                        fn()
                    torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - vLLM without its MoE ops: say so, go on
                print(f"  T={t} {name}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                continue
            kernels = {}
            for event in prof.key_averages():
                device_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
                if device_us > 0 and event.count >= repeats:
                    kernels[event.key[:90]] = dict(us_per_call=device_us / repeats, launches=event.count // repeats)
            total = sum(k["us_per_call"] for k in kernels.values())
            rows.append(dict(tokens=t, engine=name, device_us=total, kernels=kernels))
            print(f"T={t:>5} {name:>5}: {total:9.1f} us device time per layer call", flush=True)
            for key, k in sorted(kernels.items(), key=lambda kv: -kv[1]["us_per_call"])[:8]:
                print(f"        {k['us_per_call']:9.1f} us  x{k['launches']:<3} {key}", flush=True)
    return rows


def model_check(layers=3, requests=32, new_tokens=64, *, fp8=False):
    """Train == rollout through the harness on a random Qwen3-30B-A3B-shaped model with a few layers
    (``fp8``: block-FP8 attention, experts and shared MLPs under bf16-moe-fp8-v1; bench/fp8_moe_gpu.py)."""
    from hal.model import DecoderLM, tiny_config, tiny_fp8_config
    from hal.rollout import HarnessConfig, Request, RolloutHarness, recompute_logprobs

    backend = create_backend("cuda", "bf16-moe-fp8-v1" if fp8 else "bf16-moe-v1")
    config = (tiny_fp8_config if fp8 else tiny_config)(
        "qwen3_moe", "bfloat16", vocab_size=151936, hidden_size=2048, num_layers=layers, num_heads=32,
        num_kv_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        max_position=4096)
    model = DecoderLM.random(config, seed=3, backend=backend)
    g = torch.Generator().manual_seed(4)
    reqs = [Request(tuple(torch.randint(0, 151936, (int(torch.randint(16, 200, (1,), generator=g)),),
                                        generator=g).tolist()), new_tokens, seed=i, temperature=1.0)
            for i in range(requests)]
    start = time.perf_counter()
    completions = RolloutHarness(model, HarnessConfig(page_size=64, max_num_seqs=requests, max_batch_tokens=2048,
                                                      seed=0)).generate(reqs)
    rollout_s = time.perf_counter() - start
    with torch.no_grad():
        trains = recompute_logprobs(model, completions, seed=1, max_batch_sequences=8, page_size=64)
    tokens = sum(len(c.tokens) for c in completions)
    mismatches = sum(int((lp.cpu() != c.logprobs.cpu()).sum()) for c, lp in zip(completions, trains))
    result = {"layers": layers, "requests": requests, "generated_tokens": tokens, "mismatching_logprobs": mismatches,
              "rollout_s": rollout_s}
    print(json.dumps(result), flush=True)
    return result


def sort_warps(tokens, shape, warps=(1, 2, 4, 8)):
    """The one-program slot sort (decode batches) at each warp count: the same token / position / tile
    expert arrays as at the default, and its time per sort (us) in a CUDA graph of ten."""
    from hal.kernels import moe as kernels

    default = kernels.ONE_PROGRAM_SORT_WARPS
    rows = []
    try:
        for t in tokens:
            g = torch.Generator(device="cuda").manual_seed(t)
            ids = torch.rand(t, shape["experts"], generator=g, device="cuda").topk(shape["top_k"], dim=1).indices
            ids = ids.to(torch.int32)
            kernels.ONE_PROGRAM_SORT_WARPS = default
            base = kernels.sort_slots(ids, shape["experts"], 16, slot_tiles=False)
            for w in warps:
                kernels.ONE_PROGRAM_SORT_WARPS = w
                got = kernels.sort_slots(ids, shape["experts"], 16, slot_tiles=False)
                same = all(torch.equal(getattr(got, f), getattr(base, f)) for f in ("token", "position", "tile_expert"))
                # ten sorts in one graph: the replay's own overhead spread over them
                us, why = graph_timed(lambda: [kernels.sort_slots(ids, shape["experts"], 16, slot_tiles=False)
                                               for _ in range(10)])
                rows.append(dict(tokens=t, warps=w, same=same, graph_us=us / 10 if us is not None else None, why=why))
                print(f"  sort T={t} warps={w}: {rows[-1]['graph_us'] or float('nan'):.2f} us per sort (graph), "
                      f"same arrays: {same} {why or ''}", flush=True)
    finally:
        kernels.ONE_PROGRAM_SORT_WARPS = default
    return rows


def slot_tiles(cuda, tokens, shape):
    """The layer with each slot in a tile of its own (``sort_slots(slot_tiles=True)``: no sort) and with the
    sorted layout, at the default launches: the same output bits? CUDA-graph time of each (us)."""
    from hal.kernels import moe as kernels

    routing = routing_of(shape)
    w = layer(shape)
    rows = []
    for t in tokens:
        x = torch.randn(t, shape["hidden"], generator=torch.Generator().manual_seed(t)).to(torch.bfloat16).cuda()
        default = kernels.takes_slot_tiles(t * shape["top_k"], shape["experts"])
        row = dict(tokens=t, default_slot_tiles=default)
        outs = {}
        for tiles in (True, False):
            outs[tiles] = run_layer(cuda, x, w, routing, {"slot_tiles": tiles})[0]
            row[f"graph_us_slot_tiles_{tiles}"], why = graph_timed(lambda: run_layer(cuda, x, w, routing,
                                                                                      {"slot_tiles": tiles}))
            if why:
                row[f"why_{tiles}"] = why
        row["same"] = bool(torch.equal(outs[True], outs[False]))
        print(f"  slot tiles T={t}: graph {row['graph_us_slot_tiles_True'] or float('nan'):.1f} us, sorted "
              f"{row['graph_us_slot_tiles_False'] or float('nan'):.1f} us, same bits: {row['same']} "
              f"(default: {'slot tiles' if default else 'sorted'})", flush=True)
        rows.append(row)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", required=True)
    parser.add_argument("--tokens", default="1,8,64,512,2048,8192", help="token counts to time ('' : no timing)")
    parser.add_argument("--model", action="store_true", help="also train == rollout on a Qwen3-30B-A3B-shaped model")
    parser.add_argument("--no-checks", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="grouped-GEMM launch configurations: same bits? fastest?")
    parser.add_argument("--kernels", default="", help="token counts at which to profile the device time per kernel")
    parser.add_argument("--best-from", default="", help="a JSON of an earlier --sweep run: time its fastest launches "
                                                        "beside the defaults (same bits: that sweep checked)")
    parser.add_argument("--sort-warps", default="", help="token counts at which to time the one-program slot sort "
                                                         "at 1-8 warps (its arrays checked against the default's)")
    parser.add_argument("--slot-tiles", default="", help="token counts at which to time the layer with a tile per "
                                                         "slot (no sort) and sorted (their bits compared)")
    args = parser.parse_args(argv)
    cuda = create_backend("cuda", "bf16-moe-v1")
    ref = create_backend("reference", "bf16-moe-v1", device="cuda")
    report = {"device": torch.cuda.get_device_name(), "qwen3_30b_a3b": QWEN3_30B, "deepseek_style": DEEPSEEK_STYLE}
    if not args.no_checks:
        report["checks"] = checks(cuda, ref, {"qwen3_30b_a3b": QWEN3_30B, "deepseek_style": DEEPSEEK_STYLE})
    best = None
    if args.sweep:
        report["sweep_qwen3_30b_a3b"] = sweep(cuda, [int(t) for t in (args.tokens or "1,64,512,2048,8192").split(",")],
                                              QWEN3_30B)
        best = {row["tokens"]: row["best"] for row in report["sweep_qwen3_30b_a3b"]}
    elif args.best_from:
        with open(args.best_from) as f:
            best = {row["tokens"]: row["best"] for row in json.load(f).get("sweep_qwen3_30b_a3b", [])}
    if args.tokens:
        report["timing_qwen3_30b_a3b"] = timing(cuda, [int(t) for t in args.tokens.split(",")], QWEN3_30B, best)
    if args.kernels:
        report["kernels_qwen3_30b_a3b"] = kernel_breakdown(cuda, [int(t) for t in args.kernels.split(",")], QWEN3_30B)
    if args.sort_warps:
        report["sort_warps"] = sort_warps([int(t) for t in args.sort_warps.split(",")], QWEN3_30B)
    if args.slot_tiles:
        report["slot_tiles"] = slot_tiles(cuda, [int(t) for t in args.slot_tiles.split(",")], QWEN3_30B)
    if args.model:
        report["model"] = model_check()
    with open(args.json, "w") as f:
        json.dump(report, f, indent=2)
    ok = all(c["grouped_equals_per_expert_dense"] and c["placement_equal"] and all(c["batch_composition_equal"].values())
             for c in report.get("checks", [])) and report.get("model", {}).get("mismatching_logprobs", 0) == 0 \
        and all(r["identical"] == r["candidates"] for r in report.get("sweep_qwen3_30b_a3b", [])) \
        and all(r["same"] for r in report.get("sort_warps", []) + report.get("slot_tiles", []))
    print("MOE CHECKS", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
