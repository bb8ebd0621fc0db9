"""Logging set-up shared by the processes: quiet by default, one prefix per process."""

from __future__ import annotations

import logging


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
