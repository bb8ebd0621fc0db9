"""A client that makes its jobs' text gets what the engine would have sent: the same tokens,
text, streamed pieces and finishes, however late its cancel of a stopped sample reaches the
engine. Both sides run for real (the frontend and the scheduler core, the client's
``JobState``); only the device is replaced by the token sequences drawn here."""

from __future__ import annotations

from collections import deque
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from cbpipe.client.jobs import JobState
from cbpipe.detokenizer import Detokenizer
from cbpipe.protocol.messages import Cancel, Finished, Message, Submit, Tokens, encode
from cbpipe.protocol.sampling import SamplingParams
from cbpipe.scheduler.core import StepOutput
from cbpipe.scheduler.frontend import Frontend
from tests.unit.test_frontend import CLIENT, EOS, FakeSocket, make_frontend, tokenizer

WORDS = ["Return", " the", " list", " of", " all", " héllo", " 日本", "語", " ok", ".\n", " a"]


def _word_ids() -> list[list[int]]:
    return [list(tokenizer()(w, add_special_tokens=False).input_ids) for w in WORDS]


def _run(
    frontend: Frontend,
    socket: FakeSocket,
    params: SamplingParams,
    outputs: list[list[int]],
    state: JobState,
    cancel_delay: int,
) -> None:
    """Submit one job and step it to its end, sample ``i`` sampling ``outputs[i]`` in turn;
    every frame goes to ``state`` as it is sent, and a cancel ``state`` asks for reaches the
    engine ``cancel_delay`` steps later (a step or two is in flight when a client hears)."""
    socket.inbox.append([CLIENT, encode(Submit(1, [5, 6], params))])
    frontend.receive()
    delivered = 0
    cancels: deque[tuple[int, Cancel]] = deque()
    scheduler = frontend.scheduler
    step = 0

    def deliver() -> None:
        nonlocal delivered
        for message in socket.sent[delivered:]:
            _apply(state, message, step, cancels, cancel_delay)
        delivered = len(socket.sent)

    while scheduler.requests:
        while cancels and cancels[0][0] <= step:
            socket.inbox.append([CLIENT, encode(cancels.popleft()[1])])
            frontend.receive()
            deliver()
        plan = scheduler.schedule()
        if not plan.seqs:
            break
        ids = [
            outputs[s.req.sample_index][len(s.req.output_token_ids) % len(outputs[0])]
            for s in plan.seqs
        ]
        frontend.publish(scheduler.update(plan, StepOutput.of_ids(ids)))
        deliver()
        step += 1
    assert state.done


def _apply(
    state: JobState, message: Message, step: int, cancels: deque[tuple[int, Cancel]], delay: int
) -> None:
    if isinstance(message, Tokens):
        for entry in range(len(message.request_ids)):
            stopped = state.on_tokens(message, entry)
            if stopped is not None:
                cancels.append((step + delay, Cancel(1, stopped)))
    elif isinstance(message, Finished):
        state.on_finished(message)
    else:
        raise AssertionError(f"unexpected {message!r}")


def _seen(state: JobState) -> list[tuple[Any, ...]]:
    """Each sample's streamed tokens and text, and its result."""
    out = []
    for result in state.results():
        deltas = [d for d in state.deltas() if d.index == result.index]
        streamed_ids = [t for d in deltas for t in d.token_ids]
        streamed = "".join(d.text for d in deltas)
        finish = deltas[-1].finish_reason, deltas[-1].stop_reason
        out.append((result.token_ids, streamed_ids, result.text, streamed, result.finish_reason,
                    result.stop_reason, finish))  # fmt: skip
    return out


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_text_made_by_the_client_is_the_engines(data: st.DataObject) -> None:
    words = _word_ids()
    n = data.draw(st.integers(1, 2), label="n")
    outputs = []
    for _ in range(n):
        chosen = data.draw(st.lists(st.sampled_from(range(len(words))), min_size=1, max_size=8))
        ids = [t for w in chosen for t in words[w]]
        if data.draw(st.booleans(), label="ends at EOS"):
            ids.append(EOS)
        outputs.append(ids)
    # Every sample's sequence as long as the first's (they are sampled modulo its length).
    length = len(outputs[0])
    outputs = [(ids * length)[:length] for ids in outputs]
    text = tokenizer().decode(outputs[0], skip_special_tokens=True)
    stops = data.draw(
        st.lists(
            st.sampled_from(
                [text[i : i + k] for k in (1, 2, 4) for i in range(len(text))] or ["x"]
            ),
            max_size=2,
        ),  # fmt: skip
        label="stop",
    )
    stop_ids = data.draw(st.lists(st.sampled_from(outputs[0]), max_size=1), label="stop ids")
    max_new_tokens = data.draw(st.integers(1, length + 2), label="max_new_tokens")
    params = SamplingParams(
        max_new_tokens=max_new_tokens,
        n=n,
        stop=tuple(s for s in stops if s),
        stop_token_ids=tuple(stop_ids),
        min_tokens=data.draw(st.integers(0, min(3, max_new_tokens)), label="min_tokens"),
        include_stop_str_in_output=data.draw(st.booleans(), label="include"),
        skip_special_tokens=data.draw(st.booleans(), label="skip special"),
    )
    delay = data.draw(st.integers(0, 2), label="cancel delay")

    by_engine = JobState(1, params)
    _run(*make_frontend(with_tokenizer=True), params, outputs, by_engine, delay)
    here = JobState(1, params, Detokenizer(tokenizer()))
    _run(*make_frontend(with_tokenizer=True), params.without_text(), outputs, here, delay)
    assert _seen(here) == _seen(by_engine)
