"""The worker's completion thread and the end of its process's ZeroMQ context."""

from __future__ import annotations

import queue
import tempfile
import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from cbpipe.protocol.messages import Shutdown
from cbpipe.worker.process import _send_completions

TERM_BOUND_S = 30.0  # term() takes milliseconds; generous for a loaded machine
BLOCKED_AFTER_S = 1.0  # the thread sent nothing for this long: it waits on the socket


@pytest.fixture
def gone_scheduler() -> Iterator[str]:
    """An ipc address that nothing binds, in a folder of the launcher's kind (short: an ipc
    path is at most 107 bytes, and pytest's ``tmp_path`` can be longer)."""
    with tempfile.TemporaryDirectory(prefix="cbpipe-test-") as folder:
        yield f"ipc://{folder}/results.sock"


def test_ending_the_context_ends_a_completion_thread_blocked_on_a_gone_scheduler(
    gone_scheduler: str,
) -> None:
    """The worker's stop waits a while for its completion thread, then ends the context. A
    thread blocked in a send to a scheduler that is gone (its queue full) gets
    ``ContextTerminated``; it used to try to report that as a failure with one more send,
    which raised again and left its socket open, and ``context.term()`` waited for that
    socket for ever. Closing it is not enough either: a linger given to ``close()`` once
    the context is ending is refused (silently), and the default lingers for ever on the
    frames queued for a scheduler that will never take them."""
    context = zmq.Context()
    outbox: queue.Queue = queue.Queue()
    frames = 20_000  # more than the socket queues (its high-water mark) for a peer never there
    for _ in range(frames):
        outbox.put(Shutdown())
    sender = threading.Thread(
        target=_send_completions,
        args=(context, gone_scheduler, b"token", outbox, True),
        daemon=True,
    )
    sender.start()
    deadline = time.monotonic() + TERM_BOUND_S
    while outbox.qsize() == frames and time.monotonic() < deadline:  # its socket is made
        time.sleep(0.05)
    # Blocked once the queue stops shrinking before its end (the socket takes a few thousand).
    previous = -1
    while (left := outbox.qsize()) != previous and time.monotonic() < deadline:
        previous = left
        time.sleep(BLOCKED_AFTER_S)
    assert 0 < outbox.qsize() < frames, "the thread should be blocked in a send"

    terminated = threading.Event()
    threading.Thread(target=lambda: (context.term(), terminated.set()), daemon=True).start()
    assert terminated.wait(TERM_BOUND_S), "context.term() waits for the thread's socket"
    sender.join(TERM_BOUND_S)
    assert not sender.is_alive()
