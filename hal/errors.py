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


# -- the model, its checkpoints and training -------------------------------------------------------

class CheckpointError(HalError):
    """A checkpoint directory is missing files or tensors, holds tensors of the wrong shape, or a file
    that cannot be read (not JSON, not safetensors, truncated, keys missing or of the wrong type).

    (``hal.model.CheckpointError``: the model's HF weights. A training run's resume checkpoint raises
    ``TrainingCheckpointError``.)"""


class TrainingCheckpointError(HalError):
    """A training checkpoint cannot be resumed: it is damaged, not a hal checkpoint, or written for other
    steps. (``hal.rl.CheckpointError`` is this class.)"""


class WeightsChangedError(HalError):
    """A tensor saved by the forward was modified in place before the backward used it."""


class DivergedError(HalError):
    """Training produced a non-finite logprob, loss or weight; the run stopped before recording the step."""


class RecipeError(HalError):
    """A recipe (or an override of it) is malformed or cannot run here; nothing was started."""


# -- tools -----------------------------------------------------------------------------------------

class NothingComparedError(HalError):
    """The two traces had no (op, position) pair in common: "no divergence" would mean nothing."""


# -- integrations ----------------------------------------------------------------------------------

class VllmVersionError(HalError):
    """The installed vLLM is not one the plugin supports: refusing beats routing half the ops."""
