"""Speculative decoding and prefix caching in the built-in harness: same outputs, what they save (issue #24).

GRPO-shaped requests (``--prompts`` prompts x ``--group`` samples each, 64-token prompts of a repeating
pattern, ``--new-tokens`` each) on a random model, generated four ways: plain, speculative
(``--drafts`` prompt-lookup drafts per decode), prefix caching, both. Every variant must give the plain
run's tokens and logprob bits (checked, the script fails otherwise); the table gives tokens/s (median of
``--repeats`` rounds in which the variants take turns), engine steps, draft acceptance and the prompt
tokens read from the cache instead of computed. Greedy requests (``--temperature 0``) loop and accept
drafts often; sampled ones (T = 1) on a random model rarely.

    python3 bench/harness_rollout.py --json out.json                       # reference backend, CPU
    python3 bench/harness_rollout.py --backend cuda --model 0.6b --json out.json        # on a GPU
``--model 0.6b``: a random Qwen3-0.6B-shaped model (hidden 1024, 28 layers, 16/8 heads of 128, vocab
151936), for a GPU; the default ``tiny`` one (hidden 128, 2 layers, vocab 256) suits the CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from hal.api import create_backend
from hal.model import DecoderLM, tiny_config
from hal.rollout import HarnessConfig, Request, RolloutHarness


def requests(prompts: int, group: int, new_tokens: int, temperature: float, vocab: int) -> list[Request]:
    g = torch.Generator().manual_seed(0)
    out = []
    for p in range(prompts):
        pattern = torch.randint(0, vocab, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
        prompt = tuple((pattern * 64)[:64])
        out += [Request(prompt, new_tokens, seed=1000 * p + j, temperature=temperature) for j in range(group)]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="reference")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--drafts", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--model", choices=["tiny", "0.6b"], default="tiny")
    parser.add_argument("--repeats", type=int, default=1, help="timed rounds, variants taking turns (median)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    backend = create_backend(args.backend)
    dtype = "bfloat16" if args.backend == "cuda" else "float32"
    if args.model == "0.6b":
        config = tiny_config("qwen3", dtype, hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8,
                             head_dim=128, intermediate_size=3072, vocab_size=151936, max_position=1024)
    else:
        config = tiny_config("llama", dtype, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=64,
                             vocab_size=256, num_layers=2)
    model = DecoderLM.random(config, seed=3, backend=backend, device=backend.device)
    reqs = requests(args.prompts, args.group, args.new_tokens, args.temperature, config.vocab_size)
    base = dict(page_size=16, max_num_seqs=args.prompts * args.group, max_batch_tokens=1024, seed=0)
    variants = {"plain": {}, "speculative": dict(speculative_tokens=args.drafts),
                "prefix caching": dict(prefix_caching=True),
                "both": dict(speculative_tokens=args.drafts, prefix_caching=True)}
    print(f"{args.backend} backend on {backend.device}, {args.model} model ({config.num_layers} layers, hidden "
          f"{config.hidden_size}, vocab {config.vocab_size}), {len(reqs)} requests x {args.new_tokens} new tokens, "
          f"T = {args.temperature}, {args.drafts} drafts", flush=True)
    harnesses = {name: RolloutHarness(model, HarnessConfig(**base, **extra)) for name, extra in variants.items()}
    for harness in harnesses.values():
        harness.generate(reqs[:2])                                     # warm-up (compiles, allocations)
    # The variants take turns, --repeats rounds: a slow spell of the machine hits all of them alike.
    seconds = {name: [] for name in variants}
    outputs, stats = {}, {}
    for round_ in range(args.repeats):
        for name, harness in harnesses.items():
            t0 = time.perf_counter()
            with torch.no_grad():
                out = harness.generate(reqs)
            seconds[name].append(time.perf_counter() - t0)
            if round_ == 0:
                outputs[name], stats[name] = out, harness.stats
            print(f"  round {round_ + 1}/{args.repeats} {name:15} {seconds[name][-1]:7.2f} s", flush=True)
    rows, reference = [], outputs["plain"]
    for name in variants:
        out, st = outputs[name], stats[name]
        same = all(a.tokens == b.tokens and torch.equal(a.logprobs, b.logprobs) for a, b in zip(reference, out))
        prompt_tokens = sum(len(r.prompt) for r in reqs)
        median = statistics.median(seconds[name])
        row = dict(variant=name, identical_to_plain=same, seconds=median, seconds_each=seconds[name],
                   tok_s=sum(len(c.tokens) for c in out) / median, steps=st.steps, draft_tokens=st.draft_tokens,
                   accepted_tokens=st.accepted_tokens, acceptance_rate=st.acceptance_rate,
                   cached_prompt_tokens=sum(c.cached_prompt_tokens for c in out), prompt_tokens=prompt_tokens)
        rows.append(row)
        spread = f" (of {min(seconds[name]):.2f}-{max(seconds[name]):.2f} s)" if args.repeats > 1 else ""
        print(f"{name:15} {'same' if same else 'DIFFERENT':9} {row['tok_s']:8.0f} tok/s{spread}  {st.steps:4} steps  "
              f"drafts {st.accepted_tokens}/{st.draft_tokens} accepted  "
              f"prompt tokens from the cache {row['cached_prompt_tokens']}/{prompt_tokens}", flush=True)
    plain = rows[0]["tok_s"]
    for row in rows:
        row["speedup"] = row["tok_s"] / plain
    print("speedup vs plain: " + ", ".join(f"{r['variant']} {r['speedup']:.2f}x" for r in rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": args.backend, "args": vars(args), "rows": rows}, f, indent=1)
    return 0 if all(r["identical_to_plain"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
