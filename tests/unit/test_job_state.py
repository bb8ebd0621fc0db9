"""A job's state in the client: what readers are handed as deltas, and what it keeps."""

from __future__ import annotations

import gc

from cbpipe.client.jobs import Delta, JobState
from cbpipe.protocol.messages import Finished, Tokens
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
