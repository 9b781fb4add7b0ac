"""What an operator can set on a server; `turnkv serve` fills it from its flags."""

from __future__ import annotations

from dataclasses import dataclass

API_KEY_ENV = "TURNKV_API_KEY"


@dataclass
class ServeConfig:
    host: str = "127.0.0.1"  # loopback unless the operator says otherwise
    port: int = 8000
    api_key: str | None = None  # checked on every /v1 route when set
    served_model_name: str | None = None  # defaults to the engine's model name
    max_running: int = 32  # requests decoding together: the batch of one decode step
    max_waiting: int = 64  # requests queued behind them; past that a request gets 429
    retry_after_s: int = 1
    prefill_chunk: int = 512  # tokens per prefill slice; one slice runs between two decode steps
    max_body_bytes: int = 4 << 20
    default_max_tokens: int = 256
    reuse: bool = True  # keep conversations between requests (off: every request prefills from scratch)
    drain_timeout_s: float = 30.0

    def __post_init__(self):
        for name in ("max_running", "prefill_chunk", "max_body_bytes", "default_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.max_waiting < 0:
            raise ValueError("max_waiting must be at least 0")
