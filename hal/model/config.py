"""The architecture of a decoder LLM of the Llama / Qwen2 / Qwen3 / Qwen3-MoE family, as plain data.

The families share one block (RMSNorm, GQA attention with neox RoPE, SwiGLU MLP) and differ only in
switches: Qwen2 adds a bias to the merged qkv projection, Qwen3 normalises every query and key head
(RMSNorm over head_dim) before RoPE, Qwen3-MoE is Qwen3 with a mixture-of-experts MLP (``hal.moe``)
in every layer not listed in ``moe_dense_layers``. The MoE block also takes DeepSeek-V3's routing
switches (``scoring_func = "sigmoid"``, ``n_group`` / ``topk_group``, the ``e_score_correction_bias``
of ``topk_method = "noaux_tc"``, ``routed_scaling_factor``, ``n_shared_experts``) under their HF
names: a DeepSeek-style MoE block on Qwen3 attention, a combination no HF architecture ships
(DeepSeek-V3's own MLA attention is not implemented). ``ModelConfig.from_hf`` reads a Hugging Face
``config.json``; anything it cannot honour exactly (rope scaling, sliding windows, partial rotary,
MLP bias, another activation) is refused with the key that asked for it, never silently ignored.

Block FP8 (``Fp8Quantization``, from the ``quantization_config`` DeepSeek-V3 ships: ``quant_method
"fp8"``, ``fmt "e4m3"``, ``weight_block_size [128, 128]``, ``activation_scheme "dynamic"``) makes the
attention and dense-MLP projections FP8 linears (``hal.model.model.Fp8Linear``) and an MoE model's
routed experts FP8 experts (``Fp8Experts``); the embedding, the lm_head, the norms and an MoE router
stay in the model dtype, as DeepSeek's checkpoints keep them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hal.errors import CheckpointError, UnsupportedError

ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3_moe")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_HF_CLASSES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
               "Qwen3MoeForCausalLM": "qwen3_moe"}


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


@dataclass(frozen=True)
class Fp8Quantization:
    """A checkpoint's block-FP8 scheme (HF ``quantization_config``): e4m3 weights with one fp32
    ``weight_scale_inv`` per ``weight_block`` = (rows, columns) block, activations quantised dynamically
    inside each linear. Which bits that gives is the contract's [fp8] section, not this: the model
    refuses to run unless the two agree (``DecoderLM.fp8_spec``)."""

    fmt: str = "e4m3"
    weight_block: tuple[int, int] = (128, 128)
    activation_scheme: str = "dynamic"

    def __post_init__(self):
        object.__setattr__(self, "weight_block", tuple(int(b) for b in self.weight_block))
        if self.fmt != "e4m3":
            raise UnsupportedError(f"quantization_config: fmt {self.fmt!r} is not supported; block-FP8 weights "
                                   f"are e4m3 (float8_e4m3fn), as DeepSeek-V3 ships them")
        if self.activation_scheme != "dynamic":
            raise UnsupportedError(f"quantization_config: activation_scheme {self.activation_scheme!r} is not "
                                   f"supported; only 'dynamic' (a scale per 1 x 128 group of each token, computed "
                                   f"inside the linear from that group alone)")
        if len(self.weight_block) != 2 or min(self.weight_block) <= 0:
            raise UnsupportedError(f"quantization_config: weight_block_size {list(self.weight_block)} must be two "
                                   f"positive integers [rows, columns]")

    @classmethod
    def from_hf(cls, qc: dict[str, Any], source: str = "config.json") -> "Fp8Quantization":
        r = _HfReader(qc, f"{source}: quantization_config")
        method = r.text("quant_method")
        if method != "fp8":
            raise UnsupportedError(f"{source}: quantization_config.quant_method {method!r} is not supported "
                                   f"(only DeepSeek-style block 'fp8')")
        block = r._get("weight_block_size", _REQUIRED, (list,), "[rows, columns], e.g. [128, 128]")
        if len(block) != 2 or not all(isinstance(b, int) and not isinstance(b, bool) for b in block):
            raise CheckpointError(f"{source}: quantization_config.weight_block_size = {json.dumps(block)}: expected "
                                  f"[rows, columns], e.g. [128, 128] (per-tensor FP8 checkpoints are not supported)")
        skipped = r._get("modules_to_not_convert", [], (list,), "a list of module names")
        if skipped:
            raise UnsupportedError(f"{source}: quantization_config.modules_to_not_convert = {json.dumps(skipped)} "
                                   f"is not supported: every attention and dense-MLP projection is FP8 here")
        return cls(fmt=r.text("fmt", "e4m3"), weight_block=tuple(block),
                   activation_scheme=r.text("activation_scheme", "dynamic"))

    def to_hf(self) -> dict[str, Any]:
        return {"quant_method": "fp8", "fmt": self.fmt, "weight_block_size": list(self.weight_block),
                "activation_scheme": self.activation_scheme}


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


KV_CACHE_DTYPES = ("auto", "fp8")


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
    # Mixture of experts (qwen3_moe; 0 experts: a dense MLP in every layer). HF names.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_dense_layers: tuple[int, ...] = ()   # layers with a dense MLP (HF mlp_only_layers, decoder_sparse_step)
    scoring_func: str = "softmax"            # DeepSeek-V3: "sigmoid"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    e_score_correction_bias: bool = False     # DeepSeek-V3 topk_method "noaux_tc"
    n_shared_experts: int = 0                 # shared experts of moe_intermediate_size each, one merged MLP
    # Block FP8 (HF quantization_config): attention and dense-MLP projections are FP8 linears
    fp8: Fp8Quantization | None = None
    # The KV cache of rollout and training attention: "auto" (the activation dtype) or "fp8" (the contract's
    # [fp8].kv_format with its scale rule, hal.fp8.Fp8KVCache). A run-time choice, as vLLM's kv_cache_dtype:
    # not in config.json
    kv_cache_dtype: str = "auto"

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
        object.__setattr__(self, "moe_dense_layers", tuple(int(i) for i in self.moe_dense_layers))
        if self.architecture == "qwen3_moe":
            if self.moe_intermediate_size <= 0:
                raise UnsupportedError(f"model config: qwen3_moe needs moe_intermediate_size > 0, got "
                                       f"{self.moe_intermediate_size}")
            self.routing   # validates the routing switches (hal.moe.Routing)
        elif self.num_experts:
            raise UnsupportedError(f"model config: num_experts = {self.num_experts} needs architecture 'qwen3_moe', "
                                   f"not {self.architecture!r}")
        if self.fp8 is not None:
            self._check_fp8_shapes()
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise UnsupportedError(f"model config: kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                                   f"{self.kv_cache_dtype!r}")

    def _check_fp8_shapes(self) -> None:
        """Every FP8 linear's K is whole blocks (the activation groups), and every merged projection's
        parts (q | k | v, gate | up) start on a block row, so that each HF tensor's own scales are rows of
        the merged scale grid (vLLM's block-FP8 linears require the same)."""
        rows, cols = self.fp8.weight_block
        parts = {"hidden_size (K of qkv_proj, gate_up_proj)": (self.hidden_size, cols),
                 "num_attention_heads * head_dim (K of o_proj)": (self.q_size, cols),
                 "num_attention_heads * head_dim (rows of q_proj)": (self.q_size, rows),
                 "num_key_value_heads * head_dim (rows of k_proj, v_proj)": (self.kv_size, rows)}
        if not self.is_moe or self.moe_dense_layers:
            parts.update({"intermediate_size (K of down_proj)": (self.intermediate_size, cols),
                          "intermediate_size (rows of gate_proj, up_proj)": (self.intermediate_size, rows)})
        if self.is_moe:
            # The routed experts (and the shared ones, one merged MLP of n_shared_experts experts) are FP8
            # too, as in DeepSeek-V3's checkpoints; the router gate is not.
            parts.update({"hidden_size (rows of each expert's down_proj)": (self.hidden_size, rows),
                          "moe_intermediate_size (K of each expert's down_proj)": (self.moe_intermediate_size, cols),
                          "moe_intermediate_size (rows of each expert's gate_proj, up_proj)":
                              (self.moe_intermediate_size, rows)})
        for what, (size, block) in parts.items():
            if size % block:
                raise UnsupportedError(f"model config: {what} = {size} is not a multiple of the FP8 weight block "
                                       f"{block} (quantization_config.weight_block_size {list(self.fp8.weight_block)}); "
                                       f"block-FP8 linears need whole blocks")

    @property
    def is_moe(self) -> bool:
        return self.architecture == "qwen3_moe"

    def moe_layer(self, index: int) -> bool:
        """Whether layer ``index`` has a mixture-of-experts MLP (else a dense one)."""
        return self.is_moe and index not in self.moe_dense_layers

    @property
    def routing(self):
        """The MoE routing scheme (``hal.moe.Routing``) of an MoE model."""
        from hal.moe import Routing

        return Routing(num_experts=self.num_experts, top_k=self.num_experts_per_tok, scoring=self.scoring_func,
                       renormalize=self.norm_topk_prob, num_groups=self.n_group, topk_groups=self.topk_group,
                       scaling=self.routed_scaling_factor)

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
        moe = _read_moe(r, arch, r.integer("num_hidden_layers"))
        theta = params.get("rope_theta", 10000.0)
        if isinstance(theta, bool) or not isinstance(theta, (int, float)):
            raise CheckpointError(f"{source}: rope_parameters.rope_theta = {json.dumps(theta)}: expected a number")
        qc = r.table("quantization_config")
        fp8 = Fp8Quantization.from_hf(qc, source) if qc else None
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
            qk_norm=arch in ("qwen3", "qwen3_moe"),
            dtype=str(dtype_from_name(dtype)).replace("torch.", ""),
            fp8=fp8,
            **moe,
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
        elif self.architecture in ("qwen3", "qwen3_moe"):
            hf["attention_bias"] = False
        if self.is_moe:
            hf.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                      moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                      mlp_only_layers=list(self.moe_dense_layers), decoder_sparse_step=1)
            deepseek = {"scoring_func": (self.scoring_func, "softmax"), "n_group": (self.n_group, 1),
                        "topk_group": (self.topk_group, 1),
                        "routed_scaling_factor": (self.routed_scaling_factor, 1.0),
                        "n_shared_experts": (self.n_shared_experts, 0)}
            hf.update({key: value for key, (value, default) in deepseek.items() if value != default})
            if self.e_score_correction_bias:
                hf["topk_method"] = "noaux_tc"
        if self.fp8 is not None:
            hf["quantization_config"] = self.fp8.to_hf()
        return hf


def _read_moe(r: _HfReader, arch: str, num_layers: int) -> dict[str, Any]:
    """The MoE fields of a qwen3_moe config.json (HF Qwen3-MoE names, plus DeepSeek-V3's routing
    switches under theirs); {} for a dense architecture."""
    if arch != "qwen3_moe":
        return {}
    step = r.integer("decoder_sparse_step", 1)
    if step < 1:
        raise CheckpointError(f"{r.source}: decoder_sparse_step = {step}: expected an integer >= 1")
    only = r._get("mlp_only_layers", [], (list,), "a list of layer indices")
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise CheckpointError(f"{r.source}: mlp_only_layers = {json.dumps(only)}: expected a list of layer indices")
    # HF Qwen3-MoE: layer i is sparse iff i is not in mlp_only_layers and (i + 1) % step == 0.
    dense = tuple(i for i in range(num_layers) if i in only or (i + 1) % step)
    method = r.text("topk_method", "greedy")
    if method not in ("greedy", "noaux_tc"):
        raise UnsupportedError(f"{r.source}: topk_method {method!r} is not supported (greedy or noaux_tc)")
    if r.integer("shared_expert_intermediate_size", 0):
        raise UnsupportedError(f"{r.source}: shared_expert_intermediate_size (a Qwen2-MoE-style gated shared "
                               f"expert) is not supported; the DeepSeek-style shared experts are n_shared_experts")
    if r.integer("first_k_dense_replace", 0):
        raise UnsupportedError(f"{r.source}: first_k_dense_replace is DeepSeek's; a qwen3_moe config names its "
                               f"dense layers with mlp_only_layers")
    return dict(num_experts=r.integer("num_experts"), num_experts_per_tok=r.integer("num_experts_per_tok"),
                moe_intermediate_size=r.integer("moe_intermediate_size"),
                norm_topk_prob=r.flag("norm_topk_prob", False), moe_dense_layers=dense,
                scoring_func=r.text("scoring_func", "softmax"), n_group=r.integer("n_group", 1),
                topk_group=r.integer("topk_group", 1),
                routed_scaling_factor=r.number("routed_scaling_factor", 1.0),
                e_score_correction_bias=method == "noaux_tc", n_shared_experts=r.integer("n_shared_experts", 0))


def tiny_fp8_config(architecture: str = "llama", dtype: str | torch.dtype = "float32", **overrides: Any) -> ModelConfig:
    """The smallest block-FP8 model of the family: every FP8 linear's K and every merged part's rows
    are whole 128-blocks, so hidden 128, 4 query / 2 KV heads of 64 (head dim 64 is one the cuda
    attention kernels take), intermediate 128 (Qwen3-MoE: experts of intermediate 128); vocab 128,
    2 layers."""
    base = dict(hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=128,
                fp8=Fp8Quantization())
    if architecture == "qwen3_moe":
        base.update(moe_intermediate_size=128)       # 8 experts, 2 per token (tiny_config's)
    base.update(overrides)
    return tiny_config(architecture, dtype, **base)


def tiny_config(architecture: str = "llama", dtype: str | torch.dtype = "float32", **overrides: Any) -> ModelConfig:
    """A tiny model of the family for tests and demos: hidden 64, 2 layers, 4 query / 2 KV heads of
    16, intermediate 128, vocab 128 (Qwen3 ties its embeddings, as its small checkpoints do). Qwen3-MoE:
    8 experts of intermediate 32, 2 per token, renormalised."""
    qwen3 = architecture in ("qwen3", "qwen3_moe")
    base = dict(architecture=architecture, vocab_size=128, hidden_size=64, intermediate_size=128,
                num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
                rope_theta=10000.0, max_position=512, tie_word_embeddings=qwen3,
                qkv_bias=architecture == "qwen2", qk_norm=qwen3,
                dtype=str(dtype_from_name(dtype)).replace("torch.", ""))
    if architecture == "qwen3_moe":
        base.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    base.update(overrides)
    return ModelConfig(**base)
