"""``cbpipe.worker.kernels.jit``: the warning a variant compiled while serving gets.

Triton compiles only on a GPU, so the hook is called here as Triton calls it (keyword
arguments, its answer deciding whether Triton compiles); the GPU suite's
``test_no_kernel_compiles_while_serving_after_warm_up`` holds the start-up to needing none.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

triton = pytest.importorskip("triton")


@pytest.fixture
def runtime() -> Any:
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_cache_hook"):
        pytest.skip(f"Triton {triton.__version__} has no jit_cache_hook")
    previous = runtime.jit_cache_hook
    yield runtime
    runtime.jit_cache_hook = previous


def test_each_kernel_is_named_once_and_still_compiles(
    runtime: Any, caplog: pytest.LogCaptureFixture
) -> None:
    from cbpipe.worker.kernels.jit import warn_of_compiles

    seen: list[str] = []

    def earlier(*, fn: Any, **_: Any) -> bool:
        seen.append(fn.name)
        return False

    runtime.jit_cache_hook = earlier
    assert warn_of_compiles()
    hook = runtime.jit_cache_hook
    with caplog.at_level(logging.WARNING, logger="cbpipe.worker.kernels.jit"):
        for name in ("_draw_kernel", "_draw_kernel", "_merge_kernel"):
            fn = SimpleNamespace(name=name)
            assert hook(key=(), repr=f"{name}(rows: i32)", fn=fn, compile={}) is False
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2, warnings
    assert "_draw_kernel" in warnings[0] and "while serving" in warnings[0]
    assert "_merge_kernel" in warnings[1]
    assert seen == ["_draw_kernel", "_draw_kernel", "_merge_kernel"]  # chained, every call
