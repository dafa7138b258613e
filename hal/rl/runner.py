"""``hal run RECIPE [KEY=VALUE ...] [--compare]``: one recipe, or the recipe twice (contract backend
vs the ``torch`` baseline) with a comparison report.

Layout of ``output_dir``: a single run writes ``metrics.jsonl``, ``checkpoint.pt`` and the resolved
recipe (``resolved-recipe.yaml``) there; compare mode writes one such run directory per backend
(``output_dir/<backend>/``) plus ``report.md``, ``summary.json`` and the PNG plots.
A run holds an exclusive lock on ``output_dir/.hal-run.lock`` (``fcntl.flock``: the kernel releases
it when the process exits or is killed) from before its first check of the directory to its end; a
second run into the same directory is refused.
Exit status: 0 when every step on a contract backend had diff = 0 (a baseline's differences are
expected and do not fail), 1 otherwise, 2 for a bad recipe or a run stopped by an error.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import time
from pathlib import Path
from typing import Callable, Iterator

from hal.rl.grpo import METRICS, GRPORun, num_threads
from hal.rl.recipe import Recipe, RecipeError, check_output_dir, load_recipe
from hal.rl.report import progress_line, read_metrics, side_by_side, summary_table, write_comparison


def _runs(recipe: Recipe) -> list[tuple[Recipe, Path]]:
    out = Path(recipe.output_dir)
    if not recipe.compare:
        return [(recipe, out)]
    return [(recipe.replace(compare=False), out / recipe.backend),
            (recipe.replace(compare=False, backend=recipe.baseline, contract=None), out / recipe.baseline)]


LOCK = ".hal-run.lock"


@contextlib.contextmanager
def output_dir_lock(output_dir: str | Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``output_dir/.hal-run.lock``, or raise ``RecipeError`` if another
    process (or another run in this one) holds it. An OS lock, not a pid file: it dies with the
    process, so a killed run never blocks the next one. A directory this call created is removed
    again if nothing but the lock file is in it at the end (a run refused by a late check)."""
    out = Path(output_dir)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    f = (out / LOCK).open("a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise RecipeError(f"output_dir {out} is in use by another `hal run` ({holder} holds {out / LOCK}); "
                          f"wait for it to finish or choose another output_dir") from None
    try:
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()}\n")    # for the message above only; the flock is the lock
        f.flush()
        yield
    finally:
        if created and [p.name for p in out.iterdir()] == [LOCK]:
            (out / LOCK).unlink()
            out.rmdir()
        fcntl.flock(f, fcntl.LOCK_UN)
        f.close()


def run_recipe(recipe: Recipe, *, echo: Callable[[str], None] | None = print) -> dict:
    """Run a validated recipe (``load_recipe`` validates). Returns ``{"runs": {backend: metrics of
    every step in the run's metrics.jsonl}, "wall_s": {...}, "report": path or None}``.

    Under the output directory's lock: the directory is checked again, every run is prepared
    (backend, model, preflight, verified checkpoint), and only then is anything replaced or written."""
    runs, wall = {}, {}
    with output_dir_lock(recipe.output_dir), num_threads(recipe.threads):
        check_output_dir(recipe, "recipe")
        jobs = []
        for sub, run_dir in _runs(recipe):
            progress = None if echo is None else (lambda m, n=sub.steps: echo(progress_line(m, n)))
            job = GRPORun(sub, run_dir, progress)
            t0 = time.perf_counter()
            job.prepare()
            jobs.append((job, time.perf_counter() - t0))
        for job, prepare_s in jobs:
            t0 = time.perf_counter()
            job.execute()
            wall[job.recipe.backend] = prepare_s + time.perf_counter() - t0
            runs[job.recipe.backend] = read_metrics(job.run_dir / METRICS)
        report = None
        if recipe.compare:           # still under the lock: the report is part of the run's output
            report = write_comparison(recipe.output_dir, runs, wall_s=wall,
                                      title=f"{recipe.name}: {recipe.backend} (contract) vs {recipe.baseline} "
                                            f"(stock kernels)")
    if recipe.compare:
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
