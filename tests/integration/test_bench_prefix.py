"""The prefix-caching benchmarks end to end on the CPU: a shared system prompt
(``scripts/bench.py --shared-prefix-len``) and multi-turn conversations
(``scripts/bench_multiturn.py``), each with the cache on and off. In float32 on the CPU the
tokens must not depend on the cache, and the cache must serve what is shared."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).parents[2] / "scripts"
TINY = ("--model", "random:qwen2-tiny", "--device", "cpu")


def run_script(name: str, *flags: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, str(SCRIPTS / name), *TINY, *flags]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    return run


def test_a_shared_system_prompt_is_served_from_the_cache(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    run = run_script("bench.py", "--num-requests", "6", "--shared-prefix-len", "48",
                     "--random-prompt-len", "3,9", "--output-len", "4", "--modes", "async",
                     "--compare-prefix-caching", "--json", str(out))  # fmt: skip
    report = json.loads(out.read_text())
    cached, uncached = report["modes"]["async"], report["modes"]["async no-cache"]
    # 48 shared tokens are three blocks of 16: each request after the first finds them.
    assert cached["prefix_hit_rate"] >= 5 * 48 / (6 * 48 + 6 * 9)
    assert uncached["prefix_hit_rate"] is None  # nothing is looked up
    assert report["same_tokens_without_the_prefix_cache"]["async"] == 6
    assert "with the prefix cache" in run.stdout
    # The wall time splits into the prompts' ramp, the decode phase and the tail.
    for mode in (cached, uncached):
        assert mode["ramp_steps"] >= 1
        assert 0 < mode["ramp_device_s"] <= mode["ramp_s"] < mode["wall_s"]
        assert 0 <= mode["tail_ms"] < mode["wall_s"] * 1e3


def test_multi_turn_conversations_find_their_history_in_the_cache(tmp_path: Path) -> None:
    out = tmp_path / "multiturn.json"
    run_script("bench_multiturn.py", "--conversations", "3", "--turns", "3", "--new-tokens",
               "20", "--output-len", "4", "--json", str(out))  # fmt: skip
    cached, uncached = json.loads(out.read_text())["runs"]
    for run in (cached, uncached):
        assert run["errors"] == 0
        assert run["output_tokens"] == 3 * 3 * 4
        assert all(t > 0 for t in run["median_ttft_ms"])
    # Turn 2 re-sends 24 tokens, of which one block was computed; turn 3 re-sends 48, of which
    # 47 were computed (its last answer token never was): two blocks.
    assert cached["prefix_hit_rate"] == round((16 + 32) / (20 + 44 + 68), 4)
    assert uncached["prefix_hit_rate"] is None
