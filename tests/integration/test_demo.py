"""``make run``'s demo (``scripts/demo.py``): Ctrl-C ends it quietly, and its engine too."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

from tests.integration.conftest import leftover_segments

DEMO = Path(__file__).parents[2] / "scripts" / "demo.py"


def _restore_sigint() -> None:
    # A shell's background job starts with SIGINT ignored, which Python would keep.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_ends_the_demo_with_130_no_traceback_and_no_engine_left() -> None:
    demo = subprocess.Popen(
        [sys.executable, str(DEMO), "--device", "cpu"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=_restore_sigint,
    )
    assert demo.stdout is not None
    lines = []
    for line in demo.stdout:
        lines.append(line)
        if line.startswith("engine ready at "):
            demo.send_signal(signal.SIGINT)  # as the terminal sends Ctrl-C: to the demo alone
            break
    output = "".join(lines) + demo.communicate(timeout=60)[0]
    assert demo.returncode == 130, output
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
    match = re.search(r"ipc://(/\S+/cbpipe-(\d+)-[^/]+)/client\.sock", output)
    assert match is not None, output
    run_dir, launcher_pid = Path(match[1]), int(match[2])
    assert not run_dir.exists(), f"the engine's socket folder is left: {run_dir}"
    assert not leftover_segments(launcher_pid)
    assert not Path(f"/proc/{launcher_pid}").exists(), "the launcher still runs"
