"""logprobs / top_logprobs (chat) and logprobs (completions), streamed too, equal to the engine's own
log-softmax; frequency_penalty, presence_penalty and logit_bias applied per request inside the batched
decode step; OpenAI fields the engine cannot honour refused with a 400 naming the field."""

from __future__ import annotations

import threading

import httpx
import pytest
import torch

from tests.serve.conftest import MODEL
from tests.serve.test_errors import HELLO, assert_error, post

PROMPT = [5, 42, 300, 77, 1024, 9]  # a raw token-id prompt for /v1/completions


def reference_logprobs(llm, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """The engine's own log-softmax [T, V] at each generated token, by teacher forcing."""
    reply = llm.generate(prompt, max_new_tokens=len(generated), ignore_eos=True)
    assert reply.token_ids == generated  # greedy: the same tokens
    conv = llm.conversation()
    logits = llm.runner.prefill(conv.kv, prompt + generated[:-1], all_logits=True)
    conv.close()
    return logits[len(prompt) - 1 :].float().log_softmax(-1)[:, : llm.vocab_limit]


def test_completion_logprobs_equal_the_engines_log_softmax(serve_llm, server):
    r = post(server, {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "logprobs": 3, "ignore_eos": True},
             path="/v1/completions")
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    tokenizer = serve_llm.tokenizer
    generated = serve_llm.generate(PROMPT, max_new_tokens=6, ignore_eos=True).token_ids
    assert "".join(lp["tokens"]) == r.json()["choices"][0]["text"] == tokenizer.decode(generated)
    want = reference_logprobs(serve_llm, PROMPT, generated)
    assert lp["token_logprobs"] == pytest.approx([float(want[i, t]) for i, t in enumerate(generated)], abs=1e-4)
    for i, top in enumerate(lp["top_logprobs"]):
        values, _ = want[i].topk(3)
        assert sorted(top.values(), reverse=True) == pytest.approx(values.tolist(), abs=1e-4)
    assert len(lp["tokens"]) == len(lp["text_offset"]) == 6


def test_chat_logprobs_stream_and_plain_agree(server):
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 6, "extra_body": {"ignore_eos": True},
            "logprobs": True, "top_logprobs": 2}
    plain = server.client().chat.completions.create(**body)
    content = plain.choices[0].logprobs.content
    assert len(content) == 6 and all(len(c.top_logprobs) == 2 for c in content)
    assert bytes(b for c in content for b in c.bytes) == plain.choices[0].message.content.encode("utf-8")
    assert all(c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)  # greedy: the top one
    streamed = [c for c in server.client().chat.completions.create(stream=True, **body) if c.choices]
    got = [e for c in streamed if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in got] == [e.token for e in content]
    # The streamed request reuses the plain one's KV: its logits differ by rounding.
    assert [e.logprob for e in got] == pytest.approx([e.logprob for e in content], abs=1e-4)
    # Without logprobs there are none.
    r = server.client().chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
    assert r.choices[0].logprobs is None


def test_penalties_follow_openais_formula(serve_llm, server):
    """Each greedy token is the argmax of the model's logits minus frequency_penalty x count minus
    presence_penalty x (count > 0), over the tokens generated before it (negative penalties here:
    the random model repeats nothing on its own)."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "ignore_eos": True, "logprobs": 0,
            "frequency_penalty": -1.5, "presence_penalty": -0.7}
    plain = post(server, {**body, "frequency_penalty": 0, "presence_penalty": 0}, path="/v1/completions").json()
    r = post(server, body, path="/v1/completions").json()
    tokenizer = serve_llm.tokenizer
    generated = tokenizer.encode(r["choices"][0]["text"], add_special_tokens=False)
    assert r["choices"][0]["text"] != plain["choices"][0]["text"]
    conv = serve_llm.conversation()
    logits = serve_llm.runner.prefill(conv.kv, PROMPT + generated[:-1], all_logits=True)[len(PROMPT) - 1 :].float()
    conv.close()
    counts = torch.zeros(logits.shape[-1])
    for i, token in enumerate(generated):
        row = logits[i, : serve_llm.vocab_limit] + 1.5 * counts[: serve_llm.vocab_limit] \
            + 0.7 * (counts[: serve_llm.vocab_limit] > 0).float()
        assert int(row.argmax()) == token
        counts[token] += 1


def test_logit_bias_changes_only_its_own_request_in_a_shared_batch(long_llm):
    from tests.serve.conftest import running

    target = 1234
    with running(long_llm, served_model_name=MODEL) as s:
        alone = post(s, {"model": MODEL, "prompt": PROMPT, "max_tokens": 40, "ignore_eos": True},
                     path="/v1/completions").json()["choices"][0]["text"]
        out = {}

        def send(name, extra):
            out[name] = httpx.post(s.url + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": PROMPT, "max_tokens": 40, "ignore_eos": True, **extra}).json()

        threads = [threading.Thread(target=send, args=("biased", {"logit_bias": {str(target): 100}})),
                   threading.Thread(target=send, args=("plain", {}))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert s.metric("turnkv:decode_batch_size_bucket", le="2.0") - s.metric("turnkv:decode_batch_size_bucket",
                                                                                 le="1.0") > 0  # they shared steps
    assert out["plain"]["choices"][0]["text"] == alone
    biased = long_llm.tokenizer.encode(out["biased"]["choices"][0]["text"], add_special_tokens=False)
    assert set(biased) == {target}


@pytest.mark.parametrize("field,value", [("audio", {"voice": "alloy", "format": "wav"}), ("modalities", ["audio"]),
                                         ("prediction", {"type": "content", "content": "x"}),
                                         ("function_call", "auto"), ("reasoning_effort", "high")])
def test_unsupported_chat_fields_get_a_400_naming_them(server, field, value):
    error = assert_error(post(server, {"model": MODEL, "messages": HELLO, field: value}), 400, "unsupported_field",
                         field)
    assert field in error["message"]


def test_unsupported_completion_fields_and_bad_values_get_400s(server):
    for field, value in (("echo", True), ("suffix", "end"), ("best_of", 3)):
        assert_error(post(server, {"model": MODEL, "prompt": "Hi", field: value}, path="/v1/completions"), 400,
                     "unsupported_field", field)
    for field, value in (("logit_bias", {"abc": 1}), ("logit_bias", {"5": 101}), ("frequency_penalty", 3),
                         ("presence_penalty", -2.5), ("top_logprobs", 21)):
        assert_error(post(server, {"model": MODEL, "messages": HELLO, field: value}), 400, param=field)
    assert_error(post(server, {"model": MODEL, "messages": HELLO, "top_logprobs": 2}), 400)  # needs logprobs
    error = assert_error(post(server, {"model": MODEL, "messages": HELLO, "logit_bias": {"99999999": 1}}), 400)
    assert "vocabulary" in error["message"]
    # Harmless OpenAI metadata is accepted.
    r = post(server, {"model": MODEL, "messages": HELLO, "max_tokens": 2, "user": "u1", "modalities": ["text"],
                      "echo": False, "store": False})
    assert r.status_code == 200, r.text
    assert post(server, {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "echo": False, "best_of": 1},
                path="/v1/completions").status_code == 200
