"""Logging set-up shared by the processes: quiet by default, one prefix per process."""

from __future__ import annotations

import logging
import os
import sys
import threading


def setup_logging(level: str, process: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format=f"%(asctime)s {process}[%(process)d] %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    if level != "debug":
        # transformers and friends are chatty at info level
        for noisy in ("transformers", "urllib3", "filelock"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
    # Progress bars are no log: off at every level, unless HF_HUB_DISABLE_PROGRESS_BARS=0 (or
    # TQDM_DISABLE=0) asks for them. A download's bars are hub.py's to show.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")
    _quiet_loading_bars()
    _thread_lock_for_progress_bars()


def _quiet_loading_bars() -> None:
    """transformers reads the variables above once, at its import: in a process that
    imported it first (the launcher's children inherit it) its weight-loading bar would
    still draw, unless turned off where it looks now."""
    transformers = sys.modules.get("transformers")
    if transformers is not None and os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] != "0":
        transformers.utils.logging.disable_progress_bar()


def _thread_lock_for_progress_bars() -> None:
    """tqdm guards its bars with a multiprocessing lock by default: a POSIX semaphore that a
    child leaving through ``os._exit`` never releases, and that the resource tracker then
    reports as leaked at every stop. The engine's processes draw bars from one thread."""
    try:
        import tqdm
    except ImportError:
        return
    tqdm.tqdm.set_lock(threading.RLock())
