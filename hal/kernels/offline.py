"""Compiling a kernel for Hopper (sm_90) on a machine without a GPU: what bench/sm90_report.py reports on and
what tests/test_fp8_sm90.py checks the Gluon FP8 GEMM's schedule with."""

from __future__ import annotations


def compile_for_hopper(kernel, types: dict, constants: dict, num_warps: int, num_stages: int, not16=(),
                       gluon: bool = False, maxnreg: int | None = None):
    """``kernel`` (a Triton or, with ``gluon``, a Gluon jit function) compiled for sm_90 with the argument
    properties real calls have: every pointer and integer argument 16-divisible (aligned pointers, strides
    and sizes that are multiples of 16: without it the compiler cannot vectorise loads) except those in
    ``not16``. types: argument name -> Triton type string, for every non-constexpr argument; FMA contraction
    off, as every launch here (``common.LAUNCH``); ``maxnreg``: the launch's register limit per thread, if any."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, attrs = {}, {}
    for index, name in enumerate(kernel.arg_names):
        if name in constants:
            signature[name] = "constexpr"
            continue
        signature[name] = types[name]
        if name not in not16 and not types[name].startswith(("fp", "tensordesc")):
            attrs[(index,)] = [["tt.divisibility", 16]]
    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource as source_type
    else:
        source_type = ASTSource
    source = source_type(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=False,
                                       maxnreg=maxnreg))
