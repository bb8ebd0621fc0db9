"""The Triton kernels that the GPU benchmarks time against the engine's compute what they
stand for (under Triton's interpreter on the CPU), so those timings compare like with like:

- ``bench_matmul.py``'s tiled split-K candidate computes ``x @ w.T``, its partial sums
  reduced in a fixed order;
- ``bench_layer_chain.py``'s products equal the norm, the residual adds and the product they
  take in, its small kernels the engine's norm, SiLU-and-multiply and add, and its MLP kernel
  the MLP, in one launch and in two; its parts' sums what they sum, and its layer cut in
  parts the whole layer.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.unit.triton_interpreter import REPO_ROOT, bounds_from_data, require_triton


@pytest.mark.parametrize(
    ("script", "checks"),
    [
        pytest.param("scripts/bench_matmul.py", 3, marks=bounds_from_data),
        ("scripts/bench_layer_chain.py", 17),
    ],
)
def test_self_check(script: str, checks: int) -> None:
    require_triton()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, script, "--self-check"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("ok:") == checks, proc.stdout
