"""scripts/profile_summary.py on a hand-made trace."""

from __future__ import annotations

import gzip
import importlib.util
import json
import sys
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "profile_summary.py"
_SPEC = importlib.util.spec_from_file_location("profile_summary", _SCRIPT)
assert _SPEC is not None and _SPEC.loader is not None
profile_summary = importlib.util.module_from_spec(_SPEC)
sys.modules["profile_summary"] = profile_summary  # its dataclasses look their module up
_SPEC.loader.exec_module(profile_summary)

LAUNCH = "/repo/cbpipe/worker/runner.py(521): launch"


def _span(name: str, ts: float, dur: float, cat: str = "python_function", **args: int) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": 1, "args": args}


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    events = [
        _span(LAUNCH, 0, 1000),
        _span("forward", 10, 900),
        _span("forward", 20, 500),  # recursion: counted once inclusively
        _span("aten::mm", 30, 100, cat="cpu_op"),
        _span("cudaLaunchKernel", 40, 20, cat="cuda_runtime", correlation=7),
        _span("gemm", 5000, 300, cat="kernel", correlation=7),
        _span(LAUNCH, 2000, 100),
        _span("cuLaunchKernel", 2010, 10, cat="cuda_driver", correlation=8),
        _span("attention", 6000, 50, cat="kernel", correlation=8),
        _span("other_thread_work", 2020, 10) | {"tid": 2},
    ]
    path = tmp_path / "steps_1-2.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return path


def test_each_launch_gets_its_host_and_device_time_and_its_functions(trace: Path) -> None:
    first, second = profile_summary.summarise(profile_summary.load_events(trace))
    assert first.host_ms == 1.0 and first.kernels == 1 and first.device_ms == pytest.approx(0.3)
    assert first.inclusive_ms["forward"] == pytest.approx(0.9)
    assert first.calls["forward"] == 2
    assert first.self_ms["forward"] == pytest.approx(0.8)  # 900 - 500 + 500 - 100
    assert first.self_ms["aten::mm"] == pytest.approx(0.08)
    assert second.host_ms == pytest.approx(0.1) and second.device_ms == pytest.approx(0.05)
    assert "other_thread_work" not in second.calls
    text = profile_summary.report([first, second], top=3)
    assert "launch 0: host 1.00 ms, its kernels 0.30 ms" in text


def test_a_trace_without_launches_says_so(tmp_path: Path) -> None:
    path = tmp_path / "empty.json"
    path.write_text(json.dumps({"traceEvents": [_span("x", 0, 1)]}))
    assert profile_summary.summarise(profile_summary.load_events(path)) == []
