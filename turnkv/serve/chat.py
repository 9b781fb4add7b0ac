"""What a chat request needs beyond its messages, worked out on the HTTP side (off the model worker):
the rendering with tools, the grammar a reply must follow (response_format, a required tool call),
and turning a finished or streamed reply into OpenAI's message, with tool calls parsed out of it."""

from __future__ import annotations

from dataclasses import dataclass

from jinja2 import TemplateError

from turnkv.errors import InvalidRequestError
from turnkv.serve import tools as tool_calls
from turnkv.serve.errors import APIError
from turnkv.serve.job import Rendered, render_chat
from turnkv.serve.protocol import ChatCompletionRequest, NamedToolChoice


@dataclass
class ChatPlan:
    messages: list[dict]  # as the template takes them (the conversation's history)
    rendered: Rendered
    grammar: object | None  # engine/grammar.py's Compiled, or None
    fmt: tool_calls.ToolFormat
    names: set[str]  # functions the reply may call (empty: no calls are parsed)
    parallel: bool


def plan(llm, req: ChatCompletionRequest) -> ChatPlan:
    """Render the request and compile its grammar (runs in a worker thread of the HTTP side)."""
    tokenizer = llm.turn_parts.require_tokenizer()
    fmt = tool_calls.detect(getattr(tokenizer, "chat_template", None))
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    messages = tool_calls.template_messages([m.as_template_message() for m in req.messages], fmt, tools)
    try:
        rendered = render_chat(tokenizer, messages, tools=tools if fmt.name != "fallback" else None)
    except InvalidRequestError as e:
        raise APIError(400, str(e), param="messages") from None
    except TemplateError as e:  # the template refused these messages (its raise_exception)
        raise APIError(400, f"the chat template cannot render these messages: {e}", param="messages") from None
    grammar = None
    try:
        grammar = _grammar(llm, req, fmt, tools)
    except InvalidRequestError as e:
        param = "response_format" if req.response_format is not None else "tool_choice"
        raise APIError(400, f"{param}: {e}", param=param) from None
    names = {t["function"]["name"] for t in tools} if tools and req.tools_active else set()
    return ChatPlan(messages, rendered, grammar, fmt, names, req.parallel_tool_calls is not False)


def _grammar(llm, req: ChatCompletionRequest, fmt, tools):
    choice = req.tool_choice
    if tools and (choice == "required" or isinstance(choice, NamedToolChoice)):
        only = choice.function.name if isinstance(choice, NamedToolChoice) else None
        return llm.turn_parts.grammars().wrapped(*tool_calls.call_grammar(tools, fmt, only))
    rf = req.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return llm.turn_parts.grammars().json_object()
    schema = rf.json_schema.schema_ or {}
    return llm.turn_parts.grammars().json_schema(schema, strict=bool(rf.json_schema.strict))


def message(plan_: ChatPlan, text: str, finish_reason: str) -> tuple[dict, str]:
    """OpenAI's assistant message for a finished reply, and its finish_reason ("tool_calls" when it
    called tools)."""
    if not plan_.names:
        return {"role": "assistant", "content": text}, finish_reason
    content, calls = tool_calls.parse(text, plan_.fmt, plan_.names)
    if not calls:
        return {"role": "assistant", "content": text}, finish_reason
    if not plan_.parallel:
        calls = calls[:1]
    out = {"role": "assistant", "content": content, "tool_calls": [c.as_openai() for c in calls]}
    return out, "tool_calls" if finish_reason == "stop" else finish_reason


class StreamedReply:
    """A streamed reply's content deltas, holding back what may be tool calls; at the end, the
    held text parsed into delta.tool_calls."""

    def __init__(self, plan_: ChatPlan):
        self.plan = plan_
        self.filter = tool_calls.StreamFilter(plan_.fmt, plan_.names) if plan_.names else None

    def content(self, piece: str) -> str:
        return piece if self.filter is None else self.filter.push(piece)

    def closing(self, finish_reason: str) -> tuple[list[dict], str]:
        """(deltas still to send, finish_reason) once the reply is over."""
        if self.filter is None:
            return [], finish_reason
        rest = self.filter.rest()
        content, calls = tool_calls.parse(rest, self.plan.fmt, self.plan.names)
        if not calls:
            return ([{"content": rest}] if rest else []), finish_reason
        if not self.plan.parallel:
            calls = calls[:1]
        deltas = [{"content": content}] if content else []
        deltas += [{"tool_calls": [c.as_openai(index=i)]} for i, c in enumerate(calls)]
        return deltas, "tool_calls" if finish_reason == "stop" else finish_reason
