"""What the launcher reads from the served model's ``config.json``: its vocabulary size.

SGLang 0.5.23 reports no vocabulary size (neither ``/server_info`` nor ``/model_info``), and its scheduler
dies on an input id at or past the embedding table. The launcher reads the size where SGLang read the
model from and sends it at registration, so the manager refuses such ids before they reach the box.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.json"


def vocab_size_of(config: Any) -> int | None:
    """The embedding rows a model config declares: ``vocab_size``, or its text model's for a multimodal
    config (``text_config``); None when neither is a positive int."""
    if not isinstance(config, dict):
        return None
    for where in (config, config.get("text_config")):
        size = where.get("vocab_size") if isinstance(where, dict) else None
        if isinstance(size, int) and not isinstance(size, bool) and size > 0:
            return size
    return None


def config_path(model_path: str) -> Path | None:
    """``config.json`` of a model directory, or of a hub model id already in the local Hugging Face
    cache (where SGLang downloaded it); None when there is none here. Never downloads anything."""
    local = Path(model_path).expanduser() / CONFIG_FILE
    if local.is_file():
        return local
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # the daemon's base install has no hub client: a local path is all we can read
        return None
    try:
        cached = try_to_load_from_cache(model_path, CONFIG_FILE)
    except Exception:  # not a repo id at all (e.g. a missing local path)
        return None
    return Path(cached) if isinstance(cached, str) else None


def model_vocab_size(model_path: str) -> int | None:
    """The vocabulary size of the model at ``model_path`` (a directory or a cached hub id), or None."""
    path = config_path(model_path)
    if path is None:
        return None
    try:
        return vocab_size_of(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return None
