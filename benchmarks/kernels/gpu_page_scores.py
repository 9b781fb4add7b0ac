"""LServe's page scores (turnkv/attention/triton/page_select.py `page_scores`) at 128K, Llama-3.1-8B
shape (8 KV heads, 32 query heads, head dim 128), 64-token physical pages of 16-token logical ones, 16-token
pool pages in shuffled order, half the KV heads selecting (the others hold a short streaming ring), as
CUDA-graph replays of all 32 layers' calls (each layer its own statistics, so L2 holds none of them).
Checks each launch setting against the torch reference first, then prints microseconds per layer beside
the floor: the selecting heads' statistics bytes over the copy bandwidth measured here. JSON to
$OUT/page_scores.json.

    python benchmarks/kernels/gpu_page_scores.py     # H100: ~1 min
"""
import json
import os
import sys

import torch

sys.path.insert(0, ".")
from benchmarks.gpu_timing import time_graphed  # noqa: E402
from turnkv.attention.triton import page_select  # noqa: E402
from turnkv.bench import hardware  # noqa: E402
from turnkv.methods.lserve.selector import SelectorConfig, graph_page_scores_reference  # noqa: E402

L, H, G, D, PS, CONTEXT = 32, 8, 4, 128, 16, 129536
PHYS, LOGICAL = 64, 16
P = 131072 // PS  # the graph's page-table width at max_model_len 131072
num_phys = P * PS // PHYS


torch.manual_seed(0)
dev = "cuda"
pages = H * P
kmax = [torch.randn(pages + 1, D, device=dev, dtype=torch.bfloat16) for _ in range(L)]
kmin = [k - torch.rand_like(k) for k in kmax]
table = torch.randperm(pages, device=dev).view(1, H, P).to(torch.int32)
lengths = torch.full((1, H), CONTEXT, device=dev, dtype=torch.int32)
lengths[0, 1::2] = 320  # streaming heads: sink + local ring
q = torch.randn(1, H * G, D, device=dev, dtype=torch.bfloat16)
cfg = SelectorConfig(physical_page=PHYS, logical_page=LOGICAL)
want = graph_page_scores_reference(q, kmax[0], kmin[0], table, lengths, num_phys, cfg, PS)
copy = hardware.copy_bandwidth(torch.device(dev))
floor_us = (H // 2) * (CONTEXT // LOGICAL) * 2 * D * 2 / copy * 1e6
rows = []
for rpp in (16, 32, 64):
    for warps in (2, 4, 8):
        got = page_select.page_scores(q, kmax[0], kmin[0], table, lengths, num_phys, PHYS, LOGICAL, PS,
                                      rows_per_program=rpp, num_warps=warps)
        err = (got - want).abs().nan_to_num().max().item()
        same_inf = torch.equal(torch.isinf(got), torch.isinf(want))
        us = time_graphed(lambda: [page_select.page_scores(q, kmax[i], kmin[i], table, lengths, num_phys, PHYS,
                                                           LOGICAL, PS, rows_per_program=rpp, num_warps=warps)
                                   for i in range(L)], calls=1, warmup=1, back_to_back=True) * 1e6 / L
        rows.append(dict(rows_per_program=rpp, num_warps=warps, us_per_layer=us, floor_us=floor_us,
                         of_floor=floor_us / us, max_abs_err=err, same_inf=same_inf))
        print(f"rows/program {rpp:3d} warps {warps}: {us:6.2f} us per layer (floor {floor_us:.2f}, "
              f"{floor_us / us:.2f}); max err {err:.2e}, -inf agree {same_inf}", flush=True)
with open(os.path.join(os.environ.get("OUT", "."), "page_scores.json"), "w") as f:
    json.dump({"copy_bandwidth": copy, "rows": rows}, f, indent=1)
