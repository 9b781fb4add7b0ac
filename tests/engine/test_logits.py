"""Per-request logits processing (engine/logits.py): penalties over the tokens generated so far,
logit_bias, a grammar's mask, and the log-probabilities a request keeps, checked by hand."""

from __future__ import annotations

import json

import pytest
import torch

from turnkv.engine import decode_loop
from turnkv.engine.logits import LogitsProcessor, token_logprob
from turnkv.engine.sampling import SamplingParams
from turnkv.engine.turn import TurnRun
from turnkv.errors import InvalidRequestError


def test_penalties_and_bias_follow_openais_formula():
    proc = LogitsProcessor(0.5, 0.25, {3: 10.0, 1: -2.0}, torch.device("cpu"))
    logits = torch.zeros(6)
    assert proc.apply(logits).tolist() == [0, -2, 0, 10, 0, 0]
    for token in (2, 2, 4):
        proc.accept(token)
    # token 2: twice (2 x 0.5 + 0.25), token 4: once (0.5 + 0.25)
    assert proc.apply(logits).tolist() == pytest.approx([0, -2, -1.25, 10, -0.75, 0])


def test_token_logprob_is_the_log_softmax_and_its_top():
    logits = torch.tensor([1.0, 3.0, 2.0, -1.0])
    entry = token_logprob(logits, 2, top=2)
    want = logits.log_softmax(-1)
    assert entry.token == 2 and entry.logprob == pytest.approx(float(want[2]))
    assert [t for t, _ in entry.top] == [1, 2] and entry.top[0][1] == pytest.approx(float(want[1]))


def test_bad_sampling_values_are_refused():
    for bad in ({"frequency_penalty": 2.5}, {"presence_penalty": float("nan")}, {"logit_bias": {-1: 1.0}},
                {"logit_bias": {5: 101}}, {"logprobs": 21}, {"seed": 1 << 64}):
        with pytest.raises(InvalidRequestError):
            SamplingParams(**bad)


def test_a_generation_under_a_grammar_writes_what_the_schema_allows(chat_llm):
    pytest.importorskip("xgrammar", reason="structured output needs xgrammar (turnkv[structured])")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                             "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    compiled = chat_llm.turn_parts.grammars().json_schema(schema)
    conv = chat_llm.conversation()
    params = chat_llm.turn_parts.sampling_params(max_new_tokens=40, temperature=1.0, seed=3)
    inputs = conv._turn_input("Hello.", None)
    gen = chat_llm.turn_parts.new_generation(conv.kv, params, constraint=compiled.constraint())
    turn = TurnRun(conv, inputs, gen).begin()
    turn.take(turn.prefill())
    for _ in decode_loop.decode(chat_llm, [turn]):
        pass
    reply = turn.finish()
    assert reply.finish_reason == "stop"
    value = json.loads(reply.text)
    assert isinstance(value["ok"], bool) and 0 <= value["n"] <= 9
    conv.close()
