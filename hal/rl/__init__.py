"""RL recipes and the GRPO runner (``hal run``), on the built-in rollout harness.

    from hal.rl import load_recipe, run_recipe
    recipe = load_recipe("recipes/default.yaml", ["backend=reference", "steps=5"])
    result = run_recipe(recipe)          # per-step metrics; diff = 0 on a contract backend

Modules: ``recipe`` (schema, overrides, validation), ``task`` (toy verifiable tasks), ``grpo``
(the loop, checkpoints), ``report`` (JSONL metrics, progress line, comparison report),
``runner`` (single/compare runs and the CLI subcommand). See docs/rl.md.
"""

from hal.rl.grpo import CheckpointError, DivergedError
from hal.rl.recipe import Recipe, RecipeError, load_recipe, recipe_from_dict, validate
from hal.rl.runner import run_recipe

__all__ = ["CheckpointError", "DivergedError", "Recipe", "RecipeError", "load_recipe", "recipe_from_dict",
           "run_recipe", "validate"]
