"""The sampled rows' Triton passes (``kernels/full_sample.py``) against ``sample_full_reference``.

CPU cases run under Triton's interpreter in one subprocess (``tests/unit/triton_interpreter.py``
says why), through the same ops the CUDA sampler calls, and at the kernels' level with small
tiles, so that rows of a few hundred tokens span many pieces. The interpreter computes in
numpy's IEEE float32, so there the processed rows must equal the reference's exactly and the
tokens must be the same. With CUDA the cases run on the GPU and Llama 3's vocabulary beside
them, against the reference on the GPU; plus a check that a call never synchronises and a CUDA
graph replayed after rewriting its inputs. ``pytest tests/unit/test_full_sample_kernel.py -m
gpu`` runs the GPU ones.
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

# lse and log-probabilities: float32 sums over the vocabulary, in pieces either way.
_ATOL = 1e-5


@dataclass(frozen=True)
class Case:
    name: str
    rows: int
    vocab: int
    dtype: str = "bfloat16"
    truncation: bool = False
    # "mixed": each row its own processing (penalties, bias, min-p, top-k/top-p, greedy);
    # "plain": none (as ``sample`` has it); "ties": plain, mostly greedy rows of integer
    # logits, whose maximum recurs across tiles and pieces; "bans": most of each row banned
    # by the bias, one row down to a single token, another a banned block of whole pieces;
    # "narrow": hot rows that top-k or top-p cut to a few tokens, so a draw past the cut
    # shows; "nan": mixed, with NaN logits in some rows (a broken model's), whose tokens are
    # unspecified but must be tokens, the other rows the reference's.
    processing: str = "mixed"
    strided: bool = False  # the logits a view of every other row of a wider buffer
    tile: int | None = None  # None: through the ops at the module's tile; else the kernels
    seed: int = 0


CPU_CASES = [
    Case("mixed", 8, 5000),
    Case("mixed-truncation", 8, 5000, truncation=True),
    Case("mixed-fp32-strided", 6, 4099, dtype="float32", strided=True),
    Case("mixed-fp16-truncation", 6, 4099, dtype="float16", truncation=True),
    Case("mixed-truncation-strided", 6, 4099, truncation=True, strided=True),
    Case("plain", 5, 3000, processing="plain"),
    Case("ties", 6, 3000, processing="ties"),
    Case("ties-small-tiles", 6, 300, processing="ties", tile=16),
    Case("bans", 6, 5000, processing="bans"),
    Case("bans-truncation", 6, 5000, truncation=True, processing="bans"),
    Case("narrow", 8, 5000, truncation=True, processing="narrow"),
    Case("nan", 8, 5000, processing="nan"),
    Case("nan-truncation", 8, 5000, truncation=True, processing="nan"),
    Case("narrow-small-tiles", 8, 300, truncation=True, processing="narrow", tile=16),
    Case("small-tiles", 7, 300, tile=16),
    Case("small-tiles-truncation", 7, 300, truncation=True, tile=16, seed=1),
    Case("one-token", 3, 1, tile=16),
    Case("tiny-vocab-ragged", 4, 37, tile=8, truncation=True),
]
_LLAMA3 = 128_256
GPU_CASES = [
    *CPU_CASES,
    Case("llama3-mixed-64", 64, _LLAMA3),
    Case("llama3-truncation-64", 64, _LLAMA3, truncation=True),
    Case("llama3-plain-1", 1, _LLAMA3, processing="plain"),
    Case("llama3-truncation-1", 1, _LLAMA3, truncation=True),
    Case("llama3-bans-strided-32", 32, _LLAMA3, processing="bans", strided=True),
    Case("llama3-truncation-256", 256, _LLAMA3, truncation=True),
]


def make_inputs(case: Case, device: torch.device) -> tuple[Any, ...]:
    """``(logits, bias, counts, seen, inputs)`` for ``sample_full``, the state with one row
    more than the batch (the spare), the rows' state rows shuffled."""
    from tests.unit.test_full_sampler import full_inputs

    gen = torch.Generator().manual_seed(case.seed)
    n, vocab = case.rows, case.vocab
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[
        case.dtype
    ]
    logits = (torch.randn(n, vocab, generator=gen) * 3).to(dtype)
    if case.processing == "ties":
        logits = torch.randint(0, 6, (n, vocab), generator=gen).to(dtype)
    if case.processing == "nan":
        logits[1, 17] = float("nan")
        logits[4] = float("nan")
        logits[6, vocab // 2 :] = float("nan")
    if case.strided:
        wide = torch.full((2 * n, vocab + 9), 7.0, dtype=dtype)
        wide[::2, 4 : 4 + vocab] = logits
        logits = wide[::2, 4 : 4 + vocab]
    bias = torch.zeros(n + 1, vocab)
    counts = torch.randint(0, 3, (n + 1, vocab), generator=gen).int() * (
        torch.rand(n + 1, vocab, generator=gen) < 0.05
    )
    seen = (counts > 0) | (torch.rand(n + 1, vocab, generator=gen) < 0.05)
    rows = torch.randperm(n + 1, generator=gen)[:n]

    def column(values: list[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.tensor([values[i % len(values)] for i in range(n)], dtype=dtype)

    if case.processing == "plain":
        inputs = full_inputs(n, temperature=column([0.7, 1.0, 0.0, 1.3]))
    elif case.processing == "ties":
        inputs = full_inputs(n, temperature=column([0.0, 0.0, 1.0]))
    elif case.processing == "narrow":
        inputs = full_inputs(
            n,
            temperature=column([3.0]),
            top_k=column([1, 2, 0, 3], torch.int32),
            top_p=column([1.0, 1.0, 0.05, 0.5]),
            truncation=True,
        )
    else:
        if case.processing == "bans":
            for i, row in enumerate(rows.tolist()):
                if i % 3 == 0:
                    bias[row] = float("-inf")
                    bias[row, (7 * i + 3) % vocab] = 0.0  # one token left
                elif i % 3 == 1:
                    bias[row, : vocab * 3 // 5] = float("-inf")  # whole pieces
                else:
                    bias[row, torch.rand(vocab, generator=gen) < 0.9] = float("-inf")
        else:
            bias[rows[1::4]] = torch.randn(len(rows[1::4]), vocab, generator=gen)
        inputs = full_inputs(
            n,
            temperature=column([0.7, 0.0, 1.0, 0.5, 1.3, 0.9, 0.0]),
            presence_penalty=column([0.0, 0.3, 0.0, 0.0, 0.5, 0.0]),
            frequency_penalty=column([0.0, 0.0, 0.2, 0.0, 0.0, 0.1]),
            repetition_penalty=column([1.0, 1.0, 1.0, 1.2, 1.0, 0.8]),
            min_p=column([0.3, 0.05, 0.0, 0.1, 0.0, 0.9]),
            top_p=column([0.9, 1.0, 0.8, 1.0, 1.0, 0.95]),
            top_k=column([0, 0, 0, 20, 0, 5], torch.int32),
            output_index=column([5, 0, 17], torch.int32),
            truncation=case.truncation,
        )
    inputs.rows.copy_(rows)
    inputs.seed.copy_(torch.randint(-(2**62), 2**62, (n,), generator=gen))
    moved = [t.to(device) for t in (logits, bias, counts, seen)]
    fields = {
        name: value.to(device) if isinstance(value, torch.Tensor) else value
        for name, value in vars(inputs).items()
    }
    return (*moved, type(inputs)(**fields))


def run_kernels(case: Case, args: tuple[Any, ...]) -> tuple[Any, torch.Tensor]:
    """The sample and the processed row the draw read (before top-k/top-p), through the ops
    (off CUDA the truncation op's cut is the sort's), or the kernels themselves at
    ``case.tile``, the truncation kernel's among them, composed as ``sample_full_kernels``."""
    from cbpipe.worker import sampler
    from cbpipe.worker.kernels import full_sample, truncation

    logits, bias, counts, seen, inputs = args
    if case.tile is None:
        result = sampler.sample_full_kernels(*args)
        scaled, _ = torch.ops.cbpipe.sample_prepare(logits, inputs.temperature, _state(args))
        return result, scaled
    scaled, stats = full_sample.prepare_triton(
        logits, inputs.temperature, tuple(_state(args)), tile=case.tile
    )
    before = scaled.clone()
    min_p, cut = inputs.min_p, None
    if case.truncation:  # the truncation kernel's cut, at sizes that reach its gather
        full_sample.apply_min_p_triton(scaled, stats, min_p, tile=case.tile)
        cut = truncation.top_k_top_p_cut_triton(
            scaled, inputs.top_k, inputs.top_p, block=case.tile, cap=16
        )
        min_p = None
    ids, logprobs, lse = full_sample.draw_triton(
        logits, scaled, stats, inputs.temperature, inputs.seed, inputs.output_index, min_p, cut,
        tile=case.tile,
    )  # fmt: skip
    return sampler.FullSample(ids, logprobs, lse), before


def _state(args: tuple[Any, ...]) -> list[torch.Tensor]:
    _, bias, counts, seen, inputs = args
    return [
        bias, counts, seen, inputs.rows, inputs.presence_penalty, inputs.frequency_penalty,
        inputs.repetition_penalty,
    ]  # fmt: skip


def reference_scaled(args: tuple[Any, ...]) -> torch.Tensor:
    from cbpipe.worker.sampler import apply_penalties

    logits, bias, counts, seen, inputs = args
    rows = inputs.rows
    processed = apply_penalties(
        logits.float() + bias[rows],
        counts[rows],
        seen[rows],
        presence=inputs.presence_penalty,
        frequency=inputs.frequency_penalty,
        repetition=inputs.repetition_penalty,
    )
    return processed / inputs.temperature.clamp_min(1e-6)[:, None]


def check_case(case: Case, device: torch.device) -> dict[str, object]:
    from cbpipe.worker import sampler

    args = make_inputs(case, device)
    want = sampler.sample_full_reference(*args)
    got, scaled = run_kernels(case, args)
    inputs = args[4]
    if case.processing == "nan":
        clean = ~args[0].float().isnan().any(-1)
        return {
            "ids_in_range": bool(((got.ids >= 0) & (got.ids < case.vocab)).all()),
            "clean_same": bool(torch.equal(got.ids[clean], want.ids[clean])),
        }
    greedy = inputs.temperature == 0
    result: dict[str, object] = {
        "ids_same": (got.ids == want.ids).float().mean().item(),
        "greedy_same": bool(torch.equal(got.ids[greedy], want.ids[greedy])),
        "lse_err": (got.lse - want.lse).abs().max().item(),
        "logprob_err": (got.logprobs - want.logprobs).abs().max().item(),
        "scaled_equal": bool(torch.equal(scaled, reference_scaled(args))),
        "types_ok": got.ids.dtype == torch.int64 and got.logprobs.dtype == torch.float32,
    }
    if case.processing in ("plain", "ties"):
        # ``sample`` through the same kernels draws what the full sampler drew, bit for bit.
        plain = sampler.SamplingInputs(
            inputs.temperature, inputs.seed, inputs.output_index, all_greedy=False
        )
        ids, logprobs = sampler.sample_kernels(args[0], plain)
        result["plain_same"] = bool(torch.equal(ids, got.ids))
        want_ids, want_logprobs = sampler.sample_reference(args[0], plain)
        result["plain_reference_same"] = (ids == want_ids).float().mean().item()
        result["plain_logprob_err"] = (logprobs - want_logprobs).abs().max().item()
    return result


def assert_result(case: Case, result: dict[str, Any], *, exact: bool) -> None:
    assert "error" not in result, f"{case.name} raised:\n{result['error']}"
    if case.processing == "nan":
        assert result["ids_in_range"], f"{case.name}: a token id outside the vocabulary"
        assert result["clean_same"], f"{case.name}: a row without NaN drew another token"
        return
    assert result["types_ok"], case.name
    assert result["greedy_same"], f"{case.name}: a greedy row's token differs"
    # On the GPU the noise's logarithms are Triton's and torch's: a draw between two tokens
    # within a rounding of each other may part.
    assert result["ids_same"] >= (1.0 if exact else 0.98), f"{case.name}: {result['ids_same']}"
    assert result["lse_err"] <= _ATOL, f"{case.name}: lse off by {result['lse_err']}"
    assert result["logprob_err"] <= _ATOL, f"{case.name}: logprob off by {result['logprob_err']}"
    if exact:  # float32 in numpy: the same operations, the same bits
        assert result["scaled_equal"], f"{case.name}: processed rows differ"
    if "plain_same" in result:
        assert result["plain_same"], f"{case.name}: sample and sample_full drew apart"
        assert result["plain_reference_same"] >= (1.0 if exact else 0.98), case.name
        assert result["plain_logprob_err"] <= _ATOL, case.name


def _interpreter_main() -> None:
    """Subprocess entry: every CPU case under the interpreter, one JSON line on stdout."""
    emit(check_each(CPU_CASES, lambda case: check_case(case, torch.device("cpu"))))


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, Any]:
    return run_interpreted("tests.unit.test_full_sample_kernel")


def test_triton_is_importable() -> None:
    require_triton()


def _interpreted(case: Case) -> Any:
    """The truncation kernel's loops run to bounds computed from the data."""
    if case.truncation and case.tile is not None:
        return pytest.param(case, marks=bounds_from_data, id=case.name)
    return pytest.param(case, id=case.name)


@pytest.mark.parametrize("case", [_interpreted(case) for case in CPU_CASES])
def test_interpreted_matches_the_reference(case: Case, interpreter_results: dict) -> None:
    assert_result(case, interpreter_results[case.name], exact=True)


def test_the_op_shapes_follow_from_the_vocabulary() -> None:
    """The fake shapes (what ``torch.compile`` plans with) are the launch's."""
    import cbpipe.worker.sampler  # noqa: F401  (registers the ops)
    from cbpipe.worker.kernels.full_sample import MAX_PIECES, TILE, num_pieces

    assert num_pieces(_LLAMA3) == 63
    assert num_pieces(1) == 1
    assert num_pieces(TILE * 2 * MAX_PIECES) == MAX_PIECES
    assert num_pieces(TILE * 2 * MAX_PIECES + 1) <= MAX_PIECES
    fake = torch._subclasses.FakeTensorMode()
    with fake:
        logits = torch.empty(3, _LLAMA3, dtype=torch.bfloat16)
        scaled, stats = torch.ops.cbpipe.sample_prepare(logits, torch.empty(3), [])
    assert scaled.shape == (3, _LLAMA3) and stats.shape == (5, 3, 63)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name)
def test_gpu_matches_the_reference(case: Case) -> None:
    assert_result(case, check_case(case, torch.device("cuda")), exact=False)


@pytest.mark.gpu
@needs_cuda
def test_gpu_compiled_sampler_never_syncs_and_replays_in_a_graph() -> None:
    """As the decode graphs run it: ``torch.compile``d, no host synchronisation in a call,
    and a CUDA graph replayed after its inputs are rewritten in place samples what an eager
    call on the new inputs samples."""
    from cbpipe.worker.compiling import compile_decode_fn
    from cbpipe.worker.sampler import sample_full

    case = Case("graph", 32, _LLAMA3, truncation=True)
    args = make_inputs(case, torch.device("cuda"))
    compiled = compile_decode_fn(sample_full)
    for _ in range(2):
        compiled(*args)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        compiled(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = compiled(*args)
    fresh = make_inputs(Case("graph", 32, _LLAMA3, truncation=True, seed=5), torch.device("cuda"))
    for target, source in zip(args[:4], fresh[:4], strict=True):
        target.copy_(source)
    for name, value in vars(fresh[4]).items():
        if isinstance(value, torch.Tensor):
            getattr(args[4], name).copy_(value)
    graph.replay()
    want = sample_full(*args)
    assert torch.equal(result.ids, want.ids)
    torch.testing.assert_close(result.lse, want.lse)


if __name__ == "__main__":
    _interpreter_main()
