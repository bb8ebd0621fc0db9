import msgpack
import pytest

from cbpipe.protocol import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Error,
    ErrorKind,
    ProtocolError,
    SamplingMode,
    SamplingParams,
    Step,
    StructuredOutput,
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
    step = Step(3, 1, 10, 2, 1, 9, 12, 1, None, SamplingMode.FULL, True, False, 5)
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
        (SamplingParams(0), r"max_new_tokens must be in \[1, "),
        (SamplingParams(1.5), "max_new_tokens must be an integer"),  # type: ignore[arg-type]
        (SamplingParams(1, temperature=-1), r"temperature must be in \[0, "),
        (SamplingParams(1, temperature=float("nan")), "temperature must be finite"),
        (SamplingParams(1, top_p=0.0), "top_p"),
        (SamplingParams(1, top_p=1.5), "top_p"),
        # Legal as a double, 0 as the float32 the device computes with: every token masked.
        (SamplingParams(1, top_p=1e-300), "top_p"),
        (SamplingParams(1, top_k=-1), "top_k"),
        (SamplingParams(1, top_k=2**31), "top_k"),  # overflows the slot's int32
        (SamplingParams(1, seed=-3), "seed"),
        (SamplingParams(1, stop_token_ids=(-1,)), "stop_token_ids"),
        (SamplingParams(1, stop_token_ids=tuple(range(65))), "at most 64"),
        (SamplingParams(1, min_p=1.5), "min_p"),
        (SamplingParams(1, min_p=1e-300), "min_p"),
        (SamplingParams(4, min_tokens=5), "min_tokens"),
        (SamplingParams(1, presence_penalty=2.5), "presence_penalty"),
        (SamplingParams(1, frequency_penalty=-3.0), "frequency_penalty"),
        (SamplingParams(1, repetition_penalty=0.0), "repetition_penalty"),
        (SamplingParams(1, logit_bias=((5, 101.0),)), r"logit_bias\[5\]"),
        (SamplingParams(1, logit_bias=((5, 1.0), (5, 2.0))), "twice"),
        (SamplingParams(1, logit_bias=((-1, 1.0),)), "logit_bias token id"),
        (SamplingParams(1, logprobs=21), "logprobs"),
        (SamplingParams(1, prompt_logprobs=-1), "prompt_logprobs"),
        (SamplingParams(1, n=0), "n must be"),
        (SamplingParams(1, stop=("",)), "stop string"),
        (SamplingParams(1, stop=("x" * 257,)), "stop string"),
        (SamplingParams(1, stop=("a",), detokenize=False), "need detokenize"),
        (SamplingParams(1, structured_output=StructuredOutput()), "exactly one of .* got none"),
        (
            SamplingParams(1, structured_output=StructuredOutput(regex="a", choice=("b",))),
            "got regex, choice",
        ),
        (SamplingParams(1, structured_output=StructuredOutput(choice=())), "at least one"),
        (SamplingParams(1, structured_output=StructuredOutput(choice=("",))), "non-empty"),
        (SamplingParams(1, structured_output=StructuredOutput(json="")), "non-empty"),
        (
            SamplingParams(1, structured_output=StructuredOutput(grammar="x" * 300_000)),
            "at most 262144",
        ),
        (SamplingParams(1, structured_output={"regex": "a"}), "must be a StructuredOutput"),  # type: ignore[arg-type]
    ],
)
def test_sampling_params_validation(params: SamplingParams, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        params.validate()
