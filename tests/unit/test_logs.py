"""The processes' logging set-up: progress bars stay off at every log level unless asked."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CODE = """
import transformers
from cbpipe.logs import setup_logging
setup_logging({level!r}, "test")
print(transformers.utils.logging.is_progress_bar_enabled())
"""


@pytest.mark.parametrize("level", ["warning", "info", "debug"])
@pytest.mark.parametrize("asked", [None, "0"])
def test_weight_loading_bars_are_off_unless_asked_for(level: str, asked: str | None) -> None:
    """transformers read the environment at its import, before the set-up: its bars (the
    worker's "Loading weights") are turned off where it looks now, whatever the level."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_DISABLE")
    }
    if asked is not None:
        env["HF_HUB_DISABLE_PROGRESS_BARS"] = asked
    shown = subprocess.run(
        [sys.executable, "-c", CODE.format(level=level)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.split()[-1]
    assert shown == str(asked == "0")
