"""Turning a chat into the tokens of its next turn, given the tokens whose KV a conversation keeps.

The kept tokens are ground truth: generated tokens are never re-tokenized. The next turn's tokens
are the tokenization of what the chat template adds after the kept text (the end of the previous
reply, the new user message, the assistant header). When the template renders history differently
from what was kept (a stop string cut the reply, a template that rewrites old turns), the kept
tokens are rolled back to their longest prefix that the new rendering still starts with.
"""

from __future__ import annotations

from turnkv.errors import InvalidRequestError


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
    """The chat as text; `tools` (OpenAI tool definitions) go to a template that renders them."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise InvalidRequestError("this model's tokenizer has no chat template; use generate() with a raw prompt")
    options = {} if tools is None else {"tools": tools}
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **options)


def reply_end(tokenizer) -> str:
    """What the template writes right after an assistant message's content (SmolLM2's: "<|im_end|>\\n");
    "" when the template cannot render an assistant message or writes nothing there."""
    mark = "turnkv-reply-end-probe"
    try:
        text = render(tokenizer, [{"role": "user", "content": "?"}, {"role": "assistant", "content": mark}],
                      add_generation_prompt=False)
    except Exception:  # a template may refuse a bare exchange (jinja raise_exception)
        return ""
    at = text.rfind(mark)
    return text[at + len(mark):] if at >= 0 else ""


def encode(tokenizer, text: str) -> list[int]:
    # Templates write BOS themselves, so the rendered text is encoded without special tokens.
    return tokenizer.encode(text, add_special_tokens=False) if text else []


def continuation(tokenizer, kept: list[int], kept_text: str, full_text: str) -> tuple[int, list[int]]:
    """(how many kept tokens stay valid, the tokens to add after them) so that the kept prefix plus
    the new tokens render `full_text`."""
    if full_text.startswith(kept_text):
        return len(kept), encode(tokenizer, full_text[len(kept_text) :])
    lo, hi = 0, len(kept)  # largest n with decode(kept[:n]) a prefix of full_text
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if full_text.startswith(tokenizer.decode(kept[:mid], skip_special_tokens=False)):
            lo = mid
        else:
            hi = mid - 1
    prefix = tokenizer.decode(kept[:lo], skip_special_tokens=False)
    return lo, encode(tokenizer, full_text[len(prefix) :])
