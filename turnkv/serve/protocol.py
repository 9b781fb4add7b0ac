"""Request bodies of the OpenAI API, as pydantic models, and the response objects the routes build.

Fields unknown to the OpenAI API are accepted and ignored (clients send new fields long before
servers know them, and metadata such as `user` changes no output). OpenAI fields the engine cannot
honour (UNSUPPORTED), or values of a known field it cannot honour, are rejected with a 400 that
names the field, never ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

from turnkv.engine.sampling import MAX_TOP_LOGPROBS, SEED_MAX, SEED_MIN
from turnkv.serve.token_bytes import clip

Number = StrictInt | StrictFloat


class FieldError(ValueError):
    """A check across fields that faults one of them: `param` names it in the 400 (a model
    validator's error has no location of its own)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextPart(Lenient):
    type: Literal["text"]
    text: StrictStr


class FunctionCall(Lenient):
    name: StrictStr
    arguments: StrictStr  # a JSON text


class MessageToolCall(Lenient):
    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant messages
    tool_call_id: StrictStr | None = None  # tool messages: the call they answer
    name: StrictStr | None = None

    @model_validator(mode="after")
    def _roles(self):
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs tool_call_id")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def as_template_message(self) -> dict:
        """The message the chat template renders; "developer" is the newer name of "system"."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        out = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                 for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            out["name"] = self.name
        return out


class FunctionDefinition(Lenient):
    name: StrictStr = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: StrictStr | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object
    strict: StrictBool | None = None


class Tool(Lenient):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Lenient):
    name: StrictStr


class NamedToolChoice(Lenient):
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(Lenient):
    name: StrictStr = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: StrictStr | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format json_schema needs a json_schema object")
        return self


class StreamOptions(Lenient):
    include_usage: StrictBool = False


class SamplingRequest(Lenient):
    """Fields shared by chat and text completions (turnkv extensions: top_k, ignore_eos, recipe)."""

    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: Number | None = Field(default=None, ge=0, le=2)
    top_p: Number | None = Field(default=None, gt=0, le=1)
    top_k: StrictInt | None = Field(default=None, ge=0)
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    recipe: StrictStr | None = None  # a KV-compression recipe for this conversation (turnkv methods --presets)
    frequency_penalty: Number | None = Field(default=None, ge=-2, le=2)
    presence_penalty: Number | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[StrictStr, Number] | None = None  # token id (as a string) -> bias in [-100, 100]

    # OpenAI fields whose effect the engine does not have: a request that sets one gets a 400.
    unsupported: ClassVar[tuple[str, ...]] = ()
    prompt_field: ClassVar[str] = "messages"  # the field holding the prompt (what a too-long prompt's error names)
    logprobs_field: ClassVar[str] = "logprobs"  # the field SamplingParams.logprobs comes from

    def refused_field(self) -> str | None:
        """The first OpenAI field set to a value this server cannot honour, or None."""
        extra = self.model_extra or {}
        for name in self.unsupported:
            value = extra.get(name)
            if value is not None and value is not False and value != [] and value != ["text"]:
                return name
        return None

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, bias):
        if bias is None:
            return None
        out = {}
        for key, value in bias.items():
            if not key.isdigit():
                raise ValueError(f"logit_bias keys are token ids, got {key!r}")
            if not -100 <= value <= 100:
                raise ValueError(f"logit_bias values are in [-100, 100], got {value}")
            out[int(key)] = float(value)
        return out

    def top_logprobs_kept(self) -> int | None:
        """How many alternatives to keep per token (0: only the chosen one), None: no logprobs."""
        return None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("seed")
    @classmethod
    def _seed_range(cls, seed):
        if seed is not None and not SEED_MIN <= seed <= SEED_MAX:
            raise ValueError(f"seed must be in [{SEED_MIN}, {SEED_MAX}]")
        return seed

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop or []
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stops

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def max_tokens_field(self) -> str:
        """The field requested_max_tokens() comes from (what an error about it names)."""
        return "max_tokens"

    def sampling_field(self, message: str) -> str | None:
        """The request field a SamplingParams error is about: its message starts with the
        SamplingParams name, which is the request's own but for the reply length and logprobs."""
        name = message.split(" ", 1)[0]
        return {"max_new_tokens": self.max_tokens_field, "logprobs": self.logprobs_field}.get(
            name, name if name in type(self).model_fields else None)

    def sampling(self) -> dict:
        """Keyword arguments of turnkv's SamplingParams (max_new_tokens is set once the prompt is known)."""
        return dict(temperature=float(self.temperature or 0.0),
                    top_p=float(self.top_p if self.top_p is not None else 1.0), top_k=self.top_k or 0,
                    seed=self.seed, stop=list(self.stop or []), ignore_eos=self.ignore_eos,
                    frequency_penalty=float(self.frequency_penalty or 0.0),
                    presence_penalty=float(self.presence_penalty or 0.0), logit_bias=self.logit_bias or None,
                    logprobs=self.top_logprobs_kept())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    response_format: ResponseFormat | None = None

    unsupported: ClassVar[tuple[str, ...]] = ("audio", "modalities", "prediction", "web_search_options",
                                              "functions", "function_call", "reasoning_effort", "verbosity")
    logprobs_field: ClassVar[str] = "top_logprobs"

    @model_validator(mode="after")
    def _fields_agree(self):
        if self.top_logprobs and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs needs logprobs: true")
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise FieldError("tools", "tools: function names must be unique")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise FieldError("tool_choice", f"tool_choice names {self.tool_choice.function.name!r}, which is not "
                                            f"among the tools")
        if self.tool_choice == "required" and not names:
            raise FieldError("tool_choice", "tool_choice 'required' needs tools")
        if self.tools and self.response_format is not None and self.response_format.type != "text" \
                and self.tool_choice not in (None, "none"):
            raise FieldError("response_format", "response_format cannot be combined with tools a reply may call")
        return self

    @property
    def tools_active(self) -> bool:
        """Whether the reply may hold tool calls (they are then parsed out of it)."""
        return bool(self.tools) and self.tool_choice != "none"

    def top_logprobs_kept(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


class CompletionRequest(SamplingRequest):
    prompt: StrictStr | list[StrictInt] | list[StrictStr]
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    unsupported: ClassVar[tuple[str, ...]] = ("echo", "suffix", "best_of")
    prompt_field: ClassVar[str] = "prompt"

    def refused_field(self) -> str | None:
        if (self.model_extra or {}).get("best_of") == 1:
            return None
        return super().refused_field()

    def top_logprobs_kept(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ValueError("one prompt per request is supported")
            return prompt[0]
        if not prompt:
            raise ValueError("the prompt is empty")
        if isinstance(prompt, list) and min(prompt) < 0:
            raise ValueError(f"token ids are at least 0, got {min(prompt)}")
        return prompt


# ---- responses ------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def model_card(name: str, max_model_len: int) -> dict:
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "turnkv", "root": name,
            "parent": None, "max_model_len": max_model_len, "permission": []}


def chat_logprobs(vocab, entries) -> dict:
    """OpenAI's chat `logprobs` object for TokenLogprob entries; vocab: the server's TokenBytes. Each
    token carries its raw `bytes`, so the bytes of a reply's tokens join into its UTF-8 text."""

    def one(token: int, logprob: float) -> dict:
        raw, text = vocab.of(token)
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                        for e in entries], "refusal": None}


def completion_logprobs(vocab, entries, text, reply: str | None = None) -> dict:
    """OpenAI's legacy completions `logprobs` object for the next TokenLogprob entries of a reply;
    text: the request's CompletionText (each token's piece of the reply and its character offset,
    counted across the calls of a stream). With the whole `reply` (not streamed), the pieces are cut
    to it, so they join into it even where a stop string ended it. top_logprobs' keys are the
    alternatives' own texts (TokenBytes)."""
    pieces, offsets = text.pieces([e.token for e in entries])
    if reply is not None:
        pieces, offsets = clip(pieces, reply), [min(o, len(reply)) for o in offsets]
    return {"tokens": pieces, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{vocab.of(t)[1]: lp for t, lp in e.top} for e in entries],
            "text_offset": offsets}
