"""A saved trace that cannot be used costs a compile, never a wrong answer or a failed start."""

from pathlib import Path

import torch

from cbpipe.worker.sampler import SamplingInputs, sample
from cbpipe.worker.saved_traces import SavedTraces, trace_digest


def _inputs(rows: int, vocab: int = 64) -> tuple[torch.Tensor, SamplingInputs]:
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows))
    params = SamplingInputs(
        temperature=torch.full((rows,), 0.7),
        seed=torch.arange(rows),
        output_index=torch.zeros(rows, dtype=torch.int32),
        all_greedy=False,
    )
    return logits, params


def test_the_name_holds_the_digest_of_the_traced_source(tmp_path: Path) -> None:
    traces = SavedTraces(tmp_path)
    assert traces.path("temperature") == tmp_path / f"temperature-{trace_digest()}.bin"
    assert traces.missing(("greedy", "temperature")) == ["greedy", "temperature"]
    traces.path("temperature").write_bytes(b"")
    assert traces.missing(("greedy", "temperature")) == ["greedy"]


def test_a_file_that_does_not_load_falls_back(tmp_path: Path) -> None:
    traces = SavedTraces(tmp_path)
    traces.path("temperature").write_bytes(b"not a trace")
    calls = []

    def fallback(*args):  # type: ignore[no-untyped-def]
        calls.append(args[0].shape[0])
        return sample(*args)

    traced = traces.compiled(sample, "temperature", fallback=fallback)
    for rows in (4, 3):
        args = _inputs(rows)
        assert torch.equal(traced(*args)[0], sample(*args)[0])
    assert traced.loaded is None and calls == [4, 3]


def test_a_writer_notes_a_function_it_cannot_trace_whole(tmp_path: Path) -> None:
    """A graph break fails ``aot_compile``: the writer notes the refusal, so that later starts
    count the trace as settled rather than fork processes to fail at it again."""

    def breaks(x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return x + 1

    writer = SavedTraces(tmp_path / "traces", writes=True)  # a folder not made yet
    traced = writer.compiled(breaks, "breaks", fallback=breaks)
    assert torch.equal(traced(torch.zeros(3)), torch.ones(3))
    assert traced.loaded is None
    assert not writer.path("breaks").exists()
    assert writer.missing(("breaks",)) == []
    reader = SavedTraces(tmp_path / "traces").compiled(breaks, "breaks", fallback=breaks)
    assert torch.equal(reader(torch.ones(2)), torch.full((2,), 2.0))


def test_a_writer_removes_what_other_versions_saved_under_its_name(tmp_path: Path) -> None:
    traces = SavedTraces(tmp_path)
    keep = [
        traces.path("full"),
        traces.path("full").with_suffix(".refused"),
        tmp_path / "full-top-k-top-p-0123456789abcdef.bin",  # another name's
        tmp_path / "notes.txt",
    ]
    stale = [tmp_path / "full-0123456789abcdef.bin", tmp_path / "full-fedcba9876543210.refused"]
    for file in keep + stale:
        file.write_bytes(b"")
    traces.remove_stale("full")
    assert sorted(tmp_path.iterdir()) == sorted(keep)
