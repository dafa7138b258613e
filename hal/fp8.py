"""Block-scaled FP8 under the contract's ``[fp8]`` section: quantisation, dequantisation, the GEMM rule.

Each rule is written here once, in exact torch ops (the ``reference`` backend uses these as they are,
and the trainer uses the quantisers for its master weights):

* **scale** of a piece (an activation row's 1 x 128 group along K, a weight's 128 x 128 block, a KV
  token-head vector): ``amax = max |x|`` (exact in any order), ``scale = fl32(max(amax, fl32(floor)) /
  FMAX)``, a correctly rounded division. A piece's scale depends on that piece alone, so a token's FP8
  values do not depend on its batch-mates, its padding or its position.
* **quantise**: ``q = rne_fp8(clamp(fl32(x / scale), -FMAX, FMAX))``: a correctly rounded division
  (never a multiply by the reciprocal: that differs in the last bit, and the cast can keep it), then
  one round-to-nearest-even cast, subnormals kept. Weight scales from a checkpoint are used as stored.
* **GEMM** (``block_gemm``): for each K block b of 128 in ascending order, from acc = +0:
  ``acc = fl32(acc + fl32(partial_b * fl32(a_scale[m, b] * w_scale_inv[n // 128, b])))``, partial_b
  the fp32 dot of the block's fp8 values (here: the correctly rounded fp32 of the exact sum, one
  realisation of the contract's implementation-defined order inside a block); then the bias in fp32
  and one nearest-even rounding to the output dtype.

Divisions go through fp64 and one rounding to fp32: for fp32 operands that is the correctly rounded
fp32 quotient (53 >= 2 * 24 + 2), and it keeps the result off torch's fp32 CPU kernels, which replace
a division by a scalar with a multiply by its reciprocal.
"""

from __future__ import annotations

import torch

from hal.backends.reference.exact import matmul_fp32
from hal.contract import Contract, Fp8
from hal.errors import UnsupportedError

#: torch dtype of each [fp8] format name
FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def spec_of(contract: Contract | None, who: str) -> Fp8:
    """The contract's [fp8] section; refuse (with the reason) when the contract has none."""
    if contract is None or contract.fp8 is None:
        raise UnsupportedError(f"{who}: contract {contract} has no [fp8] section, so it does not say how an FP8 "
                               f"linear's or an FP8 KV cache's bits are decided; use a contract that has one "
                               f"(bf16-fp8-v1)")
    return contract.fp8


def baseline_spec() -> Fp8:
    """The layout the stock baseline (no contract) takes its shapes from: bf16-fp8-v1's [fp8]."""
    from hal.contract import load_contract

    return load_contract("bf16-fp8-v1").fp8


def _div_rn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fl32(a / b) of fp32 tensors, correctly rounded (fp64 quotient rounded once; see the docstring)."""
    return torch.div(a.double(), b.double()).float()


def scale_of(amax: torch.Tensor, spec: Fp8, fmt: str) -> torch.Tensor:
    """fp32 scales of pieces whose fp32 ``amax`` is given: fl32(max(amax, fl32(floor)) / FMAX)."""
    floor = torch.tensor(spec.amax_floor, dtype=torch.float32, device=amax.device)
    return _div_rn(torch.maximum(amax.float(), floor), torch.full_like(amax, spec.fmax(fmt), dtype=torch.float32))


def quantise(x: torch.Tensor, scale: torch.Tensor, spec: Fp8, fmt: str) -> torch.Tensor:
    """rne_fp8(clamp(fl32(x / scale), -FMAX, FMAX)); ``scale`` broadcasts against x."""
    fmax = spec.fmax(fmt)
    y = _div_rn(x.float(), scale.float().expand_as(x)).clamp(-fmax, fmax)
    return y.to(FORMATS[fmt])      # torch's CPU cast is nearest-even with subnormals (tests/test_fp8.py)


def quantise_pieces(x: torch.Tensor, spec: Fp8, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise each row of the last dim of ``x`` (..., P) as one piece: (q (..., P), fp32 scale (...))."""
    xf = x.float()
    scale = scale_of(xf.abs().amax(-1), spec, fmt)
    return quantise(xf, scale.unsqueeze(-1), spec, fmt), scale


def check_k(k: int, spec: Fp8, who: str) -> None:
    if k % spec.activation_group:
        raise UnsupportedError(f"{who}: K = {k} is not a multiple of [fp8].activation_group = "
                               f"{spec.activation_group}; an FP8 linear's K must be whole groups (pad the weight's "
                               f"K with zero columns when the checkpoint is made)")


def quantise_activations(x: torch.Tensor, spec: Fp8) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> (q (M, K) e4m3, fp32 scales (M, K / G)): one scale per 1 x G group at absolute offsets."""
    m, k = x.shape
    check_k(k, spec, "fp8 quantise_activations")
    g = spec.activation_group
    q, scale = quantise_pieces(x.reshape(m, k // g, g), spec, spec.activation_format)
    return q.reshape(m, k), scale


def dequantise_activations(q: torch.Tensor, scale: torch.Tensor, spec: Fp8) -> torch.Tensor:
    """fp32 fl32(fp32(q) * scale) of activations quantised by ``quantise_activations``."""
    m, k = q.shape
    g = spec.activation_group
    return (q.float().reshape(m, k // g, g) * scale.float().unsqueeze(-1)).reshape(m, k)


def weight_scale_shape(n: int, k: int, spec: Fp8) -> tuple[int, int]:
    """(ceil(N / B), ceil(K / B)): one scale_inv per weight block, DeepSeek's ``weight_scale_inv`` layout."""
    b = spec.weight_block
    return (-(-n // b), -(-k // b))


def _blocked(w: torch.Tensor, b: int) -> tuple[torch.Tensor, int, int]:
    """w (N, K) zero-padded to whole blocks and viewed (N/B, B, K/B, B). Zeros never raise a block's amax."""
    n, k = w.shape
    nb, kb = -(-n // b), -(-k // b)
    padded = w.new_zeros((nb * b, kb * b))
    padded[:n, :k] = w
    return padded.view(nb, b, kb, b), n, k


def _check_whole_block_rows(n: int, block: int) -> None:
    """An expert stack's rows are whole blocks, so stacking its experts' rows keeps each expert's blocks."""
    if n % block:
        raise UnsupportedError(f"an expert stack's weight rows ({n}) must be whole {block}-row blocks")


def quantise_weight_blocks(w: torch.Tensor, spec: Fp8) -> tuple[torch.Tensor, torch.Tensor]:
    """Master weights w (N, K) -> (e4m3 (N, K), fp32 scale_inv (ceil(N/B), ceil(K/B))), the scale rule per
    B x B block: what the trainer hands the rollout engine at a weight sync, and what it computes with.
    An expert stack (E, N, K) gives (E, N, K) and (E, N/B, ceil(K/B)): each expert's own block grid."""
    b = spec.weight_block
    if w.dim() == 3:
        e, n, k = w.shape
        _check_whole_block_rows(n, b)
        q, scale = quantise_weight_blocks(w.reshape(e * n, k), spec)
        return q.view(e, n, k), scale.view(e, n // b, -1)
    blocks, n, k = _blocked(w.float(), b)
    scale = scale_of(blocks.abs().amax(dim=(1, 3)), spec, spec.weight_format)         # (N/B, K/B)
    q = quantise(blocks, scale[:, None, :, None], spec, spec.weight_format)
    return q.reshape(blocks.shape[0] * b, blocks.shape[2] * b)[:n, :k].contiguous(), scale


def dequantise_weight_blocks(q: torch.Tensor, scale_inv: torch.Tensor, spec: Fp8) -> torch.Tensor:
    """fp32 w = fl32(fp32(q) * scale_inv[n // B, k // B]) (DeepSeek's ``weight_dequant``); an expert stack
    (E, N, K) with (E, N/B, ceil(K/B)) scales expert by expert."""
    b = spec.weight_block
    if q.dim() == 3:
        e, n, k = q.shape
        _check_whole_block_rows(n, b)
        return dequantise_weight_blocks(q.reshape(e * n, k), scale_inv.reshape(e * n // b, -1), spec).view(e, n, k)
    n, k = q.shape
    full = scale_inv.float().repeat_interleave(b, 0).repeat_interleave(b, 1)[:n, :k]
    return q.float() * full


def check_weight(weight: torch.Tensor, scale_inv: torch.Tensor, k: int, spec: Fp8, who: str) -> None:
    """The weight is (N, K) in [fp8].weight_format with fp32 scale_inv (ceil(N/B), K/B)."""
    want = FORMATS[spec.weight_format]
    if weight.dim() != 2 or weight.dtype != want or weight.shape[1] != k:
        raise UnsupportedError(f"{who}: the weight must be (N, K = {k}) {want} ([fp8].weight_format = "
                               f"{spec.weight_format!r}), got {tuple(weight.shape)} {weight.dtype}")
    shape = weight_scale_shape(weight.shape[0], k, spec)
    if scale_inv.dtype != torch.float32 or tuple(scale_inv.shape) != shape:
        raise UnsupportedError(f"{who}: weight_scale_inv must be fp32 {shape} (one per {spec.weight_block} x "
                               f"{spec.weight_block} block of the {tuple(weight.shape)} weight), got "
                               f"{tuple(scale_inv.shape)} {scale_inv.dtype}")


def block_gemm(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale_inv: torch.Tensor,
               bias: torch.Tensor | None, out_dtype: torch.dtype, spec: Fp8) -> torch.Tensor:
    """The [fp8] GEMM, exactly: xq (M, K) fp8 with x_scale (M, K/G) @ wq (N, K).T fp8 with w_scale_inv
    (ceil(N/B), K/B), (+ bias), rounded once to ``out_dtype``. See the module docstring for the rule."""
    m, k = xq.shape
    n = wq.shape[0]
    b = spec.weight_block
    w_scale_cols = w_scale_inv.float().repeat_interleave(b, 0)[:n]                      # (N, K/B)
    acc = torch.zeros(m, n, dtype=torch.float32, device=xq.device)
    for block, (start, end) in enumerate(spec.group_ranges(k)):
        # fp8 values are exact in fp32, and so are their products: matmul_fp32 returns each dot's
        # correctly rounded fp32 value, which no batch, tile or thread count can change.
        partial = matmul_fp32(xq[:, start:end].float(), wq[:, start:end].float().T)
        s = x_scale[:, block].float().unsqueeze(1) * w_scale_cols[:, block].unsqueeze(0)   # fl32(a_s * w_s)
        acc = acc + partial * s                                       # two fp32 ops, each rounded (no FMA)
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(out_dtype)


# ---------------------------------------------------------------------------------------------
# The FP8 KV cache: quantise on write, dequantise in the one read path.
# ---------------------------------------------------------------------------------------------

def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
                   spec: Fp8, who: str) -> None:
    """An FP8 KV cache as [fp8] says: k, v (pages, P, Hkv, D) in kv_format; fp32 scales (pages, P, Hkv)
    for ``per_token_head``, 0-dim fp32 for ``fixed``."""
    want = FORMATS[spec.kv_format]
    if k_cache.dtype != want or v_cache.dtype != want or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise UnsupportedError(f"{who}: the FP8 KV cache must be two (pages, P, Hkv, D) {want} tensors of one shape "
                               f"([fp8].kv_format = {spec.kv_format!r}); got {tuple(k_cache.shape)} {k_cache.dtype} "
                               f"and {tuple(v_cache.shape)} {v_cache.dtype}")
    shape = tuple(k_cache.shape[:3]) if spec.kv_scale == "per_token_head" else ()
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s.dtype != torch.float32 or tuple(s.shape) != shape:
            raise UnsupportedError(f"{who}: {name} must be fp32 of shape {shape} ([fp8].kv_scale = "
                                   f"{spec.kv_scale!r}), got {tuple(s.shape)} {s.dtype}")


def quantise_kv(x: torch.Tensor, fixed_scale: torch.Tensor, spec: Fp8) -> tuple[torch.Tensor, torch.Tensor | None]:
    """K or V rows (T, Hkv, D) -> (fp8 (T, Hkv, D), fp32 scales (T, Hkv) or None): per (token, head) vector by
    the scale rule (``per_token_head``), or with the layer's ``fixed_scale`` (0-dim fp32; no scales stored)."""
    if spec.kv_scale == "per_token_head":
        return quantise_pieces(x, spec, spec.kv_format)
    return quantise(x, fixed_scale, spec, spec.kv_format), None


def dequantise_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The one read path: round_act(fl32(fp32(q) * scale)), scale (..., Hkv) per token-head or 0-dim."""
    s = scale.unsqueeze(-1) if scale.dim() else scale
    return (q.float() * s).to(dtype)


def write_kv_exact(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   k_scale: torch.Tensor, v_scale: torch.Tensor, slot_mapping: torch.Tensor, spec: Fp8,
                   quantise_rows=quantise_kv) -> None:
    """Quantise k, v (T, Hkv, D) and store them (and their scales) at flat slots ``page * P + row``; slot -1
    skips. The reference backend's ``fp8_write_kv``, in exact torch ops (``quantise_rows``: the rule, a
    test's negative control replaces it)."""
    page_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    page, row = slots // page_size, slots % page_size
    for x, cache, scales in ((k[keep], k_cache, k_scale), (v[keep], v_cache, v_scale)):
        q, scale = quantise_rows(x, scales, spec)
        cache[page, row] = q
        if scale is not None:
            scales[page, row] = scale


class Fp8KVCache:
    """A paged KV cache stored in [fp8].kv_format, with its scales.

    k, v: (num_pages, P, Hkv, D) fp8; k_scale, v_scale: (num_pages, P, Hkv) fp32 per (token, head)
    ([fp8].kv_scale = "per_token_head") or the model's fixed fp32 scale per layer ("fixed"). ``write``
    quantises each token's K and V per head by the scale rule (from that token-head vector alone, so a
    token's cache bits do not depend on which call wrote it or with whom); the read path that prefill,
    chunked prefill, decode and training all go through is [fp8].kv_dequant: under
    "fp32_multiply_round_act" k = round_act(fl32(fp32(q) * scale)), which ``read`` materialises, and
    ``attention`` asks a backend for attention that reads the cache that way (``Backend.fp8_attention``:
    the cuda kernel dequantises each K/V tile as it loads it); under "f16_operands" (fixed scales only)
    the scales act on the scores and the output, not the elements, so ``read`` gives the cache's values
    but not the read path's bits, and only ``attention`` realises the rule. Unwritten slots read as NaN
    (fp8 NaN, NaN scale), which [attention].mask keeps out."""

    def __init__(self, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, spec: Fp8,
                 device: torch.device | str = "cpu", fixed_scales: tuple[float, float] = (1.0, 1.0)):
        self.spec = spec
        dtype = FORMATS[spec.kv_format]
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k = torch.full(shape, float("nan"), device=device).to(dtype)
        self.v = torch.full(shape, float("nan"), device=device).to(dtype)
        if spec.kv_scale == "per_token_head":
            self.k_scale = torch.full(shape[:3], float("nan"), device=device)
            self.v_scale = torch.full(shape[:3], float("nan"), device=device)
        else:   # "fixed": one fp32 scale for K and one for V (the model's; 1.0 when it gives none)
            self.k_scale = torch.tensor(fixed_scales[0], dtype=torch.float32, device=device)
            self.v_scale = torch.tensor(fixed_scales[1], dtype=torch.float32, device=device)

    @property
    def page_size(self) -> int:
        return self.k.shape[1]

    def _quantise(self, x: torch.Tensor, fixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return quantise_kv(x, fixed, self.spec)

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, backend=None) -> None:
        """Store k, v (T, Hkv, D) at flat slots ``page * P + row`` (T,); slot -1 skips. With ``backend``
        its ``fp8_write_kv`` quantises and stores (the cuda backend: one kernel); without, the exact
        torch ops here."""
        if k.shape != v.shape or k.dim() != 3 or k.shape[1:] != self.k.shape[2:] or slot_mapping.shape != k.shape[:1]:
            raise UnsupportedError(f"Fp8KVCache.write: k and v must be (T, Hkv={self.k.shape[2]}, D={self.k.shape[3]}) "
                                   f"with one slot per token; got k {tuple(k.shape)}, v {tuple(v.shape)}, slots "
                                   f"{tuple(slot_mapping.shape)}")
        if backend is not None:
            backend.fp8_write_kv(k, v, self.k, self.v, self.k_scale, self.v_scale, slot_mapping)
        else:
            write_kv_exact(k, v, self.k, self.v, self.k_scale, self.v_scale, slot_mapping, self.spec,
                           lambda x, fixed, spec: self._quantise(x, fixed))

    def read(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The dequantised (num_pages, P, Hkv, D) K and V caches in the activation dtype: under
        "fp32_multiply_round_act" what every phase's attention reads; under "f16_operands" the values
        only (attention there applies the scales after the dots: ``attention``)."""
        return dequantise_kv(self.k, self.k_scale, dtype), dequantise_kv(self.v, self.v_scale, dtype)

    def attention(self, backend, q: torch.Tensor, meta, *, scale: float) -> torch.Tensor:
        """``backend.fp8_attention`` over this cache: under "fp32_multiply_round_act" the same bits as
        ``backend.attention`` over ``read(q.dtype)``; under "f16_operands" its own rule (contract)."""
        return backend.fp8_attention(q, self.k, self.v, self.k_scale, self.v_scale, meta, scale=scale)
