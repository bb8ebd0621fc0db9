"""The engine as processes: a child's death, signals, and clients with no engine to talk to.

Every test here ends its engine, so each takes a ``fresh_engine``; the fixture then checks
that the launcher left no shared memory, child process or socket folder behind.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import httpx
import pytest

from cbpipe.client import Client, EngineError, Job
from cbpipe.engine_process import EngineProcess
from tests.integration.conftest import (
    MODEL_FLAGS,
    EngineRun,
    free_tcp_address,
    leftover_segments,
    process_start_time,
)
from tests.integration.helpers import first_tokens, random_prompt

JOB_FAILURE_S = 10.0  # the engine dies or stops: every job fails with EngineError within this
LAUNCHER_EXIT_S = 15.0  # and the launcher exits within this (it is slow on a loaded machine)
# Children left without a launcher stop on their own, or their watchdog ends them after
# launcher.STOP_TIMEOUT_S: within this on a loaded machine.
ORPHAN_EXIT_S = 30.0
LONG_JOB: dict[str, Any] = {"max_new_tokens": 2000, "ignore_eos": True}


def submit_long_jobs(client: Client, count: int) -> list[Job]:
    """Jobs that run for seconds; returns once the first one streams (the step loop runs)."""
    rng = random.Random(count)
    jobs = [client.submit(random_prompt(rng, 8 + i), **LONG_JOB) for i in range(count)]
    assert len(first_tokens(jobs[0], 3)) == 3
    return jobs


def assert_jobs_fail(jobs: list[Job], within_s: float) -> None:
    """Every job ends in ``EngineError`` (a ``TimeoutError`` here means a hang)."""
    deadline = time.monotonic() + within_s
    for job in jobs:
        with pytest.raises(EngineError):
            job.result(timeout=max(deadline - time.monotonic(), 0.1))


def wait_launcher_exit(run: EngineRun, since: float) -> int:
    code = run.engine.wait_exit(max(since + LAUNCHER_EXIT_S - time.monotonic(), 0.1))
    assert code is not None, (
        f"the launcher still runs {LAUNCHER_EXIT_S:.0f} s later\nstderr:\n{run.stderr}"
    )
    return code


@pytest.mark.parametrize("victim", ["worker", "scheduler"])
def test_killed_child_fails_every_job_and_stops_the_launcher(
    fresh_engine: EngineRun, victim: str
) -> None:
    victim_pid = getattr(fresh_engine.engine, f"{victim}_pid")
    with Client(fresh_engine.address) as client:
        jobs = submit_long_jobs(client, 4)
        os.kill(victim_pid, signal.SIGKILL)
        killed_at = time.monotonic()

        assert_jobs_fail(jobs, JOB_FAILURE_S)
        with pytest.raises(EngineError):  # at submit or from the job, but never a hang
            client.submit([5, 6, 7], max_new_tokens=4).result(timeout=JOB_FAILURE_S)

    code = wait_launcher_exit(fresh_engine, since=killed_at)
    assert code != 0
    assert "exited unexpectedly" in fresh_engine.stderr, fresh_engine.stderr
    assert not leftover_segments(fresh_engine.pid)
    with pytest.raises(EngineError):
        Client(fresh_engine.address, connect_timeout=1)


def stop_with_jobs_in_flight(run: EngineRun, signum: int, *, whole_group: bool) -> None:
    """Signal an engine that is busy: its jobs fail, it exits 0 and leaves nothing behind."""
    with Client(run.address) as client:
        jobs = submit_long_jobs(client, 2)
        run.engine.send_signal(signum, whole_group=whole_group)
        signalled_at = time.monotonic()
        assert_jobs_fail(jobs, JOB_FAILURE_S)

    code = wait_launcher_exit(run, since=signalled_at)
    assert code == 0, f"exit code {code}; stderr:\n{run.stderr}"
    run.assert_cleaned_up()


@pytest.mark.parametrize(
    ("signum", "whole_group"),
    [
        pytest.param(signal.SIGTERM, False, id="SIGTERM-to-launcher"),
        pytest.param(signal.SIGINT, True, id="SIGINT-to-group"),  # Ctrl-C in a terminal
    ],
)
def test_signal_stops_cleanly_with_jobs_in_flight(
    fresh_engine: EngineRun, signum: int, whole_group: bool
) -> None:
    stop_with_jobs_in_flight(fresh_engine, signum, whole_group=whole_group)


def test_sigterm_to_the_whole_process_group_stops_cleanly(fresh_engine: EngineRun) -> None:
    """systemd (default KillMode=control-group) and coreutils ``timeout`` send SIGTERM to
    every process of the group, so the worker may die of it before the launcher has acted on
    its own: ``Launcher._watch`` must not take that exit for a crash (exit 1, "the worker
    exited unexpectedly")."""
    fresh_engine.engine.send_signal(signal.SIGTERM, whole_group=True)
    code = wait_launcher_exit(fresh_engine, since=time.monotonic())
    assert code == 0, f"exit code {code}; stderr:\n{fresh_engine.stderr}"
    fresh_engine.assert_cleaned_up()


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_client_without_an_engine_fails_fast(tmp_path: Path, transport: str) -> None:
    address = f"ipc://{tmp_path}/nothing.sock" if transport == "ipc" else free_tcp_address()
    start = time.monotonic()
    with pytest.raises(EngineError, match="no cbpipe engine answered"):
        Client(address, connect_timeout=1)
    assert time.monotonic() - start < 5


def test_client_library_imports_without_torch() -> None:
    code = "import sys, cbpipe.client; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def _status(pid: int) -> str:
    """The kernel's view of a process: state, signals pending, blocked, caught."""
    try:
        with open(f"/proc/{pid}/status") as f:
            keep = ("Name", "State", "SigPnd", "ShdPnd", "SigBlk", "SigCgt", "PPid")
            return "; ".join(line.strip() for line in f if line.startswith(keep))
    except FileNotFoundError:
        return "gone"


def _wait_until_gone(processes: dict[int, str | None], timeout: float) -> dict[int, str]:
    """Waits for processes, given as pid -> start time, to exit; returns those still running.

    A pid counts as gone once it names no live process with that start time: pids wrap
    around quickly here (pid_max 32768), and a new process may take a dead one's pid.
    """
    deadline = time.monotonic() + timeout
    running = dict(processes)
    while running and time.monotonic() < deadline:
        time.sleep(0.1)
        running = {pid: t for pid, t in running.items() if process_start_time(pid) == t}
    return {pid: _status(pid) for pid in running}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux's")
def test_engine_stops_when_the_program_that_started_it_is_killed() -> None:
    """A benchmark killed by ``timeout -s KILL`` runs no clean-up; its engine must not live on
    holding the device's memory and a shared-memory segment."""
    program = (
        "import sys\n"
        "from cbpipe.engine_process import EngineProcess\n"
        f"engine = EngineProcess.start({list(MODEL_FLAGS)!r}, timeout=120)\n"
        "print(engine.process.pid, flush=True)\n"
        "sys.stdin.read()\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", program], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None
        launcher_pid = int(parent.stdout.readline())
        launcher = {launcher_pid: process_start_time(launcher_pid)}
    finally:
        parent.kill()
        parent.wait()
    alive = _wait_until_gone(launcher, LAUNCHER_EXIT_S)
    assert not alive, f"the engine outlived its parent by {LAUNCHER_EXIT_S:.0f} s: {alive}"
    deadline = time.monotonic() + 5  # the launcher unlinks the segment as it stops
    while leftover_segments(launcher_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not leftover_segments(launcher_pid)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux's")
def test_children_stop_and_clean_up_when_the_launcher_is_killed() -> None:
    """SIGKILL (the OOM killer, ``kill -9``) gives the launcher no chance to stop its children
    or remove the shared memory and socket folder; the children do both."""
    engine = EngineProcess.start(list(MODEL_FLAGS), timeout=120)
    launcher = engine.process.pid
    names = {engine.scheduler_pid: "scheduler", engine.worker_pid: "worker"}
    children = {pid: process_start_time(pid) for pid in names}
    assert engine.address.startswith("ipc://")
    run_dir = os.path.dirname(engine.address.removeprefix("ipc://"))  # the sockets' folder
    assert os.path.isdir(run_dir) and leftover_segments(launcher)
    with Client(engine.address) as client:
        jobs = submit_long_jobs(client, 2)
        os.kill(launcher, signal.SIGKILL)
        engine.process.wait()
        assert_jobs_fail(jobs, JOB_FAILURE_S)
    alive = {
        names[pid]: status for pid, status in _wait_until_gone(children, ORPHAN_EXIT_S).items()
    }
    assert not alive, f"children outlived the launcher: {alive}\nstderr:\n{engine.stderr[-4000:]}"
    assert not leftover_segments(launcher)
    assert not os.path.exists(run_dir)
    assert "leaked shared_memory" not in engine.stderr  # the segment is not the tracker's
    if "Timeout (" in engine.stderr:  # the contract held, but through the watchdog
        warnings.warn(f"a child's orderly stop hung:\n{engine.stderr[-4000:]}", stacklevel=1)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux's")
def test_an_http_servers_access_log_blocks_nothing_after_the_launchers_kill() -> None:
    """At --log-level debug uvicorn logs every request, and it logged them to the launcher's
    stdout, a pipe that ``EngineProcess`` reads only to the ready line: some 600 requests
    filled it and the server hung in a write (before and after a ``kill -9`` of the launcher,
    when only its watchdog ended it). The children write to stderr."""
    engine = EngineProcess.start([*MODEL_FLAGS, "--port", "0", "--log-level", "debug"], timeout=120)
    try:
        fields = engine.ready_fields
        names = {int(pid): name for name, pid in fields.items() if name.startswith("api_server")}
        names |= {engine.scheduler_pid: "scheduler", engine.worker_pid: "worker"}
        children = {pid: process_start_time(pid) for pid in names}
        with httpx.Client(base_url=engine.http_url, timeout=JOB_FAILURE_S) as http:
            for _ in range(1500):  # some 150 KB of access log: twice a pipe's buffer
                assert http.get("/health").status_code == 200
        launcher = engine.process.pid
        os.kill(launcher, signal.SIGKILL)
        engine.process.wait()
        alive = {
            names[pid]: status for pid, status in _wait_until_gone(children, ORPHAN_EXIT_S).items()
        }
        assert not alive, f"children outlived the launcher: {alive}\n{engine.stderr[-4000:]}"
        assert "Timeout (" not in engine.stderr, engine.stderr[-4000:]  # no watchdog needed
        assert not leftover_segments(launcher)
    finally:
        engine.close()


_HANGING_CHILD = """
import multiprocessing as mp, os, signal, sys, time, types
from cbpipe import launcher

def stop_that_never_ends(spec, ready):
    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # a flag nobody reads
    ready.send(os.getpid())
    while True:
        time.sleep(0.1)

launcher.STOP_TIMEOUT_S = float(sys.argv[3])
spec = types.SimpleNamespace(
    launcher_pid=os.getpid(), segment_name=sys.argv[1], run_dir=sys.argv[2]
)
context = mp.get_context("fork")
receiver, sender = context.Pipe(duplex=False)
context.Process(target=launcher._child, args=(stop_that_never_ends, spec, sender, ())).start()
print(receiver.recv(), flush=True)
sys.stdin.read()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux's")
def test_an_orphan_whose_stop_hangs_still_exits_and_says_where(tmp_path: Path) -> None:
    """With the launcher killed, nobody is left to kill a child whose orderly stop hangs:
    the child's own watchdog prints where it stood and ends it."""
    segment = Path("/dev/shm") / f"cbpipe-test-{os.getpid()}-{random.randrange(1 << 30)}"
    segment.touch()
    try:
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        launcher = subprocess.Popen(
            [sys.executable, "-c", _HANGING_CHILD, segment.name, str(run_dir), "1"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert launcher.stdout is not None and launcher.stderr is not None
            child = int(launcher.stdout.readline())
            started = process_start_time(child)
        finally:
            launcher.kill()
            launcher.wait()
        alive = _wait_until_gone({child: started}, ORPHAN_EXIT_S)
        if alive:
            os.kill(child, signal.SIGKILL)
        stderr = launcher.stderr.read()  # to its end: the child held the pipe until it was gone
        assert not alive, f"the child outlived its launcher: {alive}\nstderr:\n{stderr}"
        assert not segment.exists() and not run_dir.exists()
        assert "Timeout (0:00:01)!" in stderr and "in stop_that_never_ends" in stderr, stderr
    finally:
        segment.unlink(missing_ok=True)  # if the child never got to it
