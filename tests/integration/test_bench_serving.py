"""``scripts/bench_serving.py`` end to end on a small workload against the shared server:
it runs every backend and load shape and reports what it measured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.integration.conftest import EngineRun

SCRIPT = Path(__file__).parents[2] / "scripts" / "bench_serving.py"
# Every request samples with the full sampler, as under a chat model's generation_config.
SAMPLING = {"temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.2, "seed": 3}


def test_bench_serving_measures_both_backends_and_both_loads(
    http_tiny_engine: EngineRun, tmp_path: Path
) -> None:
    out = tmp_path / "serving.json"
    command = [sys.executable, str(SCRIPT), "--url", http_tiny_engine.http_url,
               "--address", http_tiny_engine.address, "--backends", "http,zmq",
               "--request-rates", "50,inf", "--max-concurrency", "4", "--num-prompts", "6",
               "--prompt-len", "8", "--output-len", "5", "--client-processes", "2",
               "--sampling", json.dumps(SAMPLING), "--json", str(out)]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    results = json.loads(out.read_text())
    assert [(r["backend"], r["load"]) for r in results] == [
        ("http", "rate 50/s"), ("zmq", "rate 50/s"),
        ("http", "concurrency 4"), ("zmq", "concurrency 4"),
    ]  # fmt: skip
    for r in results:
        assert (r["num_requests"], r["failed"], r["output_tokens"]) == (6, 0, 30), r
        assert r["ttft_ms"]["p50"] > 0 and r["output_tok_s"] > 0
    assert "HTTP throughput" in run.stdout
    assert f"sampling {json.dumps(SAMPLING)}" in run.stdout


def test_bench_serving_refuses_sampling_parameters_it_does_not_know() -> None:
    command = [sys.executable, str(SCRIPT), "--sampling", '{"temprature": 0.7}']
    run = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "unknown ['temprature']" in run.stderr, run.stderr
