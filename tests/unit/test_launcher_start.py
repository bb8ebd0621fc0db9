"""How the launcher starts its children: forked where that is safe, spawned otherwise."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forks on Linux")


def _start_method(setup: str) -> str:
    code = "\n".join(
        [
            setup,
            "from cbpipe.launcher import _child_context",
            "print(_child_context().get_start_method())",
        ]
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()


def test_a_single_threaded_launcher_forks() -> None:
    assert _start_method("") == "fork"


def test_a_launcher_with_another_thread_spawns() -> None:
    """A fork copies only the calling thread: a lock another thread held stays held."""
    setup = (
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()"
    )
    assert _start_method(setup) == "spawn"
