"""Text prompts tokenized on a thread of their own, off the scheduler's step loop.

A text prompt of megabytes takes seconds to tokenize; on the loop's thread every other stream
would stop for that long. The Rust tokenizer releases the GIL while it works, so a thread
keeps the loop running; the loop learns of finished prompts through a pipe it polls with its
sockets (``fileno``), and collects them with ``finished()``.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class PromptTooLong(ValueError):
    pass


class PromptTokenizer:
    def __init__(self, tokenizer: Any, max_tokens: int) -> None:
        self._tokenizer = tokenizer
        self._max_tokens = max_tokens
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        self._done: queue.SimpleQueue[tuple[Hashable, Future[list[int]]]] = queue.SimpleQueue()
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        # A prompt may finish after close(), when the pipe's descriptors may already name
        # another file: the lock and flag keep its wake-up from being written there.
        self._closing = threading.Lock()
        self._closed = False

    def fileno(self) -> int:
        """Readable when a prompt is done."""
        return self._wake_read

    def submit(self, key: Hashable, text: str) -> None:
        future = self._pool.submit(self._tokenize, text)
        future.add_done_callback(lambda f: self._on_done(key, f))

    def finished(self) -> list[tuple[Hashable, list[int] | Exception]]:
        """Prompts done since the last call: their token ids, or why they were refused."""
        with contextlib.suppress(BlockingIOError):
            os.read(self._wake_read, 65536)
        results: list[tuple[Hashable, list[int] | Exception]] = []
        while not self._done.empty():
            key, future = self._done.get()
            error = future.exception()
            results.append((key, error if isinstance(error, Exception) else future.result()))
        return results

    def close(self) -> None:
        """Drop the queued prompts; one being tokenized finishes on its thread, unreported."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._closing:
            self._closed = True
            os.close(self._wake_read)
            os.close(self._wake_write)

    def _tokenize(self, text: str) -> list[int]:
        ids = list(self._tokenizer(text, add_special_tokens=False).input_ids)
        if len(ids) >= self._max_tokens:
            raise PromptTooLong(len(ids))
        return ids

    def _on_done(self, key: Hashable, future: Future[list[int]]) -> None:
        self._done.put((key, future))
        with self._closing:
            if not self._closed:
                os.write(self._wake_write, b"x")
