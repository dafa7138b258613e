"""Choosing the backend and contract that HAL ops run on.

Selection order for the backend: explicit argument > recipe > ``HAL_BACKEND`` > automatic (the
one available accelerator backend, else ``reference``). The contract: explicit argument >
``HAL_CONTRACT`` > the backend's first realised contract. A baseline backend (one that realises
no contract, like ``torch``) binds none and reports no fingerprint.

Two scopes: ``set_backend`` for the whole process, ``use`` as a context manager (restored on exit,
also on errors; per thread / task through a ContextVar).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from typing import Iterator

import torch

from hal.backend import Backend
from hal.contract import Contract, load_contract
from hal.errors import BackendUnavailableError, ContractMismatchError, HalError
from hal.registry import backend_class, describe_installed, discover

_active: contextvars.ContextVar[Backend | None] = contextvars.ContextVar("hal_active_backend", default=None)
_process_backend: Backend | None = None


def resolve_backend_name(explicit: str | None = None, recipe: str | None = None) -> tuple[str, str]:
    """(backend name, what chose it)."""
    if explicit:
        return explicit, "the explicit argument"
    if recipe:
        return recipe, "the recipe"
    env = os.environ.get("HAL_BACKEND", "").strip()
    if env:
        return env, "HAL_BACKEND"
    accelerators = []
    for name, info in discover().items():
        probe = info.probe() if info.kind == "accelerator" else None
        # An emulated accelerator (kernels run by an interpreter on the CPU) is never chosen automatically.
        if probe is not None and probe.available and not probe.details.get("emulated"):
            accelerators.append(name)
    if len(accelerators) > 1:
        raise HalError(f"several accelerator backends are available ({', '.join(accelerators)}); "
                       f"choose one with backend=..., the recipe's `backend:` or HAL_BACKEND")
    if accelerators:
        return accelerators[0], "automatic selection (the one available accelerator backend)"
    return "reference", "automatic selection (no accelerator backend is available)"


def resolve_contract(backend_cls: type[Backend], contract: str | Contract | None = None) -> Contract | None:
    """The contract a backend of class ``backend_cls`` binds: ``contract`` (a name, a path or a loaded
    Contract) > ``HAL_CONTRACT`` > the backend's first realised contract; None for a baseline, which
    binds none whatever was asked (``HAL_CONTRACT`` is process-wide, set for the contract side). Loads
    the contract but creates nothing: the vLLM front end resolves an engine's binding here without
    initialising an accelerator, and ``create_backend`` binds through the same function.
    Raises ``ContractMismatchError`` when the backend does not realise the contract."""
    if not backend_cls.contracts:
        return None
    if contract is None:
        contract = os.environ.get("HAL_CONTRACT", "").strip() or backend_cls.contracts[0]
    if not isinstance(contract, Contract):
        contract = load_contract(contract)
    if contract.name not in backend_cls.contracts:
        raise ContractMismatchError(
            f"backend {backend_cls.name!r} does not realise contract {contract.name!r}; it realises: "
            f"{', '.join(backend_cls.contracts)}. Choose one of those (contract=..., HAL_CONTRACT) or a "
            f"backend that realises {contract.name!r} (`hal doctor`, `hal contract list`).")
    backend_cls.check_realises(contract)  # its values within the backend's capabilities (UnsupportedError)
    return contract


def create_backend(backend: str | None = None, contract: str | Contract | None = None,
                   device: torch.device | str | None = None, *, recipe_backend: str | None = None) -> Backend:
    """Resolve, probe and instantiate a backend bound to a contract."""
    name, chosen_by = resolve_backend_name(backend, recipe_backend)
    cls = backend_class(name)
    probe = cls.probe()
    if not probe.available:
        raise BackendUnavailableError(
            f"backend {name!r} (chosen by {chosen_by}) is not available here: {probe.reason}\n"
            f"Installed backends:\n{describe_installed()}")
    return cls(resolve_contract(cls, contract), device)


def set_backend(backend: str | Backend | None = None, contract: str | Contract | None = None,
                device: torch.device | str | None = None) -> Backend:
    """Set the process-wide backend (used wherever no ``use`` block is active)."""
    global _process_backend
    _process_backend = backend if isinstance(backend, Backend) else create_backend(backend, contract, device)
    return _process_backend


@contextlib.contextmanager
def use(backend: str | Backend | None = None, contract: str | Contract | None = None,
        device: torch.device | str | None = None) -> Iterator[Backend]:
    """Run the enclosed HAL ops on ``backend`` bound to ``contract``; the previous choice is restored."""
    chosen = backend if isinstance(backend, Backend) else create_backend(backend, contract, device)
    token = _active.set(chosen)
    try:
        yield chosen
    finally:
        _active.reset(token)


def current() -> Backend:
    """The backend HAL ops run on now (created by automatic selection on first use)."""
    active = _active.get()
    if active is not None:
        return active
    if _process_backend is None:
        set_backend()
    return _process_backend


def active_fingerprint() -> str | None:
    """The fingerprint of the contract the current backend realises (None for a baseline)."""
    return current().fingerprint


def require_fingerprint(backend: Backend, expected: str | None, *, other_side: str = "the other side") -> None:
    """Raise if ``backend`` does not realise the contract with fingerprint ``expected``.

    Used wherever two sides must agree (engine and trainer, a backend and a recorded run).
    """
    if backend.fingerprint != expected:
        raise ContractMismatchError(
            f"contract mismatch: backend {backend.name!r} realises "
            f"{backend.contract or 'no contract'} (fingerprint {backend.fingerprint}), but {other_side} "
            f"expects fingerprint {expected}. Bind both sides to the same contract (HAL_CONTRACT / contract=...).")
