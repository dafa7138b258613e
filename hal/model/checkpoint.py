"""Local Hugging Face checkpoints (config.json + *.safetensors) <-> the vLLM weight layout.

HF stores q_proj / k_proj / v_proj and gate_proj / up_proj separately (and every expert of an MoE
layer on its own); the model (like vLLM) holds them merged as qkv_proj = [q | k | v] and
gate_up_proj = [gate | up] along the output rows, and an MoE layer's experts stacked (w13, w2). Loading
copies each HF tensor into its row slice (exact copies, cast to the model dtype when asked);
saving splits them back. Nothing is downloaded: the path must be a local directory.

Block-FP8 checkpoints (DeepSeek-V3's format, ``quantization_config`` quant_method "fp8"): each FP8
projection part is ``<name>.weight`` float8_e4m3fn (N, K) plus ``<name>.weight_scale_inv`` fp32
(ceil(N/128), ceil(K/128)). Loading keeps both bit for bit as what the forward uses and sets the master
weight to their dequantisation (``hal.model.fp8.Fp8Loader``); saving writes the fp8 weights and scales
the forward uses, so a round trip keeps every bit (the master weight's precision beyond its fp8 form is
not part of the format).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from hal.backend import Backend
from hal.model.config import CheckpointError, ModelConfig, read_hf_config
from hal.model.fp8 import Fp8Loader, check_fresh, fp8_slices, scale_index
from hal.model.model import MLP, DecoderLM, MoE

log = logging.getLogger(__name__)

__all__ = ["CheckpointError", "hf_slices", "load_pretrained", "save_pretrained"]


def _safetensors():
    """The ``safetensors`` package (imported here: it is needed only to read or write checkpoints)."""
    try:
        import safetensors
        import safetensors.torch
    except ImportError as exc:
        raise CheckpointError("reading or writing .safetensors needs the `safetensors` package: "
                              "pip install safetensors") from exc
    return safetensors


def hf_slices(model: DecoderLM) -> dict[str, tuple[torch.Tensor, slice]]:
    """Every HF tensor name -> (the model parameter it lives in, its row slice of that parameter)."""
    c = model.config
    q, kv = c.q_size, c.kv_size
    whole = slice(None)
    out: dict[str, tuple[torch.Tensor, slice]] = {"model.embed_tokens.weight": (model.model.embed_tokens.weight, whole),
                                                  "model.norm.weight": (model.model.norm.weight, whole)}
    if model.lm_head is not None:
        out["lm_head.weight"] = (model.lm_head.weight, whole)
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        out[p + "input_layernorm.weight"] = (layer.input_layernorm.weight, whole)
        out[p + "post_attention_layernorm.weight"] = (layer.post_attention_layernorm.weight, whole)
        for kind in ("weight", "bias"):
            merged = getattr(attn.qkv_proj, kind)
            if merged is None:
                continue
            out[p + f"self_attn.q_proj.{kind}"] = (merged, slice(0, q))
            out[p + f"self_attn.k_proj.{kind}"] = (merged, slice(q, q + kv))
            out[p + f"self_attn.v_proj.{kind}"] = (merged, slice(q + kv, q + 2 * kv))
        out[p + "self_attn.o_proj.weight"] = (attn.o_proj.weight, whole)
        if c.qk_norm:
            out[p + "self_attn.q_norm.weight"] = (attn.q_norm.weight, whole)
            out[p + "self_attn.k_norm.weight"] = (attn.k_norm.weight, whole)
        if isinstance(mlp, MoE):
            out.update(_moe_slices(mlp, p + "mlp."))
        else:
            out.update(_mlp_slices(mlp, p + "mlp."))
    return out


def _mlp_slices(mlp: MLP, p: str) -> dict[str, tuple[torch.Tensor, slice]]:
    inter = mlp.down_proj.weight.shape[1]
    return {p + "gate_proj.weight": (mlp.gate_up_proj.weight, slice(0, inter)),
            p + "up_proj.weight": (mlp.gate_up_proj.weight, slice(inter, 2 * inter)),
            p + "down_proj.weight": (mlp.down_proj.weight, slice(None))}


def _moe_slices(mlp: MoE, p: str) -> dict[str, tuple[torch.Tensor, slice | tuple]]:
    """HF stores one gate/up/down per expert; the model holds them stacked, as vLLM's FusedMoE does."""
    w13, w2 = mlp.experts.w13_weight, mlp.experts.w2_weight
    inter = w2.shape[2]
    out: dict[str, tuple[torch.Tensor, slice | tuple]] = {p + "gate.weight": (mlp.gate.weight, slice(None))}
    if mlp.gate.e_score_correction_bias is not None:
        out[p + "gate.e_score_correction_bias"] = (mlp.gate.e_score_correction_bias, slice(None))
    for e in range(w13.shape[0]):
        q = f"{p}experts.{e}."
        out[q + "gate_proj.weight"] = (w13, (e, slice(0, inter)))
        out[q + "up_proj.weight"] = (w13, (e, slice(inter, 2 * inter)))
        out[q + "down_proj.weight"] = (w2, (e, slice(None)))
    if mlp.shared_experts is not None:
        out.update(_mlp_slices(mlp.shared_experts, p + "shared_experts."))
    return out


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index}: cannot read its weight_map ({type(exc).__name__}: {exc}); expected "
                                  f'JSON {{"weight_map": {{tensor name: file name}}}}') from exc
        if not all(isinstance(n, str) for n in names):
            raise CheckpointError(f"{index}: weight_map values must be file names")
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise CheckpointError(f"{index} names {missing[:4]}, which are not in {path}")
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files (only safetensors checkpoints are read; "
                              f"convert a .bin checkpoint with transformers' save_pretrained(safe_serialization=True))")
    return files


def _unreadable(file: Path, exc: Exception) -> CheckpointError:
    size = file.stat().st_size if file.exists() else 0
    found = "an empty file" if size == 0 else f"{size} bytes that are not a complete safetensors file ({exc})"
    return CheckpointError(f"{file}: {found}; expected a safetensors file (truncated download or copy? "
                           f"fetch or save it again)")


def _open_safetensors(safetensors, file: Path):
    # safetensors raises its own SafetensorError (not an OSError) for a bad header, and OSError for I/O
    try:
        return safetensors.safe_open(str(file), framework="pt")
    except (safetensors.SafetensorError, OSError) as exc:
        raise _unreadable(file, exc) from exc


def _read_tensor(f, file: Path, name: str) -> torch.Tensor:
    try:
        return f.get_tensor(name)
    except Exception as exc:   # the header was fine but the data is not (the file changed while read)
        raise CheckpointError(f"{file}: tensor {name} cannot be read ({type(exc).__name__}: {exc}); "
                              f"expected a complete safetensors file: fetch or save it again") from exc


def load_pretrained(path: str | Path, *, dtype: str | torch.dtype | None = None, backend: Backend | None = None,
                    device: torch.device | str | None = None) -> DecoderLM:
    """A ``DecoderLM`` from a local HF checkpoint directory (config.json + safetensors, sharded or not).

    ``dtype`` (default: the checkpoint's ``torch_dtype``) is what the weights are cast to. Missing
    or unexpected tensors and shape mismatches raise ``CheckpointError`` listing the names.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory; expected a local Hugging Face checkpoint directory "
                              f"(config.json + *.safetensors)")
    config = ModelConfig.from_hf(read_hf_config(path), dtype, source=str(path / "config.json"))
    model = DecoderLM(config, backend=backend, device=device)
    targets = hf_slices(model)
    fp8 = Fp8Loader(model, str(path))
    safetensors = _safetensors()
    filled, unexpected = set(), []
    with torch.no_grad():
        for file in _weight_files(path):
            with _open_safetensors(safetensors, file) as f:
                for name in f.keys():
                    if name.endswith(".weight_scale_inv") or name in fp8.weight_names:
                        if not fp8.take(name, _read_tensor(f, file, name)):
                            unexpected.append(name)     # a scale of a tensor that is not an FP8 linear's
                        continue
                    if name not in targets:
                        if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and model.lm_head is None):
                            continue   # recomputed / tied to embed_tokens, as vLLM does
                        unexpected.append(name)
                        continue
                    param, rows = targets[name]
                    tensor = _read_tensor(f, file, name)
                    if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                        raise CheckpointError(f"{file.name}: {name} is stored as {tensor.dtype}, but config.json "
                                              f"makes it a {param.dtype} tensor (FP8 linears need a "
                                              f"quantization_config with quant_method 'fp8', and only the attention "
                                              f"and dense-MLP projections can be FP8); casting it without its "
                                              f"scales would change the model")
                    expected = tuple(param[rows].shape)
                    if tuple(tensor.shape) != expected:
                        raise CheckpointError(f"{file.name}: {name} has shape {tuple(tensor.shape)}, expected "
                                              f"{expected} from config.json")
                    param[rows].copy_(tensor.to(param.dtype))
                    filled.add(name)
    missing = sorted(set(targets) - filled - fp8.weight_names)
    if missing or unexpected:
        raise CheckpointError(f"{path}: missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''}; "
                              f"unexpected tensors {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    fp8.finish()
    log.info("loaded %s (%s, %d tensors) from %s", config.architecture, config.dtype, len(filled), path)
    return model


def save_pretrained(model: DecoderLM, path: str | Path) -> Path:
    """Write ``model`` as a HF checkpoint (config.json + model.safetensors with HF tensor names)."""
    safetensors = _safetensors()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {name: param[rows].detach().to("cpu").contiguous().clone()
               for name, (param, rows) in hf_slices(model).items()}
    if model.config.fp8 is not None:     # the fp8 weights and scales the forward uses, DeepSeek's format
        check_fresh(model)
        block_rows = model.config.fp8.weight_block[0]
        for prefix, (w, index) in fp8_slices(model).items():
            tensors[prefix + ".weight"] = w.fp8[index].detach().to("cpu").contiguous().clone()
            tensors[prefix + ".weight_scale_inv"] = \
                w.scale_inv[scale_index(index, block_rows)].detach().to("cpu").contiguous().clone()
    safetensors.torch.save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(model.config.to_hf(), indent=2) + "\n")
    return path
