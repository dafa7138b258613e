"""What a vLLM engine binds: a HAL backend name and contract, and the check that both sides agree.

This module imports no vLLM: the trainer uses it to refuse comparing or training across a
mismatch, and the plugin uses it to decide (once, in the process that builds the engine's config)
what every engine process must bind.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from hal.api import resolve_backend_name, resolve_contract
from hal.backend import Backend
from hal.errors import ContractMismatchError, HalError
from hal.registry import backend_class

#: the ``quantization=`` name of the plugin (and the ``quant_method`` of an HF quantization_config)
QUANT_METHOD = "hal"

#: keys accepted in ``hf_overrides={"quantization_config": {"quant_method": "hal", ...}}``
OPTION_KEYS = ("quant_method", "backend", "contract")

#: environment variables that select kernels (or the backend / contract): part of a binding's identity,
#: because two processes with the same backend name and contract but different values of these can
#: run different kernels (another op package, another attention path, Triton's interpreter)
KERNEL_ENVIRONMENT = ("HAL_BACKEND", "HAL_CONTRACT", "HAL_ASCEND_PATH", "HAL_ASCEND_ATTENTION", "TRITON_INTERPRET")

#: the ``SamplingParams.extra_args`` key that carries a request's seed to the HAL sampler in vLLM
SEED_ARG = "hal_seed"


def kernel_environment() -> tuple[tuple[str, str], ...]:
    """This process's values of ``KERNEL_ENVIRONMENT`` (unset variables left out), sorted by name."""
    return tuple((name, os.environ[name]) for name in KERNEL_ENVIRONMENT if name in os.environ)


@dataclass(frozen=True)
class EngineBinding:
    """The HAL backend and contract an engine routes its ops through.

    ``contract`` and ``fingerprint`` are None for a baseline backend (``torch``), which claims nothing.
    ``environment``: the kernel-selecting environment variables (``KERNEL_ENVIRONMENT``) of the process
    that resolved it, as sorted (name, value) pairs.
    """

    backend: str
    contract: str | None
    fingerprint: str | None
    environment: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):              # from a dict / JSON the pairs arrive as lists
        object.__setattr__(self, "environment", tuple(tuple(pair) for pair in self.environment))

    def describe(self) -> str:
        env = " ".join(f"{k}={v}" for k, v in self.environment) or "none set"
        if self.fingerprint is None:
            return f"backend {self.backend!r} (no contract; kernel environment: {env})"
        return (f"backend {self.backend!r}, contract {self.contract} (fingerprint {self.fingerprint[:16]}; "
                f"kernel environment: {env})")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def resolve_binding(options: Mapping[str, Any] | None = None) -> EngineBinding:
    """The binding for an engine: ``options`` (backend / contract) > ``HAL_BACKEND`` / ``HAL_CONTRACT``
    > automatic selection, through the same ``hal.api.resolve_contract`` as ``create_backend``. Resolves
    names only (no backend is created here: this runs in the front-end process, which must not initialise
    an accelerator)."""
    options = dict(options or {})
    unknown = sorted(set(options) - set(OPTION_KEYS))
    if unknown:
        raise HalError(f"hal vLLM plugin: unknown option(s) {unknown} in the quantization_config; "
                       f"accepted: {list(OPTION_KEYS)}")
    name, _ = resolve_backend_name(options.get("backend") or None)
    cls = backend_class(name)
    if not cls.contracts and options.get("contract"):
        # create_backend ignores a contract for a baseline; an engine's options naming one are a mistake
        raise ContractMismatchError(f"hal vLLM plugin: backend {name!r} realises no contract; drop contract="
                                    f"{options['contract']!r} from the quantization_config or choose a "
                                    f"contract backend")
    contract = resolve_contract(cls, options.get("contract") or None)
    if contract is None:
        return EngineBinding(name, None, None, kernel_environment())
    return EngineBinding(name, contract.name, contract.fingerprint, kernel_environment())


def binding_of(backend: Backend) -> EngineBinding:
    """The binding a trainer-side backend instance represents (with this process's kernel environment)."""
    return EngineBinding(backend.name, backend.contract.name if backend.contract is not None else None,
                         backend.fingerprint, kernel_environment())


def require_same_binding(engine: EngineBinding, trainer: Backend) -> None:
    """Refuse to compare or train across engine and trainer bound to different backends, contracts or
    kernel environments."""
    mine = binding_of(trainer)
    if engine != mine:
        raise ContractMismatchError(
            f"engine/trainer mismatch: the vLLM engine bound {engine.describe()}, the trainer runs "
            f"{mine.describe()}. Their logprobs are not comparable bit for bit; bind both sides to the "
            f"same backend and contract (recipe `backend:` / HAL_BACKEND, HAL_CONTRACT) and run them with the "
            f"same values of {', '.join(KERNEL_ENVIRONMENT)}.")
