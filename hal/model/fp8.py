"""A block-FP8 model's quantised weights: where they come from, and the one way they are recomputed.

An ``Fp8Linear`` keeps a master weight (model dtype, what the optimiser updates) and the quantised
form every forward uses (``weight_fp8`` e4m3 + ``weight_scale_inv`` fp32 per 128 x 128 block);
``Fp8Experts`` keeps two such stacked weights (``w13_weight``, ``w2_weight``, each with its ``_fp8`` and
``_scale_inv`` buffers, one block grid per expert). ``fp8_weights`` lists them all as ``Fp8Weight``
records, and everything below works on those. The quantised form is set in exactly two ways:

* **as stored**: from a DeepSeek-style checkpoint (``load_pretrained``) or a weight sync received by
  a rollout model (``load_weight_sync``): the fp8 values and scales are kept bit for bit, never
  re-quantised (requantising their dequantisation can give other scales, and so other bits: a
  checkpoint's scales need not be the ones our scale rule computes); the master weight is their
  dequantisation ``fl32(fp32(q) * scale_inv)`` rounded to the model dtype;
* **from the master weight**: ``quantise_master_weights`` is ``hal.fp8.quantise_weight_blocks`` (the
  contract's [fp8] scale and quantise rules) of every master weight. It is the one function both the
  trainer's ``refresh_fp8_weights`` (after each optimiser step) and the payload of a weight sync
  (``weight_sync_tensors``) call, so the rollout engine computes with the trainer's fp8 bits.

A forward whose master weights changed since their quantised form was set refuses to run
(``StaleFp8WeightsError``) instead of computing with stale weights: call ``refresh_fp8_weights`` after
``optimizer.step()``.

Merged projections: the model holds ``qkv_proj = [q | k | v]``, ``gate_up_proj = [gate | up]`` and each
expert's ``w13 = [gate | up]``; each HF tensor starts on a block row (``ModelConfig`` checks it), so its scales are whole rows of the merged
scale grid and quantising the merged weight gives each part the bits quantising it alone gives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from hal import fp8 as f8
from hal.contract import Fp8
from hal.errors import CheckpointError, HalError

__all__ = ["StaleFp8WeightsError", "Fp8Weight", "fp8_weights", "fp8_slices", "quantise_master_weights",
           "refresh_fp8_weights", "weight_sync_tensors", "load_weight_sync", "Fp8Loader", "check_fresh"]


class StaleFp8WeightsError(HalError):
    """An FP8 linear's master weight changed since its quantised form was computed or loaded."""


@dataclass(frozen=True)
class Fp8Weight:
    """One quantised weight of a model: the master parameter ``module.<attr>`` (model dtype, (N, K) or an
    expert stack (E, N, K)) and its buffers ``<attr>_fp8`` (e4m3) and ``<attr>_scale_inv`` (fp32 block
    scales, (N/B, K/B) or (E, N/B, K/B)). ``name`` is the master parameter's name in the model."""

    name: str
    module: torch.nn.Module
    attr: str

    @property
    def master(self) -> torch.Tensor:
        return getattr(self.module, self.attr)

    @property
    def fp8(self) -> torch.Tensor:
        return getattr(self.module, self.attr + "_fp8")

    @property
    def scale_inv(self) -> torch.Tensor:
        return getattr(self.module, self.attr + "_scale_inv")

    @property
    def fresh(self) -> bool:
        """Whether the buffers were set from (or loaded with) the master weight's current version."""
        return self.module.master_versions[self.attr] == self.master._version

    @property
    def never_set(self) -> bool:
        return self.module.master_versions[self.attr] is None

    def mark_fresh(self) -> None:
        self.module.master_versions[self.attr] = self.master._version


def fp8_weights(model) -> list[Fp8Weight]:
    """Every quantised weight (each Fp8Linear's, each Fp8Experts' two), in module order."""
    from hal.model.model import Fp8Experts, Fp8Linear

    out = []
    for name, m in model.named_modules():
        if isinstance(m, Fp8Linear):
            out.append(Fp8Weight(f"{name}.weight", m, "weight"))
        elif isinstance(m, Fp8Experts):
            out += [Fp8Weight(f"{name}.{attr}", m, attr) for attr in ("w13_weight", "w2_weight")]
    return out


Index = slice | tuple[int, slice]     # rows of a weight, or (expert, rows) of an expert stack


def fp8_slices(model) -> dict[str, tuple[Fp8Weight, Index]]:
    """HF tensor prefix (``model.layers.0.self_attn.q_proj``, ``model.layers.1.mlp.experts.3.up_proj``) ->
    (its Fp8Weight, its index there: a row slice, or (expert, row slice) in an expert stack): the HF layout
    of ``checkpoint.hf_slices`` for every quantised master weight."""
    from hal.model.checkpoint import hf_slices

    by_master = {id(w.master): w for w in fp8_weights(model)}
    return {name.removesuffix(".weight"): (by_master[id(param)], index)
            for name, (param, index) in hf_slices(model).items() if id(param) in by_master}


def scale_rows(rows: slice, block_rows: int) -> slice:
    """The rows of a merged weight's scale grid that hold the scales of weight rows ``rows`` (which
    start, and end, on a block row)."""
    stop = None if rows.stop is None else rows.stop // block_rows
    return slice((rows.start or 0) // block_rows, stop)


def scale_index(index, block_rows: int):
    """``fp8_slices``' index of a weight -> the index of its scales (the expert stays, the rows scale)."""
    if isinstance(index, tuple):
        expert, rows = index
        return expert, scale_rows(rows, block_rows)
    return scale_rows(index, block_rows)


def quantise_master_weights(model, spec: Fp8 | None = None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Master parameter name -> (e4m3 weight, fp32 scale_inv) of every quantised weight:
    ``hal.fp8.quantise_weight_blocks`` of its master weight under the contract's [fp8]. The one function
    behind ``refresh_fp8_weights`` and ``weight_sync_tensors``."""
    spec = spec or model.fp8_spec()
    with torch.no_grad():
        return {w.name: f8.quantise_weight_blocks(w.master.detach(), spec) for w in fp8_weights(model)}


def _set(w: Fp8Weight, q: torch.Tensor, scale_inv: torch.Tensor) -> None:
    w.fp8.copy_(q)
    w.scale_inv.copy_(scale_inv)
    w.mark_fresh()


def refresh_fp8_weights(model) -> None:
    """Recompute every FP8 linear's quantised form from its master weight (call it after each
    ``optimizer.step()``; a no-op for a model without FP8 linears)."""
    if model.config.fp8 is None:
        return
    quantised = quantise_master_weights(model)
    with torch.no_grad():
        for w in fp8_weights(model):
            _set(w, *quantised[w.name])


def weight_sync_tensors(model) -> list[tuple[str, torch.Tensor]]:
    """What a trainer sends a rollout engine, under HF names (DeepSeek's checkpoint format): each FP8
    projection part as ``<name>.weight`` e4m3 + ``<name>.weight_scale_inv`` fp32 from
    ``quantise_master_weights``, every other parameter (embedding, norms, lm_head, biases) as it is."""
    from hal.model.checkpoint import hf_slices

    quantised = quantise_master_weights(model)
    block_rows = model.config.fp8.weight_block[0]
    out = []
    fp8_names = set()
    for prefix, (w, index) in fp8_slices(model).items():
        q, scale_inv = quantised[w.name]
        out.append((prefix + ".weight", q[index].contiguous()))
        out.append((prefix + ".weight_scale_inv", scale_inv[scale_index(index, block_rows)].contiguous()))
        fp8_names.add(prefix + ".weight")
    for name, (param, rows) in hf_slices(model).items():
        if name not in fp8_names:
            out.append((name, param[rows].detach().contiguous()))
    return out


def load_weight_sync(model, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """The rollout side of a weight sync: store ``weight_sync_tensors``' payload in ``model``, the fp8
    weights and scales as they are. Returns the number of tensors loaded; a missing, unexpected or
    misshapen tensor raises ``CheckpointError``."""
    from hal.model.checkpoint import hf_slices

    loader = Fp8Loader(model, "weight sync")
    targets = hf_slices(model)
    filled = set()
    with torch.no_grad():
        for name, tensor in tensors:
            if loader.take(name, tensor):
                filled.add(name)
                continue
            if name not in targets:
                raise CheckpointError(f"weight sync: unexpected tensor {name}")
            param, rows = targets[name]
            if tuple(tensor.shape) != tuple(param[rows].shape):
                raise CheckpointError(f"weight sync: {name} has shape {tuple(tensor.shape)}, expected "
                                      f"{tuple(param[rows].shape)}")
            param[rows].copy_(tensor.to(param.dtype))
            filled.add(name)
        missing = sorted(set(targets) - filled - loader.weight_names)
        if missing:
            raise CheckpointError(f"weight sync: missing tensors {missing[:8]}")
        loader.finish()
    return len(filled)


class Fp8Loader:
    """Collects a DeepSeek-style checkpoint's FP8 tensors (``<name>.weight`` e4m3 and
    ``<name>.weight_scale_inv`` fp32 (ceil(N/B), ceil(K/B))) into the model's Fp8Linears, as stored;
    ``finish`` checks that every part got both and sets each master weight to the dequantisation."""

    def __init__(self, model, source: str):
        self.model, self.source = model, source
        self.slices = fp8_slices(model) if model.config.fp8 is not None else {}
        self.weight_names = {p + ".weight" for p in self.slices}
        self.got: set[str] = set()
        if self.slices:
            model.fp8_spec()        # refuses a contract without [fp8] or with another block size, first
            self.block = tuple(model.config.fp8.weight_block)

    def take(self, name: str, tensor: torch.Tensor) -> bool:
        """Store ``tensor`` if it is an FP8 weight or scale (True), else leave it to the caller (False)."""
        prefix, _, kind = name.rpartition(".")
        if prefix not in self.slices or kind not in ("weight", "weight_scale_inv"):
            return False
        w, index = self.slices[prefix]
        if kind == "weight":
            target = w.fp8[index]
            if tensor.dtype != torch.float8_e4m3fn:
                raise CheckpointError(f"{self.source}: {name} is {tensor.dtype}; the config's quantization_config "
                                      f"(fp8, e4m3) makes it an FP8 linear, whose weight must be stored as "
                                      f"torch.float8_e4m3fn with its {prefix}.weight_scale_inv")
        else:
            target = w.scale_inv[scale_index(index, self.block[0])]
            if tensor.dtype != torch.float32:
                raise CheckpointError(f"{self.source}: {name} is {tensor.dtype}; expected float32 (one scale per "
                                      f"{self.block[0]} x {self.block[1]} block)")
        if tuple(tensor.shape) != tuple(target.shape):
            what = f"(ceil(N/{self.block[0]}), ceil(K/{self.block[1]})) = {tuple(target.shape)}" \
                if kind == "weight_scale_inv" else f"{tuple(target.shape)} from config.json"
            raise CheckpointError(f"{self.source}: {name} has shape {tuple(tensor.shape)}, expected {what}"
                                  + (f" for weight_block_size {list(self.block)}" if kind != "weight" else ""))
        target.copy_(tensor.to(target.device))
        self.got.add(name)
        return True

    def finish(self) -> None:
        missing = sorted(p + "." + kind for p in self.slices for kind in ("weight", "weight_scale_inv")
                         if p + "." + kind not in self.got)
        if missing:
            scales = [m for m in missing if m.endswith(".weight_scale_inv") and m[:-len("_scale_inv")] in self.got]
            hint = f" ({scales[0]} is missing although its fp8 weight is there: every FP8 weight needs its " \
                   f"block scales)" if scales else ""
            raise CheckpointError(f"{self.source}: missing FP8 tensors {missing[:8]}{hint}")
        spec = self.model.fp8_spec()
        with torch.no_grad():
            for w in fp8_weights(self.model):
                w.master.copy_(f8.dequantise_weight_blocks(w.fp8, w.scale_inv, spec).to(w.master.dtype))
                w.mark_fresh()


def check_fresh(model) -> None:
    """Raise ``StaleFp8WeightsError`` if a master weight changed since its quantised form was set."""
    stale = [w.name for w in fp8_weights(model) if not w.fresh]
    if stale:
        never = [w.name for w in fp8_weights(model) if w.never_set]
        why = "were never set (construct the model with DecoderLM.random or load_pretrained)" if never else \
            "changed since their FP8 weights were computed (optimizer.step()?)"
        raise StaleFp8WeightsError(f"FP8 weights {stale[:4]}{' ...' if len(stale) > 4 else ''}: the master weights "
                                   f"{why}; the forward would use stale FP8 weights. Call "
                                   f"hal.model.fp8.refresh_fp8_weights(model) (model.refresh_fp8_weights()) after "
                                   f"each optimizer step, as the weight sync quantises them")
