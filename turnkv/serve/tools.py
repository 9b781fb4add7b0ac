"""Tool calling, following OpenAI's API: rendering tools and tool messages through the chat template,
the grammar of a call the request requires, and parsing calls out of the generated text.

Formats, told apart by the chat template's source:
- "hermes" (Qwen2.5, Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block
  per call;
- "llama3" (Llama 3.1-3.3): the reply is `{"name": ..., "parameters": {...}}` (after <|python_tag|>,
  a special token the text leaves out), several separated by ';';
- "mistral": `[TOOL_CALLS]` (a control token the text leaves out) then a JSON list of
  `{"name": ..., "arguments": {...}}`;
- "fallback", for a template that knows no tools (SmolLM2's): the tools are described in the system
  prompt (FALLBACK_PROMPT), calls are written as in "hermes", an assistant message's calls are
  rendered back as that text and a tool result as a user message in <tool_response> tags.
A call the request requires (tool_choice "required" or a named function) is constrained by a grammar:
exactly one call, its arguments matching the function's parameters schema.
"""

from __future__ import annotations

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
}


def detect(template: str | None) -> ToolFormat:
    """The tool-call format of a chat template."""
    source = template or ""
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
    if fmt.name == "mistral":  # its template requires 9 letters and digits
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


class StreamFilter:
    """What of a streamed reply may go out as content while it might still turn into tool calls:
    everything before a call's start marker ("hermes"), or nothing once the reply opens like a
    call ('{' or '[' first: "llama3", "mistral")."""

    def __init__(self, fmt: ToolFormat):
        self.fmt = fmt
        self.text = ""
        self.sent = 0
        self.holding = False  # a call has begun: the rest waits for the end

    def push(self, piece: str) -> str:
        """Add generated text; returns the content that may be sent now."""
        self.text += piece
        if self.holding:
            return ""
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

    def rest(self) -> str:
        """The text not sent yet (the reply's end: parse it for calls)."""
        return self.text[self.sent :]


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
