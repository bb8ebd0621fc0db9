"""Where each step's launch went, from a worker's step profile (``CBPIPE_PROFILE_STEPS``).

    python scripts/profile_summary.py prof/steps_8-20.json.gz --top 15

For every call of the runner's ``launch`` in the Chrome trace: its host time, the device
time of the kernels it enqueued (by correlation), and the Python functions and operators
under it by inclusive time (a function that recurses counts once per outermost call) and by
self time (its time less its children's). A step bound by its host shows a launch as long as
its step; the self times say on what.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The host's spans; the CUDA runtime's and driver's calls carry the correlation of the kernel
# they launched (Triton's launches are the driver's).
HOST_CATEGORIES = ("python_function", "cpu_op", "user_annotation", "cuda_runtime", "cuda_driver")
LAUNCH_SUFFIX = "runner.py"  # the runner's module; its ``launch`` is one step's enqueue


@dataclass
class Span:
    name: str
    start: float  # microseconds, the trace's clock
    duration: float
    thread: Any
    correlation: int | None = None

    @property
    def end(self) -> float:
        return self.start + self.duration


@dataclass
class LaunchSummary:
    host_ms: float
    device_ms: float
    kernels: int
    inclusive_ms: Counter[str] = field(default_factory=Counter)
    self_ms: Counter[str] = field(default_factory=Counter)
    calls: Counter[str] = field(default_factory=Counter)


def load_events(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def is_launch(name: str) -> bool:
    module, _, function = name.rpartition(": ")
    return function == "launch" and module.split("(")[0].endswith(LAUNCH_SUFFIX)


def summarise(events: list[dict[str, Any]]) -> list[LaunchSummary]:
    """One summary a launch, in the order the launches ran."""
    host = [
        Span(e["name"], e["ts"], e["dur"], e.get("tid"), e.get("args", {}).get("correlation"))
        for e in events
        if e.get("cat") in HOST_CATEGORIES
    ]
    kernel_ms: dict[int, float] = {}
    for e in events:
        if e.get("cat") == "kernel" and (c := e.get("args", {}).get("correlation")) is not None:
            kernel_ms[c] = kernel_ms.get(c, 0.0) + e["dur"] / 1e3
    by_thread: dict[Any, list[Span]] = defaultdict(list)
    for span in host:
        by_thread[span.thread].append(span)
    for spans in by_thread.values():
        spans.sort(key=lambda s: (s.start, -s.duration))
    summaries = []
    launches = sorted((s for s in host if is_launch(s.name)), key=lambda s: s.start)
    for launch in launches:
        inside = [
            s
            for s in by_thread[launch.thread]
            if s is not launch and launch.start <= s.start and s.end <= launch.end
        ]
        summary = LaunchSummary(launch.duration / 1e3, 0.0, 0)
        stack: list[Span] = []
        for span in inside:
            while stack and stack[-1].end <= span.start:
                stack.pop()
            if stack:
                summary.self_ms[stack[-1].name] -= span.duration / 1e3
            summary.self_ms[span.name] += span.duration / 1e3
            if all(outer.name != span.name for outer in stack):
                summary.inclusive_ms[span.name] += span.duration / 1e3
            summary.calls[span.name] += 1
            if span.correlation is not None and span.correlation in kernel_ms:
                summary.device_ms += kernel_ms[span.correlation]
                summary.kernels += 1
            stack.append(span)
        summaries.append(summary)
    return summaries


def report(summaries: list[LaunchSummary], top: int) -> str:
    lines = []
    for i, s in enumerate(summaries):
        lines.append(
            f"launch {i}: host {s.host_ms:.2f} ms, its kernels {s.device_ms:.2f} ms "
            f"on the device ({s.kernels} launches)"
        )
        for title, table in (("inclusive", s.inclusive_ms), ("self", s.self_ms)):
            lines.append(f"  by {title} time:")
            for name, ms in table.most_common(top):
                lines.append(f"    {ms:9.3f} ms  x{s.calls[name]:<5d} {name[:120]}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path, help="a step profile's .json or .json.gz")
    parser.add_argument("--top", type=int, default=15, help="rows per table")
    args = parser.parse_args()
    summaries = summarise(load_events(args.trace))
    if not summaries:
        raise SystemExit(f"{args.trace}: no call of the runner's launch in the trace")
    print(report(summaries, args.top))


if __name__ == "__main__":
    main()
