"""A vendor's accelerator backend, reduced to its plumbing: it reuses the reference ops."""

from hal.backend import Probe
from hal.backends.reference import ReferenceBackend


class DummyBackend(ReferenceBackend):
    name = "dummy"
    description = "test accelerator (reference ops under another name)"
    kind = "accelerator"

    @classmethod
    def probe(cls):
        return Probe.ok("dummy:0")
