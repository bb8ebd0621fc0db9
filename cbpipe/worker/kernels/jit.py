"""How our Triton kernels compile: what they specialise on, and compiles while serving.

Triton compiles a kernel on the host the first time a launch needs a new variant, for a
second or more, with the device idle: in a server, every step behind it waits. The worker's
start-up meets every variant its steps need (``ModelRunner.warm_up`` and the graph captures),
and ``tests/gpu/test_worker_step.py`` holds it to that; ``warn_of_compiles`` says so in the
log should a variant be missed all the same.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import triton

log = logging.getLogger(__name__)

_JIT_PARAMETERS = inspect.signature(triton.jit).parameters


def jit_varying(*names: str):  # type: ignore[no-untyped-def]
    """``triton.jit`` that does not specialise the arguments ``names`` on their values.

    Triton compiles a variant per value class of an integer (equal to 1, divisible by 16) and
    per alignment of a pointer (16 bytes). Arguments that change from step to step (a
    block-table width, a split count, metadata pointers offset by the number of decode rows,
    a batch's row count) would otherwise compile new variants while a server runs. Older
    Triton has no ``do_not_specialize_on_alignment``; there ``do_not_specialize`` covers
    both.
    """
    options = {"do_not_specialize": list(names)}
    if "do_not_specialize_on_alignment" in _JIT_PARAMETERS:
        options["do_not_specialize_on_alignment"] = list(names)
    return triton.jit(**options)


def warn_of_compiles() -> bool:
    """From now on, log a warning the first time each kernel needs a variant it has not run
    before (Triton's ``jit_cache_hook``, which sees a variant not in memory, whether it then
    compiles or loads it from the disk cache). For the worker once it serves: such a variant
    is a stall the start-up should have taken. False where this Triton has no such hook."""
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_cache_hook"):
        return False
    previous = runtime.jit_cache_hook
    warned: set[str] = set()

    def hook(*, fn: Any, repr: str, **kwargs: Any) -> bool:
        name = getattr(fn, "name", str(fn))
        if name not in warned:
            warned.add(name)
            log.warning(
                "Triton kernel %s needs a new variant while serving: the step waits while it "
                "compiles (a second or so); the start-up's warm-up missed it: %s",
                name,
                repr,
            )
        # True would skip the compile; another hook's answer stands.
        return bool(previous(fn=fn, repr=repr, **kwargs)) if previous else False

    runtime.jit_cache_hook = hook
    return True
