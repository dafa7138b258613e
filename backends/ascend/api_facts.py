"""The vendored vendor-API facts (``api_facts.toml``) and the check every NPU call passes first.

Why: the backend's calls into torch_npu and the op package cannot run without an NPU, so a wrong
keyword (``scale_value`` where torch_npu 7 says ``scale``) or a value the op rejects (a paged
``block_size`` of 64) would only show on first use on hardware. Every call goes through
``check_call`` against the schema written down, with its source, in ``api_facts.toml``; the CPU
tests run the backend's host logic with stand-in ops, so every call it makes is checked in CI.
"""

from __future__ import annotations

import sys
from functools import lru_cache
from importlib import resources

from hal.errors import UnsupportedError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ApiMismatch(UnsupportedError):
    """A call does not match the vendored schema of the op it calls."""


@lru_cache(maxsize=1)
def facts() -> dict:
    text = resources.files("hal.backends.ascend").joinpath("api_facts.toml").read_text(encoding="utf-8")
    return tomllib.loads(text)


def op(name: str) -> dict:
    """The facts of one op, with ``same_schema_as`` resolved (keeping the op's own source/confirmed)."""
    ops = facts()["op"]
    if name not in ops:
        raise ApiMismatch(f"ascend: {name} is not in api_facts.toml; every op the backend calls must be vendored")
    entry = dict(ops[name])
    if "same_schema_as" in entry:
        base = ops[entry["same_schema_as"]]
        for key in ("positional", "keywords", "renamed", "allowed", "limits", "branch_by_query_shape_s"):
            if key in base:
                entry.setdefault(key, base[key])
    return entry


def check_call(name: str, args: tuple, kwargs: dict) -> None:
    """Raise ApiMismatch unless ``name(*args, **kwargs)`` matches the vendored schema: the positional
    count, every keyword known (a renamed one says its new name), every enumerated value allowed, and
    the paged block size rule (block_table given and a query S axis > 1)."""
    entry = op(name)
    positional = entry.get("positional", [])
    if len(args) != len(positional):
        raise ApiMismatch(f"ascend: {name} takes {len(positional)} positional arguments ({', '.join(positional)}), "
                          f"got {len(args)} ({entry['source']})")
    known = set(entry.get("keywords", []))
    for key in kwargs:
        if key in entry.get("renamed", {}):
            raise ApiMismatch(f"ascend: {name} has no keyword {key!r}; it is {entry['renamed'][key]!r} since "
                              f"{entry['version']} ({entry['source']})")
        if key not in known:
            raise ApiMismatch(f"ascend: {name} has no keyword {key!r} ({entry['version']}, {entry['source']})")
    allowed = entry.get("allowed", {})
    for key, values in allowed.items():
        if key in kwargs and key != "paged_block_size" and kwargs[key] not in values:
            raise ApiMismatch(f"ascend: {name}({key}={kwargs[key]!r}) is not allowed; allowed: {values} "
                              f"({entry['source']})")
    if "paged_block_size" in allowed and kwargs.get("block_table") is not None:
        query_s = _query_s(args[0], kwargs.get("input_layout", "BSH")) if args else None
        if query_s is None or query_s > 1:
            if kwargs.get("block_size") not in allowed["paged_block_size"]:
                raise ApiMismatch(f"ascend: {name} with page attention and query length > 1 needs block_size in "
                                  f"{allowed['paged_block_size']} (a multiple of 128 in 128..512), got "
                                  f"{kwargs.get('block_size')!r} ({entry['source']})")
    limits = entry.get("limits", {})
    heads, kv_heads = kwargs.get("num_heads"), kwargs.get("num_key_value_heads") or kwargs.get("num_heads")
    if "max_heads_per_kv_head" in limits and heads and kv_heads and heads // kv_heads > limits["max_heads_per_kv_head"]:
        raise ApiMismatch(f"ascend: {name}: num_heads / num_key_value_heads = {heads // kv_heads} > "
                          f"{limits['max_heads_per_kv_head']}")


def _query_s(query, layout: str):
    """The S axis of the query's shape for a layout (None when the shape is not known)."""
    shape = getattr(query, "shape", None)
    if shape is None:
        return None
    base = layout.split("_")[0]
    if base in ("BSH", "BSND"):
        return shape[1]
    if base == "BNSD":
        return shape[2]
    return None  # TND/NTD: per-sequence lengths, not a shape axis


def setting(name: str) -> dict:
    return facts()["setting"][name]


def triton_ascend() -> dict:
    return facts()["triton_ascend"]


def triton_ascend_compile() -> dict:
    """What compiling the triton path's kernels with triton-ascend showed (bench/ascend_frontend.py)."""
    return facts()["triton_ascend_compile"]


def flash_module() -> dict:
    return facts()["module"]["flash_attn_npu_3"]
