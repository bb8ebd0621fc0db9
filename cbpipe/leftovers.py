"""What a launch leaves behind when every one of its processes is killed, and its removal.

A launcher removes its shared-memory segment and socket folder however it stops, and its
children do when it is killed (``launcher._on_launcher_death``); only ``kill -9`` of all of
them at once leaves both behind. Both names carry the launcher's pid
(``cbpipe-<pid>-<random>``), so the next launch by the same user can tell a dead launch's
leftovers (its pid runs no process) from a live one's, and removes only those.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

from cbpipe.protocol.shm import NAME_PREFIX, SHM_DIR

log = logging.getLogger(__name__)

_OWNED = re.compile(rf"^{re.escape(NAME_PREFIX)}(\d+)-")


def run_dir_prefix() -> str:
    """The prefix of this launch's socket folder: it carries the launcher's pid."""
    return f"{NAME_PREFIX}{os.getpid()}-"


def remove_dead_launches() -> list[Path]:
    """Remove this user's segments and socket folders of launches whose launcher is dead."""
    removed = []
    for folder in (Path(SHM_DIR), Path(tempfile.gettempdir())):
        try:
            entries = list(folder.iterdir())
        except OSError:
            continue
        for path in entries:
            match = _OWNED.match(path.name)
            if match is None or not _ours(path) or _running(int(match[1])):
                continue
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(path)
    if removed:
        log.warning("removed what dead launches left: %s", ", ".join(map(str, removed)))
    return removed


def _ours(path: Path) -> bool:
    try:
        return path.lstat().st_uid == os.getuid()
    except OSError:
        return False


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process holds the pid now
    return True
