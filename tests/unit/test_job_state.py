"""A job's state in the client: what readers are handed as deltas, and what it keeps."""

from __future__ import annotations

import gc
from functools import cache
from typing import Any, cast

import pytest

from cbpipe.client.jobs import Delta, JobState, submit_frame
from cbpipe.detokenizer import Detokenizer
from cbpipe.models import EMBEDDED_MODEL_DIR
from cbpipe.protocol.messages import Finished, Submit, TokenEnd, Tokens, decode
from cbpipe.protocol.sampling import SamplingParams


def _finished(request_id: int, index: int = 0) -> Finished:
    return Finished(request_id, "length", None, num_prompt_tokens=3, index=index)


def test_deltas_are_what_each_step_added_with_the_finish_last() -> None:
    state = JobState(7, SamplingParams(n=2, max_new_tokens=3, logprobs=1))
    state.on_tokens(
        Tokens(
            [7, 7],
            [[5, 6], [9]],
            indices=[0, 1],
            texts=["ab", "c"],
            logprobs=[[-0.5, -0.25], [-1.0]],
            top_ids=[[[5], [6]], [[9]]],
            top_logprobs=[[[-0.5], [-0.25]], [[-1.0]]],
        ),
        0,
    )
    frame = Tokens([7], [[8]], indices=[1], texts=["d"], logprobs=[[-2.0]],
                   top_ids=[[[8]]], top_logprobs=[[[-2.0]]])  # fmt: skip
    state.on_tokens(frame, 0)
    state.on_finished(_finished(7, index=1))
    assert state.num_deltas == 3
    assert state.deltas() == [
        Delta(0, [5, 6], "ab", [-0.5, -0.25], [[(5, -0.5)], [(6, -0.25)]]),
        Delta(1, [8], "d", [-2.0], [[(8, -2.0)]]),
        Delta(1, [], "", finish_reason="length"),
    ]
    assert state.deltas(2) == [Delta(1, [], "", finish_reason="length")]
    assert state.deltas(3) == []
    # The frame's second entry (sample 1's first token) was never applied.
    assert state.samples[1].token_ids == [8]


def test_a_job_without_logprobs_gets_none_in_its_deltas() -> None:
    state = JobState(1, SamplingParams(max_new_tokens=4))
    state.on_tokens(Tokens([1], [[3, 4]], logprobs=[[]]), 0)
    state.on_finished(_finished(1))
    assert state.deltas() == [Delta(0, [3, 4], ""), Delta(0, [], "", finish_reason="length")]
    assert state.results()[0].token_ids == [3, 4]


def test_what_a_job_keeps_per_step_is_nothing_the_collector_tracks() -> None:
    """At 256 jobs a step, a client keeps a record per job per step for late readers; were
    those records objects the garbage collector tracks, its full collections would grow with
    every step, and their pauses would hold the thread that must keep up with the engine."""
    jobs, steps = 64, 500
    states = [JobState(i, SamplingParams(max_new_tokens=steps)) for i in range(jobs)]
    gc.collect()
    before = len(gc.get_objects())
    for step in range(steps):
        frame = Tokens(list(range(jobs)), [[1000 + step] for _ in range(jobs)])
        for entry, state in enumerate(states):
            state.on_tokens(frame, entry)
    gc.collect()
    grown = len(gc.get_objects()) - before
    assert grown < 0.05 * jobs * steps, f"{grown} tracked objects for {jobs * steps} entries"
    assert all(state.num_deltas == steps for state in states)
    assert states[3].deltas(steps - 1) == [Delta(0, [1000 + steps - 1], "")]


@cache
def _tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR)


def _text_here(stop: tuple[str, ...], **params: Any) -> JobState:
    """A job whose text this client makes, from the embedded model's tokenizer."""
    params.setdefault("max_new_tokens", 64)
    return JobState(1, SamplingParams(stop=stop, **params), Detokenizer(_tokenizer()))


def _ids(text: str) -> list[int]:
    return list(_tokenizer()(text, add_special_tokens=False).input_ids)


def test_a_stop_string_found_here_cuts_the_sample_and_asks_for_its_cancel() -> None:
    """A match inside a step's tokens keeps the tokens up to the one that completed it (and
    their log-probabilities); later tokens, which the engine made before it heard of the
    stop, are dropped; the engine's ``cancelled`` reads as the stop."""
    text = "Hello world, and some more words after it"
    ids = _ids(text)
    at = next(i for i in range(len(ids)) if "world" in _tokenizer().decode(ids[: i + 1]))
    state = _text_here(("world",), logprobs=0)
    logprobs = [-float(i) for i in range(len(ids))]
    assert state.on_tokens(Tokens([1], [ids], logprobs=[logprobs]), 0) == 0
    assert state.samples[0].token_ids == ids[: at + 1]
    assert state.samples[0].logprobs == logprobs[: at + 1]
    assert state.on_tokens(Tokens([1], [[ids[0]]], logprobs=[[-1.0]]), 0) is None
    state.on_finished(Finished(1, "cancelled", None, num_prompt_tokens=3))
    result = state.results()[0]
    assert (result.finish_reason, result.stop_reason) == ("stop", "world")
    assert result.text == "".join(d.text for d in state.deltas()) == "Hello "
    assert result.token_ids == ids[: at + 1]


@pytest.mark.parametrize("end", [TokenEnd.LAST, TokenEnd.STOP_TOKEN])
def test_the_last_token_streams_what_was_held_back(end: TokenEnd) -> None:
    """Text held back for a stop string goes out with the sample's last token, before its
    ``Finished``, as the engine streams it; an EOS or stop token adds none of its own."""
    text = "one two three four"
    ids = _ids(text)
    state = _text_here(("zzzz",))
    for token_id in ids[:-1]:
        assert state.on_tokens(Tokens([1], [[token_id]]), 0) is None
    before_last = _tokenizer().decode(ids[:-1])
    assert "".join(d.text for d in state.deltas()) == before_last[:-3]  # 3 held back
    seen = state.num_deltas
    state.on_tokens(Tokens([1], [[ids[-1]]], ends=[end]), 0)
    streamed = "".join(d.text for d in state.deltas())
    expected = text if end is TokenEnd.LAST else before_last
    assert streamed == expected
    assert state.deltas(seen)[0].token_ids == [ids[-1]]
    state.on_finished(Finished(1, "stop" if end is TokenEnd.STOP_TOKEN else "length", None, 3))
    assert state.results()[0].text == expected


def test_a_client_that_makes_the_text_asks_the_engine_for_ids_only() -> None:
    params, frame = submit_frame(1, [5, 6], 8, {"stop": ["x"], "n": 2}, 1 << 20, text_here=True)
    wire = decode(frame)
    assert isinstance(wire, Submit)
    assert (params.stop, params.detokenize) == (("x",), True)
    assert (wire.params.stop, wire.params.detokenize) == ((), False)
    assert wire.params == params.without_text()
    _, plain = submit_frame(1, [5, 6], 8, {"stop": ["x"]}, 1 << 20)
    assert cast(Submit, decode(plain)).params.stop == ("x",)
