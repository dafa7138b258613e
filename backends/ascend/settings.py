"""Determinism and precision settings of the NPU stack: applied at selection, read back, verified.

Why: on Ascend several knobs outside the kernels change bits (HF32 rounding of fp32 matmul operands,
the private NZ weight format, CANN's precision mode, non-deterministic HCCL/LCCL collectives). The
backend sets them when it is constructed, reads every one back from where it lives (where it can be
read), and refuses to run if any reads back wrong or was set too late to take effect; the values are
reported next to the contract fingerprint.

A *surface* is where the settings live: ``environ`` (a mutable mapping), ``torch_npu`` (the module:
``npu.set_option``, ``npu.matmul.allow_hf32``, ``npu.conv.allow_hf32``, ``npu.config.allow_internal_format``),
``torch`` (``use_deterministic_algorithms``), ``modules`` and ``dist_initialized`` (what has started). ``real_surface()`` is the process's; tests pass a fake one.

Where and when each is read (api_facts.toml [setting.*]):
  * ``ACL_PRECISION_MODE`` is an option of ``torch_npu.npu.set_option``; an environment variable of
    that name does nothing. It has no documented getter: it is applied and reported as applied, not
    read back (Atlas A2/A3 default to must_keep_origin_dtype anyway).
  * ``HCCL_DETERMINISTIC`` / ``LCCL_DETERMINISTIC`` are read when a communicator is created: setting
    them after ``torch.distributed`` has a process group changes nothing, so then they must already
    have been in the environment (set in the launcher), or the backend refuses. ``strict`` (order
    preserving) is supported only on some Atlas A2 servers (Atlas 800T A2, 900 A2 PoD, 200T A2 Box16);
    on A3 it acts as ``true``. The default here is ``true``; pass ``hccl="strict"`` on those servers.
  * ``VLLM_ASCEND_ENABLE_NZ`` is read when vllm-ascend builds its config: once ``vllm_ascend`` is
    imported it must already be 0, or the backend refuses.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, MutableMapping

from hal.errors import HalError

#: environment variable -> required value (HCCL_DETERMINISTIC: the ``hccl`` argument)
ENV = {
    "HCCL_DETERMINISTIC": "true",          # deterministic collectives; "strict" on the A2 servers that support it
    "LCCL_DETERMINISTIC": "1",
    "VLLM_ASCEND_ENABLE_NZ": "0",          # vllm-ascend: keep weights in ND, never NZ
}
#: environment variable -> what must not have started before it was set: "dist" (a process group
#: exists: its communicators read it at creation) or a module name (imported: its config is built)
READ_BY = {"HCCL_DETERMINISTIC": "dist", "LCCL_DETERMINISTIC": "dist", "VLLM_ASCEND_ENABLE_NZ": "vllm_ascend"}
#: torch_npu.npu.set_option keys -> required value (applied; not readable back)
OPTIONS = {"ACL_PRECISION_MODE": "must_keep_origin_dtype"}
#: torch_npu attribute path -> required value
NPU_FLAGS = {
    "npu.matmul.allow_hf32": False,
    "npu.conv.allow_hf32": False,
    "npu.config.allow_internal_format": False,  # no private (NZ) formats for new tensors
}
HCCL_MODES = ("true", "strict")


class SettingsError(HalError):
    """A determinism/precision setting did not read back as required."""


@dataclass
class Surface:
    environ: MutableMapping[str, str]
    torch_npu: Any
    torch: Any
    modules: Mapping[str, Any] = field(default_factory=dict)   # sys.modules: what is imported
    dist_initialized: Callable[[], bool] = lambda: False       # torch.distributed has a process group


def real_surface() -> Surface:
    import torch
    import torch_npu

    def dist_initialized() -> bool:
        return torch.distributed.is_available() and torch.distributed.is_initialized()

    return Surface(os.environ, torch_npu, torch, sys.modules, dist_initialized)


def _resolve(root: Any, dotted: str) -> tuple[Any, str]:
    parts = dotted.split(".")
    for p in parts[:-1]:
        root = getattr(root, p)
    return root, parts[-1]


def required_env(hccl: str = "true") -> dict:
    if hccl not in HCCL_MODES:
        raise SettingsError(f"HCCL_DETERMINISTIC must be one of {HCCL_MODES}, got {hccl!r} ('strict' only on "
                            "Atlas 800T A2 / 900 A2 PoD / 200T A2 Box16)")
    return {k: (hccl if k == "HCCL_DETERMINISTIC" else v) for k, v in ENV.items()}


def check_timing(surface: Surface, hccl: str = "true") -> None:
    """Refuse where a variable is not yet as required but its reader has already started, so that
    setting it now would change nothing."""
    late = []
    for key, want in required_env(hccl).items():
        if surface.environ.get(key) == want:
            continue
        reader = READ_BY[key]
        started = surface.dist_initialized() if reader == "dist" else reader in surface.modules
        if started:
            late.append(f"{key} (is {surface.environ.get(key)!r}, required {want!r}; "
                        + ("a torch.distributed process group already exists and HCCL read it at communicator "
                           "creation" if reader == "dist" else f"{reader} is already imported and its config "
                           "read it") + ")")
    if late:
        raise SettingsError("ascend: too late to set " + "; ".join(late) + ": export them in the launcher "
                            "before Python starts (docs/ascend-backend.md)")


def apply(surface: Surface, hccl: str = "true") -> None:
    """Set every knob (after ``check_timing``: a variable set here is one nothing has read yet)."""
    check_timing(surface, hccl)
    for key, value in required_env(hccl).items():
        surface.environ[key] = value
    surface.torch_npu.npu.set_option(dict(OPTIONS))
    for dotted, value in NPU_FLAGS.items():
        obj, attr = _resolve(surface.torch_npu, dotted)
        setattr(obj, attr, value)
    surface.torch.use_deterministic_algorithms(True)


def read_back(surface: Surface) -> dict:
    """Every knob as it reads now (None where it is absent; options as applied: they have no getter)."""
    out: dict[str, Any] = {f"env.{k}": surface.environ.get(k) for k in ENV}
    out.update({f"option.{k}": f"{v} (applied through set_option; not readable)" for k, v in OPTIONS.items()})
    for dotted in NPU_FLAGS:
        try:
            obj, attr = _resolve(surface.torch_npu, dotted)
            out[f"torch_npu.{dotted}"] = getattr(obj, attr)
        except AttributeError:
            out[f"torch_npu.{dotted}"] = None
    out["torch.deterministic_algorithms"] = bool(surface.torch.are_deterministic_algorithms_enabled())
    return out


def expected(hccl: str = "true") -> dict:
    want: dict[str, Any] = {f"env.{k}": v for k, v in required_env(hccl).items()}
    want.update({f"option.{k}": f"{v} (applied through set_option; not readable)" for k, v in OPTIONS.items()})
    want.update({f"torch_npu.{k}": v for k, v in NPU_FLAGS.items()})
    want["torch.deterministic_algorithms"] = True
    return want


def verify(readback: dict, hccl: str = "true") -> None:
    """Raise SettingsError naming every knob that does not read back as required."""
    bad = [f"{k} = {readback.get(k)!r} (required {v!r})" for k, v in expected(hccl).items()
           if readback.get(k) != v]
    if bad:
        raise SettingsError("ascend: settings did not read back as required: " + "; ".join(bad))


def apply_and_verify(surface: Surface, hccl: str = "true") -> dict:
    apply(surface, hccl)
    readback = read_back(surface)
    verify(readback, hccl)
    return readback


def fingerprint(readback: dict) -> str:
    """sha256 of the read-back settings (reported with the contract fingerprint)."""
    text = json.dumps(readback, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()
