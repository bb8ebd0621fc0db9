"""The scheduler's process loop: moves messages, packs steps, keeps two steps in flight.

Slot ownership on the scheduler side (the worker's side is in ``worker/runner.py``): the
scheduler writes a slot's input region only while no step it sent into that slot is
unanswered, and reads the slot's output region only after the ``StepDone`` for that step.
Steps use the slots in turn and complete in order, so slot ``step % num_slots`` is free once
the step sent ``num_slots`` steps ago is done. With ``k`` steps in flight, step N's results
free the way for step N+k: from N's end to the worker holding N+k (N's tokens reach the
scheduler, are applied, and N+k is planned, packed and sent), the device has the k-1 steps
between to run. Two in flight give it one step, three give it two.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.utils.monitor

from cbpipe.collector import CollectorPacing
from cbpipe.protocol.liveness import HeartbeatTable
from cbpipe.protocol.messages import (
    ProtocolError,
    Shutdown,
    Step,
    StepDone,
    WorkerFailed,
    decode,
    encode,
)
from cbpipe.protocol.security import unseal
from cbpipe.scheduler.core import RequestUpdate, Scheduler, StepPlan
from cbpipe.scheduler.frontend import Frontend
from cbpipe.scheduler.packer import BatchPacker
from cbpipe.trace import StepRecord

log = logging.getLogger("cbpipe.scheduler")

POLL_MS = 100
# Client messages are taken a poll at a time, for at most this long (and this many): a flood
# of submits must not keep steps from leaving or results from being applied. Each submit costs
# the frontend a tenth of a millisecond or more, so taking a burst of hundreds whole kept the
# device idle for tens of milliseconds before its first step (docs/PERFORMANCE.md).
MESSAGE_SLICE_S = 0.005
MAX_MESSAGES_PER_POLL = 1024
# A step may take this many times what the recent steps say it should (and never less than
# the configured minimum) before the worker is declared stuck: generous, since a stuck worker
# is rare and a false alarm ends the engine.
STEP_DEADLINE_FACTOR = 20.0
_RECENT_STEPS = 64
# A step makes two or three objects per sequence that the cyclic collector tracks (its plan's
# rows, its updates, the clients' entries), alive until the step is applied and streamed, a
# few steps at once. A young generation smaller than that is collected every step for nothing:
# at the interpreter's 700, six times a step of 1,024 sequences, about a tenth of the
# scheduler's CPU (docs/PERFORMANCE.md, session 47).
YOUNG_OBJECTS_PER_SEQUENCE = 8


def young_threshold(max_num_seqs: int) -> int:
    """The young generation's size for a scheduler of ``max_num_seqs`` sequences a step."""
    return YOUNG_OBJECTS_PER_SEQUENCE * max_num_seqs


class WorkerLost(RuntimeError):
    pass


@dataclass(frozen=True)
class Liveness:
    """How long the worker may be silent: its heartbeat, and a step in flight (before any
    step came back, and after)."""

    heartbeat_timeout_s: float
    min_step_timeout_s: float
    first_step_timeout_s: float


class StepDeadline:
    """When a step in flight counts as lost: ``STEP_DEADLINE_FACTOR`` times the longest that
    one of the last steps' round trips implies for a step of its size, and at least the
    configured minimum.

    A step of more rows than a recent one may take as many times longer: on a CPU a step's
    time grows with its rows, and a burst of prompts after a few single decodes makes a
    step hundreds of times longer than any before it, which is no sign of a stuck worker.
    Fewer rows take no less (a step has a fixed part). Until a step has come back there is
    nothing to go by (a large model on a CPU takes minutes a step), so the first wait is as
    long as start-up may be."""

    def __init__(self, min_timeout_s: float, first_timeout_s: float) -> None:
        self.min_timeout_s = min_timeout_s
        self.first_timeout_s = first_timeout_s
        self._recent: deque[tuple[float, int]] = deque(maxlen=_RECENT_STEPS)

    def record(self, round_trip_s: float, num_tokens: int) -> None:
        self._recent.append((round_trip_s, max(1, num_tokens)))

    def timeout_s(self, num_tokens: int) -> float:
        """How long a step of ``num_tokens`` rows may take."""
        if not self._recent:
            return max(self.min_timeout_s, self.first_timeout_s)
        expected = max(s * max(1.0, num_tokens / n) for s, n in self._recent)
        return max(self.min_timeout_s, STEP_DEADLINE_FACTOR * expected)


@dataclass
class InFlight:
    plan: StepPlan
    step: Step
    slot: int
    schedule_start_ns: int
    sent_ns: int
    timeout_s: float | None = None  # the step deadline's, set at the first check


@dataclass
class Applied:
    """A step whose results the scheduler has applied but not yet streamed to the clients."""

    done: InFlight
    message: StepDone
    updates: list[RequestUpdate]
    done_recv_ns: int
    update_end_ns: int


def worker_frame(token: bytes, sealed: bytes) -> bytes | None:
    """The frame a worker of this run sent on the results socket, or None (logged) for one
    without the run's token: another process of this user, which says nothing of the steps."""
    frame = unseal(token, sealed)
    if frame is None:
        log.warning("ignored a frame on the results socket without the run's token")
    return frame


class EngineLoop:
    def __init__(
        self,
        *,
        scheduler: Scheduler,
        packer: BatchPacker,
        frontend: Frontend,
        client_socket: zmq.Socket,
        steps_socket: zmq.Socket,
        results_socket: zmq.Socket,
        worker_monitor: zmq.Socket,
        results_token: bytes,
        max_in_flight: int,
        pack_delay_s: float,
        heartbeats: HeartbeatTable,
        liveness: Liveness,
        worker_names: tuple[str, ...] = ("worker",),
        record_steps: bool = False,
    ) -> None:
        self.scheduler = scheduler
        self.packer = packer
        self.frontend = frontend
        self.client_socket = client_socket
        self.steps_socket = steps_socket
        self.results_socket = results_socket
        self.results_token = results_token  # the run's seal on every worker frame
        self.worker_monitor = worker_monitor
        if not 1 <= max_in_flight <= packer.layout.num_slots:
            raise ValueError(
                f"{max_in_flight} steps in flight need as many slots; the layout has "
                f"{packer.layout.num_slots}"
            )
        self.max_in_flight = max_in_flight
        self.pack_delay_s = pack_delay_s
        self.records: list[StepRecord] | None = [] if record_steps else None
        self.collector = CollectorPacing()
        self.in_flight: deque[InFlight] = deque()
        self.unpublished: list[Applied] = []
        self.num_slots = packer.layout.num_slots
        self._next_slot = 0
        self._last_slot: int | None = None
        self.stopping = False
        # Set when the plan came back empty (every runnable request waits on the step in
        # flight); cleared by anything that can change that.
        self._blocked = False
        # The worker ranks' connections to the results socket (one each), and their names
        # in the heartbeat table.
        self._worker_fds: set[int] = set()
        self.worker_names = worker_names
        self.heartbeats = heartbeats
        self.beat = heartbeats.beater("scheduler")
        self.liveness = liveness
        self.deadline = StepDeadline(liveness.min_step_timeout_s, liveness.first_step_timeout_s)
        self.poller = zmq.Poller()
        for socket in (client_socket, results_socket, worker_monitor):
            self.poller.register(socket, zmq.POLLIN)
        preparation = frontend.preparation
        self.preparation_fd = preparation.fileno() if preparation is not None else None
        if self.preparation_fd is not None:
            self.poller.register(self.preparation_fd, zmq.POLLIN)

    def run(self) -> None:
        """Serve until ``stop()``; raises ``WorkerLost`` if the worker goes away.

        A step's results are applied as soon as they arrive, but streamed to the clients only
        after the next step is sent: the worker's queue is refilled first. Full garbage
        collections wait for the same moment, or for the engine to go idle (``collector``).
        """
        while not self.stopping:
            self.beat()
            self._check_worker()
            if self._can_launch():
                self._launch()
                self._publish()
                self.collector.between_steps()
                self._poll(timeout_ms=0)
            else:
                self._publish()
                if not self.in_flight and not self.scheduler.has_work:
                    self.collector.on_idle()
                self._poll(timeout_ms=POLL_MS)

    def start_collector(self) -> None:
        """Pace the garbage collector for serving (``CollectorPacing``), its young generation
        sized for this scheduler's steps."""
        self.collector.start(young_threshold(self.scheduler.max_num_seqs))

    def stop(self) -> None:
        self.stopping = True

    def shutdown_worker(self) -> None:
        # A publisher never blocks: to ranks that are gone the message is simply not sent.
        self.steps_socket.send(encode(Shutdown()), flags=zmq.NOBLOCK)

    def _can_launch(self) -> bool:
        return (
            not self._blocked
            and len(self.in_flight) < self.max_in_flight
            and self.scheduler.has_work
        )

    def _launch(self) -> None:
        schedule_start_ns = time.perf_counter_ns()
        plan = self.scheduler.schedule()
        if not plan.seqs:
            if not self.in_flight:
                raise RuntimeError(
                    "scheduler has work but planned an empty step with none in flight"
                )
            self._blocked = True  # until a step in flight comes back
            return
        for req in plan.admitted:
            req.first_scheduled_ns = schedule_start_ns
        slot = self._next_slot
        # The previous step in flight (if any) is the one whose sampled ids carry over.
        previous = self._last_slot if self.in_flight else None
        step = self.packer.pack(plan, slot, previous)
        if self.pack_delay_s:
            _busy_wait_until(schedule_start_ns + int(self.pack_delay_s * 1e9))
        # Read before the send: once it is out, the worker may start before this thread runs.
        sent_ns = time.perf_counter_ns()
        self.steps_socket.send(encode(step))
        self.in_flight.append(InFlight(plan, step, slot, schedule_start_ns, sent_ns))
        self._last_slot = slot
        self._next_slot = (slot + 1) % self.num_slots
        if log.isEnabledFor(logging.DEBUG):
            blocks = self.scheduler.blocks
            log.debug(
                "step %d: %d seqs, %d tokens (%d decodes) into slot %d, planned in %.2f ms; "
                "prefix cache: %d blocks, %d of %d prompt tokens found",
                plan.step,
                step.num_seqs,
                step.num_tokens,
                step.num_single_token_seqs,
                slot,
                (sent_ns - schedule_start_ns) / 1e6,
                blocks.num_cached_blocks,
                blocks.num_hit_tokens,
                blocks.num_query_tokens,
            )

    def _check_worker(self) -> None:
        """Raise ``WorkerLost`` if a worker rank's heartbeat or the oldest step is overdue
        (a stuck rank holds up the others in their next collective: its step never ends)."""
        limit = self.liveness.heartbeat_timeout_s
        for name in self.worker_names:
            silent = self.heartbeats.silent_for_s(name)
            if silent is not None and silent > limit:
                raise WorkerLost(
                    f"the {name} stopped responding: no heartbeat for {silent:.1f} s "
                    f"(--liveness-timeout-s {limit:g})"
                )
        if self.in_flight:
            oldest = self.in_flight[0]
            if oldest.timeout_s is None:
                oldest.timeout_s = self.deadline.timeout_s(oldest.step.num_tokens)
            waited_s = (time.perf_counter_ns() - oldest.sent_ns) / 1e9
            if waited_s > oldest.timeout_s:
                raise WorkerLost(
                    f"the worker has not finished step {oldest.plan.step} "
                    f"({oldest.step.num_tokens} tokens) after {waited_s:.1f} s (deadline "
                    f"{oldest.timeout_s:.1f} s: --step-timeout-s "
                    f"{self.deadline.min_timeout_s:g}, or {STEP_DEADLINE_FACTOR:g} times what "
                    "the recent steps took for their tokens)"
                )

    def _poll(self, timeout_ms: int) -> None:
        events = dict(self.poller.poll(timeout_ms))
        if events:
            self._blocked = False
        if self.preparation_fd is not None and self.preparation_fd in events:
            self.frontend.on_jobs_prepared()
        if self.worker_monitor in events:
            self._on_monitor_event()
        if self.results_socket in events:
            while self.results_socket.poll(0):
                self._on_result(self.results_socket.recv())
        if self.client_socket in events:
            take_messages(lambda: bool(self.client_socket.poll(0)), self.frontend.receive)

    def _on_result(self, sealed: bytes) -> None:
        frame = worker_frame(self.results_token, sealed)
        if frame is None:
            return
        try:
            message = decode(frame, expected=(StepDone, WorkerFailed))
        except ProtocolError as exc:
            # Not the worker's (it only sends well-formed frames): whoever sent it, it says
            # nothing about the steps in flight.
            log.warning("ignored a frame on the worker's results socket: %s", exc)
            return
        if isinstance(message, WorkerFailed):
            raise WorkerLost(f"worker failed: {message.message}")
        assert isinstance(message, StepDone)
        if not self.in_flight or self.in_flight[0].plan.step != message.step:
            raise WorkerLost(f"worker reported step {message.step} out of order")
        done_recv_ns = time.perf_counter_ns()
        done = self.in_flight.popleft()
        self.deadline.record((done_recv_ns - done.sent_ns) / 1e9, done.step.num_tokens)
        output = self.packer.read_output(done.slot, done.step)
        updates = self.scheduler.update(done.plan, output)
        update_end_ns = time.perf_counter_ns()
        self.unpublished.append(Applied(done, message, updates, done_recv_ns, update_end_ns))
        log.debug(
            "step %d done: %.2f ms on the device, %.2f ms round trip, %.2f ms to apply",
            message.step,
            message.device_ms,
            (done_recv_ns - done.sent_ns) / 1e6,
            (update_end_ns - done_recv_ns) / 1e6,
        )

    def _publish(self) -> None:
        for applied in self.unpublished:
            publish_start_ns = time.perf_counter_ns()
            self.frontend.publish(applied.updates)
            if self.records is not None:
                self.records.append(_record(applied, publish_start_ns, time.perf_counter_ns()))
        self.unpublished.clear()
        self.frontend.cancel_gone_clients()

    def _on_monitor_event(self) -> None:
        """The results socket's connections: the first ones are the worker ranks' (each
        connects before it reports ready, to a socket in the run's private folder, and the
        scheduler serves only once all have reported); the end of any is a rank's end."""
        event = zmq.utils.monitor.recv_monitor_message(self.worker_monitor)
        if event["event"] == zmq.EVENT_ACCEPTED and len(self._worker_fds) < len(self.worker_names):
            self._worker_fds.add(event["value"])
        elif (
            event["event"] == zmq.EVENT_DISCONNECTED
            and event["value"] in self._worker_fds
            and not self.stopping
        ):
            raise WorkerLost(
                "the worker process exited"
                if len(self.worker_names) == 1
                else "a worker rank's process exited"
            )


def take_messages(
    waiting: Callable[[], bool],
    receive: Callable[[], None],
    *,
    slice_s: float = MESSAGE_SLICE_S,
    limit: int = MAX_MESSAGES_PER_POLL,
    clock: Callable[[], float] = time.perf_counter,
) -> int:
    """``receive`` the messages ``waiting`` says are there, up to ``limit`` and for no longer
    than ``slice_s`` (one at least); returns how many were taken."""
    started = clock()
    for taken in range(limit):
        if not waiting() or (taken and clock() - started >= slice_s):
            return taken
        receive()
    return limit


def _record(applied: Applied, publish_start_ns: int, publish_end_ns: int) -> StepRecord:
    done, message = applied.done, applied.message
    return StepRecord(
        step=message.step,
        num_seqs=done.step.num_seqs,
        num_tokens=done.step.num_tokens,
        num_decodes=done.step.num_single_token_seqs,
        num_context_tokens=sum(s.start + s.num_query_tokens for s in done.plan.seqs),
        schedule_start_ns=done.schedule_start_ns,
        pack_end_ns=done.sent_ns,
        done_recv_ns=applied.done_recv_ns,
        update_end_ns=applied.update_end_ns,
        device_start_ns=message.device_start_ns,
        device_end_ns=message.device_end_ns,
        publish_start_ns=publish_start_ns,
        publish_end_ns=publish_end_ns,
        worker_recv_ns=message.recv_ns,
        worker_launched_ns=message.launched_ns,
        worker_reported_ns=message.reported_ns,
    )


def _busy_wait_until(deadline_ns: int) -> None:
    """Stand-in for scheduling work: keeps this process's CPU busy, as real packing would."""
    while time.perf_counter_ns() < deadline_ns:
        pass
