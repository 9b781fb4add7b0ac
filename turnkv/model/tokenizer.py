"""Tokenizers and chat templates, from transformers.

A GGUF file's tokenizer is converted by transformers once (it takes seconds) and cached on disk, so
later starts load it in a fraction of a second.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

from turnkv.errors import ModelLoadError
from turnkv.paths import user_path

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    return user_path(os.environ.get("TURNKV_CACHE") or Path.home() / ".cache" / "turnkv")


def load_folder_tokenizer(folder: Path):
    """The tokenizer saved beside a safetensors checkpoint, or None when the folder has none."""
    from transformers import AutoTokenizer

    if not any((folder / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:
        raise ModelLoadError(f"cannot load the tokenizer in {folder}: {e}") from None


def load_gguf_tokenizer(path: Path):
    from transformers import AutoTokenizer

    stat = path.stat()
    key = hashlib.sha1(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = cache_dir() / "tokenizers" / key
    if (cached / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except Exception:
            log.warning("cached tokenizer in %s is unreadable; converting again", cached)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:
        raise ModelLoadError(f"cannot read the tokenizer of {path}: {e}") from None
    try:
        tmp = cached.with_name(key + f".tmp{os.getpid()}")
        tokenizer.save_pretrained(str(tmp))
        os.replace(tmp, cached)
    except OSError as e:  # a read-only home is fine: we just convert again next time
        log.info("could not cache the tokenizer: %s", e)
    return tokenizer
