"""Where pdserve keeps what it builds once per machine (models, C++ kernels, anchors)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "PDSERVE_CACHE"
DEMO_MODEL_NAME = "demo-llama-small"
# What a finished build of a cached model holds; a build is renamed into place whole, so a
# folder with these is complete.
MODEL_MARKER_FILES = ("config.json", "tokenizer.json")


def default_cache_dir() -> Path:
    """`$PDSERVE_CACHE`, else ~/.cache/pdserve."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "pdserve"


def cached_model(name: str, cache_dir: str | os.PathLike | None = None) -> Path | None:
    """The folder of a model built once under the cache dir, or None before its build. Imports
    nothing heavy: the launcher finds the demo model without loading torch."""
    folder = (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / name
    return folder if all((folder / marker).is_file() for marker in MODEL_MARKER_FILES) else None
