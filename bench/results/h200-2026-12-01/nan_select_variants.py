import importlib, sys, torch
sys.path.insert(0, sys.argv[1])
mods = {n: importlib.import_module(n) for n in ["attn_old", "attn_new", "attn_v2", "attn_v3", "attn_v4"]}
g = torch.Generator().manual_seed(0)

def rnd(shape, dtype):
    return torch.randn(*shape, generator=g).to(dtype).cuda()

def case(seq_lens, q_lens, hq, hkv, d, page, dtype):
    pages = [-(-n // page) for n in seq_lens]
    total = sum(pages)
    perm = torch.randperm(total, generator=g).tolist()
    width = max(pages)
    bt = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    at = 0
    for i, p in enumerate(pages):
        bt[i, :p] = torch.tensor(perm[at:at + p]); at += p
    k = rnd((total, page, hkv, d), dtype); v = rnd((total, page, hkv, d), dtype)
    q = rnd((sum(q_lens), hq, d), dtype)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32).cuda()
    return (q, k, v, qsl, torch.tensor(seq_lens, dtype=torch.int32).cuda(), bt.cuda(), d ** -0.5, 64, 512)

lens = torch.randint(1, 5000, (64,), generator=g).tolist()
cases = {"mixed fp32": ([2100, 600], [300, 1], 16, 2, 64, 16, torch.float32),
         "decode B=64 bf16": (lens, [1] * 64, 32, 8, 128, 16, torch.bfloat16),
         "mixed bf16": ([2100, 600, 17], [300, 1, 17], 32, 8, 128, 16, torch.bfloat16),
         "page5 bf16": ([530, 90], [40, 90], 16, 16, 64, 5, torch.bfloat16),
         "prefill 4096 bf16": ([4096], [4096], 32, 8, 128, 64, torch.bfloat16)}
for name, c in cases.items():
    args = case(*c)
    ref = mods["attn_old"].paged_attention(*args)
    ref2 = mods["attn_old"].paged_attention(*args)
    line = [f"{name:18s} old-vs-old {'eq' if torch.equal(ref, ref2) else 'NE'}"]
    for n in ["attn_new", "attn_v2", "attn_v3", "attn_v4"]:
        for lc in (dict(), dict(split_parallel=True), dict(split_parallel=False, block_q=4, num_warps=4)):
            out = mods[n].paged_attention(*args, **lc)
            ne = (out != ref) & ~(out.isnan() & ref.isnan())
            tag = "eq" if torch.equal(out, ref) else f"NE({int(ne.sum())},nan={int(out.isnan().sum())},max={float((out.float()-ref.float()).abs().nan_to_num(99).max()):.2g})"
            line.append(f"{n[5:]}{list(lc.keys())[:1]}:{tag}")
    print(" ".join(line), flush=True)
