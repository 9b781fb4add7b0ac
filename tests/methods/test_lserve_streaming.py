"""The prefill axis `streaming_heads`: its mask against brute force, a multi-turn conversation (trimmed
store) equal to one prefill of the whole history under the brute-force streaming mask, and the bytes
the trimmed streaming heads free, by number."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from turnkv.attention.lines import Keys
from turnkv.errors import InvalidRequestError
from turnkv.kv.sequence import SequenceKV
from turnkv.methods.lserve.pattern import HeadPattern
from turnkv.methods.lserve.streaming import StreamingHeads
from turnkv.methods.recipe import Recipe

STREAMING = [[True, False], [False, True]]  # tiny model: 2 layers x 2 KV heads
MESSAGES = ["The river flows past the old mill where the miller counts sacks of grain every morning before dawn.",
            "Mountains rise over the valley; snow covers the peaks while shepherds lead goats to the high meadows.",
            "And then?"]


@pytest.fixture
def pattern_file(tmp_path):
    path = tmp_path / "pattern.json"
    HeadPattern(np.array(STREAMING)).save_json(path)
    return str(path)


def brute_force(q, k, v, q_pos, k_pos, streaming, sink, local):
    """Per query head, softmax over keys with k_pos <= q_pos, and for streaming KV heads
    (k_pos < sink or q_pos - k_pos < local)."""
    Hq, T, D = q.shape
    H = k.shape[0]
    out = torch.empty_like(q)
    for hq in range(Hq):
        h = hq // (Hq // H)
        delta = q_pos[:, None] - k_pos[h][None, :]
        mask = delta >= 0
        if streaming[h]:
            mask &= (k_pos[h][None, :] < sink) | (delta < local)
        scores = (q[hq] @ k[h].T) * D**-0.5
        out[hq] = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v[h]
    return out


@pytest.mark.parametrize("history", [False, True])
def test_prefill_mask_equals_brute_force(pattern_file, history):
    torch.manual_seed(0)
    Hq, H, D, T, sink, local = 4, 2, 8, 40, 3, 7
    method = StreamingHeads(pattern=pattern_file, sink=sink, local=local, prefill_local=local)
    method.bind(2)
    # With history: kept keys with holes (a sink and a ring of the previous turn), then the new rows.
    k_pos = torch.cat([torch.tensor([0, 1, 2]), torch.arange(50, 60), torch.arange(60, 60 + T)]) if history \
        else torch.arange(T)
    q_pos = k_pos[-T:]
    S = len(k_pos)
    q, k, v = torch.randn(1, Hq, T, D), torch.randn(1, H, S, D), torch.randn(1, H, S, D)
    keys = Keys(q, k, v, q_pos[None], k_pos[None, None].expand(1, H, S), None, int(q_pos[0]), int(q_pos[-1]) + 1)
    for layer in range(2):
        out, stats = method.attend(layer, keys)
        ref = brute_force(q[0], k[0], v[0], q_pos, k_pos[None].expand(H, S), STREAMING[layer], sink, local)
        torch.testing.assert_close(out[0], ref, rtol=1e-5, atol=1e-5)
        assert stats["computed"].sum() < stats["causal"].sum()  # the streaming head skipped cells


def test_multi_turn_with_trimmed_store_equals_one_brute_force_prefill(chat_llm, pattern_file):
    """Streaming heads keep sink + last `local`; a decode step reads them + itself (a window of
    local + 1). With prefill_local = local + 1 the whole conversation is then one streaming mask of
    window local + 1 over every token: one prefill of the history must give the replies' logprobs."""
    sink, local = 4, 8
    recipe = f"prefill=streaming_heads(pattern={pattern_file},sink={sink},local={local},prefill_local={local + 1})"
    conv = chat_llm.conversation(system="Answer briefly.", recipe=recipe)
    try:
        replies = []
        for message in MESSAGES:
            reply = conv.send(message, max_new_tokens=6, ignore_eos=True, logprobs=True)
            turn = conv.turns[-1]
            replies.append((turn.prompt_end, reply.logprobs))
            assert_trimmed(conv.kv, STREAMING, sink, local)
        tokens = conv.tokens
    finally:
        conv.close()
    r = Recipe.parse(recipe)
    st = r.new_state(chat_llm.config.num_layers)
    seq = SequenceKV(chat_llm.pool)
    try:
        logits = chat_llm.runner.prefill(seq, tokens, all_logits=True, pattern=r.pattern_hook(st))
    finally:
        seq.free()
    full = torch.log_softmax(logits.float(), dim=-1)
    for prompt_end, logprobs in replies:
        n = logprobs.shape[0]
        torch.testing.assert_close(logprobs, full[prompt_end - 1 : prompt_end - 1 + n], rtol=0, atol=2e-4)


def assert_trimmed(kv, streaming, sink, local):
    end = kv.next_position
    for layer, flags in enumerate(streaming):
        for head, is_streaming in enumerate(flags):
            n = int(kv.lengths[layer, head])
            _, _, pos = kv.gather(layer)
            kept = pos[head, :n].tolist()
            expected = list(range(sink)) + list(range(end - local, end)) if is_streaming else list(range(end))
            assert kept == expected, (layer, head)


def test_streaming_heads_free_their_pages(chat_llm, pattern_file):
    sink, local = 4, 8
    dense = chat_llm.conversation(system="Answer briefly.")
    sparse = chat_llm.conversation(system="Answer briefly.",
                                   recipe=f"prefill=streaming_heads(pattern={pattern_file},sink={sink},local={local})")
    try:
        for conv in (dense, sparse):
            conv.send(MESSAGES[0] + " " + MESSAGES[1], max_new_tokens=5, ignore_eos=True)
        n = dense.kv.next_position
        assert sparse.kv.next_position == n and n > 3 * 16
        page_bytes = chat_llm.pool.page_bytes
        assert dense.kv_bytes == 4 * (-(-n // 16)) * page_bytes
        # Two dense heads hold every token; two streaming heads hold 4 + 8 tokens in one page each.
        assert sparse.kv_bytes == (2 * (-(-n // 16)) + 2 * 1) * page_bytes
        assert sparse.kv.lengths.tolist() == [[sink + local, n], [n, sink + local]]
    finally:
        dense.close()
        sparse.close()


def test_pattern_sources_and_errors(tmp_path, pattern_file):
    method = StreamingHeads(pattern="random", ratio=0.5)
    flags = method.flags(6, 4)
    assert flags.shape == (6, 4) and flags.sum() == 12
    default = StreamingHeads()  # the calibrated SmolLM2 gates, thresholded at 0.5
    assert default.flags(30, 3).mean() == pytest.approx(0.5, abs=0.02)
    assert StreamingHeads(ratio=0.25).flags(30, 3).mean() == pytest.approx(0.25, abs=0.02)
    with pytest.raises(InvalidRequestError, match="pattern="):
        StreamingHeads(pattern=pattern_file).flags(3, 2)  # a pattern for another model
    with pytest.raises(InvalidRequestError):
        StreamingHeads(pattern=str(tmp_path / "missing.json")).flags(2, 2)
    duo = tmp_path / "full_attention_heads.tsv"
    duo.write_text("0.1\t0.9\n0.8\t0.2\n")  # gate near 1: dense
    assert StreamingHeads(pattern=str(duo)).flags(2, 2).tolist() == STREAMING
    for bad in ("prefill=streaming_heads(local=0)", "prefill=streaming_heads(ratio=2)"):
        with pytest.raises(InvalidRequestError):
            Recipe.parse(bad)
