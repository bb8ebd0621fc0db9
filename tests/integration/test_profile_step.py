"""``scripts/profile_step.py`` on the CPU: it packs a steady-state step through the
scheduler and packer, so a change to admission or to the sampling table can break it
without any engine test noticing (it did: every preset packed as greedy, or nothing)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "scripts" / "profile_step.py"


def test_each_sampling_preset_packs_its_own_mode_beside_a_prefill() -> None:
    command = [sys.executable, str(SCRIPT), "--model", "random:qwen2-tiny", "--device", "cpu",
               "--batch", "3", "--context", "40", "--steps", "2", "--prefill-len", "20",
               "--prefill-seqs", "1", "--no-profile", "--inductor", "triton.max_tiles=1",
               "--sampling", "greedy,random,penalties,full-logprobs"]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    packed = dict(re.findall(r"sampling ([\w-]+) \(([^)]*)\)", run.stdout))
    assert packed == {
        "greedy": "greedy",
        "random": "random",
        "penalties": "full",
        "full-logprobs": "full, top alternatives",
    }, run.stdout
    assert "step of 4 seqs (3 decodes), 23 tokens" in run.stdout
    assert len(re.findall(r"^per step: ", run.stdout, re.MULTILINE)) == 4, run.stdout
    assert "inductor option triton.max_tiles = 1" in run.stdout


def test_an_unknown_inductor_option_is_refused_before_anything_loads() -> None:
    command = [sys.executable, str(SCRIPT), "--device", "cpu", "--inductor", "triton.no_such=1"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "inductor has no option 'triton.no_such'" in run.stderr
