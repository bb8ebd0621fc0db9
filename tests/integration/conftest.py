"""Real engines for the integration tests: ``python -m cbpipe.launcher`` as a child process.

``launch_engine(*flags)`` starts one launcher, waits for its ready line and, on exit, stops it
with SIGTERM and checks that it left nothing behind: no shared-memory segment, no child
process, no socket folder.

A launch costs many seconds on a small machine (three processes import torch and
transformers), so the fixtures start engines ahead of the tests that need them, several at
once: ``EnginePool`` looks at the collected tests, starts every shared engine they use and a
few fresh ones in parallel, and hands them out. Tests that only submit jobs share one engine
per configuration (``engine``, ``sync_engine``); tests that kill or stop an engine take a
``fresh_engine`` of their own, and the next one is already starting while they run.
"""

from __future__ import annotations

import atexit
import glob
import importlib.util
import os
import signal
import socket
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import pytest

from cbpipe.client import Client
from cbpipe.engine_process import EngineProcess, EngineStartError

MODEL_FLAGS = ("--model", "random:qwen2-tiny", "--device", "cpu", "--num-blocks", "512")
VOCAB_SIZE = 512  # of random:qwen2-tiny


def _embedded_model_dir() -> Path:
    """``cbpipe.models.EMBEDDED_MODEL_DIR``, found without importing transformers (seconds)."""
    spec = importlib.util.find_spec("cbpipe.models")
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).parent / "default"


EMBEDDED_MODEL_DIR = _embedded_model_dir()
# A model with a tokenizer for the text-prompt tests: the embedded default model, or another
# checkpoint folder named by CBPIPE_TEST_TEXT_MODEL.
TEXT_MODEL_DIR = Path(os.environ.get("CBPIPE_TEST_TEXT_MODEL", EMBEDDED_MODEL_DIR))
# The sync engine also serves the too-long-prompt tests; not a multiple of the block size, so
# a limit rounded up to whole blocks anywhere shows.
SYNC_MAX_MODEL_LEN = 250

STOP_TIMEOUT_S = 15.0  # SIGTERM to exit; then the whole process group is killed
CHILD_EXIT_TIMEOUT_S = 5.0  # after the launcher exited, for its children to be gone
POOL_READY_TIMEOUT_S = 180.0  # pooled engines start side by side and compete for the CPU
MAX_SPARE_ENGINES = 2  # fresh engines started ahead of the tests that take them


class EngineRun:
    """A test's engine: an ``EngineProcess``, plus the checks that it stops cleanly and
    leaves nothing behind, and the pids of its children, so that none can outlive it."""

    def __init__(self, flags: Sequence[str]) -> None:
        self.flags = tuple(flags)
        self.engine = EngineProcess.spawn(self.flags)
        _STARTED.append(self.engine)
        self._children: dict[int, str] = {}  # pid -> start time, against pid reuse

    @property
    def address(self) -> str:
        return self.engine.address

    @property
    def pid(self) -> int:
        return self.engine.pid

    @property
    def stderr(self) -> str:
        return self.engine.stderr

    def wait_ready(self, timeout: float) -> None:
        """Wait for the ready line (``timeout`` counts from the start); fail with stderr."""
        try:
            self.engine.wait_ready(timeout)
        except EngineStartError as exc:
            raise pytest.fail.Exception(f"engine {self.flags}: {exc}") from None
        for pid in self.child_pids():
            start_time = process_start_time(pid)
            assert start_time is not None, f"child {pid} named in the ready line is not running"
            self._children[pid] = start_time

    def child_pids(self) -> list[int]:
        """Every child named in the ready line: the scheduler, the worker, HTTP servers."""
        fields = self.engine.ready_fields
        return [
            int(v) for k, v in fields.items() if k not in ("address", "startup_s") and v.isdigit()
        ]

    @property
    def http_url(self) -> str:
        url = self.engine.http_url
        assert url is not None, f"engine {self.flags} serves no HTTP"
        return url

    def finish(self) -> None:
        """Stop the engine if it still runs (it must exit 0), then check what it left."""
        if self.engine.running:
            self.engine.send_signal(signal.SIGTERM)
            code = self.engine.wait_exit(STOP_TIMEOUT_S)
            if code is None:
                self.engine.kill()
                pytest.fail(
                    f"the launcher did not exit within {STOP_TIMEOUT_S:.0f} s of "
                    f"SIGTERM\nstderr:\n{self.stderr}"
                )
            assert code == 0, f"SIGTERM: launcher exit code {code}\nstderr:\n{self.stderr}"
            assert "did not stop within" not in self.stderr, self.stderr  # killed, not stopped
        self.assert_cleaned_up()

    def assert_cleaned_up(self) -> None:
        """After the launcher exited: no segment, no child, no socket folder of this run."""
        assert not self.engine.running, "the launcher still runs"
        segments = leftover_segments(self.pid)
        for path in segments:  # do not let one failure leak into later runs
            os.unlink(path)
        alive = self._wait_children_gone(CHILD_EXIT_TIMEOUT_S)
        if alive:
            self.kill_children()
        assert not segments, f"shared memory left behind: {segments}"
        assert not alive, f"child processes left behind: {alive}"
        run_dir = self._run_dir()
        assert run_dir is None or not run_dir.exists(), f"socket folder left behind: {run_dir}"

    def discard(self) -> None:
        """Whatever happened: kill what is left of the engine and release its files."""
        if self.engine.running or self.alive_children():
            self.engine.kill()
            self.kill_children()
        self.engine.close()

    def kill_children(self) -> None:
        for pid in self.alive_children():
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def alive_children(self) -> list[int]:
        return [pid for pid, start in self._children.items() if process_start_time(pid) == start]

    def _wait_children_gone(self, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        while (alive := self.alive_children()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return alive

    def _run_dir(self) -> Path | None:
        """The launcher's own socket folder, when it chose the client address."""
        if not self.engine.is_ready or not self.address.startswith("ipc://"):
            return None
        folder = Path(self.address.removeprefix("ipc://")).parent
        return folder if folder.name.startswith("cbpipe-") else None


_STARTED: list[EngineProcess] = []


@atexit.register
def _kill_leftovers() -> None:
    """A safety net for an aborted session: no engine outlives the test process."""
    alive = [engine for engine in _STARTED if engine.running]
    for engine in alive:
        engine.send_signal(signal.SIGTERM)
    for engine in alive:
        if engine.wait_exit(STOP_TIMEOUT_S) is None:
            engine.kill()


def leftover_segments(launcher_pid: int) -> list[str]:
    """Shared-memory segments named after this launcher (``cbpipe-<pid>-<random>``)."""
    return sorted(glob.glob(f"/dev/shm/cbpipe-{launcher_pid}-*"))


def process_start_time(pid: int) -> str | None:
    """A live (not zombie) process's start time, which tells a reused pid apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
    state, start_time = fields[0], fields[19]
    return None if state in ("Z", "X") else start_time


def free_tcp_address() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{probe.getsockname()[1]}"


@contextmanager
def launch_engine(*flags: str, timeout: float = 60.0) -> Iterator[EngineRun]:
    """Start ``python -m cbpipe.launcher *flags``; stop it and check the clean-up on exit."""
    run = EngineRun(flags)
    try:
        run.wait_ready(timeout)
        yield run
        run.finish()
    finally:
        run.discard()


# --- engines started ahead, shared or fresh --------------------------------------------------


def shared_engine_flags(name: str) -> tuple[str, ...]:
    if name == "engine":
        return MODEL_FLAGS
    if name == "sync_engine":  # over TCP, to cover --address and that transport too
        return (
            *MODEL_FLAGS,
            "--sync",
            "--max-model-len",
            str(SYNC_MAX_MODEL_LEN),
            "--address",
            "tcp://127.0.0.1:0",  # any free port, as the ready line names it
        )
    if name == "text_engine":  # two steps in flight: the other engines run one and three
        return ("--model", str(TEXT_MODEL_DIR), "--device", "cpu", "--num-blocks", "512",
                "--steps-in-flight", "2")  # fmt: skip
    if name == "http_engine":  # the text model over HTTP, with a key and a chat template
        return ("--model", str(TEXT_MODEL_DIR), "--device", "cpu", "--num-blocks", "512",
                "--port", "0", "--api-key", HTTP_API_KEY, "--served-model-name", HTTP_MODEL_NAME,
                "--chat-template", str(CHAT_TEMPLATE))  # fmt: skip
    if name == "http_tiny_engine":  # no tokenizer; two server processes share the port
        # and reach the scheduler on the TCP port it chose: the launcher hands it on.
        return (*MODEL_FLAGS, "--port", "0", "--api-server-count", "2",
                "--address", "tcp://127.0.0.1:0")  # fmt: skip
    raise KeyError(name)


HTTP_API_KEY = "sk-cbpipe-test"
HTTP_MODEL_NAME = "cbpipe-test"
# The embedded model's tokenizer has no chat template of its own.
CHAT_TEMPLATE = Path(__file__).parent / "chat_template.jinja"
SHARED_ENGINES = ("engine", "sync_engine", "text_engine", "http_engine", "http_tiny_engine")
FRESH_ENGINE_FLAGS = MODEL_FLAGS


class EnginePool:
    """Starts the engines a test session needs, in parallel, before the tests ask for them."""

    def __init__(self, shared: Sequence[str], fresh_needed: int) -> None:
        self._shared = {name: EngineRun(shared_engine_flags(name)) for name in shared}
        self._fresh_left = fresh_needed  # not yet started
        self._spares: deque[EngineRun] = deque()
        self._top_up()

    def shared(self, name: str) -> EngineRun:
        if name not in self._shared:  # a test the collection did not foresee
            self._shared[name] = EngineRun(shared_engine_flags(name))
        run = self._shared[name]
        run.wait_ready(POOL_READY_TIMEOUT_S)
        return run

    def take_fresh(self) -> EngineRun:
        """An engine no other test has used; the caller stops it (``finish()``)."""
        run = self._spares.popleft() if self._spares else EngineRun(FRESH_ENGINE_FLAGS)
        self._top_up()
        run.wait_ready(POOL_READY_TIMEOUT_S)
        return run

    def close(self) -> None:
        """SIGTERM every engine left at once, then check each one's exit and clean-up."""
        runs = [*self._shared.values(), *self._spares]
        for run in runs:
            if run.engine.running:
                run.engine.send_signal(signal.SIGTERM)
        failures = []
        for run in runs:
            code = run.engine.wait_exit(STOP_TIMEOUT_S)
            if code is None:
                run.engine.kill()
            if code != 0:
                failures.append(f"{run.flags}: exit code {code} after SIGTERM\n{run.stderr}")
            try:
                run.assert_cleaned_up()
            except AssertionError as exc:
                failures.append(f"{run.flags}: {exc}")
            run.discard()
        assert not failures, "\n".join(failures)

    def _top_up(self) -> None:
        while self._fresh_left > 0 and len(self._spares) < MAX_SPARE_ENGINES:
            self._spares.append(EngineRun(FRESH_ENGINE_FLAGS))
            self._fresh_left -= 1


@pytest.fixture(scope="session")
def engine_pool(request: pytest.FixtureRequest) -> Iterator[EnginePool]:
    items = [item for item in request.session.items if not _skipped(item)]
    used = {name for item in items for name in getattr(item, "fixturenames", ())}
    fresh_needed = sum("fresh_engine" in getattr(item, "fixturenames", ()) for item in items)
    pool = EnginePool([name for name in SHARED_ENGINES if name in used], fresh_needed)
    yield pool
    pool.close()


def _skipped(item: pytest.Item) -> bool:
    """Whether a skip or a true skipif condition marks the test (no engine to start for it)."""
    return any(
        marker.name == "skip" or (marker.args and marker.args[0] is True)
        for marker in item.iter_markers()
        if marker.name in ("skip", "skipif")
    )


@pytest.fixture(scope="session")
def engine(engine_pool: EnginePool) -> EngineRun:
    """The shared asynchronous engine (random:qwen2-tiny on the CPU). Do not stop it."""
    return engine_pool.shared("engine")


@pytest.fixture(scope="session")
def sync_engine(engine_pool: EnginePool) -> EngineRun:
    """The shared ``--sync`` engine, limited to ``SYNC_MAX_MODEL_LEN`` tokens per sequence."""
    return engine_pool.shared("sync_engine")


@pytest.fixture(scope="session")
def text_engine(engine_pool: EnginePool) -> EngineRun:
    """The shared engine of ``TEXT_MODEL_DIR`` (text prompts, ``Result.text``)."""
    return engine_pool.shared("text_engine")


@pytest.fixture(scope="session")
def http_engine(engine_pool: EnginePool) -> EngineRun:
    """The shared engine of ``TEXT_MODEL_DIR`` with an HTTP server (key ``HTTP_API_KEY``)."""
    return engine_pool.shared("http_engine")


@pytest.fixture(scope="session")
def http_tiny_engine(engine_pool: EnginePool) -> EngineRun:
    """random:qwen2-tiny (no tokenizer) behind two HTTP server processes, no key."""
    return engine_pool.shared("http_tiny_engine")


@pytest.fixture(scope="module")
def api(http_engine: EngineRun) -> Any:
    """The ``openai`` package's client of ``http_engine``."""
    import openai

    from tests.integration.helpers import RESULT_TIMEOUT_S

    return openai.OpenAI(
        base_url=http_engine.http_url + "/v1",
        api_key=HTTP_API_KEY,
        max_retries=0,
        timeout=RESULT_TIMEOUT_S,
    )


@pytest.fixture(scope="module")
def http(http_engine: EngineRun) -> Iterator[Any]:
    """An ``httpx`` client of ``http_engine``, with its key, for raw requests."""
    import httpx

    from tests.integration.helpers import RESULT_TIMEOUT_S

    headers = {"Authorization": f"Bearer {HTTP_API_KEY}"}
    with httpx.Client(
        base_url=http_engine.http_url, headers=headers, timeout=RESULT_TIMEOUT_S
    ) as client:
        yield client


@pytest.fixture
def fresh_engine(engine_pool: EnginePool) -> Iterator[EngineRun]:
    """An engine of this test's own, which it may kill; checked for clean-up afterwards."""
    run = engine_pool.take_fresh()
    try:
        yield run
        run.finish()
    finally:
        run.discard()


@pytest.fixture
def client(engine: EngineRun) -> Iterator[Client]:
    with Client(engine.address, connect_timeout=30) as connected:
        yield connected
