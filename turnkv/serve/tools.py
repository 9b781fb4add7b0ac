"""Tool calling, following OpenAI's API: rendering tools and tool messages through the chat template,
the grammar of a call the request requires, and parsing calls out of the generated text.

Formats, told apart by the chat template's source:
- "hermes" (Qwen2.5, Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block
  per call;
- "llama3" (Llama 3.1-3.3): the reply is `{"name": ..., "parameters": {...}}` (after <|python_tag|>,
  a special token the text leaves out), several separated by ';';
- "mistral": `[TOOL_CALLS]` (a control token the text leaves out) then a JSON list of
  `{"name": ..., "arguments": {...}}`;
- "mistral_v11" (templates of Mistral's tokenizers v11 and later, told by `[ARGS]` in them: Mistral
  Small 3.x, Devstral, Magistral): `[TOOL_CALLS]name[ARGS]{...}` per call, some templates with
  `[CALL_ID]id` before `[ARGS]`, after any content. The markers are control tokens the text leaves
  out (engine/detokenizer.py skips special tokens), so a call reaches the parser as `name{...}`;
  written out as text they are accepted too;
- "fallback", for a template that knows no tools (SmolLM2's): the tools are described in the system
  prompt (FALLBACK_PROMPT), calls are written as in "hermes", an assistant message's calls are
  rendered back as that text and a tool result as a user message in <tool_response> tags.
A call the request requires (tool_choice "required" or a named function) is constrained by a grammar:
exactly one call, its arguments matching the function's parameters schema. The grammar writes no
control token (a grammar cannot), so its text is the call as the parser sees a generated one.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
import string
from dataclasses import dataclass

FALLBACK_PROMPT = """# Tools

You may call one or more functions to help with the user's request. The functions, as JSON schemas:
<tools>
{tools}
</tools>

To call a function, answer with one block per call, and nothing else in the block:
<tool_call>
{{"name": <function-name>, "arguments": <arguments-json-object>}}
</tool_call>"""

HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolFormat:
    name: str
    args_key: str  # "arguments" or "parameters"
    start: str  # what begins the calls in the text ("" : a reply that opens with '{' or '[')
    grammar_prefix: str  # around one constrained call
    grammar_suffix: str


FORMATS = {
    "hermes": ToolFormat("hermes", "arguments", "<tool_call>", "<tool_call>\n", "\n</tool_call>"),
    "fallback": ToolFormat("fallback", "arguments", "<tool_call>", "<tool_call>\n", "\n</tool_call>"),
    "llama3": ToolFormat("llama3", "parameters", "", "", ""),
    "mistral": ToolFormat("mistral", "arguments", "", "[", "]"),
    "mistral_v11": ToolFormat("mistral_v11", "arguments", "[TOOL_CALLS]", "", ""),
}


def detect(template: str | None) -> ToolFormat:
    """The tool-call format of a chat template."""
    source = template or ""
    if "[ARGS]" in source:
        return FORMATS["mistral_v11"]
    if "[TOOL_CALLS]" in source:
        return FORMATS["mistral"]
    if "<tool_call>" in source:
        return FORMATS["hermes"]
    if "<|python_tag|>" in source or ("<|start_header_id|>" in source and "tools" in source):
        return FORMATS["llama3"]
    return FORMATS["fallback"]


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # the arguments as a JSON text

    def as_openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def new_call_id(fmt: ToolFormat) -> str:
    if fmt.name in ("mistral", "mistral_v11"):  # their templates require 9 letters and digits
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return "call_" + secrets.token_hex(12)


# ---- rendering ------------------------------------------------------------------------------------
def call_text(name: str, arguments: str) -> str:
    """One call as the fallback format writes it (and as its grammar generates it)."""
    return f"<tool_call>\n{{\"name\": {json.dumps(name)}, \"arguments\": {arguments}}}\n</tool_call>"


def _arguments_object(arguments: str):
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def template_messages(messages: list[dict], fmt: ToolFormat, tools: list[dict] | None) -> list[dict]:
    """OpenAI messages (with tool_calls and role "tool") as the chat template takes them: for a
    template that knows tools, calls' arguments as objects; for the fallback, plain text messages
    and the tools described in the system prompt."""
    if fmt.name != "fallback":
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [{"id": c["id"], "type": "function", "function": {
                    "name": c["function"]["name"], "arguments": _arguments_object(c["function"]["arguments"])}}
                    for c in m["tool_calls"]]
            out.append(m)
        return out
    out = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = "\n".join(call_text(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"])
            out.append({"role": "assistant", "content": (content + "\n" if content else "") + calls})
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({"role": role, "content": content})
    if tools:
        described = FALLBACK_PROMPT.format(tools="\n".join(json.dumps(t["function"]) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + described}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out


def call_grammar(tools: list[dict], fmt: ToolFormat, only: str | None = None):
    """(prefix, schemas, suffix, leads): engine/grammar.py's Grammars.wrapped arguments for one call
    to any of the tools (or to the tool named `only`). "mistral_v11" writes the function's name
    (the lead), then its arguments; the others one JSON object holding both."""
    if fmt.name != "mistral_v11":
        return fmt.grammar_prefix, call_schemas(tools, fmt, only), fmt.grammar_suffix, None
    chosen = [t["function"] for t in tools if only is None or t["function"]["name"] == only]
    schemas = [f.get("parameters") or {"type": "object", "properties": {}} for f in chosen]
    return fmt.grammar_prefix, schemas, fmt.grammar_suffix, [f["name"] for f in chosen]


def call_schemas(tools: list[dict], fmt: ToolFormat, only: str | None = None) -> list[dict]:
    """The JSON schema of one call to each tool (or to the tool named `only`), in the format's keys."""
    out = []
    for t in tools:
        f = t["function"]
        if only is not None and f["name"] != only:
            continue
        params = f.get("parameters") or {"type": "object", "properties": {}}
        out.append({"type": "object", "properties": {"name": {"type": "string", "enum": [f["name"]]},
                                                     fmt.args_key: params},
                    "required": ["name", fmt.args_key], "additionalProperties": False})
    return out


# ---- parsing -------------------------------------------------------------------------------------
ARGS_KEY = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


def _raw_arguments(raw: str) -> str | None:
    """The arguments of a call's JSON text `raw` exactly as written (rendered back the same way, a
    later request's history matches the kept tokens)."""
    match = ARGS_KEY.search(raw)
    if match is None:
        return None
    try:
        _, end = json.JSONDecoder().raw_decode(raw, match.end())
    except json.JSONDecodeError:
        return None
    return raw[match.end() : end]


def _call(obj, fmt: ToolFormat, raw: str | None = None) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        text = args
    else:
        text = (_raw_arguments(raw) if raw is not None else None) or json.dumps(args, ensure_ascii=False)
    return ToolCall(new_call_id(fmt), obj["name"], text)


def parse(text: str, fmt: ToolFormat, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a generated reply. Calls to functions not in `names`, or whose JSON does
    not parse, are left in the content as text."""
    calls: list[ToolCall] = []
    if fmt.name == "mistral_v11":
        return _parse_v11(text, fmt, names)
    if fmt.start == "<tool_call>":
        content, last = [], 0
        for match in HERMES_CALL.finditer(text):
            try:
                call = _call(json.loads(match.group(1)), fmt, match.group(1))
            except json.JSONDecodeError:
                call = None
            if call is None or call.name not in names:
                continue
            content.append(text[last : match.start()])
            calls.append(call)
            last = match.end()
        content.append(text[last:])
        rest = "".join(content).strip()
        return (rest or None) if calls else text, calls
    body = text.strip()
    if body.startswith("[TOOL_CALLS]"):
        body = body[len("[TOOL_CALLS]") :].strip()
    if fmt.name == "llama3" and body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>") :].strip()
    pieces = [body]
    if fmt.name == "llama3" and ";" in body:
        pieces = [p for p in body.split(";") if p.strip()]
    for piece in pieces:
        try:
            obj = json.loads(piece)
        except json.JSONDecodeError:
            return text, []
        for item in obj if isinstance(obj, list) else [obj]:
            call = _call(item, fmt, piece if not isinstance(obj, list) else None)
            if call is None or call.name not in names:
                return text, []
            calls.append(call)
    return (None, calls) if calls else (text, [])


# ---- "mistral_v11" --------------------------------------------------------------------------------
V11_MARKER = "[TOOL_CALLS]"
# What may still follow a name before its '{': [CALL_ID], an id, [ARGS], blanks. Looser than that
# (the stream filter holds a few characters longer than needed), never stricter.
V11_BETWEEN = re.compile(r"[A-Za-z0-9_\[\]]{0,30}\s{0,16}")


@functools.lru_cache(maxsize=64)
def _v11_head(names: tuple[str, ...]) -> re.Pattern:
    """A call's head, up to its arguments' '{' (which must follow): an optional [TOOL_CALLS], one of
    `names` (longest first), an optional call id (9 letters and digits, after [CALL_ID], or bare
    where the markers were left out), an optional [ARGS], blanks."""
    alternatives = "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
    return re.compile(rf"(?:\[TOOL_CALLS\])?(?P<name>{alternatives})"
                      rf"(?:(?:\[CALL_ID\])?(?P<id>[A-Za-z0-9]{{9}}))?(?:\[ARGS\])?\s*(?=\{{)")


def _v11_calls(text: str, at: int, head: re.Pattern, fmt: ToolFormat) -> list[ToolCall] | None:
    """The calls that make up all of text[at:] (blanks between and after them), or None."""
    calls, pos = [], at
    while True:
        match = head.match(text, pos)
        if match is None:
            return None
        try:
            obj, end = json.JSONDecoder().raw_decode(text, match.end())
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict):
            return None
        calls.append(ToolCall(match["id"] or new_call_id(fmt), match["name"], text[match.end() : end]))
        pos = len(text) - len(text[end:].lstrip())
        if pos == len(text):
            return calls


def _parse_v11(text: str, fmt: ToolFormat, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """The calls that end the reply, from the earliest head after which the rest is all calls;
    the text before them is the content. Arguments are kept as written (a JSON object)."""
    if not names:
        return text, []
    head = _v11_head(tuple(sorted(names)))
    pos = 0
    while (match := head.search(text, pos)) is not None:
        calls = _v11_calls(text, match.start(), head, fmt)
        if calls:
            return text[: match.start()].strip() or None, calls
        pos = match.start() + 1
    return text, []


def _v11_may_start(tail: str, names) -> bool:
    """Whether `tail` (the end of the text) may still grow into a call's head."""
    if V11_MARKER.startswith(tail):
        return True
    if tail.startswith(V11_MARKER):
        tail = tail[len(V11_MARKER) :]
    return any(n.startswith(tail) or (tail.startswith(n) and V11_BETWEEN.fullmatch(tail[len(n) :]))
               for n in names)


class StreamFilter:
    """What of a streamed reply may go out as content while it might still turn into tool calls:
    everything before a call's start marker ("hermes"); everything before a call's head to one of
    `names` ("mistral_v11": `[TOOL_CALLS]`, or a name then `{`, the end of the text waiting while it
    may still become one); or nothing once the reply opens like a call ('{' or '[' first: "llama3",
    "mistral")."""

    def __init__(self, fmt: ToolFormat, names=()):
        self.fmt = fmt
        self.text = ""
        self.sent = 0
        self.holding = False  # a call has begun: the rest waits for the end
        self.names = tuple(sorted(names))
        self.head = _v11_head(self.names) if fmt.name == "mistral_v11" and self.names else None

    def push(self, piece: str) -> str:
        """Add generated text; returns the content that may be sent now."""
        self.text += piece
        if self.holding:
            return ""
        if self.head is not None:
            return self._push_v11()
        if self.fmt.start:
            at = self.text.find(self.fmt.start, max(0, self.sent - len(self.fmt.start)))
            if at >= 0:
                self.holding = True
                out, self.sent = self.text[self.sent : at], at
                return out
            keep = _partial_suffix(self.text, self.fmt.start)
            out, self.sent = self.text[self.sent : len(self.text) - keep], len(self.text) - keep
            return out
        stripped = self.text.lstrip()
        if not stripped:
            return ""
        if stripped[0] in "{[":
            self.holding = True
            return ""
        out, self.sent = self.text[self.sent :], len(self.text)
        return out

    def _push_v11(self) -> str:
        window = self.text[self.sent :]
        match = self.head.search(window)
        if match is not None:
            self.holding = True
            self.sent += match.start()
            return window[: match.start()]
        longest = len(V11_MARKER) + max(map(len, self.names)) + 30 + 16
        keep = next((k for k in range(min(len(window), longest), 0, -1)
                     if _v11_may_start(window[-k:], self.names)), 0)
        self.sent += len(window) - keep
        return window[: len(window) - keep]

    def rest(self) -> str:
        """The text not sent yet (the reply's end: parse it for calls)."""
        return self.text[self.sent :]


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
