"""The Triton greedy-sampling kernels against ``torch.argmax`` and ``torch.log_softmax``.

CPU cases run under Triton's interpreter in one subprocess (``tests/unit/triton_interpreter.py``
says why); small tiles there give many tiles and pieces on small vocabularies. The
``cbpipe::greedy_sample`` op's plain-torch fallback, its fake registration and its use under
``torch.compile`` are checked in this process. With CUDA the same cases (and Llama 3's 128256
vocabulary) run on the GPU, plus a check that a call never synchronises and a CUDA graph
replayed after rewriting the logits in place. ``pytest tests/unit/test_greedy_sample_kernel.py
-m gpu`` runs the GPU ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from tests.unit.triton_interpreter import (
    bounds_from_data,
    check_each,
    emit,
    needs_cuda,
    require_triton,
    run_interpreted,
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The log-probability of the chosen (largest) logit lies in [-log(vocab), 0] and is computed
# in float32 from exactly upcast inputs, whatever their dtype.
_ATOL = 1e-5


@dataclass(frozen=True)
class Case:
    name: str
    dtype: str
    rows: int
    vocab: int
    num_pieces: int | None = None  # None: default_num_pieces
    tile: int | None = None  # None: the module's default
    # "randn"; "ties": the row's maximum at several positions, across pieces and tiles;
    # "neg-inf": -inf entries, whole pieces and whole rows of them; "large": uniform in
    # +-1e4; "offset": randn + 1e4 (many ties once rounded to bf16).
    values: str = "randn"
    strided: bool = False  # rows as a view into a wider buffer, every other row, offset
    seed: int = 0


CPU_CASES = [
    Case("vocab1-fp32", "float32", 3, 1),
    Case("vocab7-tile4-fp32", "float32", 2, 7, num_pieces=4, tile=4),
    Case("vocab1000-one-short-tile-fp32", "float32", 5, 1000),
    Case("vocab1000-pieces-bf16", "bfloat16", 4, 1000, num_pieces=5, tile=64),
    Case("vocab4099-fp16", "float16", 3, 4099, num_pieces=3, tile=512),
    Case("vocab4099-auto-tail-piece-fp32", "float32", 1, 4099),
    Case("vocab32000-bf16", "bfloat16", 2, 32000, num_pieces=7, tile=512),
    Case("vocab32000-default-tile-fp32", "float32", 2, 32000, num_pieces=2),
    Case("rows33-fp32", "float32", 33, 300, num_pieces=3, tile=32),
    Case("ties-fp32", "float32", 6, 4099, num_pieces=5, tile=128, values="ties"),
    Case("ties-bf16", "bfloat16", 5, 1000, num_pieces=4, tile=64, values="ties"),
    Case("ties-one-piece-fp16", "float16", 4, 1000, num_pieces=1, tile=64, values="ties"),
    Case("neg-inf-fp32", "float32", 8, 1000, num_pieces=6, tile=32, values="neg-inf"),
    Case("neg-inf-fp16", "float16", 4, 4099, num_pieces=4, tile=256, values="neg-inf"),
    Case("neg-inf-vocab7", "float32", 4, 7, num_pieces=2, tile=2, values="neg-inf"),
    Case("strided-fp32", "float32", 5, 1000, num_pieces=3, tile=64, strided=True),
    Case("strided-ties-bf16", "bfloat16", 4, 4099, 4, 256, values="ties", strided=True),
    Case("large-fp32", "float32", 4, 4099, num_pieces=4, tile=256, values="large"),
    Case("large-fp16", "float16", 3, 1000, num_pieces=3, tile=64, values="large"),
    Case("offset-bf16", "bfloat16", 3, 1000, num_pieces=4, tile=64, values="offset"),
]
_LLAMA3 = 128256
GPU_CASES = [
    *CPU_CASES,
    Case("llama3-batch32-bf16", "bfloat16", 32, _LLAMA3),
    Case("llama3-batch1-fp32", "float32", 1, _LLAMA3),
    Case("llama3-batch33-fp16", "float16", 33, _LLAMA3),
    Case("llama3-ties-bf16", "bfloat16", 32, _LLAMA3, values="ties"),
    Case("llama3-neg-inf-bf16", "bfloat16", 8, _LLAMA3, values="neg-inf"),
    Case("llama3-strided-bf16", "bfloat16", 32, _LLAMA3, strided=True),
    Case("llama3-large-fp32", "float32", 4, _LLAMA3, values="large"),
    Case("llama3-offset-bf16", "bfloat16", 16, _LLAMA3, values="offset"),
    Case("batch1100-one-piece-bf16", "bfloat16", 1100, 32000),
]
# (rows, vocab, SMs) and the pieces per row the default rule should give.
PIECE_RULE = [
    ((32, _LLAMA3, 132), 32),
    ((33, _LLAMA3, 132), 32),
    ((1, _LLAMA3, 132), 126),
    ((0, _LLAMA3, 132), 126),
    ((64, _LLAMA3, 132), 16),
    ((256, _LLAMA3, 132), 5),
    ((2048, _LLAMA3, 132), 1),
    ((8, 32000, 132), 32),
    ((4, 1000, 132), 1),
    ((5, 4099, 1), 2),
]


def _set_ties(x: torch.Tensor, case: Case, gen: torch.Generator) -> None:
    """Put each row's new maximum at a few random positions, one tile after the first, and
    one a lane lower in the next tile (whose lane is then not the lowest index's)."""
    from cbpipe.worker.kernels.greedy_sample import _TILE

    tile = case.tile or _TILE
    value = float(x.max().ceil()) + 1.0  # an integer below 256: exact in every dtype
    for row in range(case.rows):
        positions = torch.randperm(case.vocab, generator=gen)[: 2 + row % 4].tolist()
        first = min(positions)
        positions += [p for p in (first + tile, first + tile - 3) if first < p < case.vocab]
        x[row, positions] = value


def _set_neg_inf(x: torch.Tensor, case: Case, gen: torch.Generator) -> None:
    """Row patterns in turn: scattered -inf, the first 60% -inf (whole pieces), one finite
    entry at the end, everything -inf."""
    for row in range(case.rows):
        pattern = row % 4
        if pattern == 0:
            x[row, torch.rand(case.vocab, generator=gen) < 0.5] = float("-inf")
        elif pattern == 1:
            x[row, : case.vocab * 3 // 5] = float("-inf")
        elif pattern == 2:
            x[row, :-1] = float("-inf")
        else:
            x[row] = float("-inf")


def make_logits(case: Case, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(case.seed)
    shape = (case.rows, case.vocab)
    if case.values == "large":
        x = (torch.rand(shape, generator=gen) * 2 - 1) * 1e4
    elif case.values == "offset":
        x = torch.randn(shape, generator=gen) + 1e4
    else:
        x = torch.randn(shape, generator=gen) * 3
    if case.values == "ties":
        _set_ties(x, case, gen)
    elif case.values == "neg-inf":
        _set_neg_inf(x, case, gen)
    x = x.to(_DTYPES[case.dtype])
    if case.strided:
        wide = torch.full((case.rows * 2, case.vocab + 13), 1e3, dtype=x.dtype)
        wide[::2, 5 : 5 + case.vocab] = x
        return wide.to(device)[::2, 5 : 5 + case.vocab]
    return x.to(device)


def compare(logits: torch.Tensor, ids: torch.Tensor, logprobs: torch.Tensor) -> dict[str, object]:
    """The properties the tests check, against torch's float32 argmax and log-softmax."""
    x = logits.float()
    want_ids = x.argmax(dim=-1)
    # The first index of the maximum, not relying on argmax's tie-breaking.
    positions = torch.arange(x.shape[-1], device=x.device).expand_as(x)
    first = torch.where(x == x.max(dim=-1, keepdim=True).values, positions, x.shape[-1])
    want_logprobs = x.log_softmax(dim=-1).gather(-1, want_ids[:, None])[:, 0]
    nan = want_logprobs.isnan()
    return {
        "ids_match": bool(torch.equal(ids, want_ids)),
        "ids_first": bool(torch.equal(ids, first.min(dim=-1).values)),
        "nan_match": bool(torch.equal(logprobs.isnan(), nan)),
        "max_err": (logprobs[~nan] - want_logprobs[~nan]).abs().max().item() if (~nan).any() else 0,
        "types_ok": ids.dtype == torch.int64
        and logprobs.dtype == torch.float32
        and ids.shape == logprobs.shape == (logits.shape[0],),
    }


def check_case(case: Case, device: torch.device) -> dict[str, object]:
    from cbpipe.worker.kernels.greedy_sample import _TILE, greedy_sample_triton

    logits = make_logits(case, device)
    ids, logprobs = greedy_sample_triton(
        logits, num_pieces=case.num_pieces, tile=case.tile or _TILE
    )
    return compare(logits, ids, logprobs)


def assert_result(case: Case, result: dict[str, Any]) -> None:
    assert "error" not in result, f"{case.name} raised:\n{result['error']}"
    assert result["types_ok"], f"{case.name}: wrong dtype or shape"
    assert result["ids_match"], f"{case.name}: ids differ from torch.argmax"
    assert result["ids_first"], f"{case.name}: ids are not the first index of the maximum"
    assert result["nan_match"], f"{case.name}: NaN log-probabilities where torch has none"
    assert result["max_err"] <= _ATOL, f"{case.name}: max error {result['max_err']}"


def _interpreter_main() -> None:
    """Subprocess entry: every CPU case under the interpreter, one JSON line on stdout."""
    emit(check_each(CPU_CASES, lambda case: check_case(case, torch.device("cpu"))))


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, Any]:
    return run_interpreted("tests.unit.test_greedy_sample_kernel")


def test_triton_is_importable() -> None:
    require_triton()


@bounds_from_data
@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.name)
def test_interpreter_matches_torch(case: Case, interpreter_results: dict[str, Any]) -> None:
    assert_result(case, interpreter_results[case.name])


@pytest.mark.parametrize(("sizes", "want"), PIECE_RULE, ids=str)
def test_default_piece_rule(sizes: tuple[int, int, int], want: int) -> None:
    from cbpipe.worker.kernels.greedy_sample import num_pieces_for

    assert num_pieces_for(*sizes) == want


def test_bad_logits_are_refused() -> None:
    from cbpipe.worker.kernels.greedy_sample import greedy_sample_triton

    with pytest.raises(ValueError, match="rows, vocab"):
        greedy_sample_triton(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="rows, vocab"):
        greedy_sample_triton(torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="empty vocabulary"):
        greedy_sample_triton(torch.zeros(2, 0))
    with pytest.raises(ValueError, match="num_pieces"):
        greedy_sample_triton(torch.zeros(2, 3), num_pieces=0)


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.name)
def test_op_falls_back_to_torch_on_cpu(case: Case) -> None:
    from cbpipe.worker.sampler import greedy_sample

    logits = make_logits(case, torch.device("cpu"))
    assert_result(case, compare(logits, *greedy_sample(logits)))


def test_fake_registration_shapes() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from cbpipe.worker.sampler import greedy_sample

    torch.library.opcheck(greedy_sample, (torch.randn(3, 50),))
    with FakeTensorMode():
        ids, logprobs = greedy_sample(torch.empty(5, 1000, dtype=torch.bfloat16))
    assert (ids.shape, ids.dtype) == ((5,), torch.int64)
    assert (logprobs.shape, logprobs.dtype) == ((5,), torch.float32)


def test_compiled_op_stays_opaque_on_cpu() -> None:
    """Under torch.compile(fullgraph=True) the op is one call in inductor's code, and off
    CUDA it computes the plain-torch result."""
    from torch._inductor.utils import run_and_get_code

    from cbpipe.worker.sampler import greedy_sample

    def step(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return greedy_sample(x.float() * 2.0)

    x = make_logits(Case("compiled", "bfloat16", 4, 1000, values="ties"), torch.device("cpu"))
    (ids, logprobs), code = run_and_get_code(torch.compile(step, fullgraph=True), x)
    assert "cbpipe.greedy_sample" in "\n".join(code)
    assert_result(Case("compiled", "float32", 4, 1000), compare(x.float() * 2.0, ids, logprobs))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name)
def test_gpu_matches_torch(case: Case) -> None:
    assert_result(case, check_case(case, torch.device("cuda")))


@pytest.mark.gpu
@needs_cuda
def test_gpu_op_matches_torch() -> None:
    import cbpipe.worker.sampler  # noqa: F401  (registers the op)

    case = Case("op", "bfloat16", 32, _LLAMA3, values="ties")
    logits = make_logits(case, torch.device("cuda"))
    assert_result(case, compare(logits, *torch.ops.cbpipe.greedy_sample(logits)))


@pytest.mark.gpu
@needs_cuda
def test_gpu_call_never_syncs() -> None:
    """After compiling, a call raises nothing under the strictest sync debug mode."""
    from cbpipe.worker.sampler import greedy_sample

    logits = make_logits(Case("sync", "bfloat16", 32, _LLAMA3), torch.device("cuda"))
    greedy_sample(logits)  # compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        greedy_sample(logits)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.gpu
@needs_cuda
def test_gpu_cuda_graph_replays_with_rewritten_logits() -> None:
    """Capture once; logits written in place are what a replay samples from."""
    from cbpipe.worker.sampler import greedy_sample

    device = torch.device("cuda")
    logits = torch.empty(32, _LLAMA3, dtype=torch.bfloat16, device=device)

    def fill(case: Case) -> None:
        logits.copy_(make_logits(case, device))

    fill(Case("graph-0", "bfloat16", 32, _LLAMA3))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        greedy_sample(logits)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids, logprobs = greedy_sample(logits)

    for values, seed in [("ties", 1), ("neg-inf", 2), ("large", 3)]:
        case = Case(f"graph-{values}", "bfloat16", 32, _LLAMA3, values=values, seed=seed)
        fill(case)
        ids.fill_(-1)
        logprobs.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_result(case, compare(logits, ids, logprobs))


if __name__ == "__main__":
    _interpreter_main()
