"""Level 5: accuracy against an fp64 oracle, within bounds every conforming backend must meet.

The bounds follow from the contract's rounding points, with room for what the contract leaves
implementation-defined (the order inside one reduction chunk, exp/log to a few ulp):

  u = 2**-24 (one fp32 rounding); r = one rounding to the activation dtype with margin
  (2**-8 for bf16, 2**-22 for fp32).

  linear        |err| <= (2 ceil(K/16) + 2 chunks + 2) u sum|x w| (+ r |y| when rounded to bf16/fp32 act.)
                 (fp32 accumulation of at most one rounding per 16-wide MMA step, plus the chunk combine)
  attention     |err| <= 2 r max|v| + r |y| + 256 u max|v|  (P rounded to the act. dtype; the
                 denominator sums the same rounded P, so the output is a convex combination of V)
  rms_norm      |err| <= (r + 64 u) |y|
  silu_mul      |err| <= (r + 32 u) |y|
  rotary        |err| <= r |y| + 8 u (|x1 c| + |x2 s|)
  log_softmax   |err| <= 2**-18 (1 + |x/T| + max|x/T| + |logp|)
  sum, mean     |err| <= (2 log2(block) + blocks + 2) u sum|x|   (mean: / n, + u |mean|)
  topk, write_kv exact
  fp8_attention against fp64 attention over the values [fp8]'s read path gives (kv_dequant
                "fp32_multiply_round_act": the dequantised round_act(fl32(fp8 x scale)), and the attention bound
                as it is; "f16_operands": the exact fp8 x scale, P rounded to f16 (max(r, 2**-10) in the P term)
                and q to f16 once: a score error eps <= scale max_j sum_d (2**-11 |q_d| + 2**-25) |k_jd| moves the
                output by at most 3 eps max|v|; f16 subnormal P adds L 2**-24 max|v|)
  moe_route     the fp64 oracle's experts exactly on rows without a near-tie at the k-th choice (gap > 1e-5);
                weights |err| <= 64 u |w| there
  moe_experts   through each rounding point of [moe]'s expert path (gate/up rounded, SiLU*up rounded, the
                down GEMM in fp32, the weighted fp32 combine rounded once), twice the propagated bound:
                dgu = r|gu| + G(H) |x||w13|;  dh = 1.1 dg (|u| + du) + |silu g| du + (r + 32 u)(|h| + ...);
                dy = |w2| dh + G(I) |w2||h|;  dout = sum_k |w_k| dy_k + 4k u sum_k |w_k y_k| + r |out|
                (G(K) = (2 ceil(K/16) + 2 chunks + 2) u, the linear bound above)
"""

from __future__ import annotations

import math

import torch

from hal.backend import Backend
from hal.conformance import oracle
from hal.conformance.checks import AttentionCase, random_tensor, run_schedule
from hal.rope import cos_sin_cache

U = 2.0 ** -24


def act_rel(dtype: torch.dtype) -> float:
    return 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -22


def _check(what: str, got: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor) -> list[str]:
    err = (got.double() - exact).abs()
    bad = ~(err <= bound)
    if not bool(bad.any()):
        return []
    worst = int((err - bound).nan_to_num(nan=math.inf).argmax())
    return [f"{what}: {int(bad.sum())}/{bad.numel()} values outside the bound; worst at flat index {worst}: "
            f"|err| {float(err.flatten()[worst]):.3g} > bound {float(bound.flatten()[worst]):.3g}"]


# Inside one K block of 128, Hopper's FP8 MMA keeps fewer bits than fp32 (bench/fp8_gpu.py's accuracy section:
# at worst 2**-12.3 of sum |x| |w| on the H200, five shapes); the kit allows 2**-10 of it per output, beside the
# fp32 block adds. A wrong scale layout (a block's scale from another block) is far outside it.
FP8_BLOCK_REL = 2.0 ** -10


def _fp8_linear_problems(backend: Backend, size: int, width: int, dtype: torch.dtype, g: torch.Generator) -> list:
    """fp8_linear against the fp64 product of the contract's quantised operands: the activations quantised
    by the reference rule (hal.fp8), the weights as their checkpoint blocks, both dequantised exactly in
    fp64 (an e4m3 value times an fp32 scale has at most 28 significant bits)."""
    from hal import fp8

    spec = backend.contract.fp8
    group = spec.activation_group
    k = -(-width // group) * group
    n = 150                                              # crosses a 128-row weight block
    x = random_tensor((size, k), dtype, g, spread=4)
    master = random_tensor((n, k), torch.float32, g, scale=k ** -0.5)
    wq, ws = fp8.quantise_weight_blocks(master, spec)
    b = random_tensor((n,), dtype, g)
    xq, xs = fp8.quantise_activations(x, spec)
    xd = xq.double() * xs.double().repeat_interleave(group, 1)
    wd = wq.double() * ws.double().repeat_interleave(spec.weight_block, 0)[:n].repeat_interleave(group, 1)[:, :k]
    exact = xd @ wd.T + b.double()
    mag = xd.abs() @ wd.abs().T + b.double().abs()
    blocks = k // group
    problems = []
    dev = backend.device
    for out_dtype in (dtype, torch.float32):
        got = backend.fp8_linear(x.to(dev), wq.to(dev), ws.to(dev), b.to(dev), out_dtype=out_dtype).cpu()
        bound = (FP8_BLOCK_REL + (2 * blocks + 2) * U) * mag
        if out_dtype == dtype:
            bound = bound + act_rel(dtype) * exact.abs()
        problems += _check(f"fp8_linear M={size} K={k} N={n} -> {out_dtype}", got, exact, bound)
    return problems


def accuracy_problems(backend: Backend, op: str, size: int, width: int, dtype: torch.dtype, seed: int) -> list[str]:
    """Run ``op`` on random inputs of ``size`` rows (or tokens) and ``width`` features; compare to fp64."""
    g = torch.Generator().manual_seed(seed)
    dev = backend.device
    r = act_rel(dtype)

    def rand(*shape, scale=1.0):
        return random_tensor(shape, dtype, g, scale=scale, device=dev)

    if op == "linear":
        n = 37
        x, w, b = rand(size, width), rand(n, width, scale=width ** -0.5), rand(n)
        problems = []
        for out_dtype in (dtype, torch.float32):
            got = backend.linear(x, w, b, out_dtype=out_dtype).cpu()
            exact = oracle.linear(x.cpu(), w.cpu(), b.cpu())
            chunks = backend.contract.gemm.chunk_count(width) if backend.contract else 1
            mag = x.cpu().double().abs() @ w.cpu().double().abs().T + b.cpu().double().abs()
            bound = (2 * math.ceil(width / 16) + 2 * chunks + 2) * U * mag
            if out_dtype == dtype:
                bound = bound + r * exact.abs()
            problems += _check(f"linear M={size} K={width} N={n} -> {out_dtype}", got, exact, bound)
        return problems
    if op == "fp8_linear":
        return _fp8_linear_problems(backend, size, width, dtype, g)
    if op == "fp8_attention":
        return _fp8_attention_problems(backend, size, width, dtype, seed)
    if op == "attention":
        case = AttentionCase(size, 4, 2, width, dtype, seed)
        q, k, v = (t.cpu() for t in case.tensors())
        got = run_schedule(backend, case, [size], page_size=16).cpu()
        exact = oracle.attention(q, k, v, width ** -0.5)
        return _check(f"attention L={size} D={width}", got, exact, _attention_bound(r, v.double().abs().max(), exact))
    if op == "rms_norm":
        x, w, res = rand(size, width), rand(width), rand(size, width)
        problems = []
        for residual in (None, res):
            got = backend.rms_norm(x, w, 1e-6, residual)
            if residual is not None:
                got, res_out = got
                if not torch.equal(res_out.cpu(), (x.float() + res.float()).to(dtype).cpu()):
                    problems.append("rms_norm: residual output is not round_act(fl32(x + residual))")
            exact = oracle.rms_norm(x.cpu(), w.cpu(), 1e-6, None if residual is None else residual.cpu())
            problems += _check(f"rms_norm rows={size} width={width} residual={residual is not None}",
                               got.cpu(), exact, (r + 64 * U) * exact.abs())
        return problems
    if op == "silu_mul":
        x = rand(size, 2 * width, scale=4.0)
        exact = oracle.silu_mul(x.cpu())
        return _check(f"silu_mul rows={size} I={width}", backend.silu_mul(x).cpu(), exact,
                      (r + 32 * U) * exact.abs() + 1e-30)
    if op == "rotary":
        head_dim = 2 * max(1, width // 2)
        table = cos_sin_cache(head_dim, 257, device=dev)
        positions = torch.randint(0, 257, (size,), generator=g).to(dev)
        q, k = rand(size, 4, head_dim), rand(size, 2, head_dim)
        problems = []
        for got, x in zip(backend.rotary(positions, q, k, table), (q, k)):
            exact = oracle.rotary(positions.cpu(), x.cpu(), table.cpu())
            mag = oracle.rotary_magnitude(positions.cpu(), x.cpu(), table.cpu())
            problems += _check(f"rotary T={size} D={head_dim}", got.cpu(), exact, r * exact.abs() + 8 * U * mag)
        return problems
    if op in ("log_softmax", "token_logprobs"):
        logits = random_tensor((size, width), torch.float32, g, scale=6.0, device=dev)
        problems = []
        for temperature in (1.0, 0.7):
            exact = oracle.log_softmax(logits.cpu(), temperature)
            scaled = logits.cpu().double().abs() / temperature
            bound = 2.0 ** -18 * (1 + scaled + scaled.amax(-1, keepdim=True) + exact.abs())
            if op == "log_softmax":
                got = backend.log_softmax(logits, temperature).cpu()
            else:
                ids = torch.randint(0, width, (size,), generator=g)
                got = backend.token_logprobs(logits, ids.to(dev), temperature).cpu()
                pick = ids.view(-1, 1)
                exact, bound = exact.gather(-1, pick).squeeze(-1), bound.gather(-1, pick).squeeze(-1)
            problems += _check(f"{op} rows={size} V={width} T={temperature}", got, exact, bound)
        return problems
    if op in ("sum", "mean"):
        x = rand(size, width)
        block = backend.contract.reduce.row_block if backend.contract else width
        blocks = math.ceil(width / block)
        exact = x.cpu().double().sum(-1)
        bound = (2 * math.ceil(math.log2(max(2, min(width, block)))) + blocks + 2) * U * x.cpu().double().abs().sum(-1)
        if op == "sum":
            return _check(f"sum rows={size} width={width}", backend.sum(x).cpu(), exact, bound)
        mean = exact / width
        return _check(f"mean rows={size} width={width}", backend.mean(x).cpu(), mean, bound / width + U * mean.abs())
    if op == "topk":
        x = torch.randint(-3, 4, (size, width), generator=g).to(dtype).to(dev)  # full of ties
        k = min(width, 5)
        values, indices = backend.topk(x, k)
        problems = []
        for i, row in enumerate(x.cpu().tolist()):
            expected = sorted(range(width), key=lambda j: (-row[j], j))[:k]
            if indices[i].tolist() != expected or values[i].cpu().tolist() != [row[j] for j in expected]:
                problems.append(f"topk row {i}: got indices {indices[i].tolist()}, expected {expected} "
                                f"(value descending, ties to the lower index)")
                break
        return problems
    if op == "write_kv":
        page = 16
        k_new, v_new = rand(size, 2, width), rand(size, 2, width)
        pages = math.ceil(size / page) + 3
        k_cache = torch.zeros(pages, page, 2, width, dtype=dtype, device=dev)
        v_cache = torch.zeros_like(k_cache)
        slots = torch.randperm(pages * page, generator=g)[:size].to(dev)
        slots[0] = -1 if size > 1 else slots[0]  # a padding slot: must be skipped
        backend.write_kv(k_new, v_new, k_cache, v_cache, slots)
        keep = slots >= 0
        flat_k, flat_v = k_cache.view(-1, 2, width), v_cache.view(-1, 2, width)
        ok = torch.equal(flat_k[slots[keep]], k_new[keep]) and torch.equal(flat_v[slots[keep]], v_new[keep])
        untouched = torch.ones(pages * page, dtype=torch.bool, device=dev)
        untouched[slots[keep]] = False
        ok = ok and bool((flat_k[untouched] == 0).all()) and bool((flat_v[untouched] == 0).all())
        return [] if ok else [f"write_kv T={size} D={width}: cache slots do not hold exactly the written K/V"]
    if op in ("moe_route", "moe_experts"):
        return _moe_accuracy_problems(backend, op, size, width, dtype, g)
    raise ValueError(f"no accuracy check for op {op!r}")


def _attention_bound(r: float, vmax: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """The attention bound of the module docstring: P's rounding, the output's, fp32 steps."""
    return 2 * r * vmax + r * exact.abs() + 256 * U * vmax


def _fp8_attention_problems(backend: Backend, size: int, width: int, dtype: torch.dtype, seed: int) -> list:
    """fp8_attention (one prefill through an FP8 KV cache, ``run_schedule``) within the module docstring's bound."""
    from hal import fp8

    spec = fp8.spec_of(backend.contract, "the conformance kit's fp8_attention accuracy")
    case = AttentionCase(size, 4, 2, width, dtype, seed, kv_cache="fp8")
    q, k, v = (t.cpu() for t in case.tensors())
    got = run_schedule(backend, case, [size], page_size=16).cpu()
    one = torch.tensor(1.0)                                  # Fp8KVCache's fixed scales
    read = []
    for x in (k, v):
        xq, xs = fp8.quantise_kv(x, one, spec)
        read.append(xq.double() if spec.kv_dequant == "f16_operands" else
                    fp8.dequantise_kv(xq, one if xs is None else xs, dtype).double())
    kd, vd = read
    scale = width ** -0.5
    exact = oracle.attention(q, kd, vd, scale)
    vmax = vd.abs().max()
    r = act_rel(dtype)
    bound = _attention_bound(r, vmax, exact)
    if spec.kv_dequant == "f16_operands":
        group = q.shape[1] // kd.shape[1]
        qerr = 2.0 ** -11 * q.double().abs() + 2.0 ** -25
        eps = scale * torch.einsum("qhd,khd->hqk", qerr, kd.abs().repeat_interleave(group, 1)).max()
        bound = bound + 2 * (max(r, 2.0 ** -10) - r) * vmax + 3 * eps * vmax + size * 2.0 ** -24 * vmax
    return _check(f"fp8_attention L={size} D={width} ({spec.kv_dequant})", got, exact, bound)


def _gemm_rel(backend: Backend, k: int) -> float:
    chunks = backend.contract.gemm.chunk_count(k) if backend.contract else 1
    return (2 * math.ceil(k / 16) + 2 * chunks + 2) * U


def oracle_route(logits: torch.Tensor, routing, bias: torch.Tensor | None):
    """fp64 routing of fp32 router logits: (weights, ids, the gap between the k-th and (k+1)-th choice).
    Group-limited routing keeps the groups with the largest sum of their two best choices."""
    x = logits.double()
    scores = torch.softmax(x, -1) if routing.scoring == "softmax" else torch.sigmoid(x)
    choice = scores if bias is None else scores + bias.double()
    if routing.num_groups > 1:
        grouped = choice.view(x.shape[0], routing.num_groups, -1)
        kept = grouped.topk(2, -1).values.sum(-1).topk(routing.topk_groups, -1).indices
        keep = torch.zeros(grouped.shape[:2], dtype=torch.bool).scatter_(-1, kept, True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(x)
    ranked = choice.topk(routing.top_k + 1, -1)
    ids = ranked.indices[:, :-1]
    weights = scores.gather(-1, ids)
    if routing.renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights * routing.scaling, ids, ranked.values[:, -2] - ranked.values[:, -1]


def _moe_accuracy_problems(backend: Backend, op: str, size: int, width: int, dtype: torch.dtype,
                           g: torch.Generator) -> list[str]:
    from hal.moe import Routing

    dev = backend.device
    r = act_rel(dtype)
    if op == "moe_route":
        experts = 16 if width < 64 else 64
        logits = random_tensor((size, experts), torch.float32, g, scale=2.0, device=dev)
        bias = random_tensor((experts,), torch.float32, g, scale=0.05, device=dev)
        problems = []
        for label, routing, b in (("softmax top-4", Routing(experts, 4), None),
                                  ("sigmoid group-limited top-3 + bias",
                                   Routing(experts, 3, scoring="sigmoid", num_groups=4, topk_groups=2, scaling=2.5),
                                   bias)):
            weights, ids = backend.moe_route(logits, routing, b)
            want_w, want_ids, gap = oracle_route(logits.cpu(), routing, None if b is None else b.cpu())
            clear = gap > 1e-5
            if not torch.equal(ids.cpu().long()[clear], want_ids[clear]):
                rows = (ids.cpu().long() != want_ids).any(-1) & clear
                problems.append(f"moe_route {label} T={size} E={experts}: {int(rows.sum())} rows without a near-tie "
                                f"chose other experts than the fp64 oracle")
                continue
            problems += _check(f"moe_route {label} weights T={size} E={experts}", weights.cpu()[clear], want_w[clear],
                               64 * U * want_w[clear].abs())
        return problems
    # moe_experts: a layer of 8 experts, top-2, hidden = width, intermediate 40
    hidden, inter, experts, k = width, 40, 8, 2
    x = random_tensor((size, hidden), dtype, g, device=dev)
    w13 = random_tensor((experts, 2 * inter, hidden), dtype, g, scale=hidden ** -0.5, device=dev)
    w2 = random_tensor((experts, hidden, inter), dtype, g, scale=inter ** -0.5, device=dev)
    weights, ids = backend.moe_route(random_tensor((size, experts), torch.float32, g, device=dev), Routing(experts, k))
    got = backend.moe_experts(x, w13, w2, weights, ids).cpu()
    xd, w13d, w2d = x.cpu().double(), w13.cpu().double(), w2.cpu().double()
    wd, idc = weights.cpu().double(), ids.cpu().long()
    g_h, g_i = _gemm_rel(backend, hidden), _gemm_rel(backend, inter)
    exact = torch.zeros(size, hidden, dtype=torch.float64)
    spread = torch.zeros(size, hidden, dtype=torch.float64)     # sum_k |w_k| dy_k
    magnitude = torch.zeros(size, hidden, dtype=torch.float64)  # sum_k |w_k y_k|
    for slot in range(k):
        e = idc[:, slot]
        gu = torch.einsum("th,tnh->tn", xd, w13d[e])
        mag13 = torch.einsum("th,tnh->tn", xd.abs(), w13d[e].abs())
        dgu = r * gu.abs() + (1 + r) * g_h * mag13
        (gate, up), (dg, du) = gu.chunk(2, -1), dgu.chunk(2, -1)
        silu = gate * torch.sigmoid(gate)
        h = silu * up
        dh = 1.1 * dg * (up.abs() + du) + silu.abs() * du
        dh = dh + (r + 32 * U) * (h.abs() + dh)
        y = torch.einsum("ti,thi->th", h, w2d[e])
        mag2 = torch.einsum("ti,thi->th", h.abs() + dh, w2d[e].abs())
        dy = torch.einsum("ti,thi->th", dh, w2d[e].abs()) + g_i * mag2
        w_slot = wd[:, slot:slot + 1]
        exact += w_slot * y
        spread += w_slot.abs() * dy
        magnitude += (w_slot * y).abs()
    bound = 2 * (spread + 4 * k * U * magnitude + r * (exact.abs() + spread))
    return _check(f"moe_experts T={size} H={hidden} I={inter} E={experts} k={k}", got, exact, bound)
