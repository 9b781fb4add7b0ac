"""Read-only looks into each rank's engine, through turnkv.parallel.mirror.gather (which pickles these
functions by name)."""

from __future__ import annotations


def krul_pairs(conv):
    """The layer pairs Krul chose at the conversation's last store (None before any)."""
    return getattr(conv.method_state.window, "last_pairs", None)


def teacher_forced_logits(llm, ids: list[int], prompt: int):
    """fp32 logits [len(ids) - 1, V] on the host: ids[:prompt] prefilled in one call (every position's
    logits), then ids[prompt:] fed one decode step at a time (CUDA graphs where the engine has them).
    Runs the model on every rank alike and frees what it took."""
    import torch

    from turnkv.kv.sequence import SequenceKV

    seq = SequenceKV(llm.pool)
    try:
        with torch.inference_mode():
            out = [llm.runner.prefill(seq, ids[:prompt], all_logits=True).float()]
            for t in ids[prompt:-1]:
                out.append(llm.runner.decode([seq], torch.tensor([t], device=llm.device)).float())
        return torch.cat(out).cpu()
    finally:
        seq.free()


def captured_graphs(llm) -> int:
    """How many CUDA graphs of decode steps the rank's runner holds."""
    graphs = llm.runner.graphs
    return 0 if graphs is None else len(graphs.graphs)
