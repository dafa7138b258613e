"""The Triton kernels that realise the contract, shared by every vendor that runs Triton.

One module per op family; each opens with the reduction order it realises and reads that order
from the contract's sections (``hal.contract.Gemm``, ``Attention``, ...), never from loose numbers:
  gemm.py       GEMM: K chunks of [gemm].k_chunk, ascending; direct or split-K launches
  attention.py  unified paged attention: KV chunks of [attention].kv_chunk, splits of kv_split
  rows.py       RMSNorm (+residual), sum/mean: row blocks; SiLU*up and rotary (pointwise)
  logprobs.py   log-softmax / token logprobs: vocabulary chunks of [logprobs].vocab_chunk
  common.py     the bf16 rounding and the launch options every kernel shares
  interpreter.py  Triton's CPU interpreter made row-exact, for CI
  policy.py     ``LaunchPolicy``: what a vendor decides about a launch (tiles, waves), never the bits
  realises.py   which contract values the kernels' source can realise, as data

Vendor knowledge lives in the vendor folders and comes in as a ``LaunchPolicy``:
``hal.backends.cuda`` (the GPU's multiprocessor count) and ``hal.backends.ascend`` (tiles that fit
the unified buffer). Importing this package is cheap: triton is imported by the kernel modules only.
"""
