"""Which decode bodies exist and the order they first run in (on the CPU, nothing captured)."""

from cbpipe.protocol.messages import SamplingMode, Step
from cbpipe.worker.cuda_graphs import DecodeGraphs, bucket_sizes, tuning_batch


def test_buckets_are_fine_at_the_bottom_and_end_at_the_largest_batch() -> None:
    assert bucket_sizes(6) == [1, 2, 4, 6]
    sizes = bucket_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256
    assert sizes == sorted(set(sizes))


def test_the_tuning_batch_is_the_smallest_bucket_of_at_least_32_rows() -> None:
    assert tuning_batch(bucket_sizes(256)) == 32
    assert tuning_batch([1, 2, 4, 8, 16, 24, 40, 48]) == 40
    assert tuning_batch([1, 2, 4, 6]) == 6  # none that large: the largest


def test_a_first_batch_runs_before_every_capture_in_both_modes() -> None:
    calls: list[tuple[str, int, bool]] = []
    graphs = DecodeGraphs()
    graphs.capture(
        lambda slot, batch, greedy: calls.append((slot, batch, greedy)),
        batch_sizes=[1, 2, 4, 8, 16, 32, 64],
        slots=["a", "b"],
        stream=None,
        first_batch=32,
    )
    assert calls == [("a", 32, True), ("a", 32, False)]  # the CPU runs bodies at replay only
    assert len(graphs) == 7 * 2 * 2
    step = Step(step=0, slot=1, num_tokens=20, num_seqs=20, num_single_token_seqs=20,
                max_query_len=1, max_context_len=100, block_table_width=8,
                carry_from_slot=None, sampling=SamplingMode.GREEDY, top_logprobs=False,
                prompt_logprobs=False, num_bias_entries=0)  # fmt: skip
    graphs.find(step).replay()
    assert calls[-1] == ("b", 32, True)
