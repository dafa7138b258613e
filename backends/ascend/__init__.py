"""The ``ascend`` backend: the contract on Huawei Ascend NPUs through torch_npu / CANN.

Installed as ``hal.backends.ascend``. This module stays cheap to import: torch_npu is imported
inside ``probe()`` only.

Status: the NPU ops are not written yet (issue "Ascend backend"), so ``probe()`` checks the real
prerequisites and then reports the backend as unavailable. It must never claim availability
before its ops exist and pass the conformance kit.
"""

from __future__ import annotations

from hal.backend import Backend, Probe


class AscendBackend(Backend):
    name = "ascend"
    description = "torch_npu / CANN ops for Huawei Ascend NPUs"
    kind = "accelerator"
    contracts = ("bf16-dense-v1",)

    @classmethod
    def probe(cls) -> Probe:
        try:
            import torch_npu  # noqa: F401
        except ImportError as exc:
            return Probe.missing(f"torch_npu is not importable ({exc}); install the 'ascend' extra on an NPU host")
        import torch

        if not torch.npu.is_available():
            return Probe.missing("torch_npu is installed but no NPU device is visible")
        return Probe.missing("the NPU ops of this backend are not implemented in this version")
