"""The OpenAI routes through the official client: replies, streaming, usage, and reuse of a kept
conversation across requests (cached_tokens, /metrics), with divergence served from a valid prefix."""

from __future__ import annotations

import httpx

from tests.serve.conftest import MODEL, running

SYSTEM = {"role": "system", "content": "You are terse."}
GREEDY = dict(model=MODEL, max_tokens=6, temperature=0)


def ask(client, messages, **options):
    r = client.chat.completions.create(messages=messages, **{**GREEDY, **options})
    return r.choices[0].message.content, r.usage


def test_models_health_and_a_plain_reply(server):
    client = server.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    r = client.chat.completions.create(messages=[SYSTEM, {"role": "user", "content": "Hi."}], **GREEDY)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 6 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_stream_equals_the_plain_reply_and_ends_with_usage(server):
    client = server.client()
    messages = [SYSTEM, {"role": "user", "content": "Count to three."}]
    plain, plain_usage = ask(client, messages, max_tokens=8)
    chunks = list(client.chat.completions.create(messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **{**GREEDY, "max_tokens": 8}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == plain_usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == plain_usage.prompt_tokens
    # Without include_usage no chunk carries usage; the raw stream ends with [DONE].
    with httpx.stream("POST", server.url + "/v1/chat/completions",
                      json={"model": MODEL, "messages": messages, "max_tokens": 3, "stream": True}) as raw:
        lines = [line for line in raw.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all('"usage"' not in line for line in lines)


def test_later_turns_prefill_only_their_new_tokens(server):
    client = server.client()
    before = server.metric("vllm:prefix_cache_hits_total")
    # A system prompt no earlier test sent: the prefix index has nothing for the first request.
    system = {"role": "system", "content": SYSTEM["content"] + " Be brief."}
    messages = [system, {"role": "user", "content": "Tell me about the sea."}]
    reused, previous = 0, None
    for turn, question in enumerate(["And mountains?", "Which is older?", "Thanks."]):
        reply, usage = ask(client, messages)
        expected = 0 if previous is None else previous.prompt_tokens + previous.completion_tokens - 1
        # Everything the previous request saw, and its reply, came from the kept KV; only the last
        # reply token (never fed to the model) and the new message were prefilled.
        assert usage.prompt_tokens_details.cached_tokens == expected
        assert usage.prompt_tokens > expected
        reused += expected
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": question}]
        previous = usage
    assert server.metric("vllm:prefix_cache_hits_total") - before == reused > 0
    assert server.metric("turnkv:reused_tokens_total") >= reused


def test_an_edited_earlier_message_gives_what_a_fresh_server_gives(serve_llm, server):
    client = server.client()
    first = [SYSTEM, {"role": "user", "content": "Name a colour."}]
    a1, u1 = ask(client, first)
    history = first + [{"role": "assistant", "content": a1}]
    a2, _ = ask(client, history + [{"role": "user", "content": "Name a fruit."}])
    # Edit the second question: turn 1 stays reusable, turn 2's KV must not be.
    edited = history + [{"role": "user", "content": "Name a country."}]
    b2, u2 = ask(client, edited)
    # Reused up to the end of reply 1 (its last token was fed by the request that the edit replaces).
    assert u2.prompt_tokens_details.cached_tokens == u1.prompt_tokens + u1.completion_tokens
    with running(serve_llm, served_model_name=MODEL) as fresh:
        other = fresh.client()
        assert ask(other, first)[0] == a1
        assert ask(other, edited)[0] == b2


def test_a_session_header_pins_the_conversation_even_when_its_first_message_changes(serve_llm, server):
    client = server.client(default_headers={"X-Session-Id": "chat-42"})
    first = [SYSTEM, {"role": "user", "content": "Say yes."}]
    a1, _ = ask(client, first)
    ask(client, first + [{"role": "assistant", "content": a1}, {"role": "user", "content": "Say no."}])
    edited = [SYSTEM, {"role": "user", "content": "Say maybe."}]
    reply, usage = ask(client, edited)
    system_tokens = len(serve_llm.tokenizer.encode(
        serve_llm.tokenizer.apply_chat_template([SYSTEM], tokenize=False), add_special_tokens=False))
    assert usage.prompt_tokens_details.cached_tokens == system_tokens  # back to the system prompt only
    with running(serve_llm, served_model_name=MODEL) as fresh:
        assert ask(fresh.client(), edited)[0] == reply
    # Without the header, a chat that shares only the system prompt does not take the pinned one: it
    # takes the system prompt's pages from the prefix index.
    _, usage = ask(server.client(), [SYSTEM, {"role": "user", "content": "Say maybe."}])
    assert usage.prompt_tokens_details.cached_tokens == system_tokens


def test_a_compressing_recipe_reuses_exact_extensions_only(server):
    client = server.client()
    recipe = {"recipe": "evict=snapkv(window=8) budget=16"}
    messages = [SYSTEM, {"role": "user", "content": "Describe a long river in many words, please. " * 12}]
    reply, usage = ask(client, messages, extra_body=recipe)
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Shorter."}]
    _, usage2 = ask(client, messages, extra_body=recipe)
    assert usage2.prompt_tokens_details.cached_tokens == usage.prompt_tokens + usage.completion_tokens - 1
    # Turn 2's prompt compressed turn 1 (the recipe compresses finished turns): the kept conversation
    # holds fewer tokens per head than positions.
    [kept] = [e for e in server.store.entries if "evict=snapkv" in e.recipe_key]
    heads = server.llm.config.num_layers * server.llm.config.num_kv_heads
    assert kept.conv.kv.tokens() < kept.conv.kv.next_position * heads
    # An edit inside the compressed history: its kept tokens were chosen seeing the old text, so
    # the request starts afresh, from the system prompt the prefix index keeps for this recipe.
    messages[1] = {"role": "user", "content": "Describe a short river."}
    _, usage3 = ask(client, messages, extra_body=recipe)
    tokenizer = server.llm.tokenizer
    system_tokens = len(tokenizer.encode(tokenizer.apply_chat_template([SYSTEM], tokenize=False),
                                         add_special_tokens=False))
    assert usage3.prompt_tokens_details.cached_tokens == system_tokens


def test_a_reply_of_generated_special_tokens_is_continued_under_a_compressing_recipe(server):
    """The streamed and returned text skips special tokens the model generates; the client sends
    that text back, and the compressed conversation (which cannot roll back) still continues."""
    client = server.client()
    special = server.llm.tokenizer.convert_tokens_to_ids("<|im_start|>")
    recipe = {"recipe": "evict=snapkv(window=8) budget=16 schedule=prompt"}
    messages = [SYSTEM, {"role": "user", "content": "Describe a river in many words, please. " * 6}]
    reply, usage = ask(client, messages, max_tokens=4, logit_bias={str(special): 100}, extra_body=recipe)
    assert reply == "" and usage.completion_tokens == 4  # four <|im_start|>, none of them text
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Shorter."}]
    _, usage2 = ask(client, messages, extra_body=recipe)
    assert usage2.prompt_tokens_details.cached_tokens == usage.prompt_tokens + usage.completion_tokens - 1


def test_text_completions(server):
    client = server.client()
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0)
    assert r.object == "text_completion" and r.usage.completion_tokens <= 5 and r.usage.prompt_tokens > 0
    pieces = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0,
                                            stream=True))
    assert "".join(p.choices[0].text for p in pieces if p.choices) == r.choices[0].text
    ids = server.llm.encode("Once upon a time")
    assert client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0).choices[0].text == r.choices[0].text


def test_answer_reprefill_reuses_up_to_the_previous_prompt_and_replies_the_same(server):
    client = server.client()
    messages = [SYSTEM, {"role": "user", "content": "Name a river."}]
    reprefill = {"recipe": "full answer=reprefill"}
    first, first_usage = ask(client, messages, extra_body=reprefill)
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "And a lake?"}]
    kept, _ = ask(client, messages)  # the default recipe, on its own conversation
    again, usage = ask(client, messages, extra_body=reprefill)
    # Only the previous prompt is reused: the reply's decode-time KV is dropped and prefilled again.
    assert usage.prompt_tokens_details.cached_tokens == first_usage.prompt_tokens
    assert again == kept  # dense attention: the same reply either way
