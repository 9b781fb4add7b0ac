"""What an operator can set on a server; `turnkv serve` fills it from its flags."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field
from pathlib import Path

API_KEY_ENV = "TURNKV_API_KEY"


@dataclass
class ServeConfig:
    host: str = "127.0.0.1"  # loopback unless the operator says otherwise
    port: int = 8000
    api_key: str | None = None  # checked on every /v1 route when set
    served_model_name: str | None = None  # defaults to the engine's model name
    max_running: int = 32  # a ceiling on requests running together; under it, the KV pool decides (admission.py)
    max_waiting: int = 64  # requests queued behind them; past that a request gets 429
    retry_after_s: int = 1
    prefill_chunk: int = 512  # tokens per prefill slice
    # Tokens one forward carries while requests decode: every decoding request's next token plus
    # prefill slices of waiting prompts, as many whole slices as fit (at least one). 0: the slice runs
    # as its own forward between two decode steps instead.
    max_step_tokens: int = 2048
    max_body_bytes: int = 4 << 20
    default_max_tokens: int = 256
    reuse: bool = True  # keep conversations between requests (off: every request prefills from scratch)
    # A conversation whose recipe stores it after every turn (state=krul, load, ...) is packed on a
    # thread of its own, beside the running streams (state/background.py). False: inside the turn's
    # end, on the worker, which every running stream then waits for (the baseline).
    background_packs: bool = True
    # With background packs on one device, such a conversation stays in the KV pool after its pack
    # lands, as a copy in the CPU tier (where it fits beside the conversations stored there): it leaves
    # the pool, by giving its pages back, only when the pool needs them, and a later turn that comes
    # first finds it resident. False: it leaves at every turn's end (the paper's setting).
    resident_packs: bool = True
    drain_timeout_s: float = 30.0
    # Run synthetic conversations through the worker before taking requests (serve/warmup.py), so the
    # first users do not wait for kernels to compile. None: on a CUDA device.
    warmup: bool | None = None
    # Head-pattern files a request's recipe may name (streaming_heads(pattern=NAME)): NAME -> path.
    # A recipe sent over HTTP reads no other file.
    head_patterns: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        for name in ("max_running", "prefill_chunk", "max_body_bytes", "default_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.max_waiting < 0:
            raise ValueError("max_waiting must be at least 0")
        if self.max_step_tokens < 0:
            raise ValueError("max_step_tokens must be at least 0 (0: prefill slices run as their own forward)")
        for name, path in self.head_patterns.items():
            if not PATTERN_NAME.fullmatch(name):
                raise ValueError(f"head pattern name {name!r}: use letters, digits, '_', '-' and '.'")
            if not Path(path).exists():
                raise ValueError(f"head pattern {name}: {path} does not exist")


PATTERN_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def parse_head_pattern(spec: str) -> tuple[str, str]:
    """"NAME=PATH" (the --head-pattern flag, whose parser shows this error's message) -> (NAME, PATH)."""
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--head-pattern takes NAME=PATH, got {spec!r}")
    return name, path
