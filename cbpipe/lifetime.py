"""Processes that end with the process that started them.

A parent killed outright (SIGKILL, the OOM killer) runs no clean-up, and its children would
live on holding the device's memory and a shared-memory segment. On Linux a child can ask the
kernel for a signal when its parent exits (``PR_SET_PDEATHSIG``); elsewhere these functions
do nothing.

The kernel sends the signal when the *thread* that forked the child exits: start children
from a thread that lives as long as they should (the main thread, normally).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
# Loaded at import, in the parent: a pre-exec hook runs after fork and must not dlopen.
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def end_with_parent(parent_pid: int, signum: int = signal.SIGTERM) -> None:
    """Have ``signum`` sent to this process when ``parent_pid``, its parent, exits.

    If the parent is already gone (it died before this call), the signal is sent at once.
    Safe as a ``subprocess.Popen`` ``preexec_fn``: it makes only system calls.
    """
    if _libc is None:
        return
    _libc.prctl(_PR_SET_PDEATHSIG, signum)
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signum)


def process_age_s() -> float | None:
    """Seconds since this process started (interpreter start-up and imports included), or
    None where the kernel does not say (outside Linux)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the name may hold spaces
    except OSError:
        return None
    started_ticks = int(fields[19])  # starttime, field 22, in clock ticks since boot
    return time.clock_gettime(time.CLOCK_BOOTTIME) - started_ticks / os.sysconf("SC_CLK_TCK")


def fork_is_safe() -> bool:
    """Whether a child forked now can run on: on Linux, with no Python thread but this one
    (a fork copies no other thread, whatever locks it held) and no CUDA context (a forked
    child cannot use its parent's). Native pools, such as the BLAS threads numpy starts at
    import, are fork-aware and do not count."""
    if not sys.platform.startswith("linux") or threading.active_count() != 1:
        return False
    torch = sys.modules.get("torch")
    return torch is None or not torch.cuda.is_initialized()
