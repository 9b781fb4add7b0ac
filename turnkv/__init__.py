"""turnkv: an inference engine for long multi-turn LLM conversations."""

from turnkv.engine.conversation import Conversation
from turnkv.engine.generation import Reply
from turnkv.engine.llm import LLM
from turnkv.engine.sampling import SamplingParams
from turnkv.errors import (ContextLengthError, DeviceError, InvalidRequestError, KVCacheFullError, ModelLoadError,
                           TurnkvError)
from turnkv.version import __version__

__all__ = ["LLM", "Conversation", "Reply", "SamplingParams", "TurnkvError", "ModelLoadError",
           "InvalidRequestError", "ContextLengthError", "KVCacheFullError", "DeviceError",
           "__version__"]
