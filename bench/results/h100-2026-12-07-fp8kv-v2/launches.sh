# Calls 2 and 3 of this folder (run from the checkout root on the warm machine, after call 1 installed the
# package into /tmp/site): v2's and the bf16 cache's decode launches, timed and bit-compared with the default.
cd bench && PYTHONPATH=/tmp/site:. timeout 140 python3 -c "
import torch, triton
from fp8_kv_f16_gpu import *
cuda=create_backend('cuda',V2)
for B,ctx,hq,hkv,d,pg in [(16,16384,32,8,128,64),(16,8192,40,8,128,32),(1,4096,32,8,128,64)]:
  cache,lists=filled_cache(V2.fp8,[ctx]*B,hkv,d,pg,'cuda',cuda)
  meta=build_metadata([1]*B,[ctx]*B,lists,'cuda'); q=rows(B,hq,d,5,'cuda'); s=d**-0.5
  base=attend(cuda,cache,q,meta,s)
  for v in [{},dict(split_parallel=True,splits_per_program=1),dict(split_parallel=True,splits_per_program=2),dict(split_parallel=True,splits_per_program=4),dict(num_warps=8),dict(num_stages=3),dict(num_stages=2),dict(head_split=2),dict(split_parallel=False)]:
    eq=torch.equal(attend(cuda,cache,q,meta,s,**v),base)
    t=triton.testing.do_bench_cudagraph(lambda: attend(cuda,cache,q,meta,s,**v),rep=30,return_mode='median')*1e3
    print(B,ctx,hq,pg,v,round(t,1),eq,flush=True)
" 2>&1 | tee $OUT/v2_launches.log | grep -v Warn

cd bench && PYTHONPATH=/tmp/site:. timeout 80 python3 -c "
import torch, triton
from fp8_kv_f16_gpu import *
cuda=create_backend('cuda',V2)
for B,ctx,hq,hkv,d,pg in [(16,16384,32,8,128,64),(16,8192,40,8,128,32),(4,8192,32,8,128,64),(64,8192,32,8,128,64)]:
  cache,lists=filled_cache(V2.fp8,[ctx]*B,hkv,d,pg,'cuda',cuda)
  meta=build_metadata([1]*B,[ctx]*B,lists,'cuda'); q=rows(B,hq,d,5,'cuda'); s=d**-0.5
  k,v=cache.read(torch.bfloat16)
  f=lambda **o: cuda._attention.paged_attention(q,k,v,meta.query_start_loc.int(),meta.seq_lens.int(),meta.block_table.int(),s,cuda.contract.attention,policy=cuda._launch,**o)
  base=cuda.attention(q,k,v,meta,scale=s)
  for o in [{},dict(split_parallel=True,splits_per_program=1),dict(split_parallel=True,splits_per_program=2),dict(split_parallel=True,splits_per_program=4)]:
    eq=torch.equal(f(**o),base)
    t=triton.testing.do_bench_cudagraph(lambda: f(**o),rep=30,return_mode='median')*1e3
    print('bf16',B,ctx,hq,pg,o,round(t,1),eq,flush=True)
  for o in [{},dict(split_parallel=True,splits_per_program=4)]:
    t=triton.testing.do_bench_cudagraph(lambda: attend(cuda,cache,q,meta,s,**o),rep=30,return_mode='median')*1e3
    print('v2',B,ctx,hq,pg,o,round(t,1),flush=True)
" 2>&1 | tee $OUT/bf16_launches.log | grep -v Warn
