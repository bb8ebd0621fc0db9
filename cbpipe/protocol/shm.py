"""Creating and attaching the shared-memory segment that holds the slots.

The launcher creates the segment (``multiprocessing.shared_memory``) and unlinks it when it
stops; if it is killed outright, its children unlink it by name (``cbpipe.launcher``). Children
attach by mapping ``/dev/shm/<name>`` directly: attaching through ``SharedMemory`` would
register the segment with the child's resource tracker, which unlinks it when the child
exits, or warns about a "leak" that is not one. Linux only, like the CUDA servers we target.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
from multiprocessing import resource_tracker, shared_memory

SHM_DIR = "/dev/shm"
NAME_PREFIX = "cbpipe-"


def new_segment_name() -> str:
    return f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"


class SharedMemoryTooSmall(RuntimeError):
    """``/dev/shm`` has less room than the slots need."""


def free_bytes(folder: str = SHM_DIR) -> int:
    """The room left in ``folder``'s file system, for an unprivileged writer."""
    stats = os.statvfs(folder)
    return stats.f_bavail * stats.f_frsize


def check_room(nbytes: int, free: int, folder: str = SHM_DIR) -> None:
    """Raise ``SharedMemoryTooSmall`` unless ``free`` (``free_bytes(folder)``) covers
    ``nbytes``. Checked before creating the segment: a tmpfs out of room answers the first
    write to a page with SIGBUS, which kills the launcher with no word of why (a container's
    /dev/shm is 64 MB unless it is given more)."""
    if free < nbytes:
        raise SharedMemoryTooSmall(
            f"the slots need {nbytes / 1e6:.0f} MB of shared memory and {folder} has "
            f"{free / 1e6:.0f} MB free: give it more (docker run --shm-size=1g, or --ipc=host), "
            f"or shrink the slots (--max-num-seqs, --max-model-len, --steps-in-flight)"
        )


def create_segment(name: str, nbytes: int) -> shared_memory.SharedMemory:
    """A new segment, left out of multiprocessing's resource tracker: who removes it is ours
    to say (the launcher, its children when it is killed, the next launch). Tracked, a killed
    launcher's tracker would warn of a "leak" that the children had already removed."""
    segment = shared_memory.SharedMemory(name=name, create=True, size=nbytes)
    resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
    assert segment.buf is not None
    segment.buf[:nbytes] = bytes(nbytes)  # touch every page now, not on the first step
    return segment


def remove_segment(segment: shared_memory.SharedMemory) -> None:
    segment.close()
    unlink_segment(segment.name)  # not segment.unlink(): it would tell the tracker too


def unlink_segment(name: str) -> None:
    """Remove a segment by name, from a process that did not create it; gone already is fine."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(SHM_DIR, name))


class AttachedSegment:
    """A child's writable mapping of a segment created by the launcher."""

    def __init__(self, name: str, nbytes: int) -> None:
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size < nbytes:
                raise ValueError(f"shared memory {name} holds {size} bytes, expected {nbytes}")
            self._mmap = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self.name = name
        self.buf = memoryview(self._mmap)

    def close(self) -> None:
        self.buf.release()
        # Arrays over the mapping may still be referenced (say, by a traceback); then the
        # mapping goes with the process, and the launcher unlinks the segment.
        with contextlib.suppress(BufferError):
            self._mmap.close()
