"""The sampling state's update kernels (``kernels/state_counts.py``) against the torch
definitions (``SamplingState.count_inputs_reference``, ``count_sampled_reference``).

Each case runs several steps on two copies of one state, the kernels on one and torch on the
other, and compares every request's row after each (the spare row, which the two use
differently and no request reads, is left out). The steps hold what a server's do: decode
rows (one a sequence, the carried-over token at a position already counted), prompt chunks
of several rows a sequence that repeat tokens, outputs recomputed after a preemption (past
the prompt, not yet counted), padding rows sent to the spare row, sequences that sample and
chunks that do not. CPU cases run under Triton's interpreter in a subprocess
(``tests/unit/triton_interpreter.py``); with CUDA the same cases run on the GPU, and a CUDA
graph of both launches replays with new inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from tests.unit.triton_interpreter import check_each, emit, needs_cuda, run_interpreted


@dataclass(frozen=True)
class Case:
    name: str
    requests: int  # state rows, the spare one more
    vocab: int
    steps: int
    seed: int = 0


CASES = [
    Case("small", 6, 37, 6),
    Case("many-rows", 40, 300, 4, seed=1),  # more token rows than a kernel block
    Case("tiny-vocab", 3, 2, 5, seed=2),  # every token repeats
]


def make_state(case: Case, device: torch.device) -> Any:
    from cbpipe.worker.sampling_state import SamplingState

    return SamplingState.allocate(case.requests, case.vocab, device)


def random_step(case: Case, gen: torch.Generator, spare: int) -> tuple[dict, dict]:
    """One step's ``count_inputs`` and ``count_sampled`` arguments (CPU tensors)."""
    n_seqs = int(torch.randint(1, case.requests + 1, (1,), generator=gen))
    seq_rows = torch.randperm(case.requests, generator=gen)[:n_seqs]
    lengths = torch.randint(1, 6, (n_seqs,), generator=gen)  # token rows a sequence
    padding = int(torch.randint(0, 3, (1,), generator=gen))
    prompt = torch.randint(0, 12, (n_seqs,), generator=gen)
    starts = torch.randint(0, 15, (n_seqs,), generator=gen)
    rows, positions, prompts = [], [], []
    for i in range(n_seqs):
        for j in range(int(lengths[i])):
            rows.append(int(seq_rows[i]))
            positions.append(int(starts[i]) + j)
            prompts.append(int(prompt[i]))
    rows += [spare] * padding
    positions += [0] * padding
    prompts += [0] * padding
    tokens = torch.randint(0, case.vocab, (len(rows),), generator=gen)
    inputs = {
        "rows": torch.tensor(rows, dtype=torch.int64),
        "token_ids": tokens,
        "positions": torch.tensor(positions, dtype=torch.int64),
        "num_prompt_tokens": torch.tensor(prompts, dtype=torch.int32),
    }
    seq_rows = torch.cat([seq_rows, torch.full((padding,), spare)])
    sampled = {
        "rows": seq_rows,
        "sampled_ids": torch.randint(0, case.vocab, (len(seq_rows),), generator=gen),
        "context_lens": torch.randint(0, 20, (len(seq_rows),), generator=gen).int(),
        "samples": torch.rand(len(seq_rows), generator=gen) < 0.7,
    }
    return inputs, sampled


def check_case(case: Case, device: torch.device) -> dict[str, object]:
    kernels, torch_state = make_state(case, device), make_state(case, device)
    gen = torch.Generator().manual_seed(case.seed)
    spare = kernels.spare_row
    mismatches = []
    for step in range(case.steps):
        inputs, sampled = random_step(case, gen, spare)
        inputs = {k: v.to(device) for k, v in inputs.items()}
        sampled = {k: v.to(device) for k, v in sampled.items()}
        kernels.count_inputs(**inputs)
        torch_state.count_inputs_reference(**inputs)
        kernels.count_sampled(**sampled)
        torch_state.count_sampled_reference(**sampled)
        for name in ("seen", "output_counts", "num_counted"):
            got, want = getattr(kernels, name)[:spare], getattr(torch_state, name)[:spare]
            if not torch.equal(got.cpu(), want.cpu()):
                mismatches.append((step, name))
    return {
        "mismatches": mismatches,
        "counted": int(torch_state.output_counts[:spare].sum()),
        "seen": int(torch_state.seen[:spare].sum()),
    }


def assert_result(case: Case, result: dict[str, Any]) -> None:
    assert "error" not in result, f"{case.name} raised:\n{result['error']}"
    assert not result["mismatches"], f"{case.name}: (step, table) unlike torch's: {result}"
    assert result["counted"] > 0 and result["seen"] > 0, f"{case.name} counted nothing"


def _interpreter_main() -> None:
    """Subprocess entry: the cases on CPU tensors, through the kernels, interpreted."""
    from cbpipe.worker.kernels import state_counts
    from cbpipe.worker.sampling_state import SamplingState

    # Off CUDA the state takes the torch path: send the kernel side to the kernels.
    SamplingState.count_inputs = lambda self, **kw: state_counts.count_inputs_triton(  # type: ignore[method-assign]
        self.seen, self.output_counts, self.num_counted, **kw
    )
    SamplingState.count_sampled = lambda self, **kw: state_counts.count_sampled_triton(  # type: ignore[method-assign]
        self.seen, self.output_counts, self.num_counted, **kw
    )
    emit(check_each(CASES, lambda case: check_case(case, torch.device("cpu"))))


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, Any]:
    return run_interpreted("tests.unit.test_state_counts_kernel")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_interpreted_kernels_update_as_torch_does(
    case: Case, interpreter_results: dict[str, Any]
) -> None:
    assert_result(case, interpreter_results[case.name])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_gpu_kernels_update_as_torch_does(case: Case) -> None:
    assert_result(case, check_case(case, torch.device("cuda")))


@pytest.mark.gpu
@needs_cuda
def test_gpu_updates_replay_in_a_cuda_graph() -> None:
    """Captured once, replayed after the inputs are rewritten in place: the tables move as
    torch's do on the same inputs."""
    case = Case("graph", 16, 500, 1, seed=3)
    device = torch.device("cuda")
    kernels, torch_state = make_state(case, device), make_state(case, device)
    gen = torch.Generator().manual_seed(3)
    spare = kernels.spare_row
    inputs, sampled = random_step(case, gen, spare)
    inputs = {k: v.to(device) for k, v in inputs.items()}
    sampled = {k: v.to(device) for k, v in sampled.items()}
    kernels.count_inputs(**inputs)  # compiles outside the capture
    kernels.count_sampled(**sampled)
    for table in (kernels.seen, kernels.output_counts, kernels.num_counted):
        table.zero_()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels.count_inputs(**inputs)
        kernels.count_sampled(**sampled)
    for _ in range(3):
        fresh_inputs, fresh_sampled = random_step(case, gen, spare)
        n, s = len(inputs["rows"]), len(sampled["rows"])
        for name, value in fresh_inputs.items():  # same sizes: the first rows of a new step
            inputs[name].copy_(value[:n].to(device) if len(value) >= n else inputs[name])
        for name, value in fresh_sampled.items():
            sampled[name].copy_(value[:s].to(device) if len(value) >= s else sampled[name])
        graph.replay()
        torch_state.count_inputs_reference(**inputs)
        torch_state.count_sampled_reference(**sampled)
        torch.cuda.synchronize()
        for name in ("seen", "output_counts", "num_counted"):
            got, want = getattr(kernels, name)[:spare], getattr(torch_state, name)[:spare]
            assert torch.equal(got, want), name


if __name__ == "__main__":
    _interpreter_main()
