"""Running the shared Triton kernels under Triton's CPU interpreter (``TRITON_INTERPRET=1``), for CI.

The interpreter evaluates ``tl.dot`` with one numpy matmul per tile. Numpy's BLAS may round a row
differently depending on its position inside the tile (seen with OpenBLAS' Haswell kernel on rows
6-15 of 16), which would make bitwise batch-invariance depend on the CI host, not on our kernels.
``patch_row_dot`` makes the interpreter's dot compute each row with its own matmul, so a row's
bits depend only on that row, as on the GPU. Nothing else of the interpreter is changed.
"""

from __future__ import annotations

import numpy as np

_patched = False


def patch_row_dot() -> None:
    global _patched
    if _patched:
        return
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.data.ndim != 2 or a.dtype.primitive_bitwidth == 8:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        rows = [np.matmul(a.data[i:i + 1], b.data, dtype=d.data.dtype) for i in range(a.data.shape[0])]
        return interpreter.TensorHandle(np.concatenate(rows) + d.data, d.dtype.scalar)

    builder.create_dot = create_dot
    _patched = True
