import os
import sys
from pathlib import Path

import pytest

# The cuda backend's kernels run under Triton's CPU interpreter in these tests when no GPU is
# present. The variable must be set before triton is first imported: triton decorates its own
# standard library (tl.sum, tl.cdiv, ...) at import time, interpreted or compiled.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

# The example backends import from here.
sys.path.insert(0, str(Path(__file__).parent.parent / "examples" / "broken_backend"))


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny shapes: OpenMP threads cost more than they save there, and stall when the CPU is shared
    (measured: 0.1 s vs 5 s for a stock-backend model test on a busy 2-core machine). Bits do not
    depend on it: the reference backend is thread-count invariant by construction."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
