"""What the ascend backend needs on this host, and exactly what is missing.

Kept apart from the ops so ``hal doctor`` stays cheap and the logic is testable without an NPU:
every check goes through ``import_module`` / ``lookup_op`` (module-level functions tests can
replace) and ``sys.modules`` (where tests put fake modules). Nothing here touches a device
beyond asking torch_npu how many there are.

Pieces, per path (``HAL_ASCEND_PATH``):
  both    torch_npu, the CANN toolkit (its environment from ``set_env.sh``), an NPU device
  cann    the batch-invariant op package (``import batch_invariant_ops`` registers
          ``torch.ops.batch_invariant_ops.*``, installed by the op package's .run installer into
          ``ASCEND_CUSTOM_OPP_PATH``) and its batch-invariant fused-inference-attention variant.
          flash-attention-npu (module ``flash_attn_npu_3``, renamed from ``flash_attn_npu_v3``) can be
          chosen but is reported as unable to realise any shipped contract (mapping.attention_args)
  triton  triton-ascend: reported unavailable on an NPU whatever is installed (the shared kernels need
          rounding guarantees and bitcasts it does not give: api_facts.toml [triton_ascend]); it runs
          only as CPU emulation under TRITON_INTERPRET=1
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field

PATHS = ("cann", "triton")
DEFAULT_PATH = "cann"
ATTENTION_IMPLS = ("fia_batch_invariant", "flash_attn_npu_3")
DEFAULT_ATTENTION_IMPL = "fia_batch_invariant"

OP_NAMESPACE = "batch_invariant_ops"
OP_PACKAGE = "batch_invariant_ops"  # the Python package whose import registers the ops
#: ops of the package each op of the cann path calls (torch.ops.batch_invariant_ops.<name>)
CANN_OPS = ("npu_mm_batch_invariant", "npu_reduce_sum_batch_invariant")
FIA_OP = "npu_fused_infer_attention_score_batch_invariant"
FLASH_MODULE, FLASH_FUNC = "flash_attn_npu_3", "flash_attn_with_kvcache"  # renamed from flash_attn_npu_v3
TRITON_ASCEND_BACKENDS = ("triton.backends.ascend", "triton.backends.cann")
CANN_ENV = ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")


def import_module(name: str):
    """The import hook every check uses (tests replace it or put fakes in sys.modules)."""
    return importlib.import_module(name)


def lookup_op(namespace: str, name: str):
    """``torch.ops.<namespace>.<name>`` or None when it is not registered."""
    import torch

    try:
        return getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return None


def resolve_path(path: str | None = None) -> str:
    """The NPU path: the explicit argument, else ``HAL_ASCEND_PATH``, else ``cann``."""
    chosen = (path or os.environ.get("HAL_ASCEND_PATH", "") or DEFAULT_PATH).strip().lower()
    if chosen not in PATHS:
        from hal.errors import UnsupportedError

        raise UnsupportedError(f"HAL_ASCEND_PATH / path must be one of {PATHS}, got {chosen!r}")
    return chosen


def resolve_attention_impl(impl: str | None = None) -> str:
    chosen = (impl or os.environ.get("HAL_ASCEND_ATTENTION", "") or DEFAULT_ATTENTION_IMPL).strip()
    if chosen not in ATTENTION_IMPLS:
        from hal.errors import UnsupportedError

        raise UnsupportedError(f"HAL_ASCEND_ATTENTION must be one of {ATTENTION_IMPLS}, got {chosen!r}")
    return chosen


@dataclass
class Diagnosis:
    """Every missing piece (in a fixed order, torch_npu first) and what was found."""

    path: str
    attention_impl: str
    missing: list[str] = field(default_factory=list)
    found: dict = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return not self.missing

    @property
    def reason(self) -> str:
        return "; ".join(self.missing)


def _try_import(name: str):
    try:
        return import_module(name), None
    except Exception as exc:  # ImportError, or OSError from a missing shared library
        return None, f"{type(exc).__name__}: {exc}"


def diagnose(path: str | None = None, attention_impl: str | None = None,
             environ: dict | None = None) -> Diagnosis:
    """Check every prerequisite of ``path``; never raises for a missing piece."""
    environ = os.environ if environ is None else environ
    d = Diagnosis(resolve_path(path), resolve_attention_impl(attention_impl))

    torch_npu, err = _try_import("torch_npu")
    if torch_npu is None:
        hint = " (it needs the CANN libraries: source the toolkit's set_env.sh)" \
            if err and ("libascend" in err or "libhccl" in err or "OSError" in err) else ""
        d.missing.append(f"torch_npu is not importable ({err}){hint}; install the 'ascend' extra on an NPU host")
    else:
        d.found["torch_npu"] = getattr(torch_npu, "__version__", "unknown")

    cann_home = next((environ[k] for k in CANN_ENV if environ.get(k)), None)
    if cann_home is None:
        d.missing.append(f"the CANN toolkit environment is not set (none of {', '.join(CANN_ENV)}); "
                         "source <toolkit>/set_env.sh")
    else:
        d.found["cann"] = cann_home

    if d.path == "cann":
        package, err = _try_import(OP_PACKAGE)
        if package is None:
            d.missing.append(f"the CANN batch-invariant op package is not importable "
                             f"(import {OP_PACKAGE}: {err})")
        else:
            absent = [op for op in CANN_OPS + (FIA_OP,)
                      if lookup_op(OP_NAMESPACE, op) is None]
            if absent:
                d.missing.append("the batch-invariant op package lacks "
                                 + ", ".join(f"torch.ops.{OP_NAMESPACE}.{op}" for op in absent))
            else:
                d.found["batch_invariant_ops"] = getattr(package, "__version__", "present")
        if d.attention_impl == "flash_attn_npu_3":
            flash, err = _try_import(FLASH_MODULE)
            if flash is not None:
                d.found["flash_attn_npu_3"] = getattr(flash, "__version__", "present")
            # Whether or not it is installed: its softmax steps over 512 keys with exp and an fp32-P row
            # sum, which no shipped contract (kv_chunk 64 or 128) is.
            d.missing.append("flash-attention-npu (flash_attn_npu_3) realises no shipped contract: its softmax "
                             "steps over 512 keys whatever the page size; choose HAL_ASCEND_ATTENTION="
                             "fia_batch_invariant")
    else:
        triton, err = _try_import("triton")
        if triton is None:
            d.missing.append(f"triton-ascend is not importable (import triton: {err})")
        else:
            backend = None
            for name in TRITON_ASCEND_BACKENDS:
                mod, _ = _try_import(name)
                if mod is not None:
                    backend = name
                    break
            if backend is None:
                d.missing.append(f"triton {getattr(triton, '__version__', '?')} is not triton-ascend "
                                 f"(none of {', '.join(TRITON_ASCEND_BACKENDS)} is importable)")
            else:
                d.found["triton"] = f"{getattr(triton, '__version__', '?')} ({backend})"
        d.missing.append(triton_ascend_refusal())

    if torch_npu is not None:
        try:
            count = int(torch_npu.npu.device_count()) if torch_npu.npu.is_available() else 0
        except Exception as exc:  # a broken driver must read as "no device", with the reason
            count, d.found["device_error"] = 0, f"{type(exc).__name__}: {exc}"
        if count == 0:
            d.missing.append("no NPU device is visible to torch_npu (torch_npu.npu.is_available() is False)")
        else:
            d.found["devices"] = count
    else:
        d.missing.append("no NPU device can be checked without torch_npu")
    return d


def triton_ascend_refusal() -> str:
    """Why the triton path cannot realise the contract on an NPU (from api_facts.toml)."""
    from hal.backends.ascend import api_facts

    t = api_facts.triton_ascend()
    return (f"the triton path cannot realise the contract on an NPU ({t['version']}): it ignores "
            f"{', '.join(t['ignored_launch_options'])} (FMA contraction is not ruled out), lowers "
            f"{' and '.join(t['no_rounding_guarantee'])} to plain divide/sqrt (no rounding guarantee), and does "
            f"not support {'; '.join(t['unsupported'])}; its adapter fails on "
            f"{'; '.join(api_facts.triton_ascend_compile()['adapter_failures'])}; use HAL_ASCEND_PATH=cann")
