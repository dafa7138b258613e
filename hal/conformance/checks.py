"""Property checks shared by the conformance kit and the project's own tests.

Each check runs one backend on random inputs arranged in several ways that must not change a
row's bits, compares with ``torch.equal`` and returns the list of ``Mismatch``es (empty = the
property holds). Checks never use tolerances; accuracy is checked elsewhere against fp64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from hal.backend import AttentionMetadata, Backend
from hal.kvcache import PageAllocator, PagedKVCache, build_metadata, pages_needed, slot_mapping
from hal.rope import cos_sin_cache


@dataclass
class Mismatch:
    """One arrangement whose bits differ from the baseline arrangement."""

    what: str
    max_abs_diff: float
    differing: int
    total: int
    params: dict = field(default_factory=dict)

    def __str__(self) -> str:
        return (f"{self.what}: {self.differing}/{self.total} values differ, max |diff| {self.max_abs_diff:.3g} "
                f"({', '.join(f'{k}={v}' for k, v in self.params.items())})")


def compare(what: str, expected: torch.Tensor, got: torch.Tensor, **params) -> Mismatch | None:
    """None if bitwise equal (``torch.equal``), else a Mismatch describing the difference."""
    if expected.shape == got.shape and torch.equal(expected, got):
        return None
    if expected.shape != got.shape:
        return Mismatch(f"{what} (shape {tuple(got.shape)} != {tuple(expected.shape)})", math.inf, -1, -1, params)
    e, g = expected.double(), got.double()
    same = (e == g) | (torch.isnan(e) & torch.isnan(g))
    diff = (e - g).abs().nan_to_num(nan=math.inf)
    return Mismatch(what, float(diff.max()), int((~same).sum()), same.numel(), params)


def random_tensor(shape, dtype, generator, scale: float = 1.0, device="cpu", spread: int = 0) -> torch.Tensor:
    """Random normal values (never zeros or constants), rounded to ``dtype``. With ``spread`` > 0 each
    value is also scaled by 2**e, e uniform in [-spread, spread], so that sums are rarely exact and
    reduction orders show (bf16 products of similar magnitude often sum exactly in fp32)."""
    values = torch.randn(*shape, generator=generator) * scale
    if spread:
        values = values * torch.exp2(torch.randint(-spread, spread + 1, shape, generator=generator).float())
    return values.to(dtype).to(device)


# ---------------------------------------------------------------------------------------------
# Batch invariance: a row alone vs the same row inside batches.
# ---------------------------------------------------------------------------------------------

def row_invariance(op_name: str, fn: Callable[[torch.Tensor], torch.Tensor], rows: torch.Tensor,
                   batch_sizes: list[int], generator: torch.Generator, distinct: int = 48) -> list[Mismatch]:
    """``fn`` maps (M, ...) rows to (M, ...) outputs row by row.

    The first ``distinct`` rows are each computed alone once. Every batch is then drawn from them
    at random (so each row appears at random positions, permuted and repeated), and *every* row of
    the batch output must equal that row's output alone. Also: a batch repeating one row, and
    determinism (the same call twice)."""
    pool = rows[:distinct]
    alone = torch.cat([fn(pool[i:i + 1]) for i in range(pool.shape[0])])
    failures = []
    if (m := compare(f"{op_name}: determinism (same call twice)", alone[:1], fn(pool[:1]))):
        failures.append(m)

    def check(what: str, index: torch.Tensor) -> None:
        got = fn(pool[index])
        expected = alone[index]
        if (m := compare(what, expected, got, batch=len(index))) is not None:
            flat_bad = (got.reshape(len(index), -1) != expected.reshape(len(index), -1)).any(-1)
            positions = flat_bad.nonzero().flatten()
            m.params["rows_differing"] = int(positions.numel())
            m.params["first_position"] = int(positions[0]) if positions.numel() else -1
            m.params["first_row"] = int(index[positions[0]]) if positions.numel() else -1
            failures.append(m)

    for size in batch_sizes:
        if size > 1:
            check(f"{op_name}: rows alone vs inside a batch (random positions, permuted, repeated)",
                  torch.randint(0, pool.shape[0], (size,), generator=generator))
    size = max(batch_sizes)
    if size > 1:
        check(f"{op_name}: row alone vs a batch repeating it", torch.zeros(size, dtype=torch.long))
    return failures


# ---------------------------------------------------------------------------------------------
# Phase consistency: attention for a sequence in prefill, chunked prefill and decode.
# ---------------------------------------------------------------------------------------------

@dataclass
class AttentionCase:
    """One sequence's attention inputs. ``kv_cache``: "auto" (a cache in the activation dtype, ``write_kv`` /
    ``attention``) or "fp8" (``hal.fp8.Fp8KVCache`` under the contract's [fp8]: ``fp8_write_kv`` /
    ``fp8_attention``, the layer's fixed scales 1.0 where [fp8].kv_scale is "fixed")."""
    seq_len: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    seed: int
    kv_cache: str = "auto"

    @property
    def op(self) -> str:
        """The kit's op (report row) this case exercises."""
        return "fp8_attention" if self.kv_cache == "fp8" else "attention"

    def allocate_cache(self, backend: Backend, num_pages: int, page_size: int):
        if self.kv_cache == "auto":
            return PagedKVCache.allocate(num_pages, page_size, self.kv_heads, self.head_dim, self.dtype,
                                         backend.device)
        if self.kv_cache != "fp8":
            raise ValueError(f"kv_cache {self.kv_cache!r}: expected 'auto' or 'fp8'")
        from hal import fp8

        spec = fp8.spec_of(backend.contract, "the conformance kit's FP8 KV cache cells")
        return fp8.Fp8KVCache(num_pages, page_size, self.kv_heads, self.head_dim, spec, backend.device)

    def write(self, backend: Backend, cache, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        if self.kv_cache == "fp8":
            cache.write(k, v, slots, backend=backend)
        else:
            backend.write_kv(k, v, cache.k, cache.v, slots)

    def attend(self, backend: Backend, cache, q: torch.Tensor, meta) -> torch.Tensor:
        if self.kv_cache == "fp8":
            return cache.attention(backend, q, meta, scale=self.head_dim ** -0.5)
        return backend.attention(q, cache.k, cache.v, meta, scale=self.head_dim ** -0.5)

    def tensors(self, device="cpu"):
        g = torch.Generator().manual_seed(self.seed)
        q = random_tensor((self.seq_len, self.q_heads, self.head_dim), self.dtype, g, device=device)
        k = random_tensor((self.seq_len, self.kv_heads, self.head_dim), self.dtype, g, device=device)
        v = random_tensor((self.seq_len, self.kv_heads, self.head_dim), self.dtype, g, device=device)
        return q, k, v


def run_schedule(backend: Backend, case: AttentionCase, steps: list[int], page_size: int,
                 mates: int = 0, seed: int = 0,
                 post: Callable[[torch.Tensor], torch.Tensor] | None = None, strided: bool = False) -> torch.Tensor:
    """Attention output (seq_len, Hq, D) for the case's sequence, fed in ``steps`` (query counts per
    call, summing to seq_len), with pages handed out in a scrambled order. With ``mates`` > 0 each
    call also carries that many other sequences (random lengths and phases) as batch-mates.
    ``post`` (optional) maps each call's whole output (rows, Hq, D) to (rows, ...), as the rest of a
    decoder block would on that step's batch; the case's rows of it are returned. ``strided``: the
    queries, the slot mapping and the metadata (query starts, sequence lengths, block table) reach the
    backend as strided views (``strided_copy``), the same values."""
    lay = strided_copy if strided else (lambda t: t)
    device = backend.device
    q, k, v = case.tensors(device)
    gen = torch.Generator().manual_seed(seed)
    mate_cases = [AttentionCase(int(torch.randint(1, 2 * case.seq_len + 2, (1,), generator=gen)), case.q_heads,
                                case.kv_heads, case.head_dim, case.dtype, seed * 1000 + i + 1, case.kv_cache)
                  for i in range(mates)]
    mate_tensors = [c.tensors(device) for c in mate_cases]
    total_tokens = case.seq_len + sum(c.seq_len for c in mate_cases)
    num_pages = pages_needed(total_tokens, page_size) + len(mate_cases) + 8
    cache = case.allocate_cache(backend, num_pages, page_size)
    allocator = PageAllocator(num_pages, gen)
    pages = allocator.take(pages_needed(case.seq_len, page_size))
    mate_pages = [allocator.take(pages_needed(c.seq_len, page_size)) for c in mate_cases]
    mate_done = [0] * len(mate_cases)
    outputs = []
    done = 0
    for step in steps:
        # Batch-mates advance by a random amount (prefill chunk or one decode token).
        q_parts, q_lens, seq_lens, page_lists, slots, k_new, v_new = [], [], [], [], [], [], []
        order = torch.randperm(len(mate_cases) + 1, generator=gen).tolist()
        for idx in order:
            if idx == len(mate_cases):
                lo, hi = done, done + step
                at = sum(q_lens)
                q_parts.append(q[lo:hi]); k_new.append(k[lo:hi]); v_new.append(v[lo:hi])
                slots.append(slot_mapping(pages, range(lo, hi), page_size, device))
                q_lens.append(step); seq_lens.append(hi); page_lists.append(pages)
            else:
                c, (mq, mk, mv) = mate_cases[idx], mate_tensors[idx]
                lo = mate_done[idx]
                if lo >= c.seq_len:
                    continue
                hi = min(c.seq_len, lo + int(torch.randint(1, 9, (1,), generator=gen)))
                q_parts.append(mq[lo:hi]); k_new.append(mk[lo:hi]); v_new.append(mv[lo:hi])
                slots.append(slot_mapping(mate_pages[idx], range(lo, hi), page_size, device))
                q_lens.append(hi - lo); seq_lens.append(hi); page_lists.append(mate_pages[idx])
                mate_done[idx] = hi
        case.write(backend, cache, torch.cat(k_new), torch.cat(v_new), lay(torch.cat(slots)))
        meta = build_metadata(q_lens, seq_lens, page_lists, device)
        if strided:
            meta = AttentionMetadata(lay(meta.query_start_loc), lay(meta.seq_lens), lay(meta.block_table))
        result = case.attend(backend, cache, lay(torch.cat(q_parts)), meta)
        if post is not None:
            result = post(result)
        outputs.append(result[at:at + step])
        done += step
    return torch.cat(outputs)


def decoder_block_after_attention(backend: Backend, case: AttentionCase, vocab: int = 97) -> Callable:
    """What follows attention in a decoder layer and the head, as one row function of the attention
    output: o_proj, fused residual add + RMSNorm, gate_up, SiLU*up, down, final norm, lm_head in
    fp32, log-probabilities of a token chosen from the row. Weights are fixed by the case's seed."""
    g = torch.Generator().manual_seed(case.seed + 17)
    hidden = case.q_heads * case.head_dim
    dtype, device = case.dtype, backend.device
    o_proj = random_tensor((hidden, hidden), dtype, g, scale=hidden ** -0.5, device=device)
    norm_w = random_tensor((hidden,), dtype, g, device=device)
    gate_up = random_tensor((4 * hidden, hidden), dtype, g, scale=hidden ** -0.5, device=device)
    down = random_tensor((hidden, 2 * hidden), dtype, g, scale=(2 * hidden) ** -0.5, device=device)
    lm_head = random_tensor((vocab, hidden), dtype, g, scale=hidden ** -0.5, device=device)

    def block(attn_out: torch.Tensor) -> torch.Tensor:
        x = attn_out.reshape(attn_out.shape[0], hidden)
        h = backend.linear(x, o_proj)
        normed, residual = backend.rms_norm(h, norm_w, 1e-6, residual=x)
        mlp = backend.linear(backend.silu_mul(backend.linear(normed, gate_up)), down)
        final, _ = backend.rms_norm(mlp, norm_w, 1e-6, residual=residual)
        logits = backend.linear(final, lm_head, out_dtype=torch.float32)
        tokens = (x.float().abs().argmax(-1) * 7 + 3) % vocab
        return torch.cat([final.float(), backend.token_logprobs(logits, tokens).unsqueeze(-1)], -1)

    return block


def attention_phases(backend: Backend, case: AttentionCase, cuts: list[int], page_sizes: list[int],
                     decode_from: int, mates: int = 3, block: bool = False) -> list[Mismatch]:
    """Full prefill (first page size, no batch-mates) is the baseline; compare chunked prefill at each
    cut, token-by-token decode from ``decode_from``, other page sizes, and calls with batch-mates.
    With ``block`` the compared output is the rest of a decoder block and the token logprobs
    computed on each call's batch (``decoder_block_after_attention``), not the attention output."""
    params = dict(seq_len=case.seq_len, q_heads=case.q_heads, kv_heads=case.kv_heads,
                  head_dim=case.head_dim, dtype=str(case.dtype).replace("torch.", ""), seed=case.seed,
                  kv_cache=case.kv_cache)
    post = decoder_block_after_attention(backend, case) if block else None
    what = "decoder block" if block else case.op

    def run(steps, page_size, **kw):
        return run_schedule(backend, case, steps, page_size, post=post, **kw)

    full = run([case.seq_len], page_sizes[0])
    failures = []
    for page_size in page_sizes:
        schedules = {"full prefill": [case.seq_len]} if page_size != page_sizes[0] else {}
        for cut in cuts:
            if 0 < cut < case.seq_len:
                schedules[f"chunked prefill cut at {cut}"] = [cut, case.seq_len - cut]
        if 0 < decode_from < case.seq_len:
            schedules[f"prefill {decode_from} then decode token by token"] = \
                [decode_from] + [1] * (case.seq_len - decode_from)
        for label, steps in schedules.items():
            got = run(steps, page_size, seed=len(steps))
            if (m := compare(f"{what}: {label} vs full prefill", full, got, page_size=page_size, **params)):
                failures.append(m)
    if mates:
        steps = [cuts[0], case.seq_len - cuts[0]] if cuts and 0 < cuts[0] < case.seq_len else [case.seq_len]
        got = run(steps, page_sizes[-1], mates=mates, seed=7)
        if (m := compare(f"{what}: with batch-mates in every call vs alone", full, got,
                         page_size=page_sizes[-1], mates=mates, **params)):
            failures.append(m)
    return failures


# ---------------------------------------------------------------------------------------------
# Per-op row functions for batch invariance.
# ---------------------------------------------------------------------------------------------

def _moe_row_functions(backend: Backend, width: int, out_features: int, dtype: torch.dtype,
                       generator: torch.Generator, lay: Callable = lambda t: t
                       ) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """MoE row ops ([moe]): routing of a row of ``width`` router logits (rounded to halves, so rows are
    full of ties), group-limited sigmoid routing with a correction bias, and a whole MoE layer of 8
    experts (top-2) of intermediate ``out_features`` on a row of ``width`` hidden features."""
    from hal.moe import Routing

    device = backend.device
    experts, inter = 8, out_features
    router = lay(random_tensor((experts, width), dtype, generator, device=device))
    w13 = lay(random_tensor((experts, 2 * inter, width), dtype, generator, device=device))
    w2 = lay(random_tensor((experts, width, inter), dtype, generator, device=device))
    # routing over at most 512 experts (real models have 8-384; a wider row's other logits are unused)
    num_experts = min(width, 512)
    bias = lay(random_tensor((max(num_experts, 8),), torch.float32, generator, device=device) * 0.1)

    def route(x, routing, with_bias):
        logits = (x[:, :routing.num_experts].float() * 2).round() / 2
        weights, ids = backend.moe_route(logits, routing, bias[: routing.num_experts] if with_bias else None)
        return torch.cat([weights, ids.float()], -1)

    def layer(x):
        weights, ids = backend.moe_route(backend.linear(x, router, out_dtype=torch.float32), Routing(experts, 2))
        return backend.moe_experts(x, w13, w2, weights, ids)

    fns = {"moe_route": lambda x: route(x, Routing(num_experts, min(4, num_experts)), False), "moe layer": layer}
    if num_experts % 4 == 0 and num_experts >= 8:
        grouped = Routing(num_experts, 3, scoring="sigmoid", num_groups=4, topk_groups=2, scaling=2.5)
        fns["moe_route grouped"] = lambda x: route(x, grouped, True)
    return fns


def _fp8_row_functions(backend: Backend, width: int, out_features: int, dtype: torch.dtype,
                       generator: torch.Generator, lay: Callable = lambda t: t
                       ) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Block-FP8 linear row ops ([fp8]): a row of ``width`` features repeated out to K, one activation
    group more than the row needs (so every K crosses a group boundary; the values are the row's own, so
    they move with it), through ``out_features`` rows of block-quantised weights (N edges cross the
    weight blocks where out_features > the block)."""
    from hal import fp8

    spec = backend.contract.fp8
    group = spec.activation_group
    k = (-(-width // group) + 1) * group
    master = random_tensor((out_features, k), torch.float32, generator, spread=8)
    wq, ws = (lay(t.to(backend.device)) for t in fp8.quantise_weight_blocks(master, spec))
    bias = lay(random_tensor((out_features,), dtype, generator, device=backend.device))

    def widen(x):
        return x.repeat(1, -(-k // x.shape[-1]))[:, :k]

    fns = {"fp8_linear": lambda x: backend.fp8_linear(widen(x), wq, ws),
           "fp8_linear+bias": lambda x: backend.fp8_linear(widen(x), wq, ws, bias),
           "fp8_linear->fp32": lambda x: backend.fp8_linear(widen(x), wq, ws, out_dtype=torch.float32)}
    if backend.contract.moe is not None:
        fns["fp8 moe layer"] = _fp8_moe_layer(backend, k, out_features, dtype, generator, widen, lay)
    return fns


def _fp8_moe_layer(backend: Backend, k: int, out_features: int, dtype: torch.dtype, generator: torch.Generator,
                   widen: Callable[[torch.Tensor], torch.Tensor], lay: Callable = lambda t: t
                   ) -> Callable[[torch.Tensor], torch.Tensor]:
    """A block-FP8 MoE layer ([moe] + [fp8]): 8 experts, top-2, hidden K (the widened row), expert
    intermediate ``out_features`` rounded up to whole weight blocks, so the down GEMM's K is whole
    activation groups; the router in the activation dtype."""
    from hal import fp8
    from hal.moe import Routing

    spec, device, experts = backend.contract.fp8, backend.device, 8
    inter = -(-out_features // spec.weight_block) * spec.weight_block
    router = lay(random_tensor((experts, k), dtype, generator, device=device))

    def stack(n, kk):
        q, s = fp8.quantise_weight_blocks(random_tensor((experts, n, kk), torch.float32, generator, spread=8), spec)
        return lay(q.to(device)), lay(s.to(device))

    (w13, w13_s), (w2, w2_s) = stack(2 * inter, k), stack(k, inter)

    def layer(x):
        x = widen(x)
        weights, ids = backend.moe_route(backend.linear(x, router, out_dtype=torch.float32), Routing(experts, 2))
        return backend.fp8_moe_experts(x, w13, w13_s, w2, w2_s, weights, ids)

    return layer


def strided_copy(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as a strided view: every other element of a buffer twice as wide in the last dim, the
    elements between them NaN (or -1). A parameter sliced out of a fused one, or a weight tied by a view,
    arrives like this; an op that reads it as contiguous reads the fillers, and its bits change."""
    filler = float("nan") if t.dtype.is_floating_point else -1
    buffer = torch.full((*t.shape[:-1], 2 * t.shape[-1]), filler, dtype=t.dtype, device=t.device)
    view = buffer[..., ::2]
    view.copy_(t)
    return view


def op_row_functions(backend: Backend, width: int, out_features: int, dtype: torch.dtype,
                     generator: torch.Generator, *, strided: bool = False
                     ) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """For each row op: a function of a (M, width) batch, with its weights fixed here. ``strided``: every
    parameter (weights, biases, norm weight, rotary table, router, experts, FP8 weights and their scales) as a
    strided view (``strided_copy``), the same values."""
    device = backend.device
    lay = strided_copy if strided else (lambda t: t)
    weight = lay(random_tensor((out_features, width), dtype, generator, device=device, spread=8))
    bias = lay(random_tensor((out_features,), dtype, generator, device=device))
    norm_weight = lay(random_tensor((width,), dtype, generator, device=device))
    table = lay(cos_sin_cache(width if width % 2 == 0 else width - 1, 64, device=device)) if width > 1 else None

    def residual_for(x):
        # A residual derived from the row itself, so a row keeps its residual wherever it sits.
        return (x.float() * 0.5 + 0.25).to(x.dtype).flip(-1)

    def token_ids_for(x):
        # Token chosen from the row's own bits, so it moves with the row.
        return (x.float().abs().argmax(-1) * 7 + 3) % x.shape[-1]

    def topk_row(x):
        # Rounded to integers so that rows are full of ties.
        values, indices = backend.topk((x.float() * 2).round().to(x.dtype), min(5, x.shape[-1]))
        return torch.cat([values.float(), indices.float()], -1)

    fns = {
        "linear": lambda x: backend.linear(x, weight),
        "linear+bias": lambda x: backend.linear(x, weight, bias),
        "linear->fp32 logits": lambda x: backend.linear(x, weight, out_dtype=torch.float32),
        "rms_norm": lambda x: backend.rms_norm(x, norm_weight, 1e-6),
        "rms_norm+residual": lambda x: torch.cat(backend.rms_norm(x, norm_weight, 1e-6, residual_for(x)), -1),
        "log_softmax": lambda x: backend.log_softmax(x.float() * 4.0),
        "log_softmax T=0.7": lambda x: backend.log_softmax(x.float() * 4.0, temperature=0.7),
        "token_logprobs": lambda x: backend.token_logprobs(x.float() * 4.0, token_ids_for(x)).unsqueeze(-1),
        "sum": lambda x: backend.sum(x).unsqueeze(-1),
        "mean": lambda x: backend.mean(x).unsqueeze(-1),
        "topk": topk_row,
    }
    if width % 2 == 0:
        fns["silu_mul"] = lambda x: backend.silu_mul(x)
    if backend.contract is not None and backend.contract.moe is not None:
        fns.update(_moe_row_functions(backend, width, out_features, dtype, generator, lay))
    if backend.contract is not None and backend.contract.fp8 is not None:
        fns.update(_fp8_row_functions(backend, width, out_features, dtype, generator, lay))
    if table is not None and width % 2 == 0:
        def rotary(x):
            # The position comes from the row's own first value, pointwise: a reduction here (torch's
            # sum) would itself change bits with the batch on a GPU and move the row to another angle.
            pos = (x[..., 0].float().abs() * 1000).long() % 64
            q, k = backend.rotary(pos, x.unsqueeze(1), x.unsqueeze(1), table)
            return torch.cat([q, k], -1).squeeze(1)
        fns["rotary"] = rotary
    return fns


# ---------------------------------------------------------------------------------------------
# Masked keys: a key a query may not see contributes exactly nothing, whatever its K/V hold.
# ---------------------------------------------------------------------------------------------

def _poison_like(t: torch.Tensor) -> torch.Tensor:
    """NaN, +Inf and -Inf in turn: what stale or uninitialised cache memory may hold."""
    values = torch.tensor([math.nan, math.inf, -math.inf], dtype=t.dtype, device=t.device)
    return values[torch.arange(t.numel(), device=t.device) % 3].reshape(t.shape)


def masked_keys(backend: Backend, case: AttentionCase, page_size: int, hidden: int) -> list[Mismatch]:
    """Attention with NaN/Inf in the K and V of every key a query may not see (the last ``hidden``
    keys of the sequence: causally later positions; and every unused slot of every page) must give
    the bits of the same call on a zero-filled cache. Two calls: a full prefill of the sequence (its
    first ``seq_len - hidden`` queries are compared) and a decode step of the query just before the
    poisoned keys, whose pages still hold them beyond its context (unused page slots)."""
    device = backend.device
    q, k, v = case.tensors(device)
    n, seen = case.seq_len, case.seq_len - hidden
    gen = torch.Generator().manual_seed(case.seed)
    num_pages = pages_needed(n, page_size) + 2
    pages = PageAllocator(num_pages, gen).take(pages_needed(n, page_size))
    slots = slot_mapping(pages, range(n), page_size, device)
    scale = case.head_dim ** -0.5
    params = dict(seq_len=n, hidden=hidden, page_size=page_size, q_heads=case.q_heads, kv_heads=case.kv_heads,
                  head_dim=case.head_dim, dtype=str(case.dtype).replace("torch.", ""), seed=case.seed)

    def caches(poisoned: bool):
        cache = PagedKVCache.allocate(num_pages, page_size, case.kv_heads, case.head_dim, case.dtype, device)
        if poisoned:
            cache.k.copy_(_poison_like(cache.k))
            cache.v.copy_(_poison_like(cache.v).flip(0))
        k_in, v_in = k.clone(), v.clone()
        if poisoned:
            k_in[seen:] = _poison_like(k_in[seen:])
            v_in[seen:] = _poison_like(v_in[seen:]).flip(-1)
        backend.write_kv(k_in, v_in, cache.k, cache.v, slots)
        return cache

    def calls(cache):
        prefill = backend.attention(q, cache.k, cache.v, build_metadata([n], [n], [pages], device), scale=scale)
        decode = backend.attention(q[seen - 1:seen], cache.k, cache.v,
                                   build_metadata([1], [seen], [pages], device), scale=scale)
        return prefill[:seen], decode

    clean, dirty = calls(caches(False)), calls(caches(True))
    failures = []
    for label, a, b in (("prefill, keys after each query hold NaN/Inf", clean[0], dirty[0]),
                        ("decode, page slots beyond the context hold NaN/Inf", clean[1], dirty[1])):
        if (m := compare(f"attention: {label} vs a zero-filled cache", a, b, **params)):
            failures.append(m)
    return failures
