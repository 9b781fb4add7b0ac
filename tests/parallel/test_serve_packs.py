"""Packs on the background packer under N=2 (gloo on CPU, fp32, the tiny chat model), with Krul's stored
form merging layer pairs (lossy): the pairing's collectives run when the pack is handed over, each rank
packs its own heads on its own packer, and rank 0 says which packs are taken. On every rank the stored
entry and the restored KV are the inline pack's; a server's conversation that comes back while its pack
runs (a worker's pack running longer than rank 0's), and once it has finished, gets the tokens of N=1."""

from __future__ import annotations

import time

import pytest
import torch

from tests.methods.turn_helpers import MESSAGES, NEW, SYSTEM
from tests.parallel import probes
from tests.parallel.conftest import engine_pair
from tests.serve.conftest import MODEL, running, wait_for
from turnkv.parallel.mirror import gather

# Every layer pair merged, every row loaded (no recompute), no row kept unmerged: lossy, and decided per
# row of a head, so that N=2 stores each rank's heads as N=1 stores them.
KRUL = "state=krul(ir_threshold=0,fallback=never,recompute_ratio=0,allocation=min_storage,max_retained=0)"
DELAYS = [1.0, 2.0]  # seconds each rank's packs start late (rank 0, rank 1)


@pytest.fixture(scope="module")
def engines(chat_model_dir):
    for single, pair in engine_pair(chat_model_dir, "32MiB", "16MiB"):
        yield single, pair


def engine_run(llm, background: bool):
    """Three turns of one conversation under KRUL, each ending in a pack (on the background packer, each
    taken before the next turn: `background`): (reply tokens, the stored entry after each turn per rank,
    the restored rows at the end per rank)."""
    if background:
        gather(llm, probes.pack_in_background, [0.0, 0.0])
    conv = llm.conversation(system=SYSTEM, recipe=KRUL)
    try:
        tokens, entries = [], []
        for message in MESSAGES[:3]:
            tokens.append(conv.send(message, max_new_tokens=NEW, ignore_eos=True).token_ids)
            if background:
                assert all(conv.id in leaving for leaving in gather(conv, probes.leaving))
                assert gather(llm, probes.land_packs) == [["cpu"]] * (llm.parallel.size if llm.parallel else 1)
            entries.append(gather(conv, probes.stored_entry))
        return tokens, entries, gather(conv, probes.restored_rows)
    finally:
        conv.close()
        gather(llm, probes.pack_inline)


def same_entry(a, b) -> bool:
    (meta_a, tensors_a), (meta_b, tensors_b) = a, b
    return meta_a == meta_b and tensors_a.keys() == tensors_b.keys() and all(
        torch.equal(tensors_a[k], tensors_b[k]) for k in tensors_a)


def test_a_background_pack_stores_and_restores_what_an_inline_pack_does_on_every_rank(engines):
    single, pair = engines
    tokens, entries, rows = engine_run(pair, background=True)
    tokens_inline, entries_inline, rows_inline = engine_run(pair, background=False)
    assert tokens == tokens_inline == engine_run(single, background=False)[0]
    for got, want in zip(entries, entries_inline):  # per turn: [rank 0's, rank 1's]
        assert len(got) == 2 and all(same_entry(a, b) for a, b in zip(got, want))
        assert all(meta["pairs"] for meta, _ in got)  # lossy: the layers were merged
    assert all(torch.equal(a, b) for got, want in zip(rows, rows_inline)
               for layers_got, layers_want in zip(got, want) for a, b in zip(layers_got, layers_want))


FIRST = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello, who are you?"}]
MORE = ["Tell me about the sea.", "And about mountains?"]


def leave_and_return(llm) -> tuple[list, float]:
    """A server's conversation under KRUL: its first turn's end hands its pack to the packers; its second
    turn arrives while rank 0's pack runs; its third once rank 0's and the workers' packs have finished,
    before they are taken. (replies and cached tokens, packs completed on rank 0)."""
    gather(llm, probes.pack_in_background, DELAYS)
    with running(llm, served_model_name=MODEL) as s:
        client, messages, got = s.client(), list(FIRST), []

        def turn():
            r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                               extra_body={"recipe": KRUL})
            messages.append({"role": "assistant", "content": r.choices[0].message.content})
            got.append((r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens))

        turn()
        [entry] = s.store.entries
        wait_for(lambda: entry.conv.id in llm.state.leaving, 10, "the first turn's pack")
        assert not llm.state.leaving[entry.conv.id].job.future.done()  # returning mid-pack
        messages.append({"role": "user", "content": MORE[0]})
        turn()
        wait_for(lambda: entry.conv.id in llm.state.leaving, 10, "the second turn's pack")
        pack = llm.state.leaving[entry.conv.id]  # the worker may take it once every rank's copy is done
        wait_for(lambda: pack.job.future.done(), 30, "rank 0's pack")
        time.sleep(DELAYS[-1])  # and the workers': the third turn comes back after the pack, taken or not
        messages.append({"role": "user", "content": MORE[1]})
        turn()
        packs = s.metric("turnkv:state_packs_completed")
    assert llm.state.packer is None and not llm.state.leaving  # the stopped server packs inline again
    return got, packs


def test_a_server_conversation_returning_mid_pack_and_after_gets_the_tokens_of_one_device(engines):
    single, pair = engines
    got, packs = leave_and_return(pair)
    want, _ = leave_and_return(single)
    assert got == want
    assert packs >= 2 and all(cached > 0 for _, cached in got[1:])
