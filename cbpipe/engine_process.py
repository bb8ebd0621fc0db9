"""Start ``cbpipe-launch`` as a child process and wait until it serves: for demos, tests
and benchmarks that drive a real engine from Python."""

from __future__ import annotations

import functools
import os
import re
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import suppress
from typing import IO

from cbpipe.lifetime import end_with_parent

READY = re.compile(r"^cbpipe ready address=(\S+) scheduler=(\d+) worker=(\d+)(.*)$")


class EngineStartError(RuntimeError):
    pass


class EngineProcess:
    """A ``cbpipe-launch`` child. ``start()`` launches one and waits until it serves;
    ``spawn()`` only launches it, for ``wait_ready()`` later (engines then start side by
    side). Use it as a context manager, or call ``stop()``.

    The launcher runs in a session of its own: a signal to the caller's process group does
    not reach it, and its own process group holds it and its children. On Linux it gets a
    SIGTERM when the caller dies, however it dies (a benchmark killed by ``timeout``, say), so
    an engine never outlives the program that started it; start it from a thread that lives
    as long as the engine should (``cbpipe.lifetime``).
    """

    def __init__(self, process: subprocess.Popen, stderr: IO[bytes]) -> None:
        self.process = process
        self.started_at = time.monotonic()
        self._stderr = stderr  # a file, not a pipe: a chatty engine must never block on its logs
        self._final_stderr = ""
        self._ready: re.Match[str] | None = None

    @classmethod
    def spawn(cls, args: Sequence[str] = ()) -> EngineProcess:
        """Launch with ``args`` (launcher flags) and return at once."""
        stderr = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the engine
        process = subprocess.Popen(
            [sys.executable, "-m", "cbpipe.launcher", *args],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            start_new_session=True,
            preexec_fn=functools.partial(end_with_parent, os.getpid()),
        )
        return cls(process, stderr)

    @classmethod
    def start(cls, args: Sequence[str] = (), *, timeout: float = 120.0) -> EngineProcess:
        """Launch with ``args`` (launcher flags) and block until the ready line."""
        engine = cls.spawn(args)
        try:
            return engine.wait_ready(timeout)
        except EngineStartError:
            engine.close()
            raise

    def wait_ready(self, timeout: float) -> EngineProcess:
        """Block until the ready line, at most ``timeout`` seconds after the spawn. On failure,
        kill the engine's process group and raise ``EngineStartError`` with its stderr."""
        if self._ready is None:
            self._ready = self._read_ready_line(self.started_at + timeout)
        if self._ready is None:
            code = self.process.poll()
            self.kill()
            why = (
                f"not ready within {timeout:.0f} s"
                if code is None
                else f"exited with code {code} before it was ready"
            )
            raise EngineStartError(f"cbpipe-launch {why}\nstderr:\n{self.stderr}")
        return self

    def _read_ready_line(self, deadline: float) -> re.Match[str] | None:
        stdout = self.process.stdout
        assert stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(stdout, selectors.EVENT_READ)
            # At least one look, however late: an engine waited for after its deadline may
            # have been ready long ago (a test pool starts engines well before their tests).
            while True:
                remaining = deadline - time.monotonic()
                if selector.select(timeout=min(max(remaining, 0.0), 0.5)):
                    line = stdout.readline()
                    if match := READY.match(line):
                        return match
                    if not line:  # stdout closed: the launcher is gone or going
                        with suppress(subprocess.TimeoutExpired):
                            self.process.wait(max(deadline - time.monotonic(), 0.0))
                        return None
                elif self.process.poll() is not None or remaining <= 0:
                    return None

    # --- what the ready line said -----------------------------------------------------------

    @property
    def is_ready(self) -> bool:
        return self._ready is not None

    @property
    def address(self) -> str:
        return self._ready_line()[1]

    @property
    def scheduler_pid(self) -> int:
        return int(self._ready_line()[2])

    @property
    def worker_pid(self) -> int:
        return int(self._ready_line()[3])

    @property
    def ready_fields(self) -> dict[str, str]:
        """Every ``key=value`` of the ready line (other children's pids, an HTTP URL, ...)."""
        line = self._ready_line()
        return dict(f.split("=", 1) for f in line[0].split()[2:] if "=" in f)

    @property
    def http_url(self) -> str | None:
        """The HTTP server's base URL (``http://host:port``), when it serves one."""
        return self.ready_fields.get("http")

    def _ready_line(self) -> re.Match[str]:
        if self._ready is None:
            raise EngineStartError("the engine is not ready: call wait_ready() first")
        return self._ready

    # --- the launcher process ---------------------------------------------------------------

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    @property
    def stderr(self) -> str:
        """What the engine logged so far (also after it stopped)."""
        if self._stderr.closed:
            return self._final_stderr
        fd = self._stderr.fileno()  # pread: the engine shares this file's offset
        return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")

    def send_signal(self, sig: int, *, whole_group: bool = False) -> None:
        """Signal the launcher, or (like Ctrl-C in a terminal) its whole process group."""
        if whole_group:
            os.killpg(self.pid, sig)
        else:
            self.process.send_signal(sig)

    def wait_exit(self, timeout: float) -> int | None:
        """The launcher's exit code, or None if it still runs after ``timeout`` seconds."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """SIGKILL the whole process group (the launcher and its children) and reap it."""
        with suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self.process.wait()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Signal the launcher and wait for it (then kill); returns its exit code."""
        if self.running:
            self.send_signal(sig)
            if self.wait_exit(timeout) is None:
                self.kill()
        if self.process.stdout is not None:
            self.process.stdout.close()
        return self.process.returncode

    def close(self) -> None:
        """``stop()``, and release the log file (``stderr`` still answers)."""
        self.stop()
        if not self._stderr.closed:
            self._final_stderr = self.stderr
            self._stderr.close()

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
