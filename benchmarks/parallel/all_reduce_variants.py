"""All-reduce variants on the GPUs of one host, for the decoder's two all-reduces a layer: NCCL's
(what turnkv runs) against PyTorch's symmetric-memory one-shot and two-shot all-reduces, eager and
replayed from a CUDA graph, for a decode step's hidden state (1 to 32 tokens of 4096 in bf16) up to a
32K-token prefill chunk's. Each variant is first checked (the sum of every rank's values); one that
fails or is missing in this torch reports why instead of a time. Rank 0 prints a table; --out writes
the JSON.

    python benchmarks/parallel/all_reduce_variants.py --gpus 2 --out all_reduce_variants.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HIDDEN = 4096
TOKENS = (1, 8, 32, 512, 4096, 32768)


def _timed(op, iterations: int, graphed: bool) -> float:
    """Microseconds per op: `iterations` eager calls between two events, or one graph of them replayed.
    Not benchmarks/gpu_timing.py: the ranks meet at a barrier right before the timed calls (else the
    first waits for the slower rank), and the capture is thread-local (NCCL's watchdog queries events)."""
    for _ in range(3):
        op()
    torch.cuda.synchronize()
    if graphed:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # NCCL's watchdog queries events
            for _ in range(iterations):
                op()
        run = graph.replay
        run()
    else:
        def run():
            for _ in range(iterations):
                op()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iterations


def _variants(x: torch.Tensor, group_name: str):
    """name -> (prepare(values), op, result()) for each variant over a [tokens, HIDDEN] buffer like x."""
    import torch.distributed._symmetric_memory as symm_mem

    out = {"nccl": (x.copy_, lambda: dist.all_reduce(x), lambda: x)}
    buf = symm_mem.empty(x.shape, dtype=x.dtype, device=x.device)
    symm_mem.rendezvous(buf, group_name)
    result = [buf]

    def one_shot():
        result[0] = torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group_name)

    out["symm_mem one-shot"] = (buf.copy_, one_shot, lambda: result[0])
    out["symm_mem two-shot"] = (buf.copy_, lambda: torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", group_name),
                                lambda: buf)
    return out


def worker(rank: int, size: int, port: int, iterations: int, out: str | None) -> None:
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size, device_id=dev)
    group_name = dist.group.WORLD.group_name
    rows = []
    for tokens in TOKENS:
        x = torch.empty(tokens, HIDDEN, dtype=torch.bfloat16, device=dev)
        values = torch.full_like(x, rank + 1.0)
        expected = size * (size + 1) / 2
        try:
            variants = _variants(x, group_name)
        except Exception as e:  # noqa: BLE001 - a torch without symmetric memory: NCCL alone
            variants = {"nccl": (x.copy_, lambda: dist.all_reduce(x), lambda: x)}
            rows.append({"tokens": tokens, "variant": "symm_mem", "error": f"{type(e).__name__}: {e}"[:200]})
        n = iterations if tokens <= 512 else max(5, iterations // 20)
        for name, (prepare, op, result) in variants.items():
            row = {"tokens": tokens, "bytes": x.numel() * x.element_size(), "variant": name}
            try:
                prepare(values)
                op()
                torch.cuda.synchronize()
                row["correct"] = bool((result().float() == expected).all())
                for graphed in (False, True):
                    row["graph_us" if graphed else "eager_us"] = _timed(op, n, graphed)
            except Exception as e:  # noqa: BLE001 - reported in the table, the others go on
                row["error"] = f"{type(e).__name__}: {e}"[:200]
            rows.append(row)
    if rank == 0:
        print(f"{size} x {torch.cuda.get_device_name(dev)}, torch {torch.__version__}")
        print("| tokens | bytes | variant | correct | eager us | graph us |\n|---|---|---|---|---|---|")
        for r in rows:
            if "error" in r:
                print(f"| {r['tokens']} | {r.get('bytes', '')} | {r['variant']} | error: {r['error']} | | |")
            else:
                print(f"| {r['tokens']} | {r['bytes']} | {r['variant']} | {r['correct']} | {r['eager_us']:.1f} | "
                      f"{r['graph_us']:.1f} |")
        if out:
            with open(out, "w") as f:
                json.dump({"gpus": size, "device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                           "rows": rows}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--iterations", type=int, default=200, help="all-reduces per timing (fewer for large ones)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if torch.cuda.device_count() < args.gpus:
        raise SystemExit(f"needs {args.gpus} GPUs; torch sees {torch.cuda.device_count()}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # multicast stays off on the lent machines
    mp.spawn(worker, args=(args.gpus, port, args.iterations, args.out), nprocs=args.gpus)


if __name__ == "__main__":
    main()
