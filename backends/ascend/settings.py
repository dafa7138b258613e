"""Determinism and precision settings of the NPU stack: applied at selection, read back, verified.

Why: on Ascend several knobs outside the kernels change bits (HF32 rounding of fp32 matmul operands,
the private NZ weight format, CANN's precision mode, non-deterministic HCCL/LCCL collectives). The
backend sets them when it is constructed, reads every one back from where it lives, and refuses to
run if any reads back wrong; the read-back values are reported next to the contract fingerprint.

A *surface* is where the settings live: ``environ`` (a mutable mapping), ``torch_npu`` (the module:
``npu.matmul.allow_hf32``, ``npu.conv.allow_hf32``, ``npu.config.allow_internal_format``) and ``torch``
(``use_deterministic_algorithms``). ``real_surface()`` is the process's; tests pass a fake one.

Environment variables read by the CANN runtime (``ACL_PRECISION_MODE``) take effect only if set
before the runtime initialises: set them in the launcher (docs/ascend-backend.md) as well; reading
them back here proves the process saw them, not that the runtime applied them.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any, MutableMapping

from hal.errors import HalError

#: environment variable -> required value
ENV = {
    "HCCL_DETERMINISTIC": "strict",        # deterministic collectives ("true" where strict is unsupported)
    "LCCL_DETERMINISTIC": "1",
    "ACL_PRECISION_MODE": "must_keep_origin_dtype",  # never silently lower bf16/fp32 operators' precision
    "VLLM_ASCEND_ENABLE_NZ": "0",          # vllm-ascend: keep weights in ND, never NZ
}
#: torch_npu attribute path -> required value
NPU_FLAGS = {
    "npu.matmul.allow_hf32": False,
    "npu.conv.allow_hf32": False,
    "npu.config.allow_internal_format": False,  # no private (NZ) formats for new tensors
}


class SettingsError(HalError):
    """A determinism/precision setting did not read back as required."""


@dataclass
class Surface:
    environ: MutableMapping[str, str]
    torch_npu: Any
    torch: Any


def real_surface() -> Surface:
    import torch
    import torch_npu

    return Surface(os.environ, torch_npu, torch)


def _resolve(root: Any, dotted: str) -> tuple[Any, str]:
    parts = dotted.split(".")
    for p in parts[:-1]:
        root = getattr(root, p)
    return root, parts[-1]


def apply(surface: Surface, hccl: str = "strict") -> None:
    """Set every knob. ``hccl`` is "strict" or "true" (for HCCL versions without strict)."""
    if hccl not in ("strict", "true"):
        raise SettingsError(f"HCCL_DETERMINISTIC must be 'strict' or 'true', got {hccl!r}")
    for key, value in ENV.items():
        surface.environ[key] = hccl if key == "HCCL_DETERMINISTIC" else value
    for dotted, value in NPU_FLAGS.items():
        obj, attr = _resolve(surface.torch_npu, dotted)
        setattr(obj, attr, value)
    surface.torch.use_deterministic_algorithms(True)


def read_back(surface: Surface) -> dict:
    """Every knob as it reads now (None where it is absent)."""
    out: dict[str, Any] = {f"env.{k}": surface.environ.get(k) for k in ENV}
    for dotted in NPU_FLAGS:
        try:
            obj, attr = _resolve(surface.torch_npu, dotted)
            out[f"torch_npu.{dotted}"] = getattr(obj, attr)
        except AttributeError:
            out[f"torch_npu.{dotted}"] = None
    out["torch.deterministic_algorithms"] = bool(surface.torch.are_deterministic_algorithms_enabled())
    return out


def expected(hccl: str = "strict") -> dict:
    want: dict[str, Any] = {f"env.{k}": (hccl if k == "HCCL_DETERMINISTIC" else v) for k, v in ENV.items()}
    want.update({f"torch_npu.{k}": v for k, v in NPU_FLAGS.items()})
    want["torch.deterministic_algorithms"] = True
    return want


def verify(readback: dict, hccl: str = "strict") -> None:
    """Raise SettingsError naming every knob that does not read back as required."""
    bad = [f"{k} = {readback.get(k)!r} (required {v!r})" for k, v in expected(hccl).items()
           if readback.get(k) != v]
    if bad:
        raise SettingsError("ascend: settings did not read back as required: " + "; ".join(bad))


def apply_and_verify(surface: Surface, hccl: str = "strict") -> dict:
    apply(surface, hccl)
    readback = read_back(surface)
    verify(readback, hccl)
    return readback


def fingerprint(readback: dict) -> str:
    """sha256 of the read-back settings (reported with the contract fingerprint)."""
    text = json.dumps(readback, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()
