"""``hal run RECIPE [KEY=VALUE ...] [--compare]``: one recipe, or the recipe twice (contract backend
vs the ``torch`` baseline) with a comparison report.

Layout of ``output_dir``: a single run writes ``metrics.jsonl``, ``checkpoint.pt`` and the resolved
``recipe.yaml`` there; compare mode writes one such run directory per backend
(``output_dir/<backend>/``) plus ``report.md``, ``summary.json`` and the PNG plots.
Exit status: 0 when every step on a contract backend had diff = 0 (a baseline's differences are
expected and do not fail), 1 otherwise, 2 for a bad recipe.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Callable

from hal.rl.grpo import METRICS, GRPORun
from hal.rl.recipe import Recipe, load_recipe
from hal.rl.report import progress_line, read_metrics, side_by_side, summary_table, write_comparison


def _runs(recipe: Recipe) -> list[tuple[Recipe, Path]]:
    out = Path(recipe.output_dir)
    if not recipe.compare:
        return [(recipe, out)]
    return [(recipe.replace(compare=False), out / recipe.backend),
            (recipe.replace(compare=False, backend=recipe.baseline, contract=None), out / recipe.baseline)]


def run_recipe(recipe: Recipe, *, echo: Callable[[str], None] | None = print) -> dict:
    """Run a validated recipe (``load_recipe`` validates). Returns ``{"runs": {backend: metrics of
    every step in the run's metrics.jsonl}, "wall_s": {...}, "report": path or None}``."""
    runs, wall = {}, {}
    for sub, run_dir in _runs(recipe):
        progress = None if echo is None else (lambda m, n=sub.steps: echo(progress_line(m, n)))
        t0 = time.perf_counter()
        GRPORun(sub, run_dir, progress).run()
        wall[sub.backend] = time.perf_counter() - t0
        runs[sub.backend] = read_metrics(run_dir / METRICS)
    report = None
    if recipe.compare:
        report = write_comparison(recipe.output_dir, runs, wall_s=wall,
                                  title=f"{recipe.name}: {recipe.backend} (contract) vs {recipe.baseline} (stock kernels)")
        if echo is not None:
            echo(side_by_side(runs))
            echo(summary_table(runs))
            echo(f"report: {report}")
    elif echo is not None:
        m = runs[recipe.backend]
        bad = sum(x["mismatches"] != 0 for x in m)
        echo(f"{recipe.backend}: {len(m) - bad}/{len(m)} steps with diff = 0; metrics in {Path(recipe.output_dir) / METRICS}")
    return {"runs": runs, "wall_s": wall, "report": report}


def _command(args: argparse.Namespace) -> int:
    overrides = list(args.overrides) + (["compare=true"] if args.compare else [])
    recipe = load_recipe(args.recipe, overrides)
    result = run_recipe(recipe, echo=None if args.quiet else print)
    from hal.registry import backend_class

    contract_runs = [b for b in result["runs"] if backend_class(b).contracts]
    ok = all(m["mismatches"] == 0 for b in contract_runs for m in result["runs"][b])
    return 0 if ok else 1


def add_subcommand(sub) -> None:
    """Register ``hal run`` on the ``hal`` parser's subparsers."""
    p = sub.add_parser("run", help="run an RL recipe (GRPO on a toy task) and check diff = 0 at every step",
                       description="Run a YAML recipe: `hal run recipes/default.yaml backend=torch steps=5`. "
                                   "KEY=VALUE overrides (dotted keys for sections, e.g. model.seed=3) are "
                                   "validated with the recipe before any work starts.")
    p.add_argument("recipe", help="path to a YAML recipe (see recipes/)")
    p.add_argument("overrides", nargs="*", help="KEY=VALUE overrides, e.g. backend=torch steps=5 resume=true")
    p.add_argument("--compare", action="store_true", help="also run on the torch baseline and write a report")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=_command)
