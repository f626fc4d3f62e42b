"""Where pdserve keeps what it builds once per machine (models, C++ kernels, anchors)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "PDSERVE_CACHE"


def default_cache_dir() -> Path:
    """`$PDSERVE_CACHE`, else ~/.cache/pdserve."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "pdserve"
