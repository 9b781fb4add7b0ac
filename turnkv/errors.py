"""Errors turnkv raises for bad input. Each leaves the engine and every conversation usable."""


class TurnkvError(Exception):
    """Base class of every error turnkv raises on purpose."""


class ModelLoadError(TurnkvError):
    """A model file is missing, corrupt, or of an unsupported architecture, or a shape name is unknown."""


class DeviceError(TurnkvError):
    """The device asked for does not exist here: CUDA without a CUDA build of torch or without a GPU,
    a GPU index past the last one, or a device name torch does not know."""


class InvalidRequestError(TurnkvError, ValueError):
    """A request is malformed: an empty raw prompt, a bad sampling parameter, an unknown option."""


class ContextLengthError(InvalidRequestError):
    """A turn would not fit in the model's context window. The conversation is left as it was."""


class KVCacheFullError(TurnkvError):
    """The KV page pool has no room for a request. Nothing was written; every conversation is intact."""


class ParallelError(TurnkvError):
    """A rank of a tensor-parallel engine died, hung past the collective timeout, or failed where rank 0
    did not. The engine cannot go on (make a new one); what the state tiers wrote stays written."""
