"""The preparation thread: the loop hands a job over (a text prompt to tokenize, work to do
after it) and never waits for it."""

from __future__ import annotations

import select
import threading
import time
from types import SimpleNamespace

import pytest

from cbpipe.scheduler.preparation import Preparation, Prepared, PromptTooLong

WAIT_S = 30.0  # a bound on waiting for the thread, never a speed assertion


class GatedTokenizer:
    """One id a character, once ``gate`` is open; records the threads it ran on."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.threads: list[int] = []
        self.gave_up = False

    def __call__(self, text: str, add_special_tokens: bool) -> SimpleNamespace:
        assert not add_special_tokens
        self.threads.append(threading.get_ident())
        if not self.gate.wait(WAIT_S):
            self.gave_up = True
            raise TimeoutError("the test never opened the gate")
        if text == "boom":
            raise RuntimeError("the tokenizer failed")
        return SimpleNamespace(input_ids=[ord(c) for c in text])


def wait_readable(prompts: Preparation) -> None:
    readable, _, _ = select.select([prompts.fileno()], [], [], WAIT_S)
    assert readable, "no prompt was reported done"


def collect(prompts: Preparation, count: int) -> dict[object, list[int] | Exception]:
    done: dict[object, list[int] | Exception] = {}
    while len(done) < count:
        wait_readable(prompts)
        done.update(prompts.finished())
    return done


@pytest.fixture
def tokenizer() -> GatedTokenizer:
    return GatedTokenizer()


@pytest.fixture
def prompts(tokenizer: GatedTokenizer):  # type: ignore[no-untyped-def]
    prompts = Preparation(tokenizer, max_tokens=5)
    yield prompts
    tokenizer.gate.set()
    prompts.close()


def test_submit_returns_while_the_tokenizer_works(
    prompts: Preparation, tokenizer: GatedTokenizer
) -> None:
    prompts.submit("a", "abc")  # the gate is shut: tokenizing it cannot finish
    readable, _, _ = select.select([prompts.fileno()], [], [], 0.05)
    assert not readable and prompts.finished() == []
    tokenizer.gate.set()
    assert collect(prompts, 1) == {"a": Prepared([97, 98, 99])}
    assert tokenizer.threads and threading.get_ident() not in tokenizer.threads


def test_each_prompt_gets_its_ids_or_why_it_was_refused(
    prompts: Preparation, tokenizer: GatedTokenizer
) -> None:
    tokenizer.gate.set()
    for key, text in [("ok", "abcd"), ("long", "abcde"), ("broken", "boom")]:
        prompts.submit(key, text)
    prompts.submit("ids", [5, 6], then=lambda: "compiled")  # ids pass as they are
    prompts.submit("failed", "ab", then=lambda: 1 / 0)
    done = collect(prompts, 5)
    assert done["ok"] == Prepared([97, 98, 99, 100])
    assert done["ids"] == Prepared([5, 6], "compiled")
    assert isinstance(done["failed"], ZeroDivisionError)
    # max_tokens is the sequence's whole limit: a prompt must leave room for one new token.
    assert isinstance(done["long"], PromptTooLong) and done["long"].args == (5,)
    assert isinstance(done["broken"], RuntimeError)
    assert prompts.finished() == []


def test_close_does_not_wait_for_queued_prompts(tokenizer: GatedTokenizer) -> None:
    prompts = Preparation(tokenizer, max_tokens=5)
    for key in range(3):
        prompts.submit(key, "ab")
    deadline = time.monotonic() + WAIT_S
    while not tokenizer.threads:  # until the first has started, and is stuck behind the gate
        assert time.monotonic() < deadline, "the tokenizer thread never started"
        time.sleep(0.01)
    prompts.close()
    assert not tokenizer.gave_up, "close() waited for the prompt being tokenized"
    tokenizer.gate.set()  # it finishes now, with nowhere to report to
    assert len(tokenizer.threads) == 1, "queued prompts were tokenized after close()"


def test_a_full_wake_up_pipe_never_blocks(tokenizer: GatedTokenizer) -> None:
    """More jobs done than the pipe holds bytes (65,536 on Linux): the wake-ups past that are
    dropped, not waited for, so close() (which cancels the queue, each cancellation a wake-up,
    on the caller's thread) returns."""
    prompts = Preparation(tokenizer, max_tokens=5)
    prompts.submit("gated", "ab")  # holds the thread, so the rest stay queued
    count = 70_000
    for key in range(count):
        prompts.submit(key, [1])
    closed = threading.Event()
    closer = threading.Thread(target=lambda: (prompts.close(), closed.set()), daemon=True)
    closer.start()
    assert closed.wait(WAIT_S), "close() blocked on a full pipe"
    tokenizer.gate.set()
