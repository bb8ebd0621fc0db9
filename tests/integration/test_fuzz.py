"""Property-based fuzzing of the engine's two sockets: whatever arrives, the engine serves on.

Frames are built from the message schemas (every client message type, its fields kept,
dropped, retyped or pushed out of range), from random msgpack values and from raw bytes.
After each case a normal greedy request must still return the reference tokens. The
clients' socket is fuzzed with everything; the worker's results socket, which only a process
of the same user can reach, with connections and frames that are not the worker's (the
scheduler ignores them; a well-formed ``step_done`` out of order means a broken worker and
fails the engine, by design).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cbpipe.client import Client
from cbpipe.protocol import PROTOCOL_VERSION, StepDone, WorkerFailed, encode
from tests.integration.conftest import VOCAB_SIZE, EngineRun
from tests.integration.helpers import RESULT_TIMEOUT_S, RawConnection

MAX_EXAMPLES = 150
REFERENCE_PROMPT = [5, 6, 7, 8]

ints = st.one_of(
    st.integers(-5, 600),
    st.sampled_from([0, 1, 2**31 - 1, 2**31, 2**32, 2**63 - 1, -(2**63)]),
)
floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, 1e-300, 1e300, -0.0, 1.0, 2.0, 1e4]),
)
scalars = st.one_of(
    st.none(), st.booleans(), ints, floats, st.text(max_size=20), st.binary(max_size=20)
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)

PARAM_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "max_new_tokens": st.one_of(st.integers(1, 8), ints),
    "temperature": st.one_of(st.sampled_from([0.0, 0.7]), floats),
    "top_p": floats,
    "top_k": ints,
    "min_p": floats,
    "seed": st.one_of(st.none(), ints),
    "stop_token_ids": st.lists(ints, max_size=70),
    "ignore_eos": st.booleans(),
    "stop": st.lists(st.text(max_size=300), max_size=20),
    "min_tokens": ints,
    "presence_penalty": floats,
    "frequency_penalty": floats,
    "repetition_penalty": floats,
    "logit_bias": st.lists(st.tuples(ints, floats).map(list), max_size=5),
    "logprobs": st.one_of(st.none(), ints),
    "prompt_logprobs": st.one_of(st.none(), ints),
    "n": st.one_of(st.integers(1, 3), ints),
    "detokenize": st.booleans(),
}


@st.composite
def mangled(draw: st.DrawFn, fields: dict[str, st.SearchStrategy[Any]]) -> dict[str, Any]:
    """A map of some of ``fields``, a few of them of any type, maybe with an unknown one."""
    chosen = draw(st.sets(st.sampled_from(sorted(fields))))
    out = {name: draw(st.one_of(fields[name], values) if draw(st.booleans()) else fields[name])
           for name in chosen}  # fmt: skip
    if draw(st.integers(0, 9)) == 0:
        out[draw(st.text(max_size=8))] = draw(values)
    return out


@st.composite
def client_frames(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["submit", "submit", "cancel", "other", "random", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    if kind == "random":
        return msgpack.packb(draw(values))
    header: dict[str, Any] = {"v": draw(st.sampled_from([PROTOCOL_VERSION] * 9 + [None, 2]))}
    if kind == "submit":
        prompt = draw(st.one_of(st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=20), values))
        fields = {
            "request_id": draw(ints),
            "prompt": prompt,
            "params": draw(mangled(PARAM_FIELDS)),
        }
        body = draw(mangled({k: st.just(v) for k, v in fields.items()}))
        return msgpack.packb({**header, "type": "submit", **body})
    if kind == "cancel":
        return msgpack.packb({**header, "type": "cancel", "request_id": draw(values)})
    name = draw(st.sampled_from(["hello", "goodbye", "get_stats", "tokens", "step", "nope"]))
    return msgpack.packb({**header, "type": name, **draw(mangled({"x": values}))})


@pytest.fixture(scope="module")
def reference(engine: EngineRun) -> Iterator[tuple[Client, list[int]]]:
    with Client(engine.address) as client:
        job = client.submit(REFERENCE_PROMPT, max_new_tokens=6, ignore_eos=True)
        yield client, job.result(timeout=RESULT_TIMEOUT_S).token_ids


def assert_still_serves(reference: tuple[Client, list[int]]) -> None:
    client, tokens = reference
    job = client.submit(REFERENCE_PROMPT, max_new_tokens=6, ignore_eos=True)
    assert job.result(timeout=RESULT_TIMEOUT_S).token_ids == tokens


@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(frames=st.lists(client_frames(), min_size=1, max_size=3))
def test_client_socket_fuzz(
    engine: EngineRun, reference: tuple[Client, list[int]], frames: list[bytes]
) -> None:
    with RawConnection(engine.address) as raw:
        for frame in frames:
            raw.send(frame)
        while raw.receive(0.02) is not None:  # whatever it answers, it answers
            pass
    # The raw connection is gone without a goodbye: any job it started is cancelled when the
    # engine next has tokens for it.
    assert_still_serves(reference)


@settings(
    max_examples=MAX_EXAMPLES // 3,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    frame=st.one_of(
        st.binary(max_size=64),
        values.map(msgpack.packb),
        st.builds(
            lambda name, body: msgpack.packb({"v": PROTOCOL_VERSION, "type": name, **body}),
            st.sampled_from(["step", "submit", "hello", "worker_ready", "nope"]),
            st.dictionaries(st.text(max_size=8), values, max_size=3),
        ),
    )
)
def test_results_socket_fuzz(
    engine: EngineRun, reference: tuple[Client, list[int]], frame: bytes
) -> None:
    send_to_results_socket(engine, [frame])
    assert_still_serves(reference)


def test_well_formed_worker_messages_from_another_process_are_ignored(
    engine: EngineRun, reference: tuple[Client, list[int]]
) -> None:
    """Frames a worker would send, from a process that is not one of the run's: without the
    run's token they are ignored, or one would end the engine (a failure, a step out of
    order) or apply a step's outputs before the device wrote them."""
    forged = [
        StepDone(step, 0, 0, 0, 0, 0, 0) for step in (*range(64), 10**9)
    ]  # the steps in flight among them
    send_to_results_socket(engine, [*map(encode, forged), encode(WorkerFailed("forged"))])
    assert_still_serves(reference)


def send_to_results_socket(engine: EngineRun, frames: list[bytes]) -> None:
    address = "ipc://" + os.path.join(
        os.path.dirname(engine.address.removeprefix("ipc://")), "results.sock"
    )
    context = zmq.Context()
    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 1000)
    push.connect(address)
    for frame in frames:
        push.send(frame)
    push.close()
    context.term()
