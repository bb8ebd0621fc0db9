"""What a job needs before it can be admitted, done on a thread of its own, off the
scheduler's step loop: its text prompt tokenized, its structured-output constraint compiled.

A text prompt of megabytes takes seconds to tokenize, and the grammar of a schema of a
hundred tools a few hundred milliseconds to compile and start; on the loop's thread every
other stream would stop for that long. The Rust tokenizer releases the GIL while it works,
and llguidance for most of its work, so a thread keeps the loop running; the loop learns of
finished jobs through a pipe it polls with its sockets (``fileno``), and collects them with
``finished()``.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any


class PromptTooLong(ValueError):
    pass


@dataclass(frozen=True)
class Prepared:
    prompt: list[int]  # token ids
    extra: Any = None  # what the job's ``then`` returned


class Preparation:
    def __init__(self, tokenizer: Any, max_tokens: int) -> None:
        self._tokenizer = tokenizer
        self._max_tokens = max_tokens
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="preparation")
        self._done: queue.SimpleQueue[tuple[Hashable, Future[Prepared]]] = queue.SimpleQueue()
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        # A full pipe already wakes the loop: a write that would block has nothing to add,
        # and a blocking one would stop whoever finishes a job (the loop's thread, when
        # close() cancels the queue) until the loop reads.
        os.set_blocking(self._wake_write, False)
        # A prompt may finish after close(), when the pipe's descriptors may already name
        # another file: the lock and flag keep its wake-up from being written there.
        self._closing = threading.Lock()
        self._closed = False

    def fileno(self) -> int:
        """Readable when a job is done."""
        return self._wake_read

    def submit(
        self, key: Hashable, prompt: str | list[int], then: Callable[[], Any] | None = None
    ) -> None:
        """Tokenize ``prompt`` (token ids pass as they are), then run ``then``."""
        future = self._pool.submit(self._prepare, prompt, then)
        future.add_done_callback(lambda f: self._on_done(key, f))

    def finished(self) -> list[tuple[Hashable, Prepared | Exception]]:
        """Jobs done since the last call: what they need, or why they were refused."""
        with contextlib.suppress(BlockingIOError):
            os.read(self._wake_read, 65536)
        results: list[tuple[Hashable, Prepared | Exception]] = []
        while not self._done.empty():
            key, future = self._done.get()
            error = future.exception()
            results.append((key, error if isinstance(error, Exception) else future.result()))
        return results

    def close(self) -> None:
        """Drop the queued jobs; one being prepared finishes on its thread, unreported."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._closing:
            self._closed = True
            os.close(self._wake_read)
            os.close(self._wake_write)

    def _prepare(self, prompt: str | list[int], then: Callable[[], Any] | None) -> Prepared:
        if isinstance(prompt, str):
            prompt = list(self._tokenizer(prompt, add_special_tokens=False).input_ids)
            if len(prompt) >= self._max_tokens:
                raise PromptTooLong(len(prompt))
        return Prepared(prompt, then() if then is not None else None)

    def _on_done(self, key: Hashable, future: Future[Prepared]) -> None:
        self._done.put((key, future))
        with self._closing:
            if not self._closed:
                with contextlib.suppress(BlockingIOError):
                    os.write(self._wake_write, b"x")
