"""The policy's ``config.json``, read at start-up from a local model directory (no model or transformers import)."""

from __future__ import annotations

import json
import os

__all__ = ["local_model_config"]


def local_model_config(model_path: str | None) -> dict | None:
    """The parsed ``config.json`` of a local model directory; None for a hub id, a remote path or an unreadable file
    (the model-dependent checks then wait for the workers)."""
    path = os.path.join(str(model_path), "config.json") if model_path else ""
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None
