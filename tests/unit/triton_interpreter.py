"""Run a kernel test module's CPU cases under Triton's interpreter, in a subprocess.

``TRITON_INTERPRET=1`` only takes effect if it is set before a kernel module's ``@triton.jit``
decorators run, which a test module cannot guarantee (another test may have imported the
kernel already), so the cases run in a fresh interpreter: ``python -m`` on the test module,
whose ``__main__`` computes every case and ends with ``emit(results)``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from packaging.version import Version

REPO_ROOT = Path(__file__).resolve().parents[2]
# The kernels' GPU cases, beside the ``gpu`` marker that selects them.
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _interpreter_breaks_on_data_bounds() -> bool:
    """Triton before 3.7 hands a loop bound computed in the kernel to ``int()`` as a
    one-element array, which numpy 2.4 and later refuse (triton-lang/triton#9171): torch
    2.11's pinned Triton 3.6 with a current numpy."""
    try:
        triton_version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return False  # require_triton() reports it
    import numpy

    return Version(triton_version) < Version("3.7") and Version(numpy.__version__) >= Version("2.4")


# For kernels whose loops run to a bound computed from loaded values: the compiled kernels
# are unaffected (their GPU cases still run), only this interpreter cannot run them.
bounds_from_data = pytest.mark.skipif(
    _interpreter_breaks_on_data_bounds(),
    reason="Triton < 3.7's interpreter cannot run a loop whose bound is computed in the kernel "
    "under numpy >= 2.4 (triton-lang/triton#9171); Triton 3.7 or later runs them",
)
_RESULT_PREFIX = "TRITON_INTERPRETER_RESULTS "


def require_triton() -> None:
    try:
        importlib.import_module("triton")
    except ImportError as exc:
        pytest.fail(f"triton is not importable ({exc}); it is a dev dependency: pip install triton")


def run_interpreted(module: str) -> dict[str, Any]:
    """The results ``module``'s ``__main__`` emitted under the interpreter."""
    require_triton()
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", module],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith(_RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        pytest.fail(
            f"the interpreter subprocess failed (exit {proc.returncode}):\n"
            f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    return json.loads(lines[-1][len(_RESULT_PREFIX) :])


def check_each(cases: Iterable[Any], check: Callable[[Any], object]) -> dict[str, object]:
    """In the subprocess: ``check(case)`` keyed by ``case.name``, or the error it raised."""
    results: dict[str, object] = {}
    for case in cases:
        try:
            results[case.name] = check(case)
        except Exception:
            results[case.name] = {"error": traceback.format_exc()}
    return results


def emit(results: dict[str, object]) -> None:
    """In the subprocess: hand the results back as one line on stdout."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    print(_RESULT_PREFIX + json.dumps(results), flush=True)
