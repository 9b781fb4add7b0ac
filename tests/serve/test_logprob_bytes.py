"""Log-probabilities of multi-byte text: chat `logprobs` carry each token's raw bytes, which join into
the reply's UTF-8 (emoji and CJK characters span several tokens of SmolLM2's byte-level vocabulary),
and a token that holds part of a character writes its bytes as \\xNN escapes, as OpenAI does; legacy
completions' tokens join into the text, with correct text_offset. Streamed and not."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.serve.conftest import MODEL
from turnkv.engine.generation import Generation
from turnkv.engine.logits import token_logprob
from turnkv.serve.token_bytes import CompletionText, TokenBytes, clip, decoder_kind

EMOJI = "😀🎉 👍🏽"
CJK = "你好，世界。東京"
MIXED = "Café 😀 naïve 你好 ∑x² — ok"
TEXTS = {"emoji": EMOJI, "cjk": CJK, "mixed": MIXED}


def byte_tokens(tokenizer, text: str) -> list[int]:
    """`text` as one byte-level token per UTF-8 byte: every character of more than one byte spans
    tokens that hold no whole character."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    char = bytes_to_unicode()
    return tokenizer.convert_tokens_to_ids([char[b] for b in text.encode("utf-8")])


def tokenizations(tokenizer, text: str) -> dict[str, list[int]]:
    return {"encoded": tokenizer.encode(text), "bytewise": byte_tokens(tokenizer, text)}


# ---- the vocabulary's bytes -------------------------------------------------------------------------
def test_each_tokens_bytes_join_into_the_text(smol_tokenizer):
    vocab = TokenBytes(smol_tokenizer)
    assert vocab.kind == "byte_level"
    for text in TEXTS.values():
        for how, ids in tokenizations(smol_tokenizer, text).items():
            parts = [vocab.of(t) for t in ids]
            assert b"".join(raw for raw, _ in parts) == text.encode("utf-8"), how
            for raw, token in parts:
                assert token == raw.decode("utf-8", errors="backslashreplace")
    # A token inside a character: its bytes, and the text OpenAI writes for them.
    assert [vocab.of(t) for t in byte_tokens(smol_tokenizer, "😀")] == [
        (b"\xf0", "\\xf0"), (b"\x9f", "\\x9f"), (b"\x98", "\\x98"), (b"\x80", "\\x80")]
    assert [vocab.of(t)[1] for t in smol_tokenizer.encode(" café")] == [" café"]
    # A special token adds nothing to the reply's text (skip_special_tokens) and says its name.
    assert vocab.of(smol_tokenizer.convert_tokens_to_ids("<|im_start|>")) == (b"", "<|im_start|>")


def test_sentencepiece_byte_fallback_tokens_give_their_bytes():
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", *(f"<0x{b:02X}>" for b in range(256)), "\u2581", "H", "i", "你"]
    model = models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], byte_fallback=True, unk_token="<unk>")
    backend = Tokenizer(model)
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    vocab = TokenBytes(tokenizer)
    assert vocab.kind == "sentencepiece" == decoder_kind(tokenizer)
    text = "Hi 你好😀"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == 5 + 3 + 4  # ▁ H i ▁ 你, then the bytes of 好 and of 😀
    assert b"".join(vocab.of(t)[0] for t in ids) == (" " + text).encode("utf-8")
    assert vocab.of(pieces.index("<0xE5>")) == (b"\xe5", "\\xe5") and vocab.of(pieces.index("你")) == ("你".encode(), "你")


def test_completion_pieces_join_into_the_text_with_their_offsets(smol_tokenizer):
    for text in TEXTS.values():
        for how, ids in tokenizations(smol_tokenizer, text).items():
            streamed = CompletionText(smol_tokenizer)
            pieces, offsets = [], []
            for start in range(0, len(ids), 3):  # in chunks, as a stream hands them over
                more, at = streamed.pieces(ids[start : start + 3])
                pieces += more
                offsets += at
            assert "".join(pieces) == text, how
            assert offsets == [len("".join(pieces[:i])) for i in range(len(pieces))]
    # Bytewise, a character goes with the token that completes it; the others before it carry "".
    pieces, offsets = CompletionText(smol_tokenizer).pieces(byte_tokens(smol_tokenizer, "a😀b"))
    assert (pieces, offsets) == (["a", "", "", "", "😀", "b"], [0, 1, 1, 1, 1, 2])
    assert clip(["ab", "", "😀c", "d"], "ab😀") == ["ab", "", "😀", ""]


# ---- over HTTP --------------------------------------------------------------------------------------
@pytest.fixture
def scripted(monkeypatch):
    """Every generation takes the tokens the test puts in the returned list (then an end-of-sequence
    token) instead of sampling; its logprobs are the model's at those tokens."""
    script: list[int] = []

    def sample(gen, logits):
        logits = gen.limit_vocab(logits)
        n = len(gen.token_ids)
        token = script[n] if n < len(script) else min(gen.eos_ids)
        if gen.token_logprobs is not None:
            gen.token_logprobs.append(token_logprob(logits, token, gen.params.logprobs))
        return token

    monkeypatch.setattr(Generation, "sample", sample)
    return script


def sse(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def check_chat_logprobs(content: list[dict], reply: str, tops: int) -> None:
    assert bytes(b for e in content for b in e["bytes"]) == reply.encode("utf-8")
    for e in content:
        assert e["token"] == bytes(e["bytes"]).decode("utf-8", errors="backslashreplace")
        assert len(e["top_logprobs"]) == tops
        for alt in e["top_logprobs"]:
            assert alt["token"] == bytes(alt["bytes"]).decode("utf-8", errors="backslashreplace")


@pytest.mark.parametrize("name", TEXTS)
def test_chat_logprob_bytes_rebuild_the_reply(server, smol_tokenizer, scripted, name):
    text = TEXTS[name]
    for how, ids in tokenizations(smol_tokenizer, text).items():
        scripted[:] = ids
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"Say it ({name}, {how})."}],
                "max_tokens": 64, "logprobs": True, "top_logprobs": 2}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
        choice = r["choices"][0]
        assert choice["message"]["content"] == text and choice["finish_reason"] == "stop"
        content = choice["logprobs"]["content"]
        assert len(content) == len(ids)
        check_chat_logprobs(content, text, tops=2)
        if how == "bytewise":  # every token of a multi-byte character is written as escapes
            assert sum(e["token"].startswith("\\x") for e in content) == sum(len(c.encode()) for c in text
                                                                             if len(c.encode()) > 1)
        # Streamed: the same entries across the chunks, and their bytes join into the streamed reply.
        chunks = sse(server.url + "/v1/chat/completions", body)
        streamed = [e for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                    for e in c["choices"][0]["logprobs"]["content"]]
        reply = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        assert reply == text
        assert [(e["token"], e["bytes"]) for e in streamed] == [(e["token"], e["bytes"]) for e in content]
        assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in content], abs=1e-4)
        check_chat_logprobs(streamed, text, tops=2)


@pytest.mark.parametrize("name", TEXTS)
def test_completion_tokens_join_into_the_text_with_their_offsets(server, smol_tokenizer, scripted, name):
    text = TEXTS[name]
    for how, ids in tokenizations(smol_tokenizer, text).items():
        scripted[:] = ids
        body = {"model": MODEL, "prompt": f"Say it ({name}, {how}):", "max_tokens": 64, "logprobs": 1}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
        choice = r["choices"][0]
        lp = choice["logprobs"]
        assert choice["text"] == text == "".join(lp["tokens"]), how
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids)
        assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(len(ids))]
        chunks = sse(server.url + "/v1/completions", body)
        tokens = [t for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                  for t in c["choices"][0]["logprobs"]["tokens"]]
        offsets = [o for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                   for o in c["choices"][0]["logprobs"]["text_offset"]]
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == text
        assert (tokens, offsets) == (lp["tokens"], lp["text_offset"])


def test_completion_tokens_stop_where_a_stop_string_ends_the_text(server, smol_tokenizer, scripted):
    scripted[:] = byte_tokens(smol_tokenizer, "你好 😀 END and more")
    body = {"model": MODEL, "prompt": "Go:", "max_tokens": 64, "logprobs": 0, "stop": ["END"]}
    choice = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == "你好 😀 " == "".join(lp["tokens"]) and choice["finish_reason"] == "stop"
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(len(lp["tokens"]))]


@pytest.mark.parametrize("stream", [False, True])
def test_sampled_multibyte_replies_rebuild_from_their_bytes(server, stream):
    """The model's own choices under a grammar that admits one string: each seed splits its characters
    into tokens its own way, many of them parts of a character."""
    pytest.importorskip("xgrammar")
    reply = json.dumps(MIXED + " " + EMOJI + CJK, ensure_ascii=False)
    fmt = {"type": "json_schema", "json_schema": {"name": "say", "strict": True,
                                                  "schema": {"type": "string", "enum": [json.loads(reply)]}}}
    partial = 0
    for seed in range(3):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Say it."}], "response_format": fmt,
                "max_tokens": 120, "temperature": 1.0, "seed": seed, "logprobs": True, "top_logprobs": 1}
        if stream:
            chunks = sse(server.url + "/v1/chat/completions", body)
            content = [e for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                       for e in c["choices"][0]["logprobs"]["content"]]
            text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        else:
            choice = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
            content, text = choice["logprobs"]["content"], choice["message"]["content"]
        assert text == reply
        check_chat_logprobs(content, reply, tops=1)
        partial += sum("\\x" in e["token"] for e in content)
    assert partial > 0
