"""The worker's step profiler (``CBPIPE_PROFILE_STEPS``)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from cbpipe import env
from cbpipe.worker.step_profiler import StepProfiler


@pytest.mark.parametrize(
    ("value", "span"), [("", None), ("8-14", (8, 14)), (" 5 ", (5, 5)), ("3-3", (3, 3))]
)
def test_the_steps_are_read_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, value: str, span: tuple[int, int] | None
) -> None:
    monkeypatch.setenv("CBPIPE_PROFILE_STEPS", value)
    assert env.profile_steps() == span


@pytest.mark.parametrize("value", ["eight", "9-8", "1-x"])
def test_a_bad_span_is_refused_with_the_variable_named(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("CBPIPE_PROFILE_STEPS", value)
    with pytest.raises(ValueError, match="CBPIPE_PROFILE_STEPS"):
        env.profile_steps()


def test_only_the_steps_in_the_span_are_profiled_once(tmp_path: Path) -> None:
    profiler = StepProfiler(2, 3, tmp_path)
    ops = {1: torch.sin, 2: torch.cos, 3: torch.tanh, 4: torch.exp}
    x = torch.ones(8)
    for step, op in ops.items():
        profiler.before_launch(step)
        op(x)
        profiler.after_launch(step)
    profiler.before_launch(2)  # a step number seen again (a new run) starts nothing
    torch.sin(x)
    profiler.after_launch(3)

    table = (tmp_path / "steps_2-3.txt").read_text()
    assert "aten::cos" in table and "aten::tanh" in table
    assert "aten::sin" not in table and "aten::exp" not in table
    with gzip.open(tmp_path / "steps_2-3.json.gz") as packed:
        events = json.load(packed)["traceEvents"]
    assert any(e.get("name") == "aten::tanh" for e in events)
    assert not (tmp_path / "steps_2-3.json").exists()
