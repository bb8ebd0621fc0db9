"""The kernels of ``scripts/bench_layer_chain.py`` compute what they stand for (under
Triton's interpreter on the CPU), so its GPU timings compare chains that do the same work:
the fused products equal the norm, the adds and the product they replace."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.unit.triton_interpreter import REPO_ROOT, require_triton


def test_layer_chain_self_check() -> None:
    require_triton()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "scripts/bench_layer_chain.py", "--self-check"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("ok:") == 10, proc.stdout
