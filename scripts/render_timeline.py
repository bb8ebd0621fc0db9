"""Render traces written with ``cbpipe-launch --trace`` as a timeline picture.

    python scripts/render_timeline.py sync.json async.json -o docs/timeline.png --steps 12

One panel per trace, top to bottom (put sync above async), each with a CPU row (the
scheduler planning and packing a step, then applying its results), a worker row (the worker
enqueueing a step, in traces that record it) and a GPU row (the step's compute span on the
device), over a stretch of ``--steps`` decode-only steps from the middle of the run (or
from ``--from-step``), on one clock.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from cbpipe.trace import StepRecord, busy_stats, decode_phase, load_steps  # noqa: E402

COLORS = {
    "plan": "#4c72b0",
    "update": "#dd8452",
    "publish": "#c44e52",
    "gpu": "#55a868",
    "mixed": "#8172b3",
    "launch": "#937860",
}


def stretch(records: list[StepRecord], num_steps: int, first: int | None) -> list[StepRecord]:
    """Consecutive steps of the decode phase, mixed steps included: from step ``first``, or
    from the middle of the phase."""
    phase = decode_phase(records)
    start = max(len(phase) // 2 - num_steps // 2, 0)
    if first is not None:
        start = next((i for i, r in enumerate(phase) if r.step >= first), len(phase))
    return phase[start : start + num_steps]


def draw(ax: plt.Axes, title: str, records: list[StepRecord]) -> None:
    origin = min(r.schedule_start_ns for r in records)

    def ms(ns: int) -> float:
        return (ns - origin) / 1e6

    for r in records:
        ax.broken_barh([(ms(r.schedule_start_ns), ms(r.pack_end_ns) - ms(r.schedule_start_ns))],
                       (2.1, 0.8), color=COLORS["plan"])  # fmt: skip
        ax.broken_barh([(ms(r.done_recv_ns), ms(r.update_end_ns) - ms(r.done_recv_ns))],
                       (2.1, 0.8), color=COLORS["update"])  # fmt: skip
        if r.publish_end_ns:  # absent from traces older than the field
            publish = ms(r.publish_start_ns), ms(r.publish_end_ns) - ms(r.publish_start_ns)
            ax.broken_barh([publish], (2.1, 0.8), color=COLORS["publish"])
        ax.broken_barh([(ms(r.device_start_ns), ms(r.device_end_ns) - ms(r.device_start_ns))],
                       (0.1, 0.8), color=COLORS["gpu" if r.is_decode_only else "mixed"],
                       edgecolor="white")  # fmt: skip
        if r.worker_recv_ns:  # absent from traces older than the field
            launch = ms(r.worker_recv_ns), ms(r.worker_launched_ns) - ms(r.worker_recv_ns)
            ax.broken_barh([launch], (1.1, 0.8), color=COLORS["launch"])
    stats = busy_stats(records)
    ax.set_title(f"{title}: device busy {stats.busy_fraction:.1%}, median idle gap "
                 f"{stats.median_gap_ms:.2f} ms, median step {stats.median_step_ms:.2f} ms",
                 fontsize=9, loc="left")  # fmt: skip
    ax.set_yticks([0.5, 1.5, 2.5], ["device", "worker", "scheduler"])
    ax.set_ylim(0, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("-o", "--output", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--from-step", type=int, help="first step drawn (default: mid-run)")
    parser.add_argument("--title", default="")
    parser.add_argument("--labels", nargs="+", help="panel names (default: the file names)")
    args = parser.parse_args()

    labels = args.labels or [path.stem for path in args.traces]
    # One time axis for all panels, so a faster run is visibly shorter.
    fig, axes = plt.subplots(len(args.traces), 1, figsize=(12, 2.0 * len(args.traces) + 0.6),
                             squeeze=False, sharex=True)  # fmt: skip
    for ax, path, label in zip(axes[:, 0], args.traces, labels, strict=True):
        draw(ax, label, stretch(load_steps(path), args.steps, args.from_step))
    axes[-1, 0].set_xlabel("ms")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    names = ["schedule + pack", "apply results", "stream to clients", "device: decode step",
             "device: step with prefill", "worker: enqueue step"]  # fmt: skip
    fig.legend(handles, names, loc="lower right", ncol=6, fontsize=8)
    if args.title:
        fig.suptitle(args.title, fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(args.output, dpi=120)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
