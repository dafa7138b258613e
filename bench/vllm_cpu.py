"""vLLM (CPU) with and without the HAL plugin against the trainer's forward: mismatching logprobs.

For tiny random Llama and Qwen3 checkpoints in fp32 and bf16, one vLLM engine HAL-bound to the
reference backend and one stock engine generate for the same 8 prompts of 3-45 tokens (26 sampled
tokens each, all at once, with prompt logprobs); the trainer (``DecoderLM.sequence_logprobs``,
reference backend) recomputes every logprob. Prints a table and writes JSON.

    python bench/vllm_cpu.py --json bench/results/cpu-vllm/vllm_cpu.json     # about 3 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from hal.api import create_backend
from hal.metrics import compare_logprobs
from hal.model.checkpoint import save_pretrained
from hal.model.config import tiny_config
from hal.model.model import DecoderLM
from hal.rollout.harness import Request
from hal.vllm.binding import resolve_binding
from hal.vllm.engine import VllmEngine, configure_environment

PROMPT_LENGTHS = (3, 7, 12, 18, 25, 31, 38, 45)
NEW_TOKENS = 26


def compare(engine_side, trainer_side) -> dict:
    c = compare_logprobs(trainer_side, engine_side)      # the metric `hal run` reports
    return {"tokens": c.num_tokens, "mismatches": c.mismatches, "max_abs_dlogp": c.max_abs_diff}


def run(architecture: str, dtype: str, hal: bool, workdir: Path) -> dict:
    config = tiny_config(architecture, dtype, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32)
    model = DecoderLM.random(config, seed=1, backend=create_backend("reference"))
    path = save_pretrained(model, workdir / f"{architecture}-{dtype}")
    requests = [Request(prompt=tuple((11 * i + 5 * j + 1) % config.vocab_size for j in range(n)),
                        max_new_tokens=NEW_TOKENS, seed=i) for i, n in enumerate(PROMPT_LENGTHS)]
    engine = VllmEngine(path, binding=resolve_binding({"backend": "reference"}) if hal else None, dtype=dtype,
                        max_num_seqs=len(requests))
    try:
        t0 = time.perf_counter()
        completions = engine.generate(requests, prompt_logprobs=True)
        seconds = time.perf_counter() - t0
    finally:
        engine.close()
    with torch.no_grad():
        sampled = model.sequence_logprobs([c.sequence for c in completions], [len(c.prompt) for c in completions])
        prompt = model.sequence_logprobs([c.prompt for c in completions])
    return {"architecture": architecture, "dtype": dtype, "engine": "hal (reference)" if hal else "stock vLLM",
            "sampled": compare([c.logprobs for c in completions], sampled),
            "prompt": compare([c.prompt_logprobs for c in completions], prompt),
            "generate_s": seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="hal-vllm-bench-"))
    configure_environment(workdir / "cache", log_level="ERROR")
    rows = []
    print(f"{'model':16} {'engine':16} {'sampled differ':>16} {'max |dlogp|':>12} {'prompt differ':>14} {'gen s':>6}")
    for architecture in ("llama", "qwen3"):
        for dtype in ("float32", "bfloat16"):
            for hal in (True, False):
                r = run(architecture, dtype, hal, workdir)
                rows.append(r)
                s, p = r["sampled"], r["prompt"]
                print(f"{architecture + ' ' + dtype:16} {r['engine']:16} {s['mismatches']:>7}/{s['tokens']:<8} "
                      f"{s['max_abs_dlogp']:>12.3g} {p['mismatches']:>6}/{p['tokens']:<7} {r['generate_s']:>6.1f}",
                      flush=True)
    if args.json:
        import vllm

        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"command": "python bench/vllm_cpu.py", "vllm": vllm.__version__,
                                         "torch": torch.__version__, "python": sys.version.split()[0],
                                         "machine": platform.machine(), "rows": rows}, indent=1) + "\n")
    failed = [r for r in rows if r["engine"].startswith("hal") and (r["sampled"]["mismatches"] or r["prompt"]["mismatches"])]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
