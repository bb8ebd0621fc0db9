"""A Hugging Face cache on disk as the Hub's downloads leave it, for tests of Hub ids."""

from __future__ import annotations

import shutil
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_model(
    cache: Path, repo_id: str, files: list[Path], ref: str = "main", commit: str = COMMIT
) -> Path:
    """``files`` as the Hugging Face cache holds a snapshot of ``repo_id`` at ``ref``."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in files:
        shutil.copy(file, snapshot / file.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot
