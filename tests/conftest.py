import os
import sys
from pathlib import Path

# The cuda backend's kernels run under Triton's CPU interpreter in these tests when no GPU is
# present. The variable must be set before triton is first imported: triton decorates its own
# standard library (tl.sum, tl.cdiv, ...) at import time, interpreted or compiled.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

# The example backends import from here.
sys.path.insert(0, str(Path(__file__).parent.parent / "examples" / "broken_backend"))
