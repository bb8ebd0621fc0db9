"""Compiled samplers saved whole, so that a later start loads them instead of tracing them.

Inductor's cache spares a warm start the compiling, not dynamo's tracing: every compiled
function is traced again in the worker, one after another. ``torch.compile(...).aot_compile``
(experimental in torch) packs one trace (its guards, the transformed bytecode and inductor's
compiled graph) into a file that another process loads without tracing: on the H200 an 8B
model's warm start-up spent 0.3-0.5 s on each sampler's first run so, against 1.5-1.7 s
traced (docs/PERFORMANCE.md). The compile-ahead processes (``compile_ahead.py``) save the
samplers' traces beside inductor's cache on the start that first needs them; the worker
loads them.

A trace holds what it was traced from. What the compile cache's folder does not name is in
the file's name: the digest of the traced code's source and of the compile settings, with
torch's and Python's versions (the bytecode is Python's). What the trace specialised on (the
vocabulary, the variant's flags) its guards check before a loaded trace first runs. Whatever
is missing, fails to load or fails its guards falls back to ``torch.compile``: a slower
start, the same kernels.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import logging
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch._dynamo import config as dynamo_config

from cbpipe.worker import compiling, sampler
from cbpipe.worker.compiling import compile_decode_fn

log = logging.getLogger("cbpipe.worker")

# The modules whose source a saved sampler's trace holds: the samplers themselves, and the
# compile options and dynamo settings they are traced under.
_TRACED_SOURCES = (sampler, compiling)


@functools.cache
def trace_digest() -> str:
    """A short digest of everything a saved trace depends on besides the compile cache
    folder's key (``compile_cache.cache_key``)."""
    digest = hashlib.sha256()
    for module in _TRACED_SOURCES:
        digest.update(inspect.getsource(module).encode())
    digest.update(f"torch {torch.__version__} python {sys.version}".encode())
    return digest.hexdigest()[:16]


@functools.cache
def traces_are_supported() -> bool:
    """Whether this torch saves and loads whole traces."""
    with _aot_compile_enabled():
        saves = hasattr(torch.compile(_identity), "aot_compile")
    return saves and hasattr(torch.compiler, "load_compiled_function")


def _aot_compile_enabled() -> contextlib.AbstractContextManager:
    """Where ``torch.compile``'s result has ``aot_compile``: torch before 2.13 (2.11 on the
    device) offers it only with dynamo's ``enable_aot_compile`` set, 2.13 by default."""
    if hasattr(dynamo_config, "enable_aot_compile"):
        return dynamo_config.patch(enable_aot_compile=True)
    return contextlib.nullcontext()


def _identity(x: Any) -> Any:
    return x


class SavedTraces:
    """A folder of saved traces. The compile-ahead processes write them (``writes``); the
    worker only reads them."""

    def __init__(self, folder: Path, *, writes: bool = False) -> None:
        self.folder = folder
        self.writes = writes

    def path(self, name: str) -> Path:
        return self.folder / f"{name}-{trace_digest()}.bin"

    def missing(self, names: tuple[str, ...]) -> list[str]:
        """Which of ``names`` no writer has tried yet: neither saved nor refused."""
        return [
            name
            for name in names
            if not self.path(name).is_file() and not _refusal(self.path(name)).is_file()
        ]

    def remove_stale(self, name: str) -> None:
        """Remove ``name``'s files of other digests: what earlier versions saved, which no
        start of this one will read."""
        current = {self.path(name), _refusal(self.path(name))}
        stale = re.compile(rf"{re.escape(name)}-[0-9a-f]{{16}}\.(bin|refused)")
        for file in self.folder.iterdir():
            if stale.fullmatch(file.name) and file not in current:
                file.unlink(missing_ok=True)

    def compiled(self, fn: Callable, name: str, fallback: Callable) -> SavedTrace:
        """``fn`` compiled as ``compile_decode_fn`` compiles it, through the trace saved as
        ``name`` (one specialisation of ``fn``, one set of its flags, a name), or else through
        ``fallback``, ``fn`` compiled."""
        return SavedTrace(fn, name, self, fallback)


def _refusal(path: Path) -> Path:
    return path.with_suffix(".refused")


class SavedTrace:
    """A compiled function that on its first call loads its saved trace, or traces and saves
    it (a writer), or else falls back to ``torch.compile``. Calls whose inputs fail the
    loaded trace's guards go to the fall-back too."""

    def __init__(self, fn: Callable, name: str, traces: SavedTraces, fallback: Callable) -> None:
        self.fn = fn
        self.name = name
        self.traces = traces
        self.path = traces.path(name)
        self.fallback = fallback
        self.loaded: Any = None  # the trace, loaded or saved by this process
        self._first_call = True
        self._refused = False

    def __call__(self, *args: Any) -> Any:
        if self._first_call:
            self._first_call = False
            self.loaded = self._load()
            if self.loaded is None and self.traces.writes:
                self.loaded = self._trace_and_save(args)
        if self.loaded is not None and self.loaded.guard_check(*args):
            return self.loaded(*args)
        if self.loaded is not None and not self._refused:
            self._refused = True
            log.info("%s: the saved trace's guards refuse these inputs; compiling", self.path.name)
        return self.fallback(*args)

    def _load(self) -> Any:
        if not self.path.is_file():
            return None
        started = time.perf_counter()
        try:
            with self.path.open("rb") as file:
                loaded = torch.compiler.load_compiled_function(file)  # type: ignore[arg-type]
            loaded.guard_check  # noqa: B018 (a torch without it cannot be trusted with guards)
        except Exception as exc:  # an artifact of a torch that saves what this one cannot load
            log.warning("could not load the saved trace %s (%s): compiling instead", self.path, exc)
            return None
        log.debug("loaded %s in %.2f s", self.path.name, time.perf_counter() - started)
        return loaded

    def _trace_and_save(self, args: tuple[Any, ...]) -> Any:
        started = time.perf_counter()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with _aot_compile_enabled():
                compiled = compile_decode_fn(self.fn, fullgraph=True)
            traced = compiled.aot_compile((args, {}))
            # Written aside, then renamed: a worker never reads half a file.
            aside = self.path.with_name(f"{self.path.name}.{os.getpid()}")
            traced.save_compiled_function(str(aside))
            os.replace(aside, self.path)
            self.traces.remove_stale(self.name)
        except Exception as exc:  # an experimental API: missing, or refusing this function
            log.warning("could not save a trace of %s (%s)", self.fn.__qualname__, exc)
            # Noted, so that later starts do not fork processes to fail at it again.
            _refusal(self.path).write_text(f"{type(exc).__name__}: {exc}\n")
            return None
        log.debug("traced and saved %s in %.1f s", self.path.name, time.perf_counter() - started)
        return traced
