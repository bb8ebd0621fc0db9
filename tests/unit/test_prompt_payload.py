"""What the client library takes as a prompt."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cbpipe.client import RequestError
from cbpipe.client.jobs import prompt_payload


@pytest.mark.parametrize(
    "prompt",
    [
        [5, 6, 7],
        (5, 6, 7),
        [np.int64(5), np.int32(6), 7],
        np.array([5, 6, 7]),
        torch.tensor([5, 6, 7]),
    ],
    ids=["list", "tuple", "numpy-ints", "numpy-array", "tensor"],
)
def test_token_ids_of_any_integer_kind_become_python_ints(prompt: object) -> None:
    ids = prompt_payload(prompt)
    assert ids == [5, 6, 7] and all(type(t) is int for t in ids)


@pytest.mark.parametrize(
    "prompt",
    [
        [5, True],
        [5.0, 6.0],
        np.array([5.0, 6.0]),
        np.array([[5, 6]]),  # a batch of one: which row is meant is the caller's to say
        torch.tensor([[5, 6]]),
        b"\x05\x06",
        {5: 6},
        5,
    ],
    ids=["bool", "floats", "float-array", "2-d-array", "2-d-tensor", "bytes", "dict", "int"],
)
def test_anything_else_is_refused(prompt: object) -> None:
    with pytest.raises(RequestError, match="a prompt must be"):
        prompt_payload(prompt)


def test_text_is_kept_as_it_is() -> None:
    assert prompt_payload("hello") == "hello"
