"""The cuda backend's GEMM, attention and logprobs kernels as first measured on the H200
(commit b7c66ae, bench/results/h200-2026-11-29), kept unchanged as a yardstick.

``bench/bench_cuda.py`` times them side by side with the current kernels, and ``bench/equal_v0.py``
checks that the current kernels give bitwise the same outputs (the speed work was not allowed to
change a single bit). Not part of the package; nothing in ``hal`` imports this.
"""
