"""The scheduler's frontend with a fake socket and fake step results: jobs of several samples,
the text stage, stop strings and prompt log-probabilities, without a model or processes."""

from __future__ import annotations

import dataclasses
import select
from collections import deque
from functools import cache
from typing import Any

import numpy as np
import pytest
import zmq

from cbpipe.models import EMBEDDED_MODEL_DIR
from cbpipe.protocol.messages import (
    Cancel,
    Error,
    ErrorKind,
    Finished,
    Message,
    PromptLogprobs,
    Submit,
    TokenEnd,
    Tokens,
    decode,
    encode,
)
from cbpipe.protocol.sampling import MAX_TOP_LOGPROBS, SamplingParams
from cbpipe.scheduler.block_manager import BlockManager
from cbpipe.scheduler.core import Scheduler, StepOutput, StepPlan
from cbpipe.scheduler.frontend import Frontend, ModelInfo

CLIENT = b"client-1"
EOS = 1


class FakeSocket:
    def __init__(self) -> None:
        self.inbox: deque[list[bytes]] = deque()
        self.sent: list[Message] = []

    def recv_multipart(self, copy: bool = True) -> list[bytes]:
        return self.inbox.popleft()

    def send_multipart(self, parts: list[bytes], flags: int = 0) -> None:
        assert parts[0] == CLIENT
        self.sent.append(decode(parts[1]))

    def of_type(self, cls: type) -> list[Any]:
        return [m for m in self.sent if isinstance(m, cls)]


@cache
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR)


def make_frontend(with_tokenizer: bool = False) -> tuple[Frontend, FakeSocket]:
    socket = FakeSocket()
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_batch_tokens=64)
    model = ModelInfo("fake", 2048, 256, frozenset({EOS}))
    tok = tokenizer() if with_tokenizer else None
    return Frontend(socket, scheduler, model, tok), socket  # type: ignore[arg-type]


def submit(frontend: Frontend, socket: FakeSocket, request_id: int, prompt: Any, **params) -> None:
    socket.inbox.append([CLIENT, encode(Submit(request_id, prompt, SamplingParams(**params)))])
    frontend.receive()
    if frontend._preparing:
        # On the preparation thread (a text prompt, a constraint): wait for it, as the loop.
        assert frontend.preparation is not None
        assert select.select([frontend.preparation.fileno()], [], [], 30)[0]
        frontend.on_jobs_prepared()


def fake_output(plan: StepPlan, tokens: dict[int, int]) -> StepOutput:
    """Sampled ids by sample index (every sample of one job), logprob -0.5 each."""
    ids = [tokens.get(s.req.sample_index, 7) for s in plan.seqs]
    output = StepOutput.of_ids(ids)
    output.sampled_logprobs[:] = -0.5
    return output


def streamed(socket: FakeSocket, index: int = 0) -> list[int]:
    out: list[int] = []
    for frame in socket.of_type(Tokens):
        indices = frame.indices or [0] * len(frame.request_ids)
        for i, ids in zip(indices, frame.token_ids, strict=True):
            if i == index:
                out += ids
    return out


def test_results_applied_before_publishing_are_streamed_whole() -> None:
    """The loop applies step N+1's results before it streams step N's: a sample that N+1
    finished still streams N+1's token before its Finished."""
    frontend, socket = make_frontend()
    submit(frontend, socket, 1, [5, 6], max_new_tokens=3, ignore_eos=True)
    scheduler = frontend.scheduler
    plans = [scheduler.schedule() for _ in range(3)]
    updates = [
        scheduler.update(plan, fake_output(plan, {0: 10 + i})) for i, plan in enumerate(plans)
    ]
    for step_updates in updates:
        frontend.publish(step_updates)
    assert streamed(socket) == [10, 11, 12]
    (finished,) = socket.of_type(Finished)
    assert finished.finish_reason == "length"
    assert socket.sent[-1] == finished


def test_a_job_of_n_samples_streams_each_and_finishes_each() -> None:
    frontend, socket = make_frontend()
    submit(frontend, socket, 4, [5, 6, 7], max_new_tokens=2, ignore_eos=True, n=3, seed=9,
           temperature=1.0)  # fmt: skip
    reqs = list(frontend.scheduler.requests.values())
    assert [r.sample_index for r in reqs] == [0, 1, 2]
    assert reqs[0].seed == 9 and len({r.seed for r in reqs}) == 3  # seeded, and all differ
    scheduler = frontend.scheduler
    while scheduler.requests:
        plan = scheduler.schedule()
        frontend.publish(scheduler.update(plan, fake_output(plan, {0: 20, 1: 21, 2: 22})))
    assert [streamed(socket, i) for i in range(3)] == [[20, 20], [21, 21], [22, 22]]
    assert sorted(f.index for f in socket.of_type(Finished)) == [0, 1, 2]
    assert all(f.request_id == 4 for f in socket.of_type(Finished))


def test_cancelling_a_job_cancels_every_sample() -> None:
    frontend, socket = make_frontend()
    submit(frontend, socket, 1, [5, 6], max_new_tokens=50, n=2)
    frontend.scheduler.schedule()
    socket.inbox.append([CLIENT, encode(Cancel(1))])
    frontend.receive()
    assert frontend.scheduler.is_idle
    reasons = [(f.index, f.finish_reason) for f in socket.of_type(Finished)]
    assert sorted(reasons) == [(0, "cancelled"), (1, "cancelled")]
    assert frontend.scheduler.blocks.num_free_blocks == 64


def test_cancelling_one_sample_leaves_the_others_running() -> None:
    """A client that makes the text itself cancels the sample whose stop string it found."""
    frontend, socket = make_frontend()
    submit(frontend, socket, 1, [5, 6], max_new_tokens=3, n=3, ignore_eos=True)
    scheduler = frontend.scheduler
    plan = scheduler.schedule()
    frontend.publish(scheduler.update(plan, fake_output(plan, {})))
    socket.inbox.append([CLIENT, encode(Cancel(1, index=1))])
    frontend.receive()
    assert [(f.index, f.finish_reason) for f in socket.of_type(Finished)] == [(1, "cancelled")]
    socket.inbox.append([CLIENT, encode(Cancel(1, index=1))])  # again: already over
    socket.inbox.append([CLIENT, encode(Cancel(1, index=3))])  # no such sample
    frontend.receive()
    frontend.receive()
    (error,) = socket.of_type(Error)
    assert (error.request_id, error.kind) == (
        1,
        ErrorKind.REQUEST,
    ) and "no sample 3" in error.message
    while scheduler.requests:
        plan = scheduler.schedule()
        frontend.publish(scheduler.update(plan, fake_output(plan, {})))
    reasons = sorted((f.index, f.finish_reason) for f in socket.of_type(Finished))
    assert reasons == [(0, "length"), (1, "cancelled"), (2, "length")]
    assert [len(streamed(socket, i)) for i in range(3)] == [3, 1, 3]


def test_tokens_say_which_entries_end_their_samples() -> None:
    """``ends``: the sample's last token, and whether it is an EOS or stop token (whose text
    a client that makes the text leaves out); absent from frames where nothing ends."""
    frontend, socket = make_frontend()
    submit(frontend, socket, 1, [5, 6], max_new_tokens=2, ignore_eos=True)
    submit(frontend, socket, 2, [5, 6], max_new_tokens=9, stop_token_ids=(9,))
    submit(frontend, socket, 3, [5, 6], max_new_tokens=9, ignore_eos=True)
    scheduler = frontend.scheduler
    for step in range(2):
        plan = scheduler.schedule()
        ids = [9 if s.req.params.stop_token_ids and step == 1 else 7 for s in plan.seqs]
        frontend.publish(scheduler.update(plan, StepOutput.of_ids(ids)))
    first, second = socket.of_type(Tokens)
    assert first.ends is None
    assert second.ends is not None
    ends = dict(zip(second.request_ids, second.ends, strict=True))
    assert ends == {1: TokenEnd.LAST, 2: TokenEnd.STOP_TOKEN, 3: TokenEnd.MORE}


def run_sample_through(frontend: Frontend, ids: list[int]) -> None:
    """Step the frontend's requests to their ends, sample 0 sampling ``ids`` in turn (from
    the start again when they run out)."""
    scheduler = frontend.scheduler
    step = 0
    while scheduler.requests:
        plan = scheduler.schedule()
        frontend.publish(scheduler.update(plan, fake_output(plan, {0: ids[step % len(ids)]})))
        step += 1


def streamed_text(socket: FakeSocket) -> str:
    return "".join(t for frame in socket.of_type(Tokens) for t in frame.texts or [])


def test_a_stop_string_finishes_the_sample_and_is_not_returned() -> None:
    frontend, socket = make_frontend(with_tokenizer=True)
    text = "Return the list of all the elements"
    ids = tokenizer()(text, add_special_tokens=False).input_ids
    submit(frontend, socket, 1, "Return", max_new_tokens=40, stop=("of all",), ignore_eos=True)
    run_sample_through(frontend, ids)
    (finished,) = socket.of_type(Finished)
    assert (finished.finish_reason, finished.stop_reason) == ("stop", "of all")
    assert finished.text == "Return the list "
    assert streamed_text(socket) == finished.text
    assert frontend.scheduler.is_idle and frontend.scheduler.blocks.num_free_blocks == 64


def test_min_tokens_holds_off_a_stop_string() -> None:
    """As vLLM: "the" completed by the 2nd output token (within min_tokens) ends nothing; the
    next "the" does."""
    frontend, socket = make_frontend(with_tokenizer=True)
    text = "Return the list of all the elements"
    ids = tokenizer()(text, add_special_tokens=False).input_ids
    submit(frontend, socket, 1, "Return", max_new_tokens=40, stop=("the",), min_tokens=2,
           ignore_eos=True)  # fmt: skip
    run_sample_through(frontend, ids)
    (finished,) = socket.of_type(Finished)
    assert (finished.finish_reason, finished.stop_reason) == ("stop", "the")
    assert finished.text == "Return the list of all "
    assert streamed_text(socket) == finished.text
    assert streamed(socket) == ids[:6]


def test_stop_reason_is_a_stop_token_and_none_at_eos() -> None:
    """vLLM's: the id of one of the job's stop tokens; None at EOS, even when EOS is one of
    them (EOS is checked first), unless the job ignores EOS."""
    frontend, socket = make_frontend()
    jobs = {1: {}, 2: {"stop_token_ids": (9,)}, 3: {"stop_token_ids": (EOS,)},
            4: {"stop_token_ids": (EOS,), "ignore_eos": True}}  # fmt: skip
    for request_id, params in jobs.items():
        submit(frontend, socket, request_id, [5, 6], max_new_tokens=4, **params)
    scheduler = frontend.scheduler
    plan = scheduler.schedule()
    ends = [9 if s.req.params.stop_token_ids == (9,) else EOS for s in plan.seqs]
    frontend.publish(scheduler.update(plan, StepOutput.of_ids(ends)))
    reasons = {f.request_id: (f.finish_reason, f.stop_reason) for f in socket.of_type(Finished)}
    assert reasons == {1: ("stop", None), 2: ("stop", 9), 3: ("stop", None), 4: ("stop", EOS)}


@pytest.mark.parametrize("ends_as", ["stop token", "EOS"])
def test_the_token_that_ends_a_sample_adds_no_text(ends_as: str) -> None:
    """vLLM's: the stop token (or EOS) that ends a sample stays in its tokens, but its text is
    neither returned nor streamed, and completes no stop string ("the list" here)."""
    frontend, socket = make_frontend(with_tokenizer=True)
    ids = tokenizer()("Return the list of all", add_special_tokens=False).input_ids
    ending = ids[2]  # " list": an ordinary word
    params: dict[str, Any] = {"stop_token_ids": (ending,)}
    if ends_as == "EOS":
        frontend.model = dataclasses.replace(frontend.model, eos_token_ids=frozenset({ending}))
        params = {}
    submit(frontend, socket, 1, "Return", max_new_tokens=40, stop=("the list",), **params)
    run_sample_through(frontend, ids)
    (finished,) = socket.of_type(Finished)
    stop_reason = ending if ends_as == "stop token" else None
    assert (finished.finish_reason, finished.stop_reason) == ("stop", stop_reason)
    assert finished.text == "Return the"
    assert streamed(socket) == ids[:3]
    # The text held back for the stop string is streamed with the last token.
    texts = [t for frame in socket.of_type(Tokens) for t in frame.texts or []]
    assert "".join(texts) == finished.text and texts[-1]


def test_text_held_back_for_stop_strings_is_streamed_at_a_length_limit() -> None:
    frontend, socket = make_frontend(with_tokenizer=True)
    ids = tokenizer()("Return the list of all", add_special_tokens=False).input_ids
    submit(frontend, socket, 1, "Return", max_new_tokens=4, stop=("never there",),
           ignore_eos=True)  # fmt: skip
    run_sample_through(frontend, ids)
    (finished,) = socket.of_type(Finished)
    assert (finished.finish_reason, finished.text) == ("length", "Return the list of")
    assert streamed_text(socket) == finished.text


def test_prompt_logprobs_are_sent_once_before_the_first_token() -> None:
    frontend, socket = make_frontend()
    submit(frontend, socket, 1, [5, 6, 7, 8], max_new_tokens=2, prompt_logprobs=2, n=2)
    scheduler = frontend.scheduler
    plan = scheduler.schedule()
    assert [s.prompt_logprobs for s in plan.seqs] == [True, False]  # one sample computes them
    output = fake_output(plan, {})
    rows = plan.num_tokens
    output.prompt_logprobs = -np.arange(rows, dtype=np.float32)
    output.prompt_top_ids = np.tile(np.arange(MAX_TOP_LOGPROBS, dtype=np.int32), (rows, 1))
    output.prompt_top_logprobs = np.full((rows, MAX_TOP_LOGPROBS), -1.0, np.float32)
    frontend.publish(scheduler.update(plan, output))
    plan = scheduler.schedule()
    frontend.publish(scheduler.update(plan, fake_output(plan, {})))
    (message,) = socket.of_type(PromptLogprobs)
    assert message.prompt_token_ids == [5, 6, 7, 8]
    assert message.logprobs == [0.0, -1.0, -2.0]  # rows 0-2 predict prompt tokens 1-3
    assert message.top_ids == [[0, 1]] * 3
    assert socket.sent.index(message) < socket.sent.index(socket.of_type(Tokens)[0])


def test_a_failing_handler_ends_its_message_not_the_engine(monkeypatch: Any) -> None:
    frontend, socket = make_frontend()
    calls = []

    def broken(req: Any) -> None:
        calls.append(req)
        raise RuntimeError("a bug")

    monkeypatch.setattr(frontend.scheduler, "add_request", broken)
    submit(frontend, socket, 1, [5, 6], max_new_tokens=3)
    (error,) = socket.of_type(Error)
    assert error.request_id == 1 and "RuntimeError" in error.message and calls
    monkeypatch.undo()
    submit(frontend, socket, 2, [5, 6], max_new_tokens=3)
    assert len(frontend.scheduler.requests) == 1  # the next request is served


def test_a_full_queue_refuses_jobs_as_busy() -> None:
    frontend, socket = make_frontend()
    frontend.max_waiting_requests = 2
    for request_id in (1, 2, 3):
        submit(frontend, socket, request_id, [5, 6], max_new_tokens=3)
    (error,) = socket.of_type(Error)
    assert (error.request_id, error.kind) == (3, ErrorKind.BUSY) and "busy" in error.message
    frontend.scheduler.schedule()  # both start: room in the queue again
    submit(frontend, socket, 4, [5, 6], max_new_tokens=3)
    assert len(socket.of_type(Error)) == 1


def test_a_job_cancelled_while_its_prompt_is_tokenized_ends_cancelled() -> None:
    frontend, socket = make_frontend(with_tokenizer=True)
    socket.inbox.append([CLIENT, encode(Submit(1, "Return the", SamplingParams(4, n=2)))])
    frontend.receive()
    socket.inbox.append([CLIENT, encode(Cancel(1))])
    frontend.receive()
    assert sorted((f.index, f.finish_reason) for f in socket.of_type(Finished)) == [
        (0, "cancelled"),
        (1, "cancelled"),
    ]
    assert frontend.preparation is not None
    assert select.select([frontend.preparation.fileno()], [], [], 30)[0]
    frontend.on_jobs_prepared()  # the finished prompt is dropped
    assert frontend.scheduler.is_idle


class GoneClientSocket(FakeSocket):
    """A ROUTER socket with ROUTER_MANDATORY, after the client's connection went away."""

    def send_multipart(self, parts: list[bytes], flags: int = 0) -> None:
        raise zmq.ZMQError(zmq.EHOSTUNREACH)


def test_a_gone_clients_jobs_are_cancelled_when_a_send_to_it_fails() -> None:
    frontend, socket = make_frontend()
    submit(frontend, socket, 1, [5, 6], max_new_tokens=50)
    submit(frontend, socket, 2, [7, 8], max_new_tokens=50)
    scheduler = frontend.scheduler
    frontend.socket = GoneClientSocket()
    plan = scheduler.schedule()
    frontend.publish(scheduler.update(plan, fake_output(plan, {})))
    assert len(scheduler.requests) == 2  # found out while streaming; cancelled after
    frontend.cancel_gone_clients()
    assert scheduler.is_idle and scheduler.blocks.num_free_blocks == 64


def test_structured_output_is_compiled_per_job_and_followed_per_sample() -> None:
    from cbpipe.protocol.sampling import StructuredOutput
    from cbpipe.scheduler.structured import Grammars

    frontend, socket = make_frontend(with_tokenizer=True)
    frontend.grammars = Grammars(tokenizer(), 2048, {EOS})
    params = SamplingParams(4, n=2, structured_output=StructuredOutput(regex="[0-9]+"))
    socket.inbox.append([CLIENT, encode(Submit(1, [5, 6], params))])
    frontend.receive()
    # Compiled on the preparation thread, off the loop: not a request until the loop hears.
    assert not frontend.scheduler.requests
    assert frontend.preparation is not None
    assert select.select([frontend.preparation.fileno()], [], [], 30)[0]
    frontend.on_jobs_prepared()
    reqs = list(frontend.scheduler.requests.values())
    assert len(reqs) == 2 and all(r.grammar is not None for r in reqs)
    assert reqs[0].grammar is not reqs[1].grammar  # each sample walks the grammar alone
    submit(frontend, socket, 2, [5], max_new_tokens=4,
           structured_output=StructuredOutput(regex="a(b"))  # fmt: skip
    submit(frontend, socket, 3, [5], max_new_tokens=4,
           structured_output=StructuredOutput(json='{"type": "nosuch"}'))  # fmt: skip
    errors = {e.request_id: e.message for e in socket.of_type(Error)}
    assert "invalid structured_output.regex" in errors[2] and "unclosed group" in errors[2]
    assert "invalid structured_output.json" in errors[3] and "nosuch" in errors[3]
    assert len(frontend.scheduler.requests) == 2


def test_structured_output_without_a_compiler_is_refused_with_the_reason() -> None:
    from cbpipe.protocol.sampling import StructuredOutput

    frontend, socket = make_frontend()
    frontend.grammars = "model fake has no tokenizer: structured output needs one"
    submit(frontend, socket, 1, [5], max_new_tokens=4,
           structured_output=StructuredOutput(choice=("a", "b")))  # fmt: skip
    (error,) = socket.of_type(Error)
    assert error.kind is ErrorKind.REQUEST and "has no tokenizer" in error.message
    assert not frontend.scheduler.requests
