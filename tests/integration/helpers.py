"""Small helpers shared by the integration tests: prompts, checks, a raw protocol socket."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import zmq

from cbpipe.client import Client, Job, Result
from cbpipe.protocol import Message, decode
from tests.integration.conftest import VOCAB_SIZE

RESULT_TIMEOUT_S = 60.0  # generous: nothing here should take more than a few seconds
FIRST_TOKEN_TIMEOUT_S = 30.0


def random_prompt(rng: random.Random, length: int) -> list[int]:
    """Token ids that avoid the random model's special ids (bos 1, eos 2)."""
    return [rng.randrange(3, VOCAB_SIZE) for _ in range(length)]


def first_tokens(job: Job, count: int) -> list[int]:
    """Wait until ``job`` has streamed ``count`` tokens (it is then still running or done)."""
    tokens: list[int] = []
    for token in job.stream(timeout=FIRST_TOKEN_TIMEOUT_S):
        tokens.append(token)
        if len(tokens) == count:
            break
    return tokens


def assert_full_length(result: Result, max_new_tokens: int) -> None:
    """With ``ignore_eos=True`` and room to spare, a job ends at exactly its length limit."""
    assert result.finish_reason == "length", result
    assert len(result.token_ids) == max_new_tokens, result
    assert all(0 <= t < VOCAB_SIZE for t in result.token_ids), result


def assert_client_serves(client: Client) -> None:
    """A normal job gets done: the engine survived whatever came before."""
    job = client.submit([5, 6, 7], max_new_tokens=4, ignore_eos=True)
    assert_full_length(job.result(RESULT_TIMEOUT_S), 4)


def assert_serves(address: str) -> None:
    """A new client gets a normal job done: the engine survived whatever came before."""
    with Client(address, connect_timeout=30) as client:
        assert_client_serves(client)


class RawConnection:
    """A bare DEALER socket speaking (or mis-speaking) the client protocol."""

    def __init__(self, address: str) -> None:
        self._context = zmq.Context()
        self.socket = self._context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)

    def send(self, *parts: bytes) -> None:
        self.socket.send_multipart(list(parts))

    def receive(self, timeout_s: float) -> Message | None:
        """The next reply, decoded, or None if none comes within ``timeout_s``."""
        if not self.socket.poll(int(timeout_s * 1000)):
            return None
        return decode(self.socket.recv())

    def receive_until(self, wanted: Callable[[Message], bool], timeout_s: float) -> Message | None:
        """The first reply that is ``wanted``, skipping others, or None after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            message = self.receive(remaining)
            if message is not None and wanted(message):
                return message
        return None

    def close(self) -> None:
        self.socket.close(linger=0)
        self._context.term()

    def __enter__(self) -> RawConnection:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
