"""The frame decoder accepts exactly the frames whose fields have their declared types.

The decoder turns each message's type hints into converters once, with fast paths for the
common shapes (a field whose wire type is already the declared one, lists of ints or floats
checked in one pass). These properties hold it to a plain reference reading of the hints:
for every message type, fields drawn valid or drawn from any msgpack value, ``decode``
succeeds exactly when every field conforms, returns the declared types (an int sent for a
float becomes a float; a bool is never an int), and fails with ``ProtocolError`` only.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cbpipe.protocol import PROTOCOL_VERSION, ProtocolError, decode
from cbpipe.protocol.messages import MESSAGE_TYPES, Message

INT64 = st.integers(-(2**63), 2**63 - 1)
SCALARS = st.one_of(
    st.none(), st.booleans(), INT64, st.floats(allow_nan=False), st.text(max_size=6)
)
ANY_VALUE = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)


def hints_of(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def conforms(hint: Any, value: Any) -> bool:  # noqa: PLR0911 - one case per type form
    """The reference: does the wire ``value`` have the declared type ``hint``?"""
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        return any(conforms(option, value) for option in get_args(hint))
    if hint is type(None):
        return value is None
    if origin is Literal:
        return value in get_args(hint)
    if origin in (list, tuple):
        args = get_args(hint)
        if not isinstance(value, list):
            return False
        if origin is tuple and args[-1:] != (Ellipsis,):
            return len(value) == len(args) and all(map(conforms, args, value))
        return all(conforms(args[0], v) for v in value)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return any(type(value) is type(m.value) and value == m.value for m in hint)
    if dataclasses.is_dataclass(hint):
        return isinstance(value, dict) and map_conforms(hint, value)  # type: ignore[arg-type]
    if hint is float:
        return type(value) in (int, float)
    return type(value) is hint  # bool, int, str: a bool is no int


def map_conforms(cls: type, raw: dict[str, Any]) -> bool:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = hints_of(cls)
    if not set(raw) <= set(fields):
        return False
    for name, f in fields.items():
        if name in raw:
            if not conforms(hints[name], raw[name]):
                return False
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            return False
    return True


def valid(hint: Any) -> st.SearchStrategy[Any]:  # noqa: PLR0911 - one case per type form
    """Wire values of type ``hint``."""
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        return st.one_of(*(valid(option) for option in get_args(hint)))
    if hint is type(None):
        return st.none()
    if origin is Literal:
        return st.sampled_from(get_args(hint))
    if origin in (list, tuple):
        args = get_args(hint)
        if origin is tuple and args[-1:] != (Ellipsis,):
            return st.tuples(*(valid(a) for a in args)).map(list)
        return st.lists(valid(args[0]), max_size=4)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return st.sampled_from([member.value for member in hint])
    if dataclasses.is_dataclass(hint):
        return fields_of(hint)  # type: ignore[arg-type]
    return {
        bool: st.booleans(),
        int: INT64,
        float: st.one_of(st.floats(allow_nan=False), INT64),
        str: st.text(max_size=6),
    }[hint]


def fields_of(cls: type) -> st.SearchStrategy[dict[str, Any]]:
    """A map of ``cls``'s fields, each valid, absent or any value; sometimes a stray key."""
    hints = hints_of(cls)

    @st.composite
    def build(draw: st.DrawFn) -> dict[str, Any]:
        raw: dict[str, Any] = {}
        for name, hint in hints.items():
            how = draw(st.sampled_from(["valid"] * 8 + ["absent", "any"]))
            if how == "valid":
                raw[name] = draw(valid(hint))
            elif how == "any":
                raw[name] = draw(ANY_VALUE)
        if draw(st.integers(0, 20)) == 0:
            raw[draw(st.text(max_size=4))] = draw(ANY_VALUE)
        return raw

    return build()


def decoded_types_match(hint: Any, value: Any) -> bool:
    """What ``decode`` returns has the declared Python types (tuples, enums, floats)."""
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        return any(decoded_types_match(option, value) for option in get_args(hint))
    if hint is float:
        return type(value) is float
    if origin is tuple:
        args = get_args(hint)
        if not isinstance(value, tuple):
            return False
        if args[-1:] == (Ellipsis,):
            return all(decoded_types_match(args[0], v) for v in value)
        return all(map(decoded_types_match, args, value))
    if origin is list:
        return isinstance(value, list) and all(
            decoded_types_match(get_args(hint)[0], v) for v in value
        )
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return isinstance(value, hint)
    if dataclasses.is_dataclass(hint):
        return isinstance(value, hint) and all(  # type: ignore[arg-type]
            decoded_types_match(h, getattr(value, name)) for name, h in hints_of(hint).items()
        )
    return conforms(hint, value)


MESSAGES = sorted(MESSAGE_TYPES.values(), key=lambda cls: cls.TYPE)


@pytest.mark.parametrize("cls", MESSAGES, ids=[cls.TYPE for cls in MESSAGES])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_decode_accepts_exactly_the_frames_of_the_declared_types(
    cls: type[Message], data: st.DataObject
) -> None:
    raw = data.draw(fields_of(cls))
    frame = msgpack.packb({"v": PROTOCOL_VERSION, "type": cls.TYPE, **raw})
    expected = map_conforms(cls, raw)
    try:
        message = decode(frame)
    except ProtocolError as exc:
        # A conforming frame may still fail the message's own consistency check.
        assert not expected or "differ in length" in str(exc), str(exc)
        return
    assert expected, f"accepted a frame the declared types refuse: {raw!r}"
    assert decoded_types_match(cls, message)


@given(prompt=st.lists(st.one_of(INT64, st.booleans(), st.floats(allow_nan=False)), max_size=6))
def test_a_prompt_of_ids_with_any_non_int_in_it_is_refused(prompt: list[Any]) -> None:
    params = {"max_new_tokens": 1}
    frame = msgpack.packb(
        {
            "v": PROTOCOL_VERSION,
            "type": "submit",
            "request_id": 1,
            "prompt": prompt,
            "params": params,
        }
    )
    if all(type(t) is int for t in prompt):
        assert decode(frame).prompt == prompt  # type: ignore[attr-defined]
    else:
        with pytest.raises(ProtocolError, match="submit.prompt: expected str or list of int"):
            decode(frame)
