"""``scripts/bench_scheduler.py`` runs its loop to the end (every job seen finished by the
clients, which the script asserts) and reports each part of a step, back to back and with a
wait between steps."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "scripts" / "bench_scheduler.py"


@pytest.mark.parametrize("interval_ms", [None, "1"])
def test_the_scheduler_benchmark_runs_every_job_to_the_end(interval_ms: str | None) -> None:
    flags = ["--num-requests", "12", "--max-num-seqs", "4", "--prompt-len", "8", "40",
             "--output-len", "3", "9", "--max-batch-tokens", "64"]  # fmt: skip
    if interval_ms is not None:
        flags += ["--step-interval-ms", interval_ms]
    run = subprocess.run(
        [sys.executable, str(SCRIPT), *flags], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout + run.stderr
    first = run.stdout.splitlines()[0]
    assert first.startswith("12 requests, ")
    assert ("1 ms between steps" in first) == (interval_ms is not None)
    assert "median CPU ms per part: schedule" in run.stdout


def _young_collections(flags: list[str]) -> tuple[int, int]:
    """Steps run and young collections made, as the script reports them."""
    run = subprocess.run(
        [sys.executable, str(SCRIPT), *flags], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout + run.stderr
    steps = int(run.stdout.split(" steps in ")[0].rsplit(" ", 1)[1])
    line = next(x for x in run.stdout.splitlines() if "generation 0 collections" in x)
    return steps, int(line.split(": ")[1].split(",")[0])


def test_the_engine_s_pacing_does_not_collect_the_young_generation_every_step() -> None:
    # 512 sequences a step: at the interpreter's 700 objects the young generation fills
    # about once a step with objects the step itself frees; the engine's pacing sizes it
    # for the steps in flight.
    flags = ["--num-requests", "512", "--max-num-seqs", "512", "--prompt-len", "8", "8",
             "--output-len", "40", "40", "--max-batch-tokens", "8192"]  # fmt: skip
    steps, paced = _young_collections(flags)
    default_steps, default = _young_collections([*flags, "--gc", "default"])
    assert steps == default_steps >= 40
    assert default >= steps // 2  # the control: the same steps collect unpaced
    assert paced <= steps // 10
