"""Per-step timing on one clock, written as a Chrome/Perfetto trace, and read back for stats.

    python -m cbpipe.trace TRACE.json [--skip-steps 40]

prints each kind of step's device time (decodes only, decodes beside prefill chunks, prefill
only) and the device's idle gaps: where a served run's latency tail comes from.

Every time is ``time.perf_counter_ns()`` (CLOCK_MONOTONIC, shared by the processes of one
host). The scheduler records its CPU phases; the worker reports the compute span of each
step (CUDA events mapped onto that clock, or wall time on the CPU) in ``StepDone``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import median

SCHEDULER_PID, WORKER_PID, WORKER_CPU_PID = 1, 2, 3


@dataclass(frozen=True)
class StepRecord:
    step: int
    num_seqs: int
    num_tokens: int
    num_decodes: int
    num_context_tokens: int  # KV entries the step attends to, summed over its sequences
    schedule_start_ns: int  # the scheduler begins planning the step
    pack_end_ns: int  # planned and packed (debug delay included); the step is sent
    done_recv_ns: int  # the scheduler receives step_done
    update_end_ns: int  # results applied to the scheduler's state
    device_start_ns: int  # the worker's compute span on the device
    device_end_ns: int
    # New tokens streamed to the clients, after the next step is sent (0 in older traces).
    publish_start_ns: int = 0
    publish_end_ns: int = 0
    # The worker's host side (0 in older traces): step received, step enqueued, outputs
    # seen in shared memory and reported.
    worker_recv_ns: int = 0
    worker_launched_ns: int = 0
    worker_reported_ns: int = 0

    @property
    def is_decode_only(self) -> bool:
        return self.num_decodes == self.num_seqs


def write_chrome_trace(records: Iterable[StepRecord], path: str | Path) -> None:
    """Three rows: the scheduler's CPU phases, the device's compute spans, and the worker's
    host side (``launch``: received to enqueued; ``report``: the outputs seen, an instant)."""
    events: list[dict] = [
        {"ph": "M", "name": "process_name", "pid": SCHEDULER_PID, "args": {"name": "CPU"}},
        {"ph": "M", "name": "process_name", "pid": WORKER_PID, "args": {"name": "device"}},
        {"ph": "M", "name": "process_name", "pid": WORKER_CPU_PID, "args": {"name": "worker"}},
    ]
    for r in records:
        args = {"seqs": r.num_seqs, "tokens": r.num_tokens, "decodes": r.num_decodes}
        events += [
            _span("schedule+pack", SCHEDULER_PID, r.schedule_start_ns, r.pack_end_ns, r.step, args),
            _span("update", SCHEDULER_PID, r.done_recv_ns, r.update_end_ns, r.step, args),
            _span("publish", SCHEDULER_PID, r.publish_start_ns, r.publish_end_ns, r.step, args),
            _span("step", WORKER_PID, r.device_start_ns, r.device_end_ns, r.step, args),
        ]
        if r.worker_recv_ns:
            events += [
                _span("launch", WORKER_CPU_PID, r.worker_recv_ns, r.worker_launched_ns, r.step, {}),
                {
                    "ph": "i",
                    "s": "p",
                    "name": f"report {r.step}",
                    "cat": "report",
                    "pid": WORKER_CPU_PID,
                    "tid": 0,
                    "ts": r.worker_reported_ns / 1e3,
                },
            ]
    trace = {"traceEvents": events, "cbpipe_steps": [asdict(r) for r in records]}
    Path(path).write_text(json.dumps(trace))


def _span(name: str, pid: int, start_ns: int, end_ns: int, step: int, args: dict) -> dict:
    return {"ph": "X", "name": f"{name} {step}", "cat": name, "pid": pid, "tid": 0,
            "ts": start_ns / 1e3, "dur": max(end_ns - start_ns, 0) / 1e3, "args": args}  # fmt: skip


def load_steps(path: str | Path) -> list[StepRecord]:
    return [StepRecord(**r) for r in json.loads(Path(path).read_text())["cbpipe_steps"]]


@dataclass(frozen=True)
class BusyStats:
    num_steps: int
    span_s: float  # first device start to last device end
    busy_fraction: float  # device compute time over that span
    median_gap_ms: float  # device idle between consecutive steps
    p99_gap_ms: float
    median_step_ms: float
    p99_step_ms: float
    median_scheduler_ms: float  # CPU per step: schedule + pack + update + publish
    # A step's round trip on the host clock (0 without the worker's times): sent by the
    # scheduler to received by the worker, received to enqueued, and outputs reported by
    # the worker to received by the scheduler.
    median_to_worker_ms: float = 0.0
    median_launch_ms: float = 0.0
    median_to_scheduler_ms: float = 0.0
    # The idle time between steps, by the first link of the chain that was late for it: the
    # step left the scheduler after the device had gone idle, or the worker enqueued it after
    # that (it reached the worker late, or its launch took long), or it was enqueued in time
    # and the device started it late (waiting on a copy, say). Without the worker's times,
    # what the scheduler did not cause counts as the worker's.
    idle_scheduler_ms: float = 0.0
    idle_worker_ms: float = 0.0
    idle_device_ms: float = 0.0


def decode_phase(records: Sequence[StepRecord]) -> list[StepRecord]:
    """Every step from the first decode-only step to the last, in device order.

    Steps with prefill rows in between belong to it: they decode too, and leaving them out
    would count their device time as idle.
    """
    steps = sorted(records, key=lambda r: r.device_start_ns)
    decodes = [i for i, r in enumerate(steps) if r.is_decode_only]
    return steps[decodes[0] : decodes[-1] + 1] if decodes else []


def busy_stats(records: Sequence[StepRecord]) -> BusyStats:
    """Device busy fraction and idle gaps over ``records`` (for example the decode phase)."""
    steps = sorted(records, key=lambda r: r.device_start_ns)
    if not steps:
        return BusyStats(0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    span = steps[-1].device_end_ns - steps[0].device_start_ns
    busy = sum(r.device_end_ns - r.device_start_ns for r in steps)
    gaps = [
        max(b.device_start_ns - a.device_end_ns, 0) / 1e6
        for a, b in zip(steps, steps[1:], strict=False)
    ]
    durations = [(r.device_end_ns - r.device_start_ns) / 1e6 for r in steps]
    cpu = [(r.pack_end_ns - r.schedule_start_ns + r.update_end_ns - r.done_recv_ns
            + r.publish_end_ns - r.publish_start_ns) / 1e6 for r in steps]  # fmt: skip
    return BusyStats(
        num_steps=len(steps),
        span_s=span / 1e9,
        busy_fraction=busy / span if span > 0 else 1.0,
        median_gap_ms=median(gaps) if gaps else 0.0,
        p99_gap_ms=_percentile(gaps, 0.99),
        median_step_ms=median(durations),
        p99_step_ms=_percentile(durations, 0.99),
        median_scheduler_ms=median(cpu),
        **_round_trip(steps),
        **_idle_by_cause(steps),
    )


def _idle_by_cause(steps: Sequence[StepRecord]) -> dict[str, float]:
    idle = {"idle_scheduler_ms": 0.0, "idle_worker_ms": 0.0, "idle_device_ms": 0.0}
    for before, late in zip(steps, steps[1:], strict=False):
        gap_ns = late.device_start_ns - before.device_end_ns
        if gap_ns <= 0:
            continue
        if late.pack_end_ns > before.device_end_ns:
            cause = "idle_scheduler_ms"
        elif not late.worker_launched_ns or late.worker_launched_ns > before.device_end_ns:
            cause = "idle_worker_ms"
        else:
            cause = "idle_device_ms"
        idle[cause] += gap_ns / 1e6
    return idle


def _round_trip(steps: Sequence[StepRecord]) -> dict[str, float]:
    timed = [r for r in steps if r.worker_recv_ns]
    if not timed:
        return {}

    def median_ms(spans: Iterable[int]) -> float:
        return median(spans) / 1e6

    return {
        "median_to_worker_ms": median_ms(r.worker_recv_ns - r.pack_end_ns for r in timed),
        "median_launch_ms": median_ms(r.worker_launched_ns - r.worker_recv_ns for r in timed),
        "median_to_scheduler_ms": median_ms(r.done_recv_ns - r.worker_reported_ns for r in timed),
    }


def _percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


@dataclass(frozen=True)
class KindStats:
    """The device time of one kind of step: how many, their rows and decodes, percentiles."""

    kind: str  # "decode", "mixed" (decodes beside prefill chunks) or "prefill"
    count: int
    min_rows: int
    max_rows: int
    min_decodes: int
    max_decodes: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    # The worker's host time to enqueue each (0 in traces without it): a graph replay's is a
    # fraction of a millisecond, an eager step's grows with its layers.
    launch_p50_ms: float = 0.0
    launch_p99_ms: float = 0.0


def step_kind(record: StepRecord) -> str:
    if record.is_decode_only:
        return "decode"
    return "mixed" if record.num_decodes else "prefill"


def kind_stats(records: Sequence[StepRecord]) -> list[KindStats]:
    """Per kind of step (in the order decode, mixed, prefill; absent kinds left out)."""
    stats = []
    for kind in ("decode", "mixed", "prefill"):
        steps = [r for r in records if step_kind(r) == kind]
        if not steps:
            continue
        durations = [(r.device_end_ns - r.device_start_ns) / 1e6 for r in steps]
        launches = [
            (r.worker_launched_ns - r.worker_recv_ns) / 1e6 for r in steps if r.worker_recv_ns
        ]
        stats.append(
            KindStats(
                kind,
                len(steps),
                min(r.num_tokens for r in steps),
                max(r.num_tokens for r in steps),
                min(r.num_decodes for r in steps),
                max(r.num_decodes for r in steps),
                _percentile(durations, 0.5),
                _percentile(durations, 0.9),
                _percentile(durations, 0.99),
                max(durations),
                _percentile(launches, 0.5),
                _percentile(launches, 0.99),
            )
        )
    return stats


def summary(records: Sequence[StepRecord]) -> str:
    lines = [
        f"{'steps':8} {'count':>6} {'rows':>11} {'decodes':>9}   device ms p50 / p90 / p99 / max"
        "   launch ms p50 / p99"
    ]
    for k in kind_stats(records):
        lines.append(
            f"{k.kind:8} {k.count:6d} {k.min_rows:5d}-{k.max_rows:<5d} "
            f"{k.min_decodes:4d}-{k.max_decodes:<4d}   "
            f"{k.p50_ms:.2f} / {k.p90_ms:.2f} / {k.p99_ms:.2f} / {k.max_ms:.2f}"
            f"   {k.launch_p50_ms:.2f} / {k.launch_p99_ms:.2f}"
        )
    busy = busy_stats(records)
    lines.append(
        f"device busy {busy.busy_fraction:.2%} over {busy.span_s:.2f} s; idle gaps p50 "
        f"{busy.median_gap_ms:.3f} ms, p99 {busy.p99_gap_ms:.3f} ms; idle ms sent late by the "
        f"scheduler {busy.idle_scheduler_ms:.1f}, enqueued late by the worker "
        f"{busy.idle_worker_ms:.1f}, started late on the device {busy.idle_device_ms:.1f}"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cbpipe.trace", description=__doc__)
    parser.add_argument("traces", nargs="+", type=Path, help="traces written with --trace")
    parser.add_argument(
        "--skip-steps",
        type=int,
        default=0,
        help="leave out steps numbered below this (a served run's warm-up, say)",
    )
    args = parser.parse_args(argv)
    for path in args.traces:
        records = [r for r in load_steps(path) if r.step >= args.skip_steps]
        print(f"{path}: {len(records)} steps")
        print(summary(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
