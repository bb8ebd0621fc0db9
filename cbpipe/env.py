"""The environment variables cbpipe reads, declared in one place."""

from __future__ import annotations

import os


def api_key() -> str | None:
    """``CBPIPE_API_KEY``: the key clients must present, when ``--api-key`` is not given."""
    return os.environ.get("CBPIPE_API_KEY") or None
