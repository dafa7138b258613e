"""The ``cuda`` backend: Triton kernels that realise the contract on NVIDIA GPUs.

Installed as ``hal.backends.cuda``. This module stays cheap to import: triton and the kernels are
imported inside ``probe()`` and the op methods only.

Status: the kernels are not written yet (issue "CUDA backend"), so ``probe()`` checks the real
prerequisites and then reports the backend as unavailable. It must never claim availability
before its kernels exist and pass the conformance kit.
"""

from __future__ import annotations

from hal.backend import Backend, Probe

MIN_CAPABILITY = (8, 0)  # bf16 tensor-core MMA


class CudaBackend(Backend):
    name = "cuda"
    description = "Triton kernels for NVIDIA GPUs"
    kind = "accelerator"
    contracts = ("bf16-dense-v1",)

    @classmethod
    def probe(cls) -> Probe:
        try:
            import triton  # noqa: F401
        except ImportError as exc:
            return Probe.missing(f"triton is not importable ({exc}); install the 'cuda' extra")
        import torch

        if not torch.cuda.is_available():
            return Probe.missing(f"no CUDA device visible to torch {torch.__version__} "
                                 f"(built with CUDA {torch.version.cuda})")
        capability = torch.cuda.get_device_capability()
        if capability < MIN_CAPABILITY:
            return Probe.missing(f"compute capability {capability} < {MIN_CAPABILITY} required for bf16 MMA")
        return Probe.missing("the Triton kernels of this backend are not implemented in this version")
