"""turnkv: an inference engine for long multi-turn LLM conversations."""

from turnkv.interrupt import one_line_on_exit

try:  # the engine imports torch: seconds, during which Ctrl-C must not print a traceback
    from turnkv.engine.conversation import Conversation
    from turnkv.engine.generation import Reply
    from turnkv.engine.llm import LLM
    from turnkv.engine.sampling import SamplingParams
except KeyboardInterrupt as interrupt:
    one_line_on_exit(interrupt)
    raise
from turnkv.errors import (ContextLengthError, DeviceError, InvalidRequestError, KVCacheFullError, ModelLoadError,
                           TurnkvError)
from turnkv.version import __version__

__all__ = ["LLM", "Conversation", "Reply", "SamplingParams", "TurnkvError", "ModelLoadError",
           "InvalidRequestError", "ContextLengthError", "KVCacheFullError", "DeviceError",
           "__version__"]
