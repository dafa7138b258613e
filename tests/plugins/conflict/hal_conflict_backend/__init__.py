from hal.backend import Probe
from hal.backends.reference import ReferenceBackend


class OtherDummy(ReferenceBackend):
    name = "dummy"
    kind = "accelerator"

    @classmethod
    def probe(cls):
        return Probe.ok("other:0")
