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


def profile_steps() -> tuple[int, int] | None:
    """``CBPIPE_PROFILE_STEPS``: ``first-last`` (or one step), the steps a worker runs under
    torch's profiler (``worker/step_profiler.py``); unset, none."""
    value = os.environ.get("CBPIPE_PROFILE_STEPS", "").strip()
    if not value:
        return None
    first, _, last = value.partition("-")
    try:
        span = int(first), int(last or first)
    except ValueError:
        expected = "expected FIRST-LAST, e.g. 8-14"
        raise ValueError(f"CBPIPE_PROFILE_STEPS={value!r}: {expected}") from None
    if span[0] > span[1]:
        raise ValueError(f"CBPIPE_PROFILE_STEPS={value!r}: the first step comes after the last")
    return span


def profile_dir() -> Path:
    """``CBPIPE_PROFILE_DIR``: where the step profiler writes; the working directory if unset."""
    return Path(os.environ.get("CBPIPE_PROFILE_DIR") or ".")
