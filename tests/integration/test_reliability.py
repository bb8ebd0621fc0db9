"""What no request, client or stuck process may do: stop, stall or outlive the engine.

Each test provokes one failure mode of docs/RELIABILITY.md and checks what it must get: an
error reply that names the problem, ``EngineError`` within the liveness bound, a cancel, a
clean next launch. Times are bounds on waiting, never speed assertions.
"""

from __future__ import annotations

import itertools
import os
import signal
import statistics
import subprocess
import sys
import textwrap
import threading
import time

import msgpack
import pytest

from cbpipe.client import Client, EngineError, RequestError
from cbpipe.engine_process import EngineProcess
from cbpipe.protocol import PROTOCOL_VERSION
from tests.integration.conftest import (
    MODEL_FLAGS,
    EngineRun,
    launch_engine,
    leftover_segments,
    process_start_time,
)
from tests.integration.helpers import RESULT_TIMEOUT_S, RawConnection, assert_serves
from tests.integration.test_bad_input import expect_error_reply, frame

LIVENESS_S = 3.0  # --liveness-timeout-s of the engines these tests stop
# What a stuck process may take to be noticed: the timeout, ZeroMQ's heartbeat, slack for a
# loaded machine.
NOTICE_BOUND_S = 30.0
HUGE_PROMPTS = 8  # text prompts at the frame limit, sent in one burst


def nested(depth: int) -> bytes:
    """A msgpack value ``depth`` lists deep: 1 byte a level."""
    return b"\x91" * depth + b"\xc0"


def test_a_frame_nested_a_thousand_deep_gets_an_error(engine: EngineRun) -> None:
    submit = msgpack.packb({"v": PROTOCOL_VERSION, "type": "submit", "request_id": 3, "params": {}})
    # The same map with a "prompt" whose value is 1000 levels deep.
    deep = b"\x85" + submit[1:] + msgpack.packb("prompt") + nested(1000)
    with RawConnection(engine.address) as raw:
        raw.send(deep)
        expect_error_reply(raw, 3, "prompt")
    assert_serves(engine.address)


def test_a_top_k_the_slots_cannot_hold_gets_an_error(engine: EngineRun) -> None:
    with RawConnection(engine.address) as raw:
        fields = {"max_new_tokens": 4, "top_k": 2**31, "temperature": 1.0}
        raw.send(frame(type="submit", request_id=4, prompt=[5, 6], params=fields))
        expect_error_reply(raw, 4, "top_k")
    assert_serves(engine.address)


def test_a_frame_over_the_limit_costs_only_its_connection(engine: EngineRun) -> None:
    with Client(engine.address) as client:
        limit = client._welcome.max_frame_bytes  # type: ignore[union-attr]
        running = client.submit([5, 6, 7], max_new_tokens=400, ignore_eos=True)
        with RawConnection(engine.address) as raw:
            raw.send(b"\x00" * (limit + 1))
            assert raw.receive(1.0) is None  # dropped unread, with its connection
        assert len(running.result(timeout=RESULT_TIMEOUT_S).token_ids) == 400
    assert_serves(engine.address)


def test_a_huge_text_prompt_does_not_stall_other_streams(text_engine: EngineRun) -> None:
    """Tokenizing happens off the step loop: another stream keeps its pace meanwhile."""
    with Client(text_engine.address) as client:
        limit = client._welcome.max_frame_bytes  # type: ignore[union-attr]
        stream = client.submit("The list of", max_new_tokens=1500, ignore_eos=True)
        arrivals: list[float] = []
        reader = threading.Thread(
            target=lambda: arrivals.extend(time.perf_counter() for _ in stream.stream(60))
        )
        reader.start()
        while len(arrivals) < 60:
            time.sleep(0.01)
        # One prompt at the frame limit tokenizes in the time of a few dozen steps, or fewer on
        # a fast machine: a burst of them makes the stall (or its absence) measurable.
        huge = ("Return the list of all the elements. " * (limit // 40))[: limit - 1024]
        big_start = time.perf_counter()
        refused = [client.submit(huge, max_new_tokens=4) for _ in range(HUGE_PROMPTS)]
        for job in refused:
            with pytest.raises(RequestError, match="too long"):
                job.result(timeout=RESULT_TIMEOUT_S)
        big_end = time.perf_counter()
        stream.cancel()
        reader.join(RESULT_TIMEOUT_S)
    before = [b - a for a, b in itertools.pairwise(arrivals) if b < big_start]
    during = [b for b in arrivals if big_start <= b <= big_end]
    one_prompt = (big_end - big_start) / HUGE_PROMPTS
    steps_per_prompt = one_prompt / statistics.median(before)
    # Tokenized on the loop, each prompt would stop the stream for all of its own time: a
    # token or two a prompt. Off it, the stream keeps at least half its pace, though the
    # tokenizer thread takes one of the cores.
    assert steps_per_prompt > 6, "the prompts were too cheap to tell anything"
    assert len(during) > 3 * HUGE_PROMPTS, (steps_per_prompt, len(during))


def test_a_killed_clients_jobs_are_cancelled(engine: EngineRun) -> None:
    script = textwrap.dedent(
        f"""
        import sys, time
        from cbpipe.client import Client
        client = Client({engine.address!r})
        jobs = [client.submit([5, 6, 7 + i], max_new_tokens=5000, ignore_eos=True)
                for i in range(20)]
        for _ in jobs[0].stream():
            print("streaming", flush=True)
            time.sleep(1000)
        """
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "streaming"
        with Client(engine.address) as client:
            # The first job streams as soon as a step held it: the scheduler bounds the time
            # a poll takes client messages, so the child's last submits may arrive a poll or
            # two after that step, and after this connection's first question.
            deadline = time.monotonic() + NOTICE_BOUND_S
            while (stats := client.stats()).num_running + stats.num_waiting < 20 and (
                time.monotonic() < deadline
            ):
                time.sleep(0.05)
            assert stats.num_running + stats.num_waiting >= 20, stats
            child.kill()
            child.wait()
            deadline = time.monotonic() + NOTICE_BOUND_S
            while (stats := client.stats()).num_running + stats.num_waiting and (
                time.monotonic() < deadline
            ):
                time.sleep(0.2)
            assert stats.num_running == stats.num_waiting == 0, stats
            assert stats.kv_cache_usage == 0.0
    finally:
        child.kill()


def stopped_child_test(run: EngineRun, pid: int, message: str) -> None:
    """SIGSTOP one child with jobs running: they fail with ``EngineError`` and the launcher
    exits non-zero, each within the bound; nothing is left behind."""
    with Client(run.address) as client:
        jobs = [client.submit([5, 6, i], max_new_tokens=100000, ignore_eos=True) for i in (7, 8)]
        next(jobs[0].stream(timeout=RESULT_TIMEOUT_S))
        stopped_at = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        try:
            for job in jobs:
                with pytest.raises(EngineError, match=message):
                    job.result(timeout=NOTICE_BOUND_S)
            failed_after = time.monotonic() - stopped_at
            code = run.engine.wait_exit(NOTICE_BOUND_S)
        finally:
            if process_start_time(pid) is not None:
                os.kill(pid, signal.SIGCONT)
    assert code is not None and code != 0, f"launcher exit code {code}\n{run.stderr}"
    assert failed_after < NOTICE_BOUND_S
    assert "stopped responding" in run.stderr, run.stderr
    run.assert_cleaned_up()


def test_a_stopped_worker_fails_every_job() -> None:
    flags = (*MODEL_FLAGS, "--liveness-timeout-s", str(LIVENESS_S))
    with launch_engine(*flags, timeout=180) as run:
        stopped_child_test(run, run.engine.worker_pid, "worker stopped responding")


def test_a_stopped_scheduler_fails_every_job() -> None:
    flags = (*MODEL_FLAGS, "--liveness-timeout-s", str(LIVENESS_S))
    with launch_engine(*flags, timeout=180) as run:
        stopped_child_test(run, run.engine.scheduler_pid, "lost the connection")


def test_the_next_launch_removes_what_a_killed_launch_left() -> None:
    engine = EngineProcess.start(MODEL_FLAGS, timeout=180)
    try:
        segments = leftover_segments(engine.pid)
        run_dir = os.path.dirname(engine.address.removeprefix("ipc://"))
        assert segments and os.path.isdir(run_dir)
        # SIGKILL to every process, with none left to clean up after the others: the launcher
        # is stopped first (it would clean up after its children), then the children die (one
        # outliving the launcher would clean up after it: ``launcher._on_launcher_death``).
        os.kill(engine.pid, signal.SIGSTOP)
        for pid in (engine.scheduler_pid, engine.worker_pid):
            os.kill(pid, signal.SIGKILL)
        while any(process_start_time(p) for p in (engine.scheduler_pid, engine.worker_pid)):
            time.sleep(0.05)
        engine.kill()
        assert leftover_segments(engine.pid) == segments and os.path.isdir(run_dir)
    finally:
        engine.close()
    with launch_engine(*MODEL_FLAGS, timeout=180) as run:
        assert not leftover_segments(engine.pid)
        assert not os.path.exists(run_dir)
        assert_serves(run.address)
    # A clean stop says nothing but the clean-up it did.
    lines = [line for line in run.stderr.splitlines() if "removed what dead launches" not in line]
    assert not lines, run.stderr


def test_listening_beyond_this_host_needs_allow_remote_and_a_key() -> None:
    anywhere = "tcp://0.0.0.0:0"  # any free port, which the ready line names
    launch = [sys.executable, "-m", "cbpipe.launcher", *MODEL_FLAGS]
    refused = subprocess.run([*launch, "--address", anywhere], capture_output=True, text=True)
    assert refused.returncode == 2 and "--allow-remote" in refused.stderr
    no_key = subprocess.run(
        [*launch, "--address", anywhere, "--allow-remote"],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "CBPIPE_API_KEY"},
    )
    assert no_key.returncode == 2 and "--api-key" in no_key.stderr
    flags = (*MODEL_FLAGS, "--address", anywhere, "--allow-remote")
    with launch_engine(*flags, "--api-key", "k3y", timeout=180) as run:
        host, port = run.address.removeprefix("tcp://").rsplit(":", 1)
        assert host == "0.0.0.0" and port.isdigit() and port != "0", run.address
        # A second engine on the taken address says so in a line, and harms the first.
        taken = subprocess.run(
            [*launch, "--address", run.address, "--allow-remote", "--api-key", "k3y"],
            capture_output=True,
            text=True,
        )
        assert taken.returncode != 0
        assert f"cannot listen for clients on tcp://0.0.0.0:{port}: Address already in use" in (
            taken.stderr
        )
        assert "Traceback" not in taken.stderr, taken.stderr
        address = f"tcp://127.0.0.1:{port}"
        with Client(address, api_key="k3y") as client:
            job = client.submit([5, 6, 7], max_new_tokens=4, ignore_eos=True)
            assert len(job.result(timeout=RESULT_TIMEOUT_S).token_ids) == 4
        for key in ("wrong", None):
            with pytest.raises(EngineError, match="api key"):
                Client(address, api_key=key, connect_timeout=20)
        with Client(address, api_key="k3y") as client:  # the refused clients harmed nothing
            job = client.submit([5, 6, 7], max_new_tokens=4, ignore_eos=True)
            assert len(job.result(timeout=RESULT_TIMEOUT_S).token_ids) == 4
    # The handshakes' authenticator stopped with the sockets: context.term() did not find its
    # socket open (which held the stop until the launcher killed the scheduler).
    assert "ContextTerminated" not in run.stderr, run.stderr
