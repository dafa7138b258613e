"""hal: a numerical-contract hardware abstraction layer for bitwise-consistent RL training and rollout.

    import hal
    with hal.use("reference"):                 # or hal.set_backend("cuda") for the whole process
        y = hal.ops.linear(x, w)
        print(hal.active_fingerprint())

The contract (``hal.contract``, data in ``contracts/``) pins what decides the bits; backends
(``hal.backend.Backend``, found by ``hal.registry`` through entry points) realise it.
"""

from hal import ops
from hal.api import active_fingerprint, create_backend, current, set_backend, use
from hal.backend import AttentionMetadata, Backend, Probe
from hal.contract import Contract, available_contracts, load_contract
from hal.errors import HalError

__version__ = "0.1.0"

__all__ = [
    "AttentionMetadata", "Backend", "Contract", "HalError", "Probe", "active_fingerprint",
    "available_contracts", "create_backend", "current", "load_contract", "ops", "set_backend", "use",
]
