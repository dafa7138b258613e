"""`hal run`: recipes, the on-policy GRPO loop on the built-in harness, resume, bad recipes
(the same loop with vLLM as the engine: tests/test_vllm.py).

The claim under test: with a contract backend (`reference`) every GRPO step has exactly 0
mismatching response tokens between the rollout's and the trainer's logprobs (k3-KL == 0), while
the stock `torch` baseline on the same recipe does not.
"""

from pathlib import Path

import pytest
import torch

from hal.cli import main
from hal.rl import RecipeError, load_recipe, run_recipe
from hal.rl.grpo import group_advantages, weights_checksum
from hal.rl.task import DIGIT_BASE, CountUp, TargetToken

ROOT = Path(__file__).resolve().parent.parent
SMOKE = ROOT / "recipes" / "ci-smoke.yaml"
# Fields that depend on the wall clock, not on the computation.
TIMING = {"rollout_s", "train_s", "rollout_tokens_per_s", "train_tokens_per_s", "resumed"}


def _recipe(tmp_path, *overrides):
    return load_recipe(SMOKE, [f"output_dir={tmp_path / 'out'}", *overrides])


def _numbers(m):
    return {k: v for k, v in m.items() if k not in TIMING}


def test_shipped_recipes_validate():
    engines = {}
    for path in sorted((ROOT / "recipes").glob("*.yaml")):
        if path.stem == "default":
            pytest.importorskip("vllm")
        engines[path.stem] = load_recipe(path, ["output_dir=/nonexistent/hal-rl-test"]).engine
    assert engines == {"ci-smoke": "harness", "default": "vllm", "harness": "harness"}


def test_reference_has_diff_zero_every_step_and_torch_baseline_does_not(tmp_path):
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
    assert sum(m["mismatches"] for m in base) > 0
    assert max(m["max_abs_diff"] for m in base) > 0 and max(m["k3_kl"] for m in base) > 0
    out = tmp_path / "out"
    for name in ("report.md", "summary.json", "k3_kl.png", "max_abs_dlogp.png", "reward.png"):
        assert (out / name).is_file(), name
    assert (out / "reference" / "metrics.jsonl").is_file() and (out / "torch" / "checkpoint.pt").is_file()


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
    pytest.importorskip("safetensors")
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
    assert CountUp(4).prompts(0, 7, 3) == CountUp(4).prompts(0, 7, 3) != CountUp(4).prompts(0, 8, 3)
    adv = group_advantages(torch.tensor([[0.0, 1.0], [0.5, 0.5]]))
    assert adv.tolist()[2:] == [0.0, 0.0] and adv[0] < 0 < adv[1]


def test_weights_checksum_sees_in_place_updates():
    p = torch.nn.Linear(3, 2)
    before = weights_checksum(p)
    with torch.no_grad():
        p.weight[0, 0] += 1e-7
    assert weights_checksum(p) != before
