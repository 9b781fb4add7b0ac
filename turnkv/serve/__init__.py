"""An OpenAI-compatible HTTP server that keeps conversations between requests (`turnkv serve`)."""

from turnkv.serve.app import create_app
from turnkv.serve.config import ServeConfig

__all__ = ["create_app", "ServeConfig"]
