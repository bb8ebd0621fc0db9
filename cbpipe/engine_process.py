"""Start ``cbpipe-launch`` as a child process and wait until it serves: for demos, tests
and benchmarks that drive a real engine from Python."""

from __future__ import annotations

import re
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO

READY = re.compile(r"^cbpipe ready address=(\S+) scheduler=(\d+) worker=(\d+)")


class EngineStartError(RuntimeError):
    pass


@dataclass
class EngineProcess:
    """A running ``cbpipe-launch``; use as a context manager, or call ``stop()``."""

    process: subprocess.Popen
    address: str
    scheduler_pid: int
    worker_pid: int
    _stderr: IO[str]  # a file, not a pipe: a chatty engine must never block on its logs
    _final_stderr: str = ""

    @classmethod
    def start(cls, args: Sequence[str] = (), *, timeout: float = 120.0) -> EngineProcess:
        """Launch with ``args`` (launcher flags) and block until the ready line."""
        stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - lives as long as the engine
        process = subprocess.Popen(
            [sys.executable, "-m", "cbpipe.launcher", *args],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            start_new_session=True,  # a signal to the caller's group does not reach it
        )
        try:
            match = _wait_ready(process, timeout)
        except EngineStartError as exc:
            process.kill()
            process.wait()
            stderr.seek(0)
            raise EngineStartError(f"{exc}\n{stderr.read()}") from None
        return cls(process, match[1], int(match[2]), int(match[3]), stderr)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def stderr(self) -> str:
        """What the engine logged so far (also after it stopped)."""
        if self._stderr.closed:
            return self._final_stderr
        self._stderr.seek(0)
        return self._stderr.read()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Signal the launcher and wait for it; returns its exit code."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()
        return self.process.returncode

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
        self._final_stderr = self.stderr
        self._stderr.close()


def _wait_ready(process: subprocess.Popen, timeout: float) -> re.Match[str]:
    assert process.stdout is not None
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if selector.select(timeout=0.5):
                line = process.stdout.readline()
                if match := READY.match(line):
                    return match
                if not line and process.poll() is not None:
                    break
            elif process.poll() is not None:
                break
    if process.poll() is not None:
        raise EngineStartError(f"cbpipe-launch exited with code {process.returncode}")
    raise EngineStartError(f"cbpipe-launch not ready within {timeout:.0f} s")
