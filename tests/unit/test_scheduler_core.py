"""The scheduling policy with fake step results: no model, no sockets."""

from __future__ import annotations

import random

from cbpipe.protocol.sampling import SamplingParams
from cbpipe.scheduler.block_manager import BlockManager
from cbpipe.scheduler.core import Scheduler, StepOutput, StepPlan
from cbpipe.scheduler.request import Request, RequestStatus

EOS = 2


def make_scheduler(
    num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8, max_batch_tokens: int = 32
) -> Scheduler:
    return Scheduler(
        BlockManager(num_blocks, block_size),
        max_num_seqs=max_num_seqs,
        max_batch_tokens=max_batch_tokens,
    )


def make_request(request_id: int, num_prompt: int, max_new_tokens: int = 4, **params) -> Request:
    return Request(
        request_id,
        list(range(10, 10 + num_prompt)),
        SamplingParams(max_new_tokens, **params),
        seed=0,
        max_total_tokens=1000,
        eos_token_ids=frozenset({EOS}),
    )


def fake_tokens(plan: StepPlan, token: int = 5) -> list[int]:
    return [token] * len(plan.seqs)


def test_prefill_is_chunked_by_the_token_budget_and_decodes_come_first() -> None:
    scheduler = make_scheduler(max_batch_tokens=10)
    long, short = make_request(1, 25), make_request(2, 3)
    scheduler.add_request(long)
    plan = scheduler.schedule()
    assert [(s.req, s.num_query_tokens, s.samples) for s in plan.seqs] == [(long, 10, False)]
    scheduler.update(plan, StepOutput.of_ids(fake_tokens(plan)))
    scheduler.add_request(short)
    plan = scheduler.schedule()
    assert [(s.req, s.num_query_tokens) for s in plan.seqs] == [(long, 10)]
    scheduler.update(plan, StepOutput.of_ids(fake_tokens(plan)))
    plan = scheduler.schedule()  # 5 left of the long prompt, then the short one
    assert [(s.req, s.start, s.num_query_tokens, s.samples) for s in plan.seqs] == [
        (long, 20, 5, True),
        (short, 0, 3, True),
    ]
    scheduler.update(plan, StepOutput.of_ids(fake_tokens(plan)))
    plan = scheduler.schedule()
    assert [s.num_query_tokens for s in plan.seqs] == [1, 1]
    assert long.output_token_ids == [5]


def test_async_planning_carries_pending_tokens_from_the_previous_step() -> None:
    scheduler = make_scheduler()
    req = make_request(1, 3, max_new_tokens=3)
    scheduler.add_request(req)
    first = scheduler.schedule()
    second = scheduler.schedule()  # planned before the first step's token is known
    (seq,) = second.seqs
    assert seq.carry_src == 0 and seq.start == 3 and seq.output_index == 1
    assert req.num_pending_tokens == 2
    scheduler.update(first, StepOutput.of_ids([7]))
    third = scheduler.schedule()
    assert third.seqs[0].carry_src == 0 and third.seqs[0].output_index == 2
    scheduler.update(second, StepOutput.of_ids([8]))
    # Three tokens are planned: nothing more may be scheduled, even before they are known.
    assert not scheduler.has_work
    scheduler.update(third, StepOutput.of_ids([9]))
    assert req.output_token_ids == [7, 8, 9] and req.status is RequestStatus.FINISHED_LENGTH
    assert scheduler.is_idle and scheduler.blocks.num_free_blocks == 64


def test_three_steps_deep_each_row_carries_the_previous_steps_token() -> None:
    scheduler = make_scheduler()
    req = make_request(1, 3, max_new_tokens=4)
    scheduler.add_request(req)
    plans = [scheduler.schedule() for _ in range(3)]  # none of their tokens known yet
    assert [(s.start, s.carry_src, s.output_index) for p in plans for s in p.seqs] == [
        (0, None, 0),
        (3, 0, 1),
        (4, 0, 2),
    ]
    assert req.num_pending_tokens == 3 and req.pending_step == 2
    scheduler.update(plans[0], StepOutput.of_ids([7]))
    fourth = scheduler.schedule()
    assert [(s.start, s.carry_src, s.output_index) for s in fourth.seqs] == [(5, 0, 3)]
    for plan, token in zip([*plans[1:], fourth], [8, 9, 6], strict=True):
        scheduler.update(plan, StepOutput.of_ids([token]))
    assert req.output_token_ids == [7, 8, 9, 6] and req.status is RequestStatus.FINISHED_LENGTH


def test_a_request_left_out_of_the_last_step_waits_for_its_token() -> None:
    """Carry-over reads only the previous step's samples: a token pending from an older step
    cannot be carried, so the request sits out until that step's result is applied."""
    scheduler = make_scheduler(max_batch_tokens=4)
    short, long = make_request(1, 2, max_new_tokens=5), make_request(2, 6, max_new_tokens=5)
    scheduler.add_request(short)
    scheduler.add_request(long)
    step0 = scheduler.schedule()
    assert [(s.req, s.num_query_tokens) for s in step0.seqs] == [(short, 2), (long, 2)]
    # Put the long prompt first, as a re-admission after preemption can: its chunk then
    # takes the whole budget of step 1 and the short request, pending from step 0, sits out.
    scheduler.running.reverse()
    step1 = scheduler.schedule()
    assert [(s.req, s.num_query_tokens) for s in step1.seqs] == [(long, 4)]
    step2 = scheduler.schedule()  # budget left, but short's token is still two steps back
    assert [(s.req, s.carry_src) for s in step2.seqs] == [(long, 0)]
    scheduler.update(step0, StepOutput.of_ids([7, 0]))
    step3 = scheduler.schedule()
    assert [(s.req, s.start, s.carry_src) for s in step3.seqs] == [(long, 7, 0), (short, 2, None)]
    assert short.output_token_ids == [7]


def test_a_row_after_eos_is_wasted_not_applied() -> None:
    scheduler = make_scheduler()
    req = make_request(1, 2, max_new_tokens=10)
    scheduler.add_request(req)
    first = scheduler.schedule()
    second = scheduler.schedule()
    scheduler.update(first, StepOutput.of_ids([EOS]))
    assert req.status is RequestStatus.FINISHED_STOPPED
    assert req.stop_reason is None  # vLLM's: no stop reason at EOS
    assert scheduler.update(second, StepOutput.of_ids([11])) == []
    assert req.output_token_ids == [EOS]
    assert scheduler.blocks.num_free_blocks == 64


def test_stop_token_ids_and_ignore_eos() -> None:
    scheduler = make_scheduler()
    stops = make_request(1, 2, max_new_tokens=10, stop_token_ids=(6,))
    ignores = make_request(2, 2, max_new_tokens=2, ignore_eos=True)
    scheduler.add_request(stops)
    scheduler.add_request(ignores)
    plan = scheduler.schedule()
    scheduler.update(plan, StepOutput.of_ids([6, EOS]))
    assert stops.status is RequestStatus.FINISHED_STOPPED and stops.stop_reason == 6
    assert ignores.status is RequestStatus.RUNNING
    plan = scheduler.schedule()
    scheduler.update(plan, StepOutput.of_ids([EOS]))
    assert ignores.status is RequestStatus.FINISHED_LENGTH and ignores.output_token_ids == [EOS] * 2


def test_preemption_frees_the_newest_and_recomputes_it_later() -> None:
    # 6 blocks of 4 tokens; two requests of 8 prompt tokens take 4 blocks, then grow.
    scheduler = make_scheduler(num_blocks=5, block_size=4, max_batch_tokens=32)
    old, new = make_request(1, 8, max_new_tokens=8), make_request(2, 8, max_new_tokens=8)
    scheduler.add_request(old)
    scheduler.add_request(new)
    preempted = []
    for _ in range(40):
        if scheduler.is_idle:
            break
        plan = scheduler.schedule()
        preempted += plan.preempted
        scheduler.update(plan, StepOutput.of_ids(fake_tokens(plan)))
    assert new in preempted and old not in preempted
    assert old.output_token_ids == [5] * 8 and new.output_token_ids == [5] * 8
    assert scheduler.blocks.num_free_blocks == 5


def test_max_num_seqs_bounds_the_running_set() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    for i in range(5):
        scheduler.add_request(make_request(i, 2))
    plan = scheduler.schedule()
    assert len(plan.seqs) == 2 and len(scheduler.waiting) == 3


def test_cancel_frees_blocks_at_once_even_with_a_step_in_flight() -> None:
    scheduler = make_scheduler()
    req = make_request(1, 9)
    scheduler.add_request(req)
    plan = scheduler.schedule()
    assert scheduler.blocks.num_free_blocks == 64 - 3
    scheduler.cancel(1)
    assert req.status is RequestStatus.FINISHED_CANCELLED
    assert scheduler.blocks.num_free_blocks == 64 and scheduler.is_idle
    assert scheduler.update(plan, StepOutput.of_ids([5])) == []


def test_a_preempted_request_waits_for_its_pending_token() -> None:
    scheduler = make_scheduler(num_blocks=3, block_size=4, max_batch_tokens=16)
    a, b = make_request(1, 4, max_new_tokens=2), make_request(2, 4, max_new_tokens=6)
    scheduler.add_request(a)
    scheduler.add_request(b)
    first = scheduler.schedule()  # both prefill, 2 blocks
    second = scheduler.schedule()  # both decode: need 2 more blocks, 1 free: b is preempted
    assert b in second.preempted and b.num_pending_tokens == 1
    # b heads the waiting queue now, but its recompute needs the token still in flight.
    assert [s.req for s in second.seqs] == [a]
    scheduler.update(first, StepOutput.of_ids([5, 6]))
    assert b.output_token_ids == [6] and b.status is RequestStatus.PREEMPTED
    scheduler.update(second, StepOutput.of_ids([7]))
    third = scheduler.schedule()
    recompute = next(s for s in third.seqs if s.req is b)
    assert (recompute.start, recompute.num_query_tokens, recompute.samples) == (0, 5, True)


def test_block_table_rows_always_hold_each_running_requests_blocks() -> None:
    """Through admissions, growth past the matrix's first width, preemptions, finishes and
    cancellations, every planned sequence's row starts with exactly its block ids."""
    rng = random.Random(3)
    # Blocks of 1 token: tables grow every step and past BlockTables' initial 64 columns.
    scheduler = make_scheduler(num_blocks=150, block_size=1, max_num_seqs=6, max_batch_tokens=24)
    for i in range(30):
        scheduler.add_request(
            make_request(i, rng.randint(1, 40), max_new_tokens=rng.randint(1, 60))
        )
    in_flight: list[StepPlan] = []
    preemptions = 0
    while scheduler.requests:
        plan = scheduler.schedule()
        preemptions += len(plan.preempted)
        for seq in plan.seqs:
            ids = seq.req.block_ids
            assert seq.req.table_row is not None
            assert plan.block_tables[seq.req.table_row, : len(ids)].tolist() == ids
        rows = [s.req.table_row for s in plan.seqs]
        assert len(set(rows)) == len(rows)
        in_flight.append(plan)
        if len(in_flight) == 2 or not plan.seqs:
            oldest = in_flight.pop(0)
            scheduler.update(oldest, StepOutput.of_ids(fake_tokens(oldest)))
        if rng.random() < 0.02 and scheduler.running:
            scheduler.cancel(rng.choice(scheduler.running).request_id)
    assert preemptions > 0
    assert scheduler.tables.rows.shape[1] > 64
    assert sorted(scheduler.tables._free_rows) == list(range(6))


def test_cancelled_waiting_requests_leave_the_queue_at_its_head() -> None:
    scheduler = make_scheduler(max_num_seqs=8)
    reqs = [make_request(i, 3) for i in range(1, 6)]
    for req in reqs:
        scheduler.add_request(req)
    scheduler.cancel(2)
    scheduler.cancel(4)
    assert scheduler.num_waiting == 3
    plan = scheduler.schedule()
    assert [s.req.request_id for s in plan.seqs] == [1, 3, 5]
    assert scheduler.num_waiting == 0 and not scheduler.waiting


def test_a_cancelled_head_does_not_count_as_work() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request(1, 3))
    scheduler.cancel(1)
    assert not scheduler.has_work and scheduler.is_idle
