"""The per-request device state's bookkeeping, step by step, as the runner drives it."""

from __future__ import annotations

import torch

from cbpipe.worker.sampling_state import SamplingState

VOCAB = 50


def state(rows: int = 3) -> SamplingState:
    return SamplingState.allocate(rows, VOCAB, torch.device("cpu"))


def chunk(s: SamplingState, row: int, tokens: list[int], start: int, num_prompt: int) -> None:
    """Count one sequence's rows ``tokens`` at positions ``start...``."""
    n = len(tokens)
    s.count_inputs(
        torch.full((n,), row),
        torch.tensor(tokens),
        torch.arange(start, start + n),
        torch.full((n,), num_prompt),
    )


def sampled(s: SamplingState, row: int, token: int, context_len: int, samples: bool = True) -> None:
    s.count_sampled(
        torch.tensor([row]),
        torch.tensor([token]),
        torch.tensor([context_len]),
        torch.tensor([samples]),
    )


def counts(s: SamplingState, row: int) -> dict[int, int]:
    nonzero = s.output_counts[row].nonzero()[:, 0].tolist()
    return {t: int(s.output_counts[row, t]) for t in nonzero}


def seen(s: SamplingState, row: int) -> set[int]:
    return set(s.seen[row].nonzero()[:, 0].tolist())


def test_prompt_chunks_then_decodes_count_each_token_once() -> None:
    s = state()
    chunk(s, 1, [4, 5, 4], start=0, num_prompt=5)
    sampled(s, 1, 9, context_len=3, samples=False)  # a chunk before the last: not an output
    chunk(s, 1, [6, 7], start=3, num_prompt=5)
    sampled(s, 1, 8, context_len=5)  # the first output
    assert counts(s, 1) == {8: 1} and seen(s, 1) == {4, 5, 6, 7, 8}
    for position, (carried, new) in enumerate([(8, 8), (8, 2), (2, 8)], start=5):
        chunk(s, 1, [carried], start=position, num_prompt=5)  # carried: counted when sampled
        sampled(s, 1, new, context_len=position + 1)
    assert counts(s, 1) == {8: 3, 2: 1}
    assert int(s.num_counted[1]) == 9
    assert not s.output_counts[[0, 2]].any() and not s.seen[[0, 2]].any()  # 3 is the spare


def test_a_prompt_of_one_token_is_seen_and_a_reset_forgets_everything() -> None:
    s = state()
    chunk(s, 0, [3], start=0, num_prompt=1)  # a decode-shaped row that is a prompt
    sampled(s, 0, 3, context_len=1)
    assert seen(s, 0) == {3} and counts(s, 0) == {3: 1}
    s.apply_bias(torch.tensor([0]), torch.tensor([7]), torch.tensor([float("-inf")]))
    s.reset(torch.tensor([0]))
    assert not s.seen[0].any() and not s.output_counts[0].any() and not s.bias[0].any()
    assert int(s.num_counted[0]) == 0


def test_a_recompute_after_preemption_rebuilds_the_same_row() -> None:
    before, after = state(), state()
    prompt, outputs = [1, 2, 3], [7, 7, 9]
    chunk(before, 2, prompt, start=0, num_prompt=3)
    sampled(before, 2, outputs[0], context_len=3)
    for i in range(1, len(outputs)):
        chunk(before, 2, [outputs[i - 1]], start=2 + i, num_prompt=3)
        sampled(before, 2, outputs[i], context_len=3 + i)
    # Preempted with all three outputs known, recomputed in another row, in two chunks; the
    # last chunk samples output number 3.
    after.reset(torch.tensor([0]))
    tokens = prompt + outputs
    chunk(after, 0, tokens[:4], start=0, num_prompt=3)
    sampled(after, 0, 11, context_len=4, samples=False)
    chunk(after, 0, tokens[4:], start=4, num_prompt=3)
    sampled(after, 0, 5, context_len=6)
    sampled(before, 2, 5, context_len=6)  # what the row would have sampled unpreempted
    assert torch.equal(after.output_counts[0], before.output_counts[2])
    assert torch.equal(after.seen[0], before.seen[2])
    assert int(after.num_counted[0]) == int(before.num_counted[2]) == 7


def test_padding_rows_touch_only_the_spare_row() -> None:
    s = state(2)
    spare = s.spare_row
    rows = torch.tensor([0, spare, spare])
    s.count_inputs(rows, torch.tensor([4, 5, 6]), torch.tensor([0, 0, 0]), torch.tensor([1, 0, 0]))
    s.count_sampled(
        rows, torch.tensor([9, 9, 9]), torch.tensor([1, 7, 7]), torch.tensor([True, False, False])
    )
    assert seen(s, 0) == {4, 9} and counts(s, 0) == {9: 1}
    assert not s.seen[1].any() and not s.output_counts[1].any()
    assert int(s.num_counted[1]) == 0


def test_bias_entries_apply_in_order_and_out_of_vocabulary_entries_are_dropped() -> None:
    s = state(2)
    s.apply_bias(
        torch.tensor([1, 1, 0, 1]),
        torch.tensor([4, 4, 4, VOCAB]),
        torch.tensor([float("-inf"), 2.5, -1.0, 3.0]),
    )
    assert s.bias[1, 4] == 2.5 and s.bias[0, 4] == -1.0
    assert int((s.bias[:2] != 0).sum()) == 2
    assert SamplingState.nbytes(256, 128256) == 257 * (128256 * 9 + 4)


def test_a_mask_rewrites_its_rows_bias_whole() -> None:
    """Bits set are tokens allowed (0), the rest -inf, whatever the row held; the columns past
    the mask's bits are banned; other rows are untouched."""
    s = state()
    s.apply_bias(torch.tensor([0, 0, 1]), torch.tensor([3, 40, 7]), torch.tensor([2.0, -1.0, 5.0]))
    words = torch.zeros(1, 1, dtype=torch.int32)  # 32 bits for a vocabulary of 50
    words[0, 0] = (1 << 3) | 1 | -(1 << 31)  # bit 31: the int32's sign bit
    s.apply_masks(torch.tensor([0]), words)
    allowed = (s.bias[0] == 0).nonzero()[:, 0].tolist()
    assert allowed == [0, 3, 31]
    assert torch.isneginf(s.bias[0]).sum() == VOCAB - 3
    assert s.bias[1, 7] == 5.0
    # The step's bias entries come after the mask: a logit bias on an allowed token.
    s.apply_bias(torch.tensor([0]), torch.tensor([3]), torch.tensor([1.5]))
    assert s.bias[0, 3] == 1.5 and s.bias[0, 0] == 0
