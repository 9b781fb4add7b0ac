"""Request bodies of the OpenAI API, as pydantic models, and the response objects the routes build.

Unknown fields are accepted and ignored (clients send new OpenAI fields long before servers know
them). Fields with a value the engine cannot honour are rejected with a 400 instead of being ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator

from turnkv.engine.sampling import SEED_MAX, SEED_MIN

Number = StrictInt | StrictFloat


class Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextPart(Lenient):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(Lenient):
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart] | None = None

    def as_template_message(self) -> dict:
        """The {role, content} the chat template renders; "developer" is the newer name of "system"."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


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

    def sampling(self) -> dict:
        """Keyword arguments of turnkv's SamplingParams (max_new_tokens is set once the prompt is known)."""
        return dict(temperature=float(self.temperature or 0.0),
                    top_p=float(self.top_p if self.top_p is not None else 1.0), top_k=self.top_k or 0,
                    seed=self.seed, stop=list(self.stop or []), ignore_eos=self.ignore_eos)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(SamplingRequest):
    prompt: StrictStr | list[StrictInt] | list[StrictStr]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ValueError("one prompt per request is supported")
            return prompt[0]
        if not prompt:
            raise ValueError("the prompt is empty")
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
