"""The int8 indexed decode kernel (issue #7) by programs per SM (choose_splits), launch setting and
dequantization, at 8 x 32K and 1 x 128K keys (separate K and V pools, random page tables), beside bf16
at its default launch. Run on a GPU: python benchmarks/gpu_kv_quant_splits.py (JSON to $OUT).
benchmarks/gpu_kv_quant.py times the chosen settings in the engine."""
import json, os, torch
from turnkv.attention.triton import decode as K
from turnkv.kv import quant
dev = torch.device("cuda"); sms = torch.cuda.get_device_properties(0).multi_processor_count
H, G, D = 8, 4, 128
rows = []
def time_graphed(fn, calls=8, repeat=15):
    fn(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls): fn()
    g.replay(); torch.cuda.synchronize(); ts = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b) / calls * 1e3)
    return sorted(ts)[len(ts) // 2]
for B, S in ((8, 32768), (1, 129536)):
    torch.manual_seed(1); ps = 16
    num_pages = B * H * S // ps + 8
    table = torch.randperm(num_pages, device=dev)[: B * H * (S // ps)].view(B, H, S // ps).to(torch.int32)
    lengths = torch.full((B, H), S, dtype=torch.int32, device=dev)
    q = torch.randn(B, H * G, D, dtype=torch.bfloat16, device=dev)
    kb = torch.randn(num_pages, ps, D, device=dev, dtype=torch.bfloat16)
    vb = torch.randn(num_pages, ps, D, device=dev, dtype=torch.bfloat16)
    sp = K.choose_splits(B * H, S, sms)
    bf = time_graphed(lambda: K.indexed_decode(q, kb, vb, table, lengths, sp))
    kc, ks = quant.quantize(kb.view(-1, D), torch.int8)
    vc, vs = quant.quantize(vb.view(-1, D), torch.int8)
    del kb, vb; torch.cuda.empty_cache()
    kc, vc = kc.view(num_pages, ps, D), vc.view(num_pages, ps, D)
    ks, vs = ks.view(num_pages, ps).contiguous(), vs.view(num_pages, ps).contiguous()
    floor = B * H * S * (2 * D + 8) / 2.9e12 * 1e6
    for dq in ("cast", "f16asm"):
        for bn, w in ((128, 4), (128, 2), (64, 2), (256, 4)):
            for st in (2, 3):
                for P in (6, 8, 12, 16):
                    splits = K.choose_splits(B * H, S, sms, programs_per_sm=P)
                    cfg = dict(block_n=bn, num_warps=w, num_stages=st)
                    try:
                        t = time_graphed(lambda: K.indexed_decode(q, kc, vc, table, lengths, splits, config=cfg, k_scale=ks, v_scale=vs, dequant=dq))
                    except Exception as e:
                        print("error", dq, cfg, str(e)[:120]); continue
                    r = dict(B=B, S=S, dq=dq, bn=bn, w=w, st=st, P=P, splits=splits, us=round(t, 1), bf16_us=round(bf, 1),
                             speedup=round(bf / t, 3), of_floor_2p9=round(floor / t, 3))
                    rows.append(r); print(json.dumps(r), flush=True)
    del kc, vc; torch.cuda.empty_cache()
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "gpu_kv_quant_splits.json"), "w"), indent=1)
rows.sort(key=lambda r: (r["B"], r["us"]))
print("B S dq bn w st P splits us bf16 speedup of_floor")
for r in rows:
    print(*r.values())
