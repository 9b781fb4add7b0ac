"""Looks into each rank's engine, through turnkv.parallel.mirror.gather (which pickles these functions by
name): read-only, but for the state tiers' packers and packs set up or taken below."""

from __future__ import annotations

import time

from turnkv.state.background import Packer


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


# ---- the state tiers' packs (tests/parallel/test_serve_packs.py) --------------------------------------------
def pack_in_background(llm, delays: list[float]) -> None:
    """Fixed restore costs (no calibration), and a background packer whose jobs each start delays[rank]
    seconds late, so that a conversation can come back while its pack runs."""
    from turnkv.state.schedule import CostModel

    llm.state.ctx.set_cost("cpu", CostModel(2e-6, 1e-9, 5e8))
    llm.state.pack_in_background(DelayedPacker(llm.device, delays[llm.parallel.rank if llm.parallel else 0]))


def pack_inline(llm) -> None:
    """Take the packs in flight; pack inside a turn's end again."""
    llm.state.pack_inline()


def leaving(conv) -> list[str]:
    """The conversations whose pack runs on this rank's packer."""
    return list(conv.llm.state.leaving)


def land_packs(llm) -> list[str]:
    """Take every pack in flight, waiting for each: the tiers they landed in."""
    landed = []
    while llm.state.leaving:
        landed += [x["tier"] for x in llm.state.land_packs(block=True)]
    return landed


def stored_entry(conv):
    """(the stored state's meta without its wall times, {name: tensor}) of the conversation on this rank."""
    _, meta, tensors = conv.llm.state.tiers.get(conv.id)
    return {k: v for k, v in meta["state"].items() if k != "pack_timing"}, {k: t.clone() for k, t in tensors.items()}


def restored_rows(conv):
    """Every layer's (K, V) rows of the rank's heads once the stored state is restored; the conversation
    is then idle and resident."""
    from turnkv.kv.snapshot import export_rows

    conv.llm.state.before_turn(conv, 0)
    rows = [export_rows(conv.kv, layer) for layer in range(conv.llm.config.num_layers)]
    conv.llm.state.abort_turn(conv)
    return rows


class DelayedPacker(Packer):
    """A packer whose jobs each start `delay_s` late."""

    def __init__(self, device, delay_s: float):
        super().__init__(device)
        self.delay_s = delay_s

    def _device(self, job):
        time.sleep(self.delay_s)
        return super()._device(job)
