import msgpack
import pytest

from cbpipe.protocol import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Error,
    ErrorKind,
    ProtocolError,
    SamplingParams,
    Step,
    Submit,
    decode,
    encode,
)


def frame(**fields) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, **fields})


def test_round_trip_of_every_field_kind() -> None:
    submit = Submit(7, [1, 2, 3], SamplingParams(5, 0.7, 0.9, 40, 123, (4, 5), True))
    assert decode(encode(submit)) == submit
    assert decode(encode(Submit(1, "text", SamplingParams(3)))).prompt == "text"
    error = Error(None, ErrorKind.ENGINE, "gone")
    assert decode(encode(error)) == error
    step = Step(3, 1, 10, 2, 1, 9, 12, 1, None, True, False)
    assert decode(encode(step)) == step


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"\xc1", "undecodable"),
        (msgpack.packb([1, 2]), "must be a map"),
        (msgpack.packb({"v": 99, "type": "hello"}), "protocol version"),
        (frame(type="launch_missiles"), "unknown or unexpected message type"),
        (frame(type="submit", request_id=1, prompt=[1]), "missing field 'params'"),
        (
            frame(type="submit", request_id=1, prompt=[1], params={"max_new_tokens": 1}, x=1),
            "unknown field",
        ),
        (
            frame(type="submit", request_id="1", prompt=[1], params={"max_new_tokens": 1}),
            "submit.request_id: expected int",
        ),
        (
            frame(type="submit", request_id=1, prompt={"a": 1}, params={"max_new_tokens": 1}),
            "submit.prompt: expected str or list of int",
        ),
        (
            frame(type="submit", request_id=1, prompt=[1], params={"max_new_tokens": True}),
            "max_new_tokens: expected int",
        ),
        (b"\x00" * (MAX_FRAME_BYTES + 1), "exceeds the limit"),
    ],
)
def test_bad_frames_are_named(raw: bytes, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        decode(raw)


def test_expected_types_restrict_what_a_socket_accepts() -> None:
    with pytest.raises(ProtocolError, match="unexpected"):
        decode(encode(Error(1, ErrorKind.REQUEST, "x")), expected=(Submit,))


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (SamplingParams(0), "max_new_tokens must be >= 1"),
        (SamplingParams(1.5), "max_new_tokens must be an integer"),  # type: ignore[arg-type]
        (SamplingParams(1, temperature=-1), "temperature must be >= 0"),
        (SamplingParams(1, temperature=float("nan")), "temperature must be finite"),
        (SamplingParams(1, top_p=0.0), "top_p"),
        (SamplingParams(1, top_p=1.5), "top_p"),
        (SamplingParams(1, top_k=-1), "top_k"),
        (SamplingParams(1, seed=-3), "seed"),
        (SamplingParams(1, stop_token_ids=(-1,)), "stop_token_ids"),
    ],
)
def test_sampling_params_validation(params: SamplingParams, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        params.validate()
