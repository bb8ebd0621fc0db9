"""The environment variables cbpipe reads, declared in one place."""

from __future__ import annotations

import os
from pathlib import Path


def api_key() -> str | None:
    """``CBPIPE_API_KEY``: the key clients must present, when ``--api-key`` is not given."""
    return os.environ.get("CBPIPE_API_KEY") or None


def cache_dir() -> Path:
    """``CBPIPE_CACHE_DIR``, else ``$XDG_CACHE_HOME/cbpipe``, else ``~/.cache/cbpipe``: where
    compiled artifacts are kept between launches."""
    if explicit := os.environ.get("CBPIPE_CACHE_DIR"):
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "cbpipe"
