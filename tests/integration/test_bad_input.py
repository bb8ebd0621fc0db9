"""Invalid requests and malformed frames: a ``RequestError`` or error reply naming the problem,
never a crash, and the engine goes on serving."""

from __future__ import annotations

import itertools
import math
from typing import Any

import msgpack
import pytest

from cbpipe.client import Client, RequestError
from cbpipe.protocol import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Error,
    ErrorKind,
    Finished,
    SamplingParams,
    Submit,
    encode,
)
from tests.integration.conftest import SYNC_MAX_MODEL_LEN, VOCAB_SIZE, EngineRun
from tests.integration.helpers import (
    RESULT_TIMEOUT_S,
    RawConnection,
    assert_client_serves,
    assert_serves,
)

REPLY_TIMEOUT_S = 10.0
NO_REPLY_WAIT_S = 1.0  # for frames that may, by design, go unanswered

_request_ids = itertools.count(1000)

# Parameters that the client refuses before sending, and the engine refuses on arrival.
BAD_PARAMS = [
    pytest.param({"max_new_tokens": 0}, "max_new_tokens", id="max_new_tokens=0"),
    pytest.param({"max_new_tokens": -5}, "max_new_tokens", id="max_new_tokens<0"),
    pytest.param({"max_new_tokens": 2.5}, "max_new_tokens", id="max_new_tokens-float"),
    pytest.param({"max_new_tokens": True}, "max_new_tokens", id="max_new_tokens-bool"),
    pytest.param({"temperature": -0.1}, "temperature", id="temperature<0"),
    pytest.param({"temperature": math.nan}, "temperature", id="temperature-nan"),
    pytest.param({"top_p": 0.0}, "top_p", id="top_p=0"),
    pytest.param({"top_p": 1.5}, "top_p", id="top_p>1"),
    pytest.param({"top_k": -1}, "top_k", id="top_k<0"),
    pytest.param({"seed": -1}, "seed", id="seed<0"),
    pytest.param({"stop_token_ids": (-1,)}, "stop_token_ids", id="stop_token_id<0"),
    pytest.param({"ignore_eos": "yes"}, "ignore_eos", id="ignore_eos-str"),
]


def bad_params(overrides: dict[str, Any]) -> SamplingParams:
    """Sampling parameters as given; ``SamplingParams`` validates only when asked."""
    return SamplingParams(**{"max_new_tokens": 4, **overrides})


def expect_request_error(client: Client, prompt: Any, match: str, **params: Any) -> None:
    """The job is refused, at ``submit`` or from ``result``, with a message naming why."""
    with pytest.raises(RequestError, match=match):
        client.submit(prompt, **{"max_new_tokens": 4, **params}).result(timeout=RESULT_TIMEOUT_S)


def expect_error_reply(raw: RawConnection, request_id: int | None, match: str) -> None:
    reply = raw.receive(REPLY_TIMEOUT_S)
    assert isinstance(reply, Error), f"expected an error reply, got {reply!r}"
    assert reply.kind is ErrorKind.REQUEST
    assert reply.request_id == request_id
    assert match in reply.message, reply.message


def expect_error_reply_or_none(raw: RawConnection, match: str) -> None:
    reply = raw.receive(NO_REPLY_WAIT_S)
    if reply is not None:
        assert isinstance(reply, Error), f"expected an error reply, got {reply!r}"
        assert reply.kind is ErrorKind.REQUEST
        assert match in reply.message, reply.message


def frame(**fields: Any) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, **fields})


def submit_fields(request_id: object, **changes: Any) -> dict[str, Any]:
    """A valid submit's fields, with ``changes``."""
    return {
        "type": "submit",
        "request_id": request_id,
        "prompt": [5, 6, 7],
        "params": {"max_new_tokens": 4},
        **changes,
    }


# --- refused by the client, and by the engine --------------------------------------------------


@pytest.mark.parametrize(("overrides", "names"), BAD_PARAMS)
def test_bad_parameters_refused_by_the_client(
    client: Client, overrides: dict[str, Any], names: str
) -> None:
    with pytest.raises(RequestError, match=names):
        client.submit([5, 6, 7], **{"max_new_tokens": 4, **overrides})
    assert_client_serves(client)


@pytest.mark.parametrize(("overrides", "names"), BAD_PARAMS)
def test_bad_parameters_refused_by_the_engine(
    engine: EngineRun, overrides: dict[str, Any], names: str
) -> None:
    request_id = next(_request_ids)
    with RawConnection(engine.address) as raw:
        raw.send(encode(Submit(request_id, [5, 6, 7], bad_params(overrides))))
        expect_error_reply(raw, request_id, names)
    assert_serves(engine.address)


@pytest.mark.parametrize(
    "prompt",
    [
        pytest.param({"a": 1}, id="dict-str-keys"),
        pytest.param({5: 1, 6: 1}, id="dict-int-keys"),
        pytest.param({5, 6, 7}, id="set"),
        pytest.param(None, id="None"),
        pytest.param(7, id="int"),
        pytest.param([5.0, 6.0], id="float-ids"),
        pytest.param([True, 6], id="bool-id"),
    ],
)
def test_prompt_of_a_wrong_type_refused_by_the_client(client: Client, prompt: Any) -> None:
    with pytest.raises(RequestError, match="prompt"):
        client.submit(prompt, max_new_tokens=4)


@pytest.mark.parametrize(
    ("prompt", "options", "name"),
    [
        ("a \udcff", {}, "prompt"),
        ([5, 6], {"stop": ["ok", "\ud800"]}, "stop"),
        ([5, 6], {"cache_salt": "\ud800"}, "cache_salt"),
    ],
)
def test_text_that_is_half_a_surrogate_pair_refused_by_the_client(
    client: Client, prompt: Any, options: dict[str, Any], name: str
) -> None:
    with pytest.raises(RequestError, match=f"^{name} holds .*surrogate"):
        client.submit(prompt, max_new_tokens=4, **options)
    assert_client_serves(client)


@pytest.mark.parametrize(
    "prompt",
    [
        pytest.param({"a": 1}, id="dict"),
        pytest.param(7, id="int"),
        pytest.param([5.5, 6], id="float-id"),
        pytest.param([5, None], id="None-id"),
    ],
)
def test_prompt_of_a_wrong_type_refused_by_the_engine(engine: EngineRun, prompt: Any) -> None:
    request_id = next(_request_ids)
    with RawConnection(engine.address) as raw:
        raw.send(frame(**submit_fields(request_id, prompt=prompt)))
        expect_error_reply(raw, request_id, "submit.prompt")
    assert_serves(engine.address)


# --- refused by the engine only -------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "params", "names"),
    [
        pytest.param([], {}, "empty", id="empty-prompt"),
        pytest.param([5, VOCAB_SIZE], {}, f"token id {VOCAB_SIZE}", id="id>=vocab"),
        pytest.param([5, -1], {}, "token id -1", id="negative-id"),
        pytest.param("hello", {}, "no tokenizer", id="text-without-tokenizer"),
        pytest.param([5], {"stop_token_ids": [VOCAB_SIZE]}, "stop token", id="stop-id>=vocab"),
    ],
)
def test_bad_request_refused_by_the_engine(
    client: Client, prompt: Any, params: dict[str, Any], names: str
) -> None:
    expect_request_error(client, prompt, names, **params)
    assert_client_serves(client)


def test_prompt_longer_than_the_engine_holds(sync_engine: EngineRun) -> None:
    with Client(sync_engine.address) as client:
        assert client.max_model_len == SYNC_MAX_MODEL_LEN
        expect_request_error(client, [5] * 300, "too long")
        expect_request_error(client, [5] * SYNC_MAX_MODEL_LEN, "too long")  # no room to output
        # Room for 6 more tokens: the job ends there, at the engine's length limit.
        prompt = [5] * (SYNC_MAX_MODEL_LEN - 6)
        result = client.submit(prompt, max_new_tokens=20, ignore_eos=True).result(
            timeout=RESULT_TIMEOUT_S
        )
        assert result.finish_reason == "length"
        assert len(result.token_ids) == 6
        assert result.num_prompt_tokens == len(prompt)


def test_frame_over_the_limit_refused_by_the_client(client: Client) -> None:
    with pytest.raises(RequestError, match="frame limit"):
        client.submit("x" * MAX_FRAME_BYTES, max_new_tokens=4)


# --- malformed frames ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "names"),
    [
        pytest.param(b"\xc1 not msgpack", "undecodable", id="garbage"),
        pytest.param(b"", "undecodable", id="empty-frame"),
        pytest.param(msgpack.packb([1, 2, 3]), "map", id="not-a-map"),
        pytest.param(b"\x00" * (MAX_FRAME_BYTES + 1), "exceeds", id="oversized-garbage"),
    ],
)
def test_undecodable_frame(engine: EngineRun, payload: bytes, names: str) -> None:
    with RawConnection(engine.address) as raw:
        raw.send(payload)
        expect_error_reply_or_none(raw, names)
    assert_serves(engine.address)


@pytest.mark.parametrize(
    ("fields", "names"),
    [
        pytest.param({"type": "frobnicate"}, "message type", id="unknown-type"),
        pytest.param(
            {"type": "tokens", "request_id": 1, "token_ids": [5]},
            "message type",
            id="engine-only-type",
        ),
        pytest.param({"type": "hello", "extra": 1}, "unknown field", id="hello-unknown-field"),
        pytest.param(
            submit_fields(7, v=PROTOCOL_VERSION + 1), "protocol version", id="wrong-version"
        ),
        pytest.param(submit_fields(7, v=None), "protocol version", id="no-version"),
        pytest.param(submit_fields(7, priority=1), "unknown field", id="submit-unknown-field"),
        pytest.param(
            submit_fields(7, params={"max_new_tokens": 4, "beam": 2}),
            "unknown field",
            id="params-unknown-field",
        ),
        pytest.param(
            {"type": "submit", "request_id": 7, "prompt": [5]}, "missing field", id="missing-field"
        ),
        pytest.param(submit_fields("seven"), "request_id", id="request_id-str"),
    ],
)
def test_invalid_message(engine: EngineRun, fields: dict[str, Any], names: str) -> None:
    with RawConnection(engine.address) as raw:
        raw.send(frame(**fields))
        request_id = fields.get("request_id")
        if isinstance(request_id, int):  # the engine can tell which request it refuses
            expect_error_reply(raw, request_id, names)
        else:
            expect_error_reply_or_none(raw, names)
    assert_serves(engine.address)


def test_oversized_submit(engine: EngineRun) -> None:
    prompt = [500] * (MAX_FRAME_BYTES // 2)  # 3 bytes each in msgpack
    with RawConnection(engine.address) as raw:
        raw.send(frame(**submit_fields(7, prompt=prompt)))
        expect_error_reply_or_none(raw, "exceeds")
    assert_serves(engine.address)


def test_multipart_message_is_dropped(engine: EngineRun) -> None:
    with RawConnection(engine.address) as raw:
        raw.send(frame(**submit_fields(8)), frame(**submit_fields(9)))
        expect_error_reply_or_none(raw, "part")
    assert_serves(engine.address)


def test_request_id_in_use_is_refused_without_harm(engine: EngineRun) -> None:
    long_job = submit_fields(5, params={"max_new_tokens": 2000, "ignore_eos": True})
    with RawConnection(engine.address) as raw:
        raw.send(frame(**long_job))
        raw.send(frame(**long_job))
        error = raw.receive_until(lambda m: isinstance(m, Error), REPLY_TIMEOUT_S)
        assert isinstance(error, Error) and error.request_id == 5, error
        assert "already in use" in error.message
        # The first job runs on; it ends when cancelled.
        raw.send(frame(type="cancel", request_id=5))
        finished = raw.receive_until(lambda m: isinstance(m, Finished), REPLY_TIMEOUT_S)
        assert isinstance(finished, Finished) and finished.request_id == 5, finished
        assert finished.finish_reason == "cancelled"
    assert_serves(engine.address)
