"""The architecture of a dense decoder LLM of the Llama / Qwen2 / Qwen3 family, as plain data.

The three families share one block (RMSNorm, GQA attention with neox RoPE, SwiGLU MLP) and differ
only in switches: Qwen2 adds a bias to the merged qkv projection, Qwen3 normalises every query and
key head (RMSNorm over head_dim) before RoPE. ``ModelConfig.from_hf`` reads a Hugging Face
``config.json``; anything it cannot honour exactly (rope scaling, sliding windows, partial rotary,
MLP bias, another activation) is refused with the key that asked for it, never silently ignored.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hal.errors import CheckpointError, UnsupportedError

ARCHITECTURES = ("llama", "qwen2", "qwen3")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_HF_CLASSES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


_REQUIRED = object()


class _HfReader:
    """Typed reads of config.json keys: a missing key or a value of the wrong JSON type is a
    CheckpointError naming the file, the key and what was found (never a KeyError or ValueError)."""

    def __init__(self, hf: dict[str, Any], source: str):
        self.hf, self.source = hf, source

    def _get(self, key: str, default: Any, types: tuple[type, ...], expected: str) -> Any:
        value = self.hf.get(key)
        if value is None:      # absent, or null as some exported configs write it
            if default is _REQUIRED:
                raise CheckpointError(f"{self.source}: key {key!r} is missing; expected {expected} "
                                      f"(a Hugging Face config.json of a Llama / Qwen2 / Qwen3 model)")
            return default
        if isinstance(value, bool) and bool not in types or not isinstance(value, types):
            raise CheckpointError(f"{self.source}: {key} = {json.dumps(value)}: expected {expected}")
        return value

    def integer(self, key: str, default: Any = _REQUIRED) -> int:
        return self._get(key, default, (int,), "an integer")

    def number(self, key: str, default: Any = _REQUIRED) -> float:
        return float(self._get(key, default, (int, float), "a number"))

    def flag(self, key: str, default: bool = False) -> bool:
        return self._get(key, default, (bool,), "true or false")

    def text(self, key: str, default: Any = _REQUIRED) -> str:
        return self._get(key, default, (str,), "a string")

    def table(self, key: str) -> dict[str, Any]:
        return self._get(key, {}, (dict,), "an object")


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The dict in a Hugging Face ``config.json`` (a file, or the checkpoint directory holding it)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path.parent}: no config.json; expected a local Hugging Face checkpoint directory")
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc.strerror})") from exc
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); "
                              f"expected the JSON config.json of a Hugging Face checkpoint") from exc
    except json.JSONDecodeError as exc:
        found = "an empty file" if not exc.doc.strip() else f"invalid JSON ({exc.msg} at line {exc.lineno} " \
                                                           f"column {exc.colno})"
        raise CheckpointError(f"{path}: {found}; expected the JSON config.json of a Hugging Face checkpoint "
                              f"(re-export it with save_pretrained)") from exc
    if not isinstance(hf, dict):
        raise CheckpointError(f"{path}: a JSON {type(hf).__name__}; expected a JSON object of model settings")
    return hf


def dtype_from_name(name: str | torch.dtype) -> torch.dtype:
    """torch dtype of ``"float32"``/``"fp32"``/``"bfloat16"``/``"bf16"`` (or a torch dtype)."""
    if isinstance(name, torch.dtype):
        if name not in _DTYPES.values():
            raise UnsupportedError(f"model dtype {name} is not supported; use float32 or bfloat16")
        return name
    aliases = {"fp32": "float32", "bf16": "bfloat16"}
    key = aliases.get(str(name).replace("torch.", ""), str(name).replace("torch.", ""))
    if key not in _DTYPES:
        raise UnsupportedError(f"model dtype {name!r} is not supported; use float32 or bfloat16")
    return _DTYPES[key]


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and switches of a decoder LLM. Weights use vLLM's layout (see ``hal.model.model``)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False      # Qwen2 (and Llama with attention_bias)
    qk_norm: bool = False       # Qwen3
    dtype: str = "bfloat16"

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise UnsupportedError(f"architecture {self.architecture!r} is not supported; "
                                   f"supported: {', '.join(ARCHITECTURES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position"):
            if int(getattr(self, name)) <= 0:
                raise UnsupportedError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedError(f"model config: num_heads {self.num_heads} is not a multiple of "
                                   f"num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise UnsupportedError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")
        dtype_from_name(self.dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # -- Hugging Face config.json ---------------------------------------------------------------

    @classmethod
    def from_hf(cls, hf: dict[str, Any], dtype: str | torch.dtype | None = None,
                source: str = "config.json") -> "ModelConfig":
        """From a Hugging Face ``config.json`` dict of a Llama, Qwen2 or Qwen3 checkpoint. A missing
        key or a value of the wrong type raises ``CheckpointError``; a setting the model cannot
        honour raises ``UnsupportedError``; ``source`` names the file in both."""
        if not isinstance(hf, dict):
            raise CheckpointError(f"{source}: a JSON {type(hf).__name__}; expected a JSON object of model settings")
        r = _HfReader(hf, source)
        arch = r.text("model_type", None)
        names = r._get("architectures", [], (list,), "a list of class names")
        if arch not in ARCHITECTURES:
            arch = next((_HF_CLASSES[a] for a in names if isinstance(a, str) and a in _HF_CLASSES), None)
        if arch is None:
            raise UnsupportedError(f"{source}: model_type {hf.get('model_type')!r} / architectures "
                                   f"{hf.get('architectures')} is not one of {', '.join(ARCHITECTURES)}")
        act = r.text("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
        rope = r.table("rope_scaling")
        params = r.table("rope_parameters")
        rope_type = rope.get("rope_type", rope.get("type")) or params.get("rope_type", "default")
        if rope_type != "default":
            raise UnsupportedError(f"{source}: rope scaling {rope_type!r} is not supported (only plain RoPE)")
        if r.number("partial_rotary_factor", 1.0) != 1.0:
            raise UnsupportedError(f"{source}: partial_rotary_factor != 1 is not supported")
        if r.flag("mlp_bias"):
            raise UnsupportedError(f"{source}: mlp_bias = true is not supported")
        if r.flag("use_sliding_window"):
            raise UnsupportedError(f"{source}: use_sliding_window = true is not supported")
        heads = r.integer("num_attention_heads")
        hidden = r.integer("hidden_size")
        if dtype is None:
            dtype = r.text("torch_dtype", None) or r.text("dtype", None) or "bfloat16"
        theta = params.get("rope_theta", 10000.0)
        if isinstance(theta, bool) or not isinstance(theta, (int, float)):
            raise CheckpointError(f"{source}: rope_parameters.rope_theta = {json.dumps(theta)}: expected a number")
        return cls(
            architecture=arch,
            vocab_size=r.integer("vocab_size"),
            hidden_size=hidden,
            intermediate_size=r.integer("intermediate_size"),
            num_layers=r.integer("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=r.integer("num_key_value_heads", heads),
            head_dim=r.integer("head_dim", hidden // heads if heads > 0 else 0),
            rms_norm_eps=r.number("rms_norm_eps", 1e-6),
            rope_theta=r.number("rope_theta", float(theta)),
            max_position=r.integer("max_position_embeddings", 4096),
            tie_word_embeddings=r.flag("tie_word_embeddings"),
            qkv_bias=arch == "qwen2" or r.flag("attention_bias"),
            qk_norm=arch == "qwen3",
            dtype=str(dtype_from_name(dtype)).replace("torch.", ""),
        )

    def to_hf(self) -> dict[str, Any]:
        """A Hugging Face ``config.json`` dict describing this model."""
        cls_name = {v: k for k, v in _HF_CLASSES.items()}[self.architecture]
        hf = {
            "architectures": [cls_name],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.dtype,
        }
        if self.architecture == "llama":
            hf["attention_bias"] = self.qkv_bias
        elif self.architecture == "qwen3":
            hf["attention_bias"] = False
        return hf


def tiny_config(architecture: str = "llama", dtype: str | torch.dtype = "float32", **overrides: Any) -> ModelConfig:
    """A tiny model of the family for tests and demos: hidden 64, 2 layers, 4 query / 2 KV heads of
    16, intermediate 128, vocab 128 (Qwen3 ties its embeddings, as its small checkpoints do)."""
    base = dict(architecture=architecture, vocab_size=128, hidden_size=64, intermediate_size=128,
                num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
                rope_theta=10000.0, max_position=512, tie_word_embeddings=architecture == "qwen3",
                qkv_bias=architecture == "qwen2", qk_norm=architecture == "qwen3",
                dtype=str(dtype_from_name(dtype)).replace("torch.", ""))
    base.update(overrides)
    return ModelConfig(**base)
