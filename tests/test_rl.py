"""`hal run`: recipes, the on-policy GRPO loop on the built-in harness, resume, bad recipes
(the same loop with vLLM as the engine: tests/test_vllm.py).

The claim under test: with a contract backend (`reference`) every GRPO step has exactly 0
mismatching response tokens between the rollout's and the trainer's logprobs (k3-KL == 0), while
the stock `torch` baseline on the same recipe does not.
"""

import json
import dataclasses
import warnings
from pathlib import Path

import pytest
import torch
from conftest import HostFact

from hal.backends.reference import ReferenceBackend
from hal.cli import main
from hal.errors import HalError
from hal.rl import RecipeError, load_recipe, run_recipe
from hal.rl.grpo import group_advantages, weights_checksum
from hal.rl.task import DIGIT_BASE, CountUp, EvenToken, TargetToken

ROOT = Path(__file__).resolve().parent.parent
SMOKE = ROOT / "recipes" / "ci-smoke.yaml"
# Fields that depend on the wall clock, not on the computation.
TIMING = {"rollout_s", "train_s", "entropy_s", "sync_s", "rollout_tokens_per_s", "train_tokens_per_s", "resumed"}


def _recipe(tmp_path, *overrides):
    return load_recipe(SMOKE, [f"output_dir={tmp_path / 'out'}", *overrides])


def _numbers(m):
    return {k: v for k, v in m.items() if k not in TIMING}


def test_shipped_recipes_validate():
    engines = {}
    for path in sorted((ROOT / "recipes").glob("*.yaml")):
        if path.stem in ("default", "grpo-h200", "moe"):
            pytest.importorskip("vllm")
        # (the tests run the cuda backend under Triton's interpreter, so the GPU recipe validates here too)
        engines[path.stem] = load_recipe(path, ["output_dir=/nonexistent/hal-rl-test"]).engine
    assert engines == {"ci-smoke": "harness", "default": "vllm", "grpo-h200": "vllm", "harness": "harness",
                       "moe": "vllm"}


def test_vllm_section_is_checked(tmp_path):
    with pytest.raises(RecipeError, match="vllm.gpu_memory_utilization"):
        _recipe(tmp_path, "engine=vllm", "vllm.gpu_memory_utilization=1.5")
    with pytest.raises(RecipeError, match="vllm: unknown key 'gpu_memory'.*'gpu_memory_utilization'"):
        _recipe(tmp_path, "vllm.gpu_memory=0.3")


def test_reference_has_diff_zero_every_step(tmp_path):
    recipe = _recipe(tmp_path, "steps=4", "prompts_per_step=4", "compare=true")
    result = run_recipe(recipe, echo=None)
    ref, base = result["runs"]["reference"], result["runs"]["torch"]
    assert [m["step"] for m in ref] == [1, 2, 3, 4] == [m["step"] for m in base]
    for m in ref:
        assert m["num_tokens"] == 4 * 4 * recipe.max_tokens
        assert m["mismatches"] == 0 and m["k3_kl"] == 0.0 and m["max_abs_diff"] == 0.0
        assert m["std_abs_diff"] == 0.0 and m["max_prob_diff"] == 0.0
        assert m["weights_changed"]          # the engine saw a new set of weights every step
        assert m["entropy"] > 0
    # whether the stock baseline differs depends on this host's kernels: reported, not asserted (the
    # loop's own negative control is the planted backend of the next test)
    warnings.warn(HostFact(f"stock torch baseline on this host: {sum(m['mismatches'] for m in base)} mismatching "
                           f"tokens over 4 GRPO steps"))
    out = tmp_path / "out"
    for name in ("report.md", "summary.json", "k3_kl.png", "max_abs_dlogp.png", "reward.png"):
        assert (out / name).is_file(), name
    assert (out / "reference" / "metrics.jsonl").is_file() and (out / "torch" / "checkpoint.pt").is_file()


def test_speculative_harness_recipe_is_the_plain_run_bit_for_bit(tmp_path):
    """``harness.speculative_tokens`` and ``harness.prefix_caching``: every step diff = 0 against the trainer,
    the step metrics report the drafts and cache hits, and the whole run (rewards, losses, logprob
    comparisons) equals the run without either."""
    spec = run_recipe(_recipe(tmp_path / "spec", "steps=3", "harness.speculative_tokens=3",
                              "harness.prefix_caching=true"), echo=None)
    plain = run_recipe(_recipe(tmp_path / "plain", "steps=3"), echo=None)
    spec_steps, plain_steps = spec["runs"]["reference"], plain["runs"]["reference"]
    assert all(m["mismatches"] == 0 and m["max_abs_diff"] == 0.0 for m in spec_steps)
    assert sum(m["draft_tokens"] for m in spec_steps) > 0 and all(0 <= m["acceptance_rate"] <= 1 for m in spec_steps)
    assert sum(m["cached_tokens"] for m in spec_steps) > 0        # groups of samples_per_prompt share prompts
    named = {"draft_tokens", "accepted_tokens", "acceptance_rate", "cached_tokens", "cached_prompt_tokens",
             "engine"}                                             # and the engine's name
    assert [{k: v for k, v in _numbers(m).items() if k not in named} for m in spec_steps] == \
        [{k: v for k, v in _numbers(m).items() if k not in named} for m in plain_steps]
    with pytest.raises(RecipeError, match="use vllm.speculative_tokens"):
        _recipe(tmp_path, "engine=vllm", "harness.speculative_tokens=2")
    with pytest.raises(RecipeError, match="use harness.speculative_tokens"):
        _recipe(tmp_path, "vllm.speculative_tokens=2")


def test_draft_model_harness_recipe_is_the_plain_run_bit_for_bit(tmp_path):
    """``harness.draft_checkpoint``: drafts from a small model (1 layer, same vocabulary) instead of prompt
    lookup; the run equals the plain one (rewards, losses, logprob comparisons) with diff = 0 every step."""
    from hal.model import DecoderLM
    from hal.model.checkpoint import save_pretrained
    from hal.model.config import tiny_config

    draft = save_pretrained(DecoderLM.random(tiny_config("llama", "float32", vocab_size=16, num_layers=1,
                                                         hidden_size=32, num_heads=2, num_kv_heads=1), seed=5),
                            tmp_path / "draft")
    spec = run_recipe(_recipe(tmp_path / "spec", "steps=2", "harness.speculative_tokens=2",
                              f"harness.draft_checkpoint={draft}"), echo=None)["runs"]["reference"]
    plain = run_recipe(_recipe(tmp_path / "plain", "steps=2"), echo=None)["runs"]["reference"]
    assert all(m["mismatches"] == 0 and m["max_abs_diff"] == 0.0 for m in spec)
    assert sum(m["draft_tokens"] for m in spec) > 0 and "drafts by draft model" in spec[0]["engine"]
    named = {"draft_tokens", "accepted_tokens", "acceptance_rate", "engine"}
    assert [{k: v for k, v in _numbers(m).items() if k not in named} for m in spec] == \
        [{k: v for k, v in _numbers(m).items() if k not in named} for m in plain]
    with pytest.raises(RecipeError, match="set harness.speculative_tokens > 0"):
        _recipe(tmp_path, f"harness.draft_checkpoint={draft}")
    with pytest.raises(RecipeError, match="set vllm.speculative_tokens > 0"):
        _recipe(tmp_path, "engine=vllm", f"vllm.draft_checkpoint={draft}")
    with pytest.raises(RecipeError, match="no such local Hugging Face checkpoint"):
        _recipe(tmp_path, "harness.speculative_tokens=2", f"harness.draft_checkpoint={tmp_path / 'nope'}")


class BatchSplitKBackend(ReferenceBackend):
    """Planted bug (cuBLAS-style split-K by batch size): a linear over more than 16 rows reduces K in
    chunks of 16 instead of the contract's; 16 rows or fewer follow the contract."""

    name = "planted-split-k"

    def __init__(self, contract, device=None):
        super().__init__(contract, device)
        split = dataclasses.replace(contract.gemm, k_chunk=16)
        self._large = ReferenceBackend(dataclasses.replace(contract, gemm=split), device)

    def linear(self, x, weight, bias=None, *, out_dtype=None):
        backend = self._large if x.numel() // x.shape[-1] > 16 else super()
        return backend.linear(x, weight, bias, out_dtype=out_dtype)


@pytest.fixture
def planted_backend_installed(monkeypatch):
    """``planted-split-k`` as if a package registered it: added to the registry's discovered backends."""
    from hal import registry

    found = dict(registry.discover())
    found["planted-split-k"] = registry.BackendInfo("planted-split-k", f"{__name__}:BatchSplitKBackend",
                                                    "tests", "0", cls=BatchSplitKBackend)
    monkeypatch.setattr(registry, "_cache", found)


def test_negative_control_a_batch_dependent_backend_shows_mismatches_every_step(tmp_path, planted_backend_installed):
    """The loop's comparison can fail on every host: the trainer's packed forward (> 16 rows) splits K
    otherwise than the rollout's decode steps (<= 16 rows: max_batch_tokens is 16)."""
    recipe = _recipe(tmp_path, "steps=2", "backend=planted-split-k")
    runs = run_recipe(recipe, echo=None)["runs"]
    assert all(m["mismatches"] > 0 and m["max_abs_diff"] > 0 for m in runs["planted-split-k"])


def test_resume_continues_bitwise_like_an_uninterrupted_run(tmp_path):
    full = run_recipe(load_recipe(SMOKE, [f"output_dir={tmp_path / 'full'}", "steps=4", "checkpoint_every=2"]),
                      echo=None)["runs"]["reference"]
    # A crash during step 4 of a longer run: the checkpoint is at step 2 and metrics.jsonl already
    # holds step 3 (its line is dropped on resume and the step re-run from the checkpoint).
    run_recipe(load_recipe(SMOKE, [f"output_dir={tmp_path / 'part'}", "steps=2"]), echo=None)
    with (tmp_path / "part" / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "lost": true}\n')
    resumed = run_recipe(load_recipe(SMOKE, [f"output_dir={tmp_path / 'part'}", "steps=4", "checkpoint_every=2",
                                             "resume=true"]), echo=None)["runs"]["reference"]
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]             # step 3 re-run once, not twice
    first = resumed[2]
    assert first["resumed"] and first["mismatches"] == 0 and first["k3_kl"] == 0.0
    assert not any(m["resumed"] for m in resumed[:2] + resumed[3:])
    # Same prompts, samples, weights and optimizer state: every number equals the uninterrupted run's.
    assert [_numbers(m) for m in resumed] == [_numbers(m) for m in full]


def test_local_hf_checkpoint_model(tmp_path):
    from hal.model import DecoderLM, save_pretrained, tiny_config

    save_pretrained(DecoderLM.random(tiny_config("qwen3", "float32", vocab_size=16), seed=1), tmp_path / "ckpt")
    recipe = _recipe(tmp_path, "steps=2", f"model.checkpoint={tmp_path / 'ckpt'}", "model.overrides={}")
    metrics = run_recipe(recipe, echo=None)["runs"]["reference"]
    assert [m["mismatches"] for m in metrics] == [0, 0]


def test_resume_refuses_a_changed_recipe(tmp_path):
    run_recipe(_recipe(tmp_path, "steps=2"), echo=None)
    with pytest.raises(RecipeError, match="learning_rate"):
        run_recipe(_recipe(tmp_path, "steps=3", "resume=true", "learning_rate=0.5"), echo=None)


@pytest.mark.parametrize("overrides, message", [
    (["lr=0.1"], "unknown key 'lr'"),
    (["model.seeed=1"], "model: unknown key 'seeed' \\(did you mean 'seeed' -> 'seed'\\?\\)"),
    (["steps=ten"], "steps = 'ten': expected an integer"),
    (["backend=nosuch"], "no backend named 'nosuch'"),
    (["backend=ascend"], "'ascend' is installed but not available here"),
    (["model.checkpoint=/nonexistent/qwen3"], "no such local Hugging Face checkpoint"),
    (["engine=vllm"], "head_dim 16.*vLLM's CPU attention takes head sizes 32, 64"),
    (["engine=vllm", "model.overrides={vocab_size: 16, head_dim: 32}", "temperature=0.5"],
     "use temperature: 1.0 with engine: vllm"),
    (["engine=sglang"], "unknown rollout engine"),
    (["resume=true"], "no checkpoint at"),
    (["compare=true", "baseline=nosuch"], "no backend named 'nosuch'"),
    (["task.name=chess"], "unknown task"),
    (["model.overrides={vocab_size: 8}"], "vocab_size >= 12"),
    (["samples_per_prompt=1"], "at least 2 samples"),
    (["steps"], "expected KEY=VALUE"),
    (["steps=-3"], "steps = -3: must be >= 1"),
    ([f"seed={2**64}"], "seed = 18446744073709551616: out of range"),
    (["seed=-1"], "seed = -1: must be >= 0"),
    (["model.overrides={vocab_size: abc}"], "model.overrides.vocab_size = 'abc': expected an integer"),
    (["model.overrides={vocab_size: 16, head_dim: 15}"], "head_dim must be even"),
    (["learning_rate=.inf"], "learning_rate = inf: expected a finite number"),
    (["harness.preempt_prob=1.5"], "harness.preempt_prob = 1.5: .* must be in \\[0, 1\\)"),
    (["task.prompt_len=600"], "prompt_len \\+ max_tokens \\(600 \\+ 4\\) exceeds the model's max_position 512"),
])
def test_bad_recipes_fail_before_any_work_and_write_nothing(tmp_path, overrides, message):
    out = tmp_path / "out"
    with pytest.raises(RecipeError, match=message):
        load_recipe(SMOKE, [f"output_dir={out}", *overrides])
    assert not out.exists()


def test_a_backend_that_cannot_run_the_model_fails_before_writing(tmp_path, monkeypatch):
    from hal.backends.reference import ReferenceBackend
    from hal.errors import UnsupportedError

    def refuse(self, *args, **kwargs):
        raise UnsupportedError("attention: head dim must be one of (64, 128)")

    monkeypatch.setattr(ReferenceBackend, "attention", refuse)
    recipe = _recipe(tmp_path, "steps=2")
    with pytest.raises(RecipeError, match="cannot run this recipe's model .*head dim must be one of"):
        run_recipe(recipe, echo=None)
    assert not (tmp_path / "out").exists()


def test_cli_bad_recipe_exit_2_and_nothing_written(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["run", str(SMOKE), f"output_dir={out}", "engine=sglang"]) == 2
    assert "unknown rollout engine; use one of harness, vllm" in capsys.readouterr().err
    assert not out.exists()
    assert main(["run", str(tmp_path / "missing.yaml")]) == 2


def test_cli_run_prints_progress_and_refuses_to_overwrite(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["run", str(SMOKE), f"output_dir={out}", "steps=2"]) == 0
    printed = capsys.readouterr().out
    assert "[reference] step   2/2" in printed and "diff = 0" in printed and "k3-KL 0" in printed
    assert (out / "metrics.jsonl").read_text().count("\n") == 2
    assert main(["run", str(SMOKE), f"output_dir={out}", "steps=2"]) == 2    # already holds a run
    assert main(["run", str(SMOKE), f"output_dir={out}", "steps=2", "overwrite=true", "--quiet"]) == 0


def test_overrides_are_typed_and_dotted(tmp_path):
    r = _recipe(tmp_path, "steps=5", "model.seed=3", "clip=null", "learning_rate=1e-2", "backend=torch")
    assert (r.steps, r.model.seed, r.clip, r.learning_rate, r.backend) == (5, 3, None, 0.01, "torch")


def test_tasks_and_advantages():
    d = lambda *xs: [DIGIT_BASE + x for x in xs]
    assert CountUp(3).reward(d(1, 2, 3), d(4, 5, 6, 7)) == 1.0
    assert CountUp(3).reward(d(1, 2, 9), d(0, 5)) == 0.5              # 9 -> 0 wraps, 0 -> 5 does not
    assert TargetToken(3, target=5).reward(d(1), [5, 1, 5, 5]) == 0.75
    assert EvenToken(3).reward(d(1), [4, 7, 100000, 3]) == 0.5 and EvenToken(3).reward(d(1), []) == 0.0
    assert CountUp(4).prompts(0, 7, 3) == CountUp(4).prompts(0, 7, 3) != CountUp(4).prompts(0, 8, 3)
    adv = group_advantages(torch.tensor([[0.0, 1.0], [0.5, 0.5]]))
    assert adv.tolist()[2:] == [0.0, 0.0] and adv[0] < 0 < adv[1]


def test_weights_checksum_sees_in_place_updates():
    p = torch.nn.Linear(3, 2)
    before = weights_checksum(p)
    with torch.no_grad():
        p.weight[0, 0] += 1e-7
    assert weights_checksum(p) != before


# -- `hal run` never loses or silently corrupts data ---------------------------------------------

def _files(directory):
    """Every file under ``directory`` (but the lock file) with its bytes."""
    return {p.relative_to(directory): p.read_bytes() for p in sorted(Path(directory).rglob("*"))
            if p.is_file() and p.name != ".hal-run.lock"}


@pytest.mark.parametrize("contents", [b"- steps: 3\n- seed: 1\n", b"42\n", b"false\n", b"\x89PNG\r\n\x1a\n\xff\xfe\x00"])
def test_cli_recipe_file_that_is_not_a_mapping_is_one_line_error(tmp_path, capsys, contents):
    path = tmp_path / "bad.yaml"
    path.write_bytes(contents)
    assert main(["run", str(path), f"output_dir={tmp_path / 'out'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "expected a mapping of keys" in err or "not a text file" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("engine", ["harness", "vllm"])
@pytest.mark.parametrize("config", ['{"hidden_size": ', '[1, 2]', '{"architectures": ["LlamaForCausalLM"]}'])
def test_cli_checkpoint_with_an_unusable_config_json_is_one_line_error(tmp_path, capsys, config, engine):
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(config)
    assert main(["run", str(SMOKE), f"output_dir={tmp_path / 'out'}", f"model.checkpoint={checkpoint}",
                 "model.overrides={}", f"engine={engine}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "config.json" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("override", [f"seed={2**63}", "model.overrides={vocab_size: abc}", "steps=-1",
                                      "model.seed=-5", "harness.page_size=0", "temperature=.nan"])
def test_cli_out_of_range_or_mistyped_override_is_one_line_error(tmp_path, capsys, override):
    assert main(["run", str(SMOKE), f"output_dir={tmp_path / 'out'}", override]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hal: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("bad, message", [("harness.preempt_prob=1.5", "preempt_prob"),
                                          ("task.prompt_len=600", "max_position")])
def test_overwrite_deletes_nothing_when_the_new_recipe_is_refused(tmp_path, bad, message):
    run_recipe(_recipe(tmp_path, "steps=2"), echo=None)
    before = _files(tmp_path / "out")
    assert {"metrics.jsonl", "checkpoint.pt"} <= {p.name for p in before}
    with pytest.raises(RecipeError, match=message):
        run_recipe(_recipe(tmp_path, "steps=2", "overwrite=true", bad), echo=None)
    assert _files(tmp_path / "out") == before


def test_a_second_concurrent_run_into_the_same_output_dir_is_refused(tmp_path):
    import threading

    started, release, errors = threading.Event(), threading.Event(), []

    def first_run():
        def hold(line):                     # the first run's progress: park it after step 1
            started.set()
            release.wait(60)
        try:
            run_recipe(_recipe(tmp_path, "steps=2"), echo=hold)
        except Exception as exc:            # reported below, not lost in the thread
            errors.append(exc)

    thread = threading.Thread(target=first_run)
    thread.start()
    try:
        assert started.wait(60)
        with pytest.raises(RecipeError, match="in use by another `hal run`"):
            run_recipe(_recipe(tmp_path, "steps=2", "overwrite=true", "seed=1"), echo=None)
    finally:
        release.set()
        thread.join(60)
    assert not errors
    lines = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]       # one run's lines, not interleaved


def test_the_lock_dies_with_a_killed_run(tmp_path):
    import signal
    import subprocess
    import sys

    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom hal.rl.runner import output_dir_lock\n"
                               "with output_dir_lock(sys.argv[1]):\n    print('locked', flush=True)\n    time.sleep(120)",
                               str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RecipeError, match=f"in use by another `hal run` \\(pid {holder.pid} holds"):
            run_recipe(_recipe(tmp_path, "steps=1"), echo=None)
    finally:
        holder.send_signal(signal.SIGKILL)         # a crash: no finally, no cleanup in the holder
        holder.wait()
    assert [m["step"] for m in run_recipe(_recipe(tmp_path, "steps=1"), echo=None)["runs"]["reference"]] == [1]


def test_a_users_recipe_in_output_dir_is_never_overwritten(tmp_path):
    from hal.rl.recipe import RESOLVED_RECIPE

    out = tmp_path / "out"
    out.mkdir()
    mine = out / "recipe.yaml"
    mine.write_text("# my recipe\n" + SMOKE.read_text())
    text = mine.read_bytes()
    run_recipe(load_recipe(mine, [f"output_dir={out}", "steps=1"]), echo=None)
    assert mine.read_bytes() == text
    # The resolved recipe hal wrote is itself a recipe: resume from it.
    resolved = out / RESOLVED_RECIPE
    assert "fingerprint" in resolved.read_text()
    run_recipe(load_recipe(resolved, ["steps=2", "resume=true"]), echo=None)
    assert "steps: 2" in resolved.read_text() and mine.read_bytes() == text
    # A user's file under the resolved recipe's name is refused, not overwritten.
    user = tmp_path / "other"
    user.mkdir()
    (user / RESOLVED_RECIPE).write_text(SMOKE.read_text())
    with pytest.raises(RecipeError, match="not a file hal wrote"):
        load_recipe(user / RESOLVED_RECIPE, [f"output_dir={user}"])
    assert (user / RESOLVED_RECIPE).read_text() == SMOKE.read_text()


def test_a_flipped_byte_in_the_adam_state_is_refused_on_resume(tmp_path):
    import io

    run_recipe(_recipe(tmp_path, "steps=2"), echo=None)
    path = tmp_path / "out" / "checkpoint.pt"
    data = bytearray(path.read_bytes())
    payload = bytes(data[data.index(b"PK\x03\x04"):])           # the torch.save zip, whatever precedes it
    state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=False)
    adam = next(iter(state["optimizer"]["state"].values()))["exp_avg_sq"]
    raw = adam.contiguous().view(torch.uint8).numpy().tobytes()
    assert data.count(raw) == 1
    data[data.index(raw) + len(raw) // 2] ^= 0x10                 # one bit of one Adam second moment
    path.write_bytes(bytes(data))
    metrics = (tmp_path / "out" / "metrics.jsonl").read_bytes()
    with pytest.raises(HalError, match="checkpoint.pt is corrupt"):      # grpo.CheckpointError
        run_recipe(_recipe(tmp_path, "steps=3", "resume=true"), echo=None)
    assert (tmp_path / "out" / "metrics.jsonl").read_bytes() == metrics


def test_a_checkpoint_from_before_the_device_digest_still_resumes_and_is_still_checked(tmp_path):
    """Checkpoints written before hal.digest record the host sha256 of the weights and no checksum kind: they
    resume (checked the old way), and one whose recorded checksum does not match its weights is refused."""
    from hal.api import create_backend
    from hal.rl.engines import host_weights_checksum
    from hal.rl.grpo import build_model, load_checkpoint, save_checkpoint

    recipe = _recipe(tmp_path, "steps=2")
    run_recipe(recipe, echo=None)
    path = tmp_path / "out" / "checkpoint.pt"
    state = load_checkpoint(path)
    assert state["weights_checksum_kind"] == "hal.digest-v1"
    model = build_model(recipe, create_backend(recipe.backend, recipe.contract))
    model.load_state_dict(state["model"])
    old = {k: v for k, v in state.items() if k != "weights_checksum_kind"}
    save_checkpoint(path, dict(old, weights_checksum=host_weights_checksum(model)))
    resumed = run_recipe(_recipe(tmp_path, "steps=3", "resume=true"), echo=None)["runs"]["reference"]
    assert [m["step"] for m in resumed] == [1, 2, 3] and resumed[2]["resumed"] and resumed[2]["mismatches"] == 0
    # negative control: the old kind with a checksum of other weights
    state = load_checkpoint(path)
    save_checkpoint(path, dict({k: v for k, v in state.items() if k != "weights_checksum_kind"},
                               weights_checksum=host_weights_checksum(torch.nn.Linear(2, 2))))
    with pytest.raises(HalError, match="restored weights' checksum differs"):
        run_recipe(_recipe(tmp_path, "steps=4", "resume=true"), echo=None)


def test_a_partial_last_metrics_line_is_dropped_on_resume_with_a_warning(tmp_path, caplog):
    run_recipe(_recipe(tmp_path, "steps=2"), echo=None)         # checkpoint at step 2
    metrics = tmp_path / "out" / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    metrics.write_text("".join(lines) + '{"step": 3, "backend": "refer')    # killed while writing step 3
    with caplog.at_level("WARNING", logger="hal.rl"):
        resumed = run_recipe(_recipe(tmp_path, "steps=3", "resume=true"), echo=None)["runs"]["reference"]
    assert "dropping its last line" in caplog.text
    assert [m["step"] for m in resumed] == [1, 2, 3] and resumed[2]["resumed"]
    # A damaged line that is not the last one is an error, never silently dropped.
    metrics.write_text(lines[0] + "{garbage\n" + lines[1])
    with pytest.raises(HalError, match="line 2 is not valid JSON"):
        run_recipe(_recipe(tmp_path, "steps=3", "resume=true"), echo=None)


def test_resume_under_another_contract_fingerprint_is_refused(tmp_path, monkeypatch):
    from hal.errors import ContractMismatchError

    first = run_recipe(_recipe(tmp_path, "steps=2"), echo=None)["runs"]["reference"]
    variant = tmp_path / "contracts" / "bf16-dense-v1.toml"     # same name, one value changed
    variant.parent.mkdir()
    text = (ROOT / "contracts" / "bf16-dense-v1.toml").read_text()
    assert text.count("kv_chunk = 64\n") == 1
    variant.write_text(text.replace("kv_chunk = 64\n", "kv_chunk = 32\n"))
    monkeypatch.setenv("HAL_CONTRACT", str(variant))
    before = _files(tmp_path / "out")
    with pytest.raises(ContractMismatchError, match="fingerprint"):
        run_recipe(_recipe(tmp_path, "steps=3", "resume=true"), echo=None)
    assert _files(tmp_path / "out") == before
    monkeypatch.delenv("HAL_CONTRACT")
    from hal.contract import load_contract

    assert first[0]["contract_fingerprint"] == load_contract("bf16-dense-v1").fingerprint
    assert load_contract(str(variant)).fingerprint != first[0]["contract_fingerprint"]


def test_resume_with_fewer_steps_than_the_checkpoint_is_refused(tmp_path):
    run_recipe(_recipe(tmp_path, "steps=2"), echo=None)
    before = _files(tmp_path / "out")
    with pytest.raises(RecipeError, match="steps = 1 but the checkpoint .* is at step 2"):
        run_recipe(_recipe(tmp_path, "steps=1", "resume=true"), echo=None)
    assert _files(tmp_path / "out") == before


def test_a_diverged_run_stops_naming_the_step(tmp_path):
    with pytest.raises(HalError, match="step 2: the run diverged"):      # grpo.DivergedError
        run_recipe(_recipe(tmp_path, "steps=3", "learning_rate=1e30"), echo=None)
    # Step 1 is recorded, the diverged step is not.
    assert [json.loads(line)["step"] for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()] == [1]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_and_inf_never_count_as_a_match(bad):
    from hal.metrics import compare_logprobs

    good = torch.tensor([-0.5, -1.25, -2.0])
    assert compare_logprobs(good, good.clone()).mismatches == 0            # control: equal finite values match
    same_bad = good.clone()
    same_bad[1] = bad
    both = compare_logprobs(same_bad, same_bad.clone())                   # NaN vs NaN, inf vs inf
    one = compare_logprobs(same_bad, good)
    for c in (both, one):
        assert c.mismatches == 1 and not c.identical
        assert not c.max_abs_diff == 0.0                                  # nan or inf, never 0


def test_safetensors_is_a_runtime_dependency():
    import sys

    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.replace(" ", "").startswith("safetensors") for d in deps)


def test_response_entropy_in_row_slices_is_the_fp64_entropy_of_every_response_token(monkeypatch):
    """response_entropy runs its fp64 log-softmax in slices of rows (the whole batch ran an H200 out of
    memory at vocab 151936); the mean over every response token must not depend on the slicing."""
    from types import SimpleNamespace

    from hal.rl import grpo

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 50, generator=g) * 3
    completions = [SimpleNamespace(prompt=(1, 2), sequence=(1, 2, 3, 4, 5)),     # 3 response tokens
                   SimpleNamespace(prompt=(1,), sequence=(1, 6, 7, 8, 9))]        # 4 response tokens
    model = SimpleNamespace(device="cpu", forward_train=lambda ids, lens, logits_rows: logits[:len(logits_rows)])
    logp = torch.log_softmax(logits.double() / 0.7, dim=-1)
    oracle = float(-(logp.exp() * logp).sum(-1).mean())
    for rows in (1024, 3, 1):
        monkeypatch.setattr(grpo, "ENTROPY_ROWS", rows)
        assert abs(grpo.response_entropy(model, completions, 0.7) - oracle) <= 1e-12 * abs(oracle)
    # negative control: dropping a slice (the last row) changes the mean
    monkeypatch.setattr(grpo, "ENTROPY_ROWS", 3)
    short = SimpleNamespace(device="cpu", forward_train=lambda ids, lens, logits_rows: logits[:6])
    assert abs(grpo.response_entropy(short, completions, 0.7) - oracle) > 1e-6


def test_even_token_trains_a_random_large_vocabulary_model_where_count_up_cannot(tmp_path):
    """A random model over 4096 tokens: count_up's rewards are 0 in every group, so every advantage is 0
    and no step changes a weight (the diff = 0 checks would then see the same weights every step: the
    negative control); even_token pays ~0.5 with a spread, so every step updates the weights and the
    next step's rollout runs on them, still with diff = 0."""
    for task, learns in (("count_up", False), ("even_token", True)):
        recipe = _recipe(tmp_path / task, "steps=2", f"task.name={task}", "model.overrides.vocab_size=4096")
        metrics = run_recipe(recipe, echo=None)["runs"]["reference"]
        assert all(m["mismatches"] == 0 for m in metrics)
        assert all(m["weights_changed"] == learns for m in metrics), (task, [m["reward"] for m in metrics])
        if not learns:
            assert all(m["reward_std"] == 0.0 for m in metrics)
