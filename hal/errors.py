"""The one error hierarchy of the HAL.

Every message says what was received, what was expected and, where there is one, how to fix it.
"""

from __future__ import annotations


class HalError(Exception):
    """Base class of every error the HAL raises on purpose."""


class ContractError(HalError):
    """A contract file is malformed: unknown key, wrong type, bad value or impossible combination."""

    def __init__(self, source: str, key: str, found: object, expected: str):
        self.source, self.key, self.found, self.expected = source, key, found, expected
        super().__init__(f"{source}: {key} = {found!r}: expected {expected}")


class UnknownContractError(HalError):
    """No contract of that name is shipped or was given as a path."""


class BackendNotFoundError(HalError):
    """No installed backend has the requested name."""


class BackendLoadError(HalError):
    """A backend's entry point is installed but importing it raised."""


class BackendConflictError(HalError):
    """Two installed packages register a backend under the same name."""


class BackendUnavailableError(HalError):
    """The backend is installed but its probe says it cannot run here."""


class UnsupportedError(HalError):
    """The backend cannot honour the contract for this call (dtype, shape, option).

    Raised instead of silently falling back to an op that does not realise the contract.
    """


class ContractMismatchError(HalError):
    """Two sides (engine and trainer, or a backend and a caller) bound different contracts."""


class WeightSyncError(HalError):
    """After a weight sync the rollout engine does not hold exactly the trainer's weights (or a sync that
    must be in place allocated new buffers)."""
