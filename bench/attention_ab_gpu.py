"""The current attention kernel against an older one (``--base``, written by bench/old_kernels.sh) on the GPU:
bitwise equal outputs, and both timed, over prefill, chunked prefill and decode shapes.

Why: a change to the kernel's loop structure (not to the reduction structure) must give the very same bits
on every phase and launch, and its speed must be measured on both sides of the change in one process: prefill
against SDPA flash (issue #20's >= 0.85x target), decode against the old kernel (no regression).

Bits: each case runs the default launch and the launch variants below, old and new, on the same random
inputs, and compares the bit patterns (``view(int16)``, so NaNs compare too). The chunked-prefill case puts
NaN and Inf into V of keys that some rows see and others do not, and into never-written slots past the
sequence ([attention].mask); so does a one-sequence prefill whose last chunk is part-filled and read by tensor
descriptor (the never-written slots come with it). A difference fails the run, but for one kind: since 2026-12-07
every non-finite output element is one NaN, where the old kernel gave +-Inf or NaN depending on the tile; elements
where the old output is non-finite and the new one NaN are counted apart (``non_finite_only``). Every launch of the
new kernel must also equal its default launch bitwise, NaN and Inf included (``same_as_new_default``).

``alt``: the current kernel with a launch choice its default does not take for the call, bits and time: what the
default's choice is worth. Prefill of a GQA group that is not a power of two: the padded rows (``packed_heads``
off); otherwise the other loop structure (``nested_splits``: the flat chunk loop for prefill, the nested split loop
for decode).

Time: CUDA-graph replay (``triton.testing.do_bench_cudagraph``, median), new, old and alt twice each in turn
(the table shows the better of the two; both are in the JSON), SDPA flash on contiguous K/V for one-sequence
prefill. Inputs are the same buffers each replay (prefill is compute bound; decode K/V may sit in L2 at the
small cells, for old and new alike).

    bash bench/old_kernels.sh HEAD .old_kernels      # on a machine with the history; carry .old_kernels
    python3 bench/attention_ab_gpu.py --base .old_kernels --json attention_ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

import old_kernels
from bench_cuda import paged_problem, sdpa_problem
from hal.kernels.tuning import do_bench_cudagraph_synced  # noqa: E402  (waits for queued input writes)
from hal.api import create_backend
from hal.backends.cuda.launch import CUDA_LAUNCH
from hal.kernels import attention
from hal.kernels.common import next_power_of_2
from hal.kernels.tuning import _bits

# (name, seq_lens, q_lens, query heads, KV heads, head dim, page, launch variants to bit-check)
PREFILL_VARIANTS = [dict(block_q=8), dict(block_q=32, num_warps=8)]
# GQA 5 or 7: the old kernel pads the group to 8 heads, so its tiles need a power-of-two block_q
ODD_GROUP_VARIANTS = [dict(block_q=8), dict(block_q=16, num_warps=8)]
DECODE_VARIANTS = [dict(split_parallel=True), dict(split_parallel=False), dict(split_parallel=True,
                                                                              splits_per_program=2)]
# Most varied bit checks first (planted NaN / Inf, chunked prefill, decode launch variants, 32k keys), then the
# packed GQA groups (5, 7, 3), so that a --budget-s cut keeps them
CASES = [
    ("prefill, planted", [3000], [3000], 32, 8, 128, 64, PREFILL_VARIANTS),   # TMA, the last chunk part-filled
    ("chunked prefill", [3000, 700, 40], [700, 700, 1], 40, 8, 128, 16, ODD_GROUP_VARIANTS),
    ("decode", [2048] * 16, [1] * 16, 40, 8, 128, 32, DECODE_VARIANTS),
    ("decode", [32768], [1], 32, 8, 128, 64, []),
    ("prefill", [4096], [4096], 40, 8, 128, 16, ODD_GROUP_VARIANTS),
    ("prefill", [4096], [4096], 28, 4, 128, 16, []),
    ("prefill", [2048], [2048], 24, 8, 128, 64, []),
    ("prefill", [2048], [2048], 32, 8, 128, 64, PREFILL_VARIANTS),
    ("prefill", [512], [512], 32, 8, 128, 64, PREFILL_VARIANTS),
    ("decode", [512] * 4, [1] * 4, 32, 8, 128, 64, DECODE_VARIANTS),
    ("prefill", [8192], [8192], 32, 8, 128, 64, []),
    ("prefill", [4096], [4096], 64, 8, 128, 64, []),
    ("prefill", [4096], [4096], 32, 8, 64, 64, PREFILL_VARIANTS),
    ("prefill", [16384], [16384], 32, 8, 128, 64, []),
    ("prefill batch", [1000] * 8, [1000] * 8, 32, 8, 128, 16, []),
    ("decode", [4096], [1], 32, 8, 128, 16, DECODE_VARIANTS),
    ("decode", [4096] * 64, [1] * 64, 32, 8, 128, 16, []),
    ("decode", [32768] * 16, [1] * 16, 16, 8, 64, 64, []),
    ("decode", [4096] * 256, [1] * 256, 32, 8, 128, 64, DECODE_VARIANTS),
]
POISONED = ("chunked prefill", "prefill, planted")   # cases with NaN / Inf planted (``_poison``)


def _poison(k_cache, v_cache, meta):
    """NaN / Inf in V (and K) of keys that only some rows see, and in slots past each sequence."""
    page = v_cache.shape[1]
    for b, n in enumerate(meta.seq_lens.tolist()):
        for pos, value in ((n - 5, float("nan")), (n - 300, float("inf")), (n - 2, float("-inf"))):
            if pos >= 0:
                slot = meta.block_table[b, pos // page].long(), pos % page
                v_cache[slot[0], slot[1], 0, 3] = value
        tail = n % page
        if tail:  # the last page's never-written slots
            last = meta.block_table[b, (n - 1) // page].long()
            k_cache[last, tail:] = float("nan")
            v_cache[last, tail:] = float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    old_kernels.add_argument(ap)
    ap.add_argument("--json", required=True)
    ap.add_argument("--rep", type=int, default=30, help="do_bench_cudagraph rep (ms)")
    ap.add_argument("--budget-s", type=float, default=1e9, help="start no new case after this many seconds")
    args = ap.parse_args()
    began = time.time()

    def write(rows, ok, complete):
        checked = sum(len(r["identical"]) for r in rows)
        same = sum(sum(r["identical"].values()) for r in rows)
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), base=os.path.basename(os.path.normpath(args.base)),
                           rows=rows, bitwise_ok=ok, identical=same, checked=checked, complete=complete), f, indent=1)
        return same, checked
    base = old_kernels.load(args.base)
    spec = create_backend("cuda").contract.attention
    torch.manual_seed(0)
    rows, ok = [], True
    for phase, seq_lens, q_lens, hq, hkv, d, page, variants in CASES:
        started = time.time()
        if started - began > args.budget_s:
            print(f"budget of {args.budget_s:.0f} s spent: {phase} B={len(seq_lens)} L={seq_lens[0]} and later not run")
            break
        q, kc, vc, meta = paged_problem(seq_lens, q_lens, hq, hkv, d, page)
        if phase in POISONED:
            _poison(kc, vc, meta)
        inputs = (q, kc, vc, meta.query_start_loc, meta.seq_lens, meta.block_table, d ** -0.5, spec)
        row = dict(phase=phase, seq_lens=seq_lens[:3], batch=len(seq_lens), q_len=q_lens[0], hq=hq, hkv=hkv, d=d,
                   page=page, identical={}, us={}, errors={})

        def new(**launch):
            return attention.paged_attention(*inputs, policy=CUDA_LAUNCH, **launch)

        def old(**launch):
            return base.attention.paged_attention(*inputs, policy=CUDA_LAUNCH, **launch)
        # A choice the default does not take for this call: padded rows for a packed GQA group, else the other
        # loop structure (nested split loop for prefill, flat for decode)
        prefill = not attention._launch_shape(q.shape[0], len(seq_lens), next_power_of_2(hq // hkv))["decode"]
        packed = prefill and hq // hkv != next_power_of_2(hq // hkv)
        alt = dict(packed_heads=False) if packed else dict(nested_splits=not prefill)
        alt_name = "padded" if packed else "flat" if prefill else "nested"
        row["alt_launch"] = alt
        new_default = None
        for launch in [dict(), *variants, alt]:
            name = "alt" if launch is alt else ",".join(f"{k}={v}" for k, v in launch.items()) or "default"
            try:
                out = new(**launch)   # the old kernel has one loop structure and pads: it takes the rest of the launch
                was = old(**{k: v for k, v in launch.items() if k not in ("nested_splits", "packed_heads")})
                same = torch.equal(_bits(out), _bits(was))
                new_default = out if new_default is None else new_default
            except Exception as exc:  # noqa: BLE001 - reported, and the run fails
                row["errors"][name] = str(exc).splitlines()[0][:200]
                same = ok = False
            else:
                if phase in POISONED and name == "default":
                    row["nan_outputs"] = int(torch.isnan(out.float()).sum())
                if not same:
                    # Since 2026-12-07 every non-finite output is one NaN ([attention].mask); the old kernel gave
                    # +-Inf or NaN by tile. Such elements are counted apart: any other difference fails the run.
                    differ = _bits(out) != _bits(was)
                    finite = torch.isfinite(out.float()) | torch.isfinite(was.float())
                    row.setdefault("non_finite_only", {})[name] = not bool((differ & finite).any())
                    row.setdefault("differ_elements", {})[name] = int(differ.sum())
                    ok &= row["non_finite_only"][name] and bool(torch.isnan(out.float()[differ]).all())
                # The new kernel's own launches against its default: bitwise, NaN and Inf included
                row.setdefault("same_as_new_default", {})[name] = torch.equal(_bits(out), _bits(new_default))
                ok &= row["same_as_new_default"][name]
            row["identical"][name] = same
        for turn in (1, 2):
            for name, fn in (("new", new), ("old", old), ("alt", lambda: new(**alt))):
                row["us"][f"{name}{turn}"] = do_bench_cudagraph_synced(fn, rep=args.rep,
                                                                               return_mode="median") * 1000
        if phase == "prefill" and len(seq_lens) == 1:
            qs, ks, vs = sdpa_problem(1, seq_lens[0], seq_lens[0], hq, hkv, d)

            def sdpa():
                with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                    return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
            try:
                row["us"]["sdpa_flash"] = do_bench_cudagraph_synced(sdpa, rep=args.rep,
                                                                            return_mode="median") * 1000
            except Exception as exc:  # noqa: BLE001 - reported, not fatal
                row["errors"]["sdpa_flash"] = str(exc).splitlines()[0][:200]
        us = row["us"]
        row["new_us"], row["old_us"] = min(us["new1"], us["new2"]), min(us["old1"], us["old2"])
        row["alt_us"] = min(us["alt1"], us["alt2"])
        row["old_over_new"] = row["old_us"] / row["new_us"]
        if "sdpa_flash" in us:
            row["sdpa_over_new"] = us["sdpa_flash"] / row["new_us"]
            row["sdpa_over_old"] = us["sdpa_flash"] / row["old_us"]
            row["sdpa_over_alt"] = us["sdpa_flash"] / row["alt_us"]
        rows.append(row)
        del q, kc, vc, meta, inputs
        torch.cuda.empty_cache()
        print(f"{phase:>15} B={len(seq_lens):<3} L={seq_lens[0]:<6} q={q_lens[0]:<5} {hq}/{hkv} d{d} p{page}: "
              f"new {row['new_us']:.1f} us, old {row['old_us']:.1f} us, old/new {row['old_over_new']:.2f}, "
              f"{alt_name} {row['alt_us']:.1f} us"
              + (f", SDPA flash / new {row['sdpa_over_new']:.2f}, / old {row['sdpa_over_old']:.2f}, "
                 f"/ {alt_name} {row['sdpa_over_alt']:.2f}"
                 if "sdpa_over_new" in row else "")
              + ("" if all(row["identical"].values()) else f"  DIFFER {row['identical']} (non-finite only: "
                 f"{row.get('non_finite_only')}, elements {row.get('differ_elements')})")
              + ("" if all(row.get("same_as_new_default", {}).values())
                 else f"  NEW LAUNCHES DIFFER {row['same_as_new_default']}")
              + (f"  nan outputs {row['nan_outputs']}" if "nan_outputs" in row else "")
              + (f"  ERRORS {row['errors']}" if row["errors"] else "") + f"  [{time.time() - started:.0f} s]",
              flush=True)
        write(rows, ok, complete=False)          # a run cut short keeps the cases it finished
    same, checked = write(rows, ok, complete=len(rows) == len(CASES))
    print(f"\nbits: {same} of {checked} case x launch outputs identical to the old kernel's; the rest differ only "
          f"where the old kernel gave +-Inf or another NaN and the new one NaN: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
