"""Launch selection by measurement (issue #20), bit-safe by construction: dense and block-FP8 linears, an
MoE layer's grouped expert GEMMs (``tune_moe``) and decode attention (``tune_decode``).

The contract fixes the GEMM's reduction structure (K chunks at absolute offsets, ascending); tiles,
warps, stages, split-K and descriptor loads are free: they never change a bit (bench/tile_freedom.py,
tests/test_cuda_interpreter.py). So the fastest launch of a shape can be found by timing.
``tune_gemm`` times every configuration of ``gemm.candidates`` for each shape on the device, checks
that each one gives the bits of the kernel's own configuration (one that does not is a kernel bug:
tuning stops with an error naming it), and keeps the fastest in a ``TuneCache``, a JSON file per device.

At run time the cuda backend's launch policy (``hal.backends.cuda.launch``) looks every GEMM up by its
shape class: M rounded up to a power of two, N, K, the input and output dtypes and k_chunk. The cache
is read once per process and never changes afterwards, so a shape class always gets the same
configuration within a process (the bits do not depend on it anyway). Without a cache file, or for a
shape class it does not hold, the kernel's own table (``gemm._config``) decides.

Decode attention likewise: its reduction structure is the contract's (KV chunks and splits at absolute
positions); splits per program, stages, register cap, warps, how a GQA group is spread over programs and
whether splits run in parallel programs are free (``attention.decode_candidates``), so ``tune_decode``
times them per decode shape class (``decode_shape_class``) with the same bit check. Prefill too: tokens a
program, warps and stages (``attention.prefill_candidates``), by ``tune_prefill`` per ``prefill_shape_class``.

    hal tune --model path/to/config.json                # a model's linears at batch sizes 1..8192, its decode
                                                        # attention at 1..256 sequences, its prefill at 512..16k
    HAL_TUNE_CACHE=/path/tune.json python train.py      # where the cache is read (default below)
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import torch

from hal.contract import Attention, Fp8, Gemm
from hal.errors import HalError

log = logging.getLogger(__name__)

FORMAT = 1

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16",
                torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


def _dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype))


def _power_of_two_at_least(x: int) -> int:
    """The class of a count that varies from call to call (tokens, slots, sequences, keys): x rounded up."""
    return 1 << max(0, (max(1, x) - 1).bit_length())


def shape_class(m: int, n: int, k: int, in_dtype: torch.dtype, out_dtype: torch.dtype, k_chunk: int) -> str:
    """The cache key of a GEMM: M rounded up to a power of two (decode batches vary step by step)."""
    return f"m{_power_of_two_at_least(m)}-n{n}-k{k}-{_dtype_name(in_dtype)}-{_dtype_name(out_dtype)}-kc{k_chunk}"


def fp8_shape_class(m: int, n: int, k: int, spec: Fp8, out_dtype: torch.dtype) -> str:
    """The cache key of a block-FP8 GEMM (``hal.kernels.fp8_gemm``): as ``shape_class``, with the
    activation format for the input and the K block for the chunk."""
    bf16_key = shape_class(m, n, k, torch.bfloat16, out_dtype, spec.activation_group)
    return bf16_key.replace("-bf16-", f"-{spec.activation_format}-", 1)


def moe_shape_class(slots: int, num_experts: int, hidden: int, inter: int, dtype: torch.dtype, k_chunk: int) -> str:
    """The cache key of an MoE layer's grouped expert GEMMs: its (token, rank) slots rounded up to a power
    of two, the experts, hidden and expert widths, the activation dtype and k_chunk."""
    return f"moe-s{_power_of_two_at_least(slots)}-e{num_experts}-h{hidden}-i{inter}-{_dtype_name(dtype)}-kc{k_chunk}"


def decode_shape_class(tokens: int, num_seqs: int, context: int, q_heads: int, kv_heads: int, head_dim: int,
                       page: int, q_dtype: torch.dtype, kv_dtype: torch.dtype, spec: Attention) -> str:
    """The cache key of a decode attention call: the sequences, the queries per sequence and the keys the
    block table holds, each rounded up to a power of two (all three vary from step to step; in a vLLM
    engine the block table's width is the model's length), the heads, head dim, page, dtypes and the
    contract's KV chunk and split."""
    q_per_seq = -(-tokens // max(1, num_seqs))
    return (f"decode-b{_power_of_two_at_least(num_seqs)}-q{_power_of_two_at_least(q_per_seq)}"
            f"-ctx{_power_of_two_at_least(context)}-h{q_heads}x{kv_heads}-d{head_dim}-p{page}"
            f"-{_dtype_name(q_dtype)}-kv{_dtype_name(kv_dtype)}"
            f"-kc{spec.kv_chunk}-ks{spec.kv_split}")


def prefill_shape_class(tokens: int, num_seqs: int, q_heads: int, kv_heads: int, head_dim: int, page: int,
                        q_dtype: torch.dtype, kv_dtype: torch.dtype, spec: Attention) -> str:
    """The cache key of a prefill (or chunked prefill) attention call: the sequences and the query tokens per
    sequence, each rounded up to a power of two, the heads, head dim, page, dtypes and the contract's KV chunk
    and split."""
    q_per_seq = -(-tokens // max(1, num_seqs))
    return (f"prefill-b{_power_of_two_at_least(num_seqs)}-q{_power_of_two_at_least(q_per_seq)}"
            f"-h{q_heads}x{kv_heads}-d{head_dim}-p{page}-{_dtype_name(q_dtype)}-kv{_dtype_name(kv_dtype)}"
            f"-kc{spec.kv_chunk}-ks{spec.kv_split}")


def default_cache_path(device_name: str) -> Path:
    """``$HAL_TUNE_CACHE`` if set, else ``~/.cache/hal/tuning/<device>.json``."""
    if os.environ.get("HAL_TUNE_CACHE"):
        return Path(os.environ["HAL_TUNE_CACHE"])
    slug = re.sub(r"[^A-Za-z0-9]+", "-", device_name).strip("-").lower() or "device"
    return Path.home() / ".cache" / "hal" / "tuning" / f"{slug}.json"


@dataclass
class TuneCache:
    """Chosen configurations per shape class, for one device and Triton version."""

    device: str
    triton: str
    entries: dict[str, dict] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path) -> "TuneCache":
        try:
            raw = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise HalError(f"tuning cache {path} is not valid JSON ({exc}); delete it or run `hal tune` again") from None
        if raw.get("format") != FORMAT:
            raise HalError(f"tuning cache {path} has format {raw.get('format')!r}, this hal reads {FORMAT}; "
                           f"run `hal tune` again")
        return cls(raw["device"], raw["triton"], dict(raw["entries"]))

    def save(self, path: Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"format": FORMAT, "device": self.device, "triton": self.triton,
                                   "entries": dict(sorted(self.entries.items()))}, indent=1))
        tmp.replace(path)     # readers never see a half-written file

    def config(self, key: str) -> dict | None:
        entry = self.entries.get(key)
        return dict(entry["config"]) if entry else None


@functools.lru_cache(maxsize=None)
def runtime_cache(device_name: str, triton_version: str) -> TuneCache | None:
    """The cache the launch policy reads for this device: loaded once per process. A cache made on
    another device or Triton version is ignored (with a warning): its timings say nothing here."""
    path = default_cache_path(device_name)
    if not path.is_file():
        return None
    cache = TuneCache.load(path)
    if (cache.device, cache.triton) != (device_name, triton_version):
        log.warning("hal: ignoring the tuning cache %s, made on %s with triton %s (this is %s, triton %s)",
                    path, cache.device, cache.triton, device_name, triton_version)
        return None
    log.info("hal: GEMM launches from the tuning cache %s (%d shape classes)", path, len(cache.entries))
    return cache


def do_bench_cudagraph_synced(fn: Callable[[], object], **kwargs):
    """``triton.testing.do_bench_cudagraph(fn, **kwargs)`` once every kernel already queued has finished.

    Why: do_bench_cudagraph runs ``fn`` on a new stream that does not wait for the current one, so inputs
    still being written there (a benchmark's random caches, block tables, activations) are read half-made.
    `hal tune` read a decode cell's block table before ``randperm`` had written it and faulted with an illegal
    memory access (B = 1 x 32k keys, H100, bench/results/h100-2026-12-07-gemm-split/); the same cell passed with
    blocking launches. Values read early are also timed on the wrong data."""
    import triton

    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, **kwargs)


def _device_ms(fn: Callable[[], object]) -> float:
    return do_bench_cudagraph_synced(fn, rep=20, return_mode="median")


def tune_gemm(shapes: Iterable[tuple[int, int, int]], spec: Gemm, *, dtype: torch.dtype = torch.bfloat16,
              out_dtypes: dict[tuple[int, int], torch.dtype] | None = None, device: torch.device | str = "cuda",
              cache: TuneCache, timer: Callable[[Callable[[], object]], float] = _device_ms,
              progress: Callable[[str], None] | None = print, baseline: Callable | None = None,
              report: list | None = None, l2_bytes: int | None = None) -> TuneCache:
    """Time ``gemm.candidates`` for every (m, n, k) and record the fastest per shape class in ``cache``
    (returned). ``out_dtypes[(n, k)]``: the output dtype of a weight (fp32 for logits; default ``dtype``).
    Every candidate's output is compared with the kernel's own configuration's, bit for bit.
    ``baseline(x, w, out_dtype)``: a stock GEMM timed beside them (cuBLAS, for the report); ``report``:
    a list that gets one row per shape (times in ms, the chosen configuration). Inputs smaller than twice
    the L2 (``l2_bytes``, default the GPU's) are timed over copies read in turn, as in a model's forward,
    where each linear reads another weight from memory."""
    from hal.backends.cuda.launch import CUDA_LAUNCH_UNTUNED as untuned   # the kernel's own tiles as the baseline
    from hal.kernels import gemm

    out_dtypes = out_dtypes or {}
    g = torch.Generator(device=device).manual_seed(0)
    for m, n, k in shapes:
        out_dtype = out_dtypes.get((n, k), dtype)
        copies = _copies_beyond_l2((m + n) * k * torch.empty((), dtype=dtype).element_size(), device, l2_bytes)
        sets = [(torch.randn(m, k, generator=g, device=device).to(dtype),
                 (torch.randn(n, k, generator=g, device=device) * k ** -0.5).to(dtype)) for _ in range(copies)]
        tma_ok = gemm._tma_ok(sets[0][0]) and gemm._tma_ok(sets[0][1]) and not gemm.INTERPRET

        def run(config, i=0, sets=sets, out_dtype=out_dtype):
            return gemm.linear(*sets[i], None, out_dtype, spec, config, policy=untuned)
        stock = (_in_turn([lambda x=x, w=w, o=out_dtype: baseline(x, w, o) for x, w in sets])
                 if baseline is not None else None)
        _tune_shape(f"GEMM ({m}, {n}, {k})", shape_class(m, n, k, dtype, out_dtype, spec.k_chunk), run,
                    gemm.candidates(m, n, k, spec, tma_ok), cache, timer, progress, report,
                    dict(m=m, n=n, k=k, copies=copies), stock, timed=_timed_in_turn(run, copies))
        del sets, stock
    return cache


def tune_fp8_gemm(shapes: Iterable[tuple[int, int, int]], spec: Fp8, *, out_dtype: torch.dtype = torch.bfloat16,
                  device: torch.device | str = "cuda", cache: TuneCache,
                  timer: Callable[[Callable[[], object]], float] = _device_ms,
                  progress: Callable[[str], None] | None = print, baseline: Callable | None = None,
                  report: list | None = None, l2_bytes: int | None = None) -> TuneCache:
    """``tune_gemm`` for the block-FP8 GEMM (``fp8_gemm.candidates``; the activations quantised once,
    outside what is timed). ``baseline(x_bf16, w_bf16)``: a stock GEMM timed beside it. Small inputs are
    timed over copies read in turn, as ``tune_gemm``'s."""
    from hal import fp8
    from hal.backends.cuda.launch import CUDA_LAUNCH_UNTUNED as untuned
    from hal.kernels import fp8_gemm, fp8_gemm_sm90

    g = torch.Generator(device=device).manual_seed(0)
    for m, n, k in shapes:
        copies = _copies_beyond_l2((m + n) * k, device, l2_bytes)     # one byte an element
        sets = []
        for _ in range(copies):
            x = torch.randn(m, k, generator=g, device=device).bfloat16()
            w = torch.randn(n, k, generator=g, device=device) * k ** -0.5
            sets.append(dict(x=x, w_bf16=w.bfloat16() if baseline is not None else None,
                             weight=fp8.quantise_weight_blocks(w, spec), act=fp8_gemm.quantise_activations(x, spec)))
            del w
        xq, wq = sets[0]["act"][0], sets[0]["weight"][0]
        ok = fp8_gemm.tma_ok(xq) and fp8_gemm.tma_ok(wq)

        def run(config, i=0, sets=sets):
            return fp8_gemm.gemm(*sets[i]["act"], *sets[i]["weight"], None, out_dtype, spec, config, policy=untuned)
        stock = (_in_turn([lambda c=c: baseline(c["x"], c["w_bf16"]) for c in sets])
                 if baseline is not None else None)
        _tune_shape(f"FP8 GEMM ({m}, {n}, {k})", fp8_shape_class(m, n, k, spec, out_dtype), run,
                    fp8_gemm.candidates(m, n, k, spec.activation_group, ok,
                                        sm90=fp8_gemm_sm90.available(xq.device)), cache, timer, progress, report,
                    dict(m=m, n=n, k=k, copies=copies), stock, timed=_timed_in_turn(run, copies))
        del sets, stock, xq, wq
    return cache


def tune_moe(layers: Iterable[tuple[int, int, int, int, int]], spec: Gemm, *, dtype: torch.dtype = torch.bfloat16,
             device: torch.device | str = "cuda", cache: TuneCache,
             timer: Callable[[Callable[[], object]], float] = _device_ms,
             progress: Callable[[str], None] | None = print, report: list | None = None) -> TuneCache:
    """The grouped expert GEMMs of MoE layers (tokens, experts, top_k, hidden, expert width), each under
    ``moe_shape_class``: for every tile-row count (``moe.TILE_ROWS``) the gate/up (gated) and the down
    launches of ``moe.candidates`` are timed apart and each is checked bit for bit, slot by slot, against
    the kernel's own launch; the pair with the least time is then checked and timed as the whole expert
    half, and kept if it beats the kernel's own. Routing is uniform (each token's top-k from random
    scores: the balanced load a trained router aims at)."""
    from hal.backends.cuda.launch import CUDA_LAUNCH_UNTUNED as untuned
    from hal.kernels import moe

    g = torch.Generator(device=device).manual_seed(0)
    for tokens, e, top_k, h, i in layers:
        x = torch.randn(tokens, h, generator=g, device=device).to(dtype)
        w13 = (torch.randn(e, 2 * i, h, generator=g, device=device) * h ** -0.5).to(dtype)
        w2 = (torch.randn(e, h, i, generator=g, device=device) * i ** -0.5).to(dtype)
        ids = torch.rand(tokens, e, generator=g, device=device).topk(top_k, dim=1).indices.to(torch.int32)
        weights = torch.rand(tokens, top_k, generator=g, device=device)
        key = moe_shape_class(tokens * top_k, e, h, i, dtype, spec.k_chunk)

        def layer(gate=None, down=None):
            return moe.experts(x, w13, w2, weights, ids, None, spec, down, gate, policy=untuned)
        reference = layer()
        default_ms = timer(layer)
        own_gate, own_down = moe.grouped_configs(tokens * top_k, e)
        slots = moe.sort_slots(ids, e, own_gate["BLOCK_M"])
        act_ref = moe.gate_up(x, w13, slots, spec, own_gate)
        down_ref = moe.grouped_linear(act_ref, w2, slots.token, slots, torch.float32, spec, own_down, x_sorted=True)
        act_ref, down_ref = act_ref[slots.position], down_ref[slots.position]      # per slot
        best, tried, skipped = None, 0, 0
        for bm in moe.TILE_ROWS:
            slots = moe.sort_slots(ids, e, bm)

            def gate_up(c):
                return moe.gate_up(x, w13, slots, spec, c)
            gate = _fastest_launch(f"gate/up grouped GEMM ({tokens} tokens, {e} experts)", gate_up,
                                   moe.candidates(bm, True), act_ref, slots.position, timer)
            act = gate_up(gate[0]) if gate[0] is not None else None

            def down_proj(c):
                return moe.grouped_linear(act, w2, slots.token, slots, torch.float32, spec, c, x_sorted=True)
            down = _fastest_launch(f"down grouped GEMM ({tokens} tokens, {e} experts)", down_proj,
                                   moe.candidates(bm, False), down_ref, slots.position, timer) \
                if act is not None else (None, None, 0, 0)
            tried, skipped = tried + gate[2] + down[2], skipped + gate[3] + down[3]
            if down[0] is not None and (best is None or gate[1] + down[1] < best[2]):
                best = (gate[0], down[0], gate[1] + down[1])
        best_ms = default_ms
        if best is not None:
            if not torch.equal(_bits(layer(best[0], best[1])), _bits(reference)):
                raise HalError(f"tune: the launches {best[:2]} give other bits than the kernel's own for the whole "
                               f"expert half ({tokens} tokens, {e} experts): a kernel bug; report it")
            best_ms = timer(lambda: layer(best[0], best[1]))
        if best is not None and best_ms < default_ms:
            cache.entries[key] = {"config": {"gate_up": best[0], "down": best[1]}, "ms": best_ms,
                                  "default_ms": default_ms, "candidates": tried, "skipped": skipped}
        else:
            cache.entries.pop(key, None)          # the kernel's own table is the fastest: nothing to override
            best_ms = min(best_ms, default_ms)
        if report is not None:
            report.append(dict(tokens=tokens, experts=e, top_k=top_k, hidden=h, inter=i, key=key,
                               default_ms=default_ms, best_ms=best_ms, config=cache.config(key), candidates=tried,
                               skipped=skipped))
        if progress:
            progress(f"  {key:44} {tried:3} launches ({skipped} did not launch), expert half: default "
                     f"{default_ms * 1e3:8.1f} us, best {best_ms * 1e3:8.1f} us ({default_ms / best_ms:.2f}x)")
        del x, w13, w2
    return cache


KV_CACHE_FORMATS = ("bf16", "e4m3", "e5m2")   # a decode cell's cache: the activation dtype, or [fp8].kv_format


def tune_decode(cells: Iterable[tuple[int, int, int, int, int, int, str]], spec: Attention, *, fp8: Fp8 | None = None,
                dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cuda", cache: TuneCache,
                timer: Callable[[Callable[[], object]], float] = _device_ms,
                progress: Callable[[str], None] | None = print, baseline: Callable | None = None,
                report: list | None = None, max_cache_bytes: int | None = None,
                l2_bytes: int | None = None) -> TuneCache:
    """Time ``attention.decode_candidates`` for decode attention cells (sequences, keys per sequence, query
    heads, KV heads, head dim, page size, cache format: "bf16", or "e4m3" / "e5m2" for an FP8 cache by
    [fp8]'s rules, which needs ``fp8``) and keep the fastest per ``decode_shape_class``, as ``tune_gemm``.
    Every sequence holds the whole context, its pages in random order; one query token each. A cell whose
    K/V would exceed ``max_cache_bytes`` is skipped and says so. ``baseline(q, batch, context, kv_heads, paged)``
    builds, once per cell, the stock attention timed beside ours (for the report): a zero-argument callable,
    or a dict of them by name (each timed; the report keeps every time and the fastest as ``baseline_ms``).
    ``paged``: this cell's cache as ``paged_attention`` reads it (``k_cache``, ``v_cache``, ``query_start``,
    ``seq_lens``, ``block_table``, ``page``), for a stock kernel that reads a paged cache. A cache smaller than
    twice the L2 (``l2_bytes``, default the GPU's) is timed over copies read in turn, ours and the stock's."""
    from hal.backends.cuda.launch import CUDA_LAUNCH_UNTUNED as untuned
    from hal.kernels import attention

    g = torch.Generator(device=device).manual_seed(0)
    for batch, context, hq, hkv, d, page, kv in cells:
        if kv not in KV_CACHE_FORMATS:
            raise HalError(f"tune: decode cache format {kv!r}; expected one of {KV_CACHE_FORMATS}")
        if kv != "bf16" and (fp8 is None or fp8.kv_format != kv):
            raise HalError(f"tune: an {kv} KV cache needs a contract whose [fp8].kv_format is {kv!r} "
                           f"(this one's: {fp8.kv_format if fp8 else 'no [fp8] section'})")
        per_seq = -(-context // page)
        pages = batch * per_seq
        what = f"decode attention (B={batch}, {context} keys, {hq}/{hkv} heads x {d}, page {page}, {kv} cache)"
        cache_bytes = 2 * pages * page * hkv * d * (2 if kv == "bf16" else 1)
        if max_cache_bytes is not None and cache_bytes > max_cache_bytes:
            if progress:
                progress(f"  {what}: skipped, its K/V take {cache_bytes / 2**30:.1f} GiB (> {max_cache_bytes / 2**30:.1f})")
            if report is not None:
                report.append(dict(op="decode", batch=batch, ctx=context, hq=hq, hkv=hkv, d=d, page=page, kv=kv,
                                   skipped=f"K/V {cache_bytes} bytes > {max_cache_bytes}"))
            continue
        query_start = torch.arange(batch + 1, dtype=torch.int32, device=device)
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        # Copies of the cache, timed in turn, so that a cache smaller than the L2 is read from memory as in a
        # decode step (each layer's K/V is another), not from the L2: L2-resident times favoured 2 pipeline
        # stages where memory latency needs 5 (bench/results/h100-2026-12-06-decode-rule/). Bits: copy 0.
        sets = []
        for _ in range(_copies_beyond_l2(cache_bytes, device, l2_bytes)):
            k_cache, v_cache, scales = _random_paged_cache(pages, page, hkv, d, kv, dtype, fp8, g, device)
            table = torch.randperm(pages, generator=g, device=device).to(torch.int32).view(batch, per_seq)
            q = torch.randn(batch, hq, d, generator=g, device=device).to(dtype)
            sets.append(dict(q=q, k_cache=k_cache, v_cache=v_cache, scales=scales, block_table=table))

        def run(config, i=0, sets=sets, query_start=query_start, seq_lens=seq_lens):
            c = sets[i]
            return attention.paged_attention(c["q"], c["k_cache"], c["v_cache"], query_start, seq_lens,
                                             c["block_table"], d ** -0.5, spec, policy=untuned, **c["scales"],
                                             **(config or {}))
        key = decode_shape_class(batch, batch, per_seq * page, hq, hkv, d, page, dtype, sets[0]["k_cache"].dtype, spec)
        candidates = attention.decode_candidates(spec.split_count(per_seq * page), _power_of_two_at_least(hq // hkv))
        stock = None
        if baseline is not None:     # built once per copy (each with that copy's paged cache), timed in turn
            built = [baseline(c["q"], batch, context, hkv,
                              dict(c, query_start=query_start, seq_lens=seq_lens, page=page)) for c in sets]
            stock = ({name: _in_turn([b[name] for b in built]) for name in built[0]} if isinstance(built[0], dict)
                     else _in_turn(built))
        _tune_shape(what, key, run, candidates, cache, timer, progress, report,
                    dict(op="decode", batch=batch, ctx=context, hq=hq, hkv=hkv, d=d, page=page, kv=kv, copies=len(sets)),
                    stock, timed=_timed_in_turn(run, len(sets)))
        del sets, stock
    return cache


def tune_prefill(cells: Iterable[tuple[int, int, int, int, int, int]], spec: Attention, *,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cuda", cache: TuneCache,
                 timer: Callable[[Callable[[], object]], float] = _device_ms,
                 progress: Callable[[str], None] | None = print, baseline: Callable | None = None,
                 report: list | None = None) -> TuneCache:
    """Time ``attention.prefill_candidates`` for causal prefill cells (sequences, prompt tokens each, query
    heads, KV heads, head dim, page size; bf16 caches) and keep the fastest per ``prefill_shape_class``, as
    ``tune_gemm``. Every prompt starts at position 0, its pages in random order. ``baseline(q, num_seqs,
    length, kv_heads)`` builds, once per cell, the stock attention timed beside ours for the report (a
    zero-argument callable)."""
    from hal.backends.cuda.launch import CUDA_LAUNCH_UNTUNED as untuned
    from hal.kernels import attention

    g = torch.Generator(device=device).manual_seed(0)
    for num_seqs, length, hq, hkv, d, page in cells:
        if hq % hkv:
            raise HalError(f"tune: prefill with {hq} query heads over {hkv} KV heads (not a multiple)")
        per_seq = -(-length // page)
        pages = num_seqs * per_seq
        k_cache, v_cache, _ = _random_paged_cache(pages, page, hkv, d, "bf16", dtype, None, g, device)
        table = torch.randperm(pages, generator=g, device=device).to(torch.int32).view(num_seqs, per_seq)
        q = torch.randn(num_seqs * length, hq, d, generator=g, device=device).to(dtype)
        query_start = torch.arange(num_seqs + 1, dtype=torch.int32, device=device) * length
        seq_lens = torch.full((num_seqs,), length, dtype=torch.int32, device=device)

        def run(config, q=q, k_cache=k_cache, v_cache=v_cache, table=table, query_start=query_start,
                seq_lens=seq_lens, d=d):
            return attention.paged_attention(q, k_cache, v_cache, query_start, seq_lens, table, d ** -0.5, spec,
                                             policy=untuned, **(config or {}))
        what = f"prefill attention ({num_seqs} x {length} tokens, {hq}/{hkv} heads x {d}, page {page})"
        key = prefill_shape_class(num_seqs * length, num_seqs, hq, hkv, d, page, dtype, k_cache.dtype, spec)
        stock = baseline(q, num_seqs, length, hkv) if baseline is not None else None
        _tune_shape(what, key, run, attention.prefill_candidates(hq // hkv), cache, timer, progress, report,
                    dict(op="prefill", seqs=num_seqs, length=length, hq=hq, hkv=hkv, d=d, page=page), stock)
        del q, k_cache, v_cache, stock
    return cache


def _copies_beyond_l2(nbytes: int, device, l2_bytes: int | None = None) -> int:
    """How many copies of ``nbytes`` of inputs, read in turn, take twice the L2 (at most 32; 1 on a CPU)."""
    if l2_bytes is None:
        if torch.device(device).type != "cuda":
            return 1
        l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
    return max(1, min(32, -(-2 * l2_bytes // max(nbytes, 1))))


def _in_turn(calls: list[Callable[[], object]]) -> Callable[[], object]:
    """One call that runs ``calls`` in turn, one per call (a CUDA graph captures the turn it reached)."""
    if len(calls) == 1:
        return calls[0]
    turn = itertools.count()
    return lambda: calls[next(turn) % len(calls)]()


def _timed_in_turn(run: Callable[..., object], copies: int) -> Callable[[dict | None], Callable[[], object]]:
    """``_tune_shape``'s ``timed``: ``run(config, i)`` over the input copies i in turn."""
    return lambda config: _in_turn([lambda i=i: run(config, i) for i in range(copies)])


def _random_paged_cache(pages: int, page: int, hkv: int, d: int, kv: str, dtype: torch.dtype, fp8: Fp8 | None,
                        g: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Random (pages, page, hkv, d) K and V caches in ``kv`` ("bf16": ``dtype``; else FP8 by [fp8]'s write rule,
    quantised a slice at a time so that no fp32 copy of the whole cache is ever held), and their scales as
    ``paged_attention``'s keyword arguments."""
    from hal import fp8 as fp8_rules

    shape = (pages, page, hkv, d)
    if kv == "bf16":
        return (torch.randn(shape, generator=g, device=device).to(dtype),
                torch.randn(shape, generator=g, device=device).to(dtype), {})
    fixed = torch.tensor(1.0, device=device)
    caches, scales = [], []
    for _ in range(2):
        q8 = torch.empty(shape, dtype=fp8_rules.FORMATS[kv], device=device)
        scale = torch.empty(shape[:3], device=device) if fp8.kv_scale == "per_token_head" else fixed
        step = max(1, (1 << 24) // (page * hkv * d))                   # pages per slice
        for p0 in range(0, pages, step):
            x = torch.randn((min(step, pages - p0) * page, hkv, d), generator=g, device=device).to(dtype)
            values, s = fp8_rules.quantise_kv(x, fixed, fp8)
            q8[p0:p0 + step] = values.view(-1, page, hkv, d)
            if s is not None:
                scale[p0:p0 + step] = s.view(-1, page, hkv)
        caches.append(q8)
        scales.append(scale)
    # The read rule is the contract's too: bf16-fp8-v2's cache is read as f16 operands (fixed scales), another
    # arithmetic than v1's with other bits; timing or bit-checking v1's read for it would tune the wrong kernel.
    return caches[0], caches[1], dict(k_scale=scales[0], v_scale=scales[1],
                                      f16_operands=fp8.kv_dequant == "f16_operands")


def _fastest_launch(what: str, run: Callable[[dict], torch.Tensor], configs: list[dict], reference: torch.Tensor,
                    position: torch.Tensor, timer: Callable) -> tuple[dict | None, float | None, int, int]:
    """(the fastest configuration, its time, how many were timed, how many did not launch) of ``run``
    over ``configs``; each one's rows at ``position`` (per slot) must have ``reference``'s bits."""
    fastest, fastest_ms, tried, skipped = None, None, 0, 0
    for config in configs:
        try:
            out = run(config)
        except Exception as exc:                  # out of resources for this tile: not a candidate here (counted)
            log.debug("tune %s: %s failed to launch: %s", what, config, exc)
            skipped += 1
            continue
        if not torch.equal(_bits(out[position]), _bits(reference)):
            raise HalError(f"tune: launch {config} of the {what} gives other bits than the kernel's own: launch "
                           f"choices must not change bits (a kernel bug; report it)")
        ms = timer(lambda: run(config))
        tried += 1
        if fastest_ms is None or ms < fastest_ms:
            fastest, fastest_ms = config, ms
    return fastest, fastest_ms, tried, skipped


def _tune_shape(what: str, key: str, run: Callable[[dict | None], torch.Tensor], configs: list[dict],
                cache: TuneCache, timer: Callable, progress: Callable[[str], None] | None, report: list | None,
                shape: dict, stock: Callable[[], object] | dict[str, Callable[[], object]] | None,
                timed: Callable[[dict | None], Callable[[], object]] | None = None) -> None:
    """Time ``run(config)`` for every configuration against ``run(None)`` (the kernel's own launch), check
    each gives the same bits, and keep the fastest in ``cache`` under ``key`` (nothing if the own launch
    is the fastest). A configuration that fails to launch (e.g. out of shared memory) is counted, not kept.
    ``stock``: the stock kernel (or several, by name) timed beside ours for the report; one that fails to
    run is reported with its error, not timed. ``timed(config)``: the call that is timed (default: ``run(config)``;
    the decode tuner's reads its inputs' copies in turn)."""
    timed = timed or (lambda config: lambda: run(config))
    reference = run(None)
    default_ms = timer(timed(None))
    best, best_ms, tried, skipped = None, default_ms, 0, 0
    timings = []                          # (configuration, ms) of every candidate: a launch rule is fitted on these
    for config in configs:
        try:
            out = run(config)
        except Exception as exc:          # e.g. out of resources for this tile: not a candidate here (counted)
            log.debug("tune %s: %s failed to launch: %s", key, config, exc)
            skipped += 1
            continue
        if not torch.equal(_bits(out), _bits(reference)):
            raise HalError(f"tune: configuration {config} of the {what} gives other bits than the kernel's own: "
                           f"launch choices must not change bits (a kernel bug; report it)")
        ms = timer(timed(config))
        tried += 1
        timings.append([config, ms])
        if ms < best_ms:
            best, best_ms = config, ms
    if best is not None:
        cache.entries[key] = {"config": best, "ms": best_ms, "default_ms": default_ms, "candidates": tried,
                              "skipped": skipped}
    else:
        cache.entries.pop(key, None)      # the kernel's own table is the fastest: nothing to override
    stocks = stock if isinstance(stock, dict) else {"stock": stock} if stock is not None else {}
    stocks_ms, stock_errors = {}, {}
    for name, fn in stocks.items():
        try:
            stocks_ms[name] = timer(fn)
        except Exception as exc:         # e.g. a stock kernel that does not take this page size: said, not timed
            stock_errors[name] = f"{type(exc).__name__}: {str(exc)[:160]}"
    stock_ms = min(stocks_ms.values(), default=None)
    if report is not None:
        row = dict(shape, key=key, default_ms=default_ms, best_ms=best_ms, config=best, candidates=tried,
                   skipped=skipped, baseline_ms=stock_ms, timings=timings)
        if isinstance(stock, dict):
            row.update(baselines_ms=stocks_ms, baseline_errors=stock_errors)
        report.append(row)
    if progress:
        stock_text = "".join(f", {name} {ms * 1e3:8.1f} us" for name, ms in stocks_ms.items())
        stock_text += f" (ours {stock_ms / best_ms:.2f}x the fastest)" if stock_ms is not None else ""
        stock_text += "".join(f", {name} failed: {error}" for name, error in stock_errors.items())
        progress(f"  {key:44} {tried:3} candidates ({skipped} did not launch), default {default_ms * 1e3:8.1f} us, "
                 f"best {best_ms * 1e3:8.1f} us ({default_ms / best_ms:.2f}x){stock_text}")


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of a float tensor (torch.equal on floats would call -0 and +0 equal)."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def model_gemm_shapes(config, batches: Iterable[int]) -> tuple[list[tuple[int, int, int]], dict]:
    """The linears of a ``hal.model.ModelConfig`` at each batch size (tokens per call): QKV, O, gate-up,
    down, the logits GEMM (fp32 out) and an MoE model's router (fp32 out). Returns (shapes, out_dtypes)."""
    c = config
    weights = [((c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.hidden_size), (c.hidden_size, c.num_heads * c.head_dim),
               (2 * c.intermediate_size, c.hidden_size), (c.hidden_size, c.intermediate_size),
               (c.vocab_size, c.hidden_size)]
    out_dtypes = {(c.vocab_size, c.hidden_size): torch.float32}
    if c.is_moe:                          # the router: fp32 logits ([moe]); the experts are tune_moe's
        weights.append((c.num_experts, c.hidden_size))
        out_dtypes[(c.num_experts, c.hidden_size)] = torch.float32
    shapes = [(m, n, k) for m in batches for n, k in dict.fromkeys(weights)]
    return shapes, out_dtypes


def model_fp8_shapes(config, batches: Iterable[int]) -> list[tuple[int, int, int]]:
    """The block-FP8 linears of a ``hal.model.ModelConfig`` with ``fp8`` (QKV, O, gate-up, down; the logits
    GEMM stays in the model dtype) at each batch size."""
    shapes, out_dtypes = model_gemm_shapes(config, batches)
    return [s for s in shapes if (s[1], s[2]) not in out_dtypes]


def model_moe_layers(config, batches: Iterable[int]) -> list[tuple[int, int, int, int, int]]:
    """The MoE layers of a ``hal.model.ModelConfig`` at each batch size: (tokens, experts, top_k, hidden,
    expert width); none for a dense model. The router GEMM is one of ``model_gemm_shapes``' linears there."""
    if not config.is_moe:
        return []
    return [(m, config.num_experts, config.num_experts_per_tok, config.hidden_size, config.moe_intermediate_size)
            for m in batches]


def model_decode_cells(config, batches: Iterable[int], contexts: Iterable[int], page: int,
                       kv_formats: Iterable[str] = ("bf16",)) -> list[tuple[int, int, int, int, int, int, str]]:
    """The decode attention cells of a ``hal.model.ModelConfig``: (sequences, keys each, query heads, KV heads,
    head dim, page, cache format) for every batch, context and cache format."""
    c = config
    return [(b, ctx, c.num_heads, c.num_kv_heads, c.head_dim, page, kv)
            for kv in kv_formats for ctx in contexts for b in batches]


def model_prefill_cells(config, lengths: Iterable[int], page: int,
                        num_seqs: Iterable[int] = (1,)) -> list[tuple[int, int, int, int, int, int]]:
    """The prefill attention cells of a ``hal.model.ModelConfig``: (sequences, prompt tokens each, query heads,
    KV heads, head dim, page) for every prompt length and number of prompts."""
    c = config
    return [(b, length, c.num_heads, c.num_kv_heads, c.head_dim, page) for length in lengths for b in num_seqs]
