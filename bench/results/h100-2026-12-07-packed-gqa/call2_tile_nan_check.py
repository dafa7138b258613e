"""Call 2 of this folder (run as bench/_diag_tmp.py, a copy, on the warm H100 after call 1; the tree of
8dc1a91): the chunked-prefill case of attention_ab_gpu.py (NaN / Inf planted) at 40/8 and 32/8 heads, the new kernel's
launches against its padded default launch, bit patterns of the differing elements. Command, from /tmp on the GPU
machine after h200.sh installed the checkout: PYTHONPATH=/tmp/site:$REPO/bench python3 $REPO/bench/_diag_tmp.py"""
import sys, torch
sys.path.insert(0, "bench")
from attention_ab_gpu import _poison
from bench_cuda import paged_problem
from hal.api import create_backend
from hal.backends.cuda.launch import CUDA_LAUNCH
from hal.kernels import attention
spec = create_backend("cuda").contract.attention
torch.manual_seed(0)
for hq in (40, 32):
    q, kc, vc, meta = paged_problem([3000, 700, 40], [700, 700, 1], hq, 8, 128, 16)
    _poison(kc, vc, meta)
    args = (q, kc, vc, meta.query_start_loc, meta.seq_lens, meta.block_table, 128 ** -0.5, spec)
    outs = {name: attention.paged_attention(*args, policy=CUDA_LAUNCH, **kw).view(torch.int16) for name, kw in
            [("packed", dict(packed_heads=True)), ("padded", dict(packed_heads=False)), ("bq8", dict(block_q=8, packed_heads=False)),
             ("bq4", dict(block_q=4, packed_heads=False)), ("bq16w8", dict(block_q=16, num_warps=8, packed_heads=False))]}
    base = outs["padded"]
    for name, o in outs.items():
        diff = o != base
        n = int(diff.sum())
        bf = o.view(torch.bfloat16).float(); bb = base.view(torch.bfloat16).float()
        both_nan = int((diff & torch.isnan(bf) & torch.isnan(bb)).sum())
        pats = sorted(set(zip(o[diff].tolist()[:2000], base[diff].tolist()[:2000])))[:6]
        print(hq, name, "differ", n, "both NaN", both_nan, "patterns", [(hex(a & 0xffff), hex(b & 0xffff)) for a, b in pats], flush=True)
