"""The Triton top-k/top-p kernel against the sort it replaces (``top_k_top_p_reference``).

CPU cases run under Triton's interpreter in one subprocess (``tests/unit/triton_interpreter.py``
says why), with small passes and a small sort capacity so that every path of the search runs
on small vocabularies: bisection by value and by key, the gather and sort, and a boundary
inside more ties than the sort holds. With CUDA the same cases and Llama 3's vocabulary run
on the GPU, plus a check that a call never synchronises and a CUDA graph replayed after
rewriting its inputs in place. ``pytest tests/unit/test_truncation_kernel.py -m gpu`` runs the
GPU ones.

Both the kernel and the sort sum float32 masses, each in its own order, so on a row of
128 k tokens they may cut a few tokens apart; ``compare`` checks the kernel against float64:
its kept tokens are a prefix of the order, of a length whose running mass is within
``_MASS_TOLERANCE`` of exact.
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

# How far (in probability) from top_p the float64 running mass at the kernel's cut may lie:
# float32 sums of 128 k terms in blocks, the kernel's, are good to about 1e-6.
_MASS_TOLERANCE = 1e-5
_LLAMA3 = 128256


@dataclass(frozen=True)
class Case:
    name: str
    rows: int
    vocab: int
    # "nan": every other row holds NaN or +inf (a broken model's), whose cut is unspecified
    # but must end and leave the clean rows beside it alone;
    # "randn": N(0, 3); "bf16": the same rounded to bfloat16 (ties by the dozen); "flat":
    # N(0, 0.01) (every token near every other); "tie-block": a block of 3/5 of the row at one
    # value near the top, more than the registers hold; "neg-inf": -inf scattered, most of a row,
    # all but one, all; "huge": a few logits at -1e30 and +-1e4 beside N(0, 3).
    values: str = "randn"
    # Per row in turn (0 and 1 keep all).
    top_k: tuple[int, ...] = (0,)
    top_p: tuple[float, ...] = (0.9,)
    block: int | None = None  # None: the module's defaults
    cap: int | None = None
    strided: bool = False
    seed: int = 0


_SMALL = {"block": 128, "cap": 32}
CPU_CASES = [
    Case("top-p", 6, 1500, top_p=(0.9, 0.5, 0.99, 0.1, 0.999, 1e-6), **_SMALL),
    Case("top-k", 6, 1500, top_k=(1, 7, 40, 1499, 1500, 5000), top_p=(1.0,), **_SMALL),
    Case(
        "top-k-then-top-p",
        6,
        1500,
        top_k=(40, 300, 2, 1, 1000, 0),
        top_p=(0.9, 0.5, 0.99, 0.3, 0.95, 0.8),
        **_SMALL,
    ),
    Case("bf16-ties", 6, 1500, "bf16", top_k=(0, 50, 0), top_p=(0.9, 0.8, 0.6), **_SMALL),
    Case("flat", 4, 1500, "flat", top_k=(0, 0, 700, 30), top_p=(0.9, 0.4, 0.7, 1.0), **_SMALL),
    Case(
        "tie-block",
        6,
        1500,
        "tie-block",
        top_k=(0, 0, 400, 0, 1200, 100),
        top_p=(0.5, 0.05, 1.0, 0.97, 0.6, 0.9),
        **_SMALL,
    ),
    Case("neg-inf", 8, 1500, "neg-inf", top_k=(0, 20, 0, 3), top_p=(0.9, 0.9, 1.0, 0.5), **_SMALL),
    Case("huge", 4, 1500, "huge", top_k=(0, 10, 0, 1400), top_p=(0.9, 0.9, 0.999, 0.5), **_SMALL),
    Case("strided", 4, 1000, top_k=(0, 30), top_p=(0.8, 0.95), strided=True, **_SMALL),
    Case("vocab1", 3, 1, top_k=(0, 1, 5), top_p=(0.5, 1.0, 0.9), block=2, cap=2),
    Case("nan", 8, 1500, "nan", top_k=(0, 0, 50, 50), top_p=(0.9, 0.9, 0.8, 0.8), **_SMALL),
    Case("defaults", 2, 3000, top_k=(0, 64), top_p=(0.9, 0.9)),
]
GPU_CASES = [
    *CPU_CASES,
    Case("llama3-top-p", 64, _LLAMA3, "bf16", top_p=(0.9, 0.95, 0.5, 0.99)),
    Case(
        "llama3-top-k-top-p",
        32,
        _LLAMA3,
        "bf16",
        top_k=(50, 0, 1000, 20),
        top_p=(0.95, 0.9, 0.8, 1.0),
    ),
    Case("llama3-flat", 16, _LLAMA3, "flat", top_p=(0.9, 0.5)),
    Case("llama3-tie-block", 8, _LLAMA3, "tie-block", top_k=(0, 30000), top_p=(0.5, 0.9)),
    Case("llama3-neg-inf", 8, _LLAMA3, "neg-inf", top_k=(0, 20), top_p=(0.9, 0.7)),
    Case("llama3-batch256", 256, _LLAMA3, top_k=(0, 40), top_p=(0.9, 0.95)),
    Case("llama3-nan", 16, _LLAMA3, "nan", top_k=(0, 0, 50, 50), top_p=(0.9, 0.9, 0.8, 0.8)),
]


def make_inputs(case: Case, device: torch.device) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(case.seed)
    shape = (case.rows, case.vocab)
    scale = 0.01 if case.values == "flat" else 3.0
    x = torch.randn(shape, generator=gen) * scale
    if case.values == "bf16":
        x = x.bfloat16().float()
    elif case.values == "tie-block":
        block = case.vocab * 3 // 5
        start = torch.randint(0, case.vocab - block + 1, (1,), generator=gen).item()
        x[:, start : start + block] = 5.0  # above most of N(0, 3), below its tail
    elif case.values == "neg-inf":
        for row in range(case.rows):
            pattern = row % 4
            if pattern == 0:
                x[row, torch.rand(case.vocab, generator=gen) < 0.5] = float("-inf")
            elif pattern == 1:
                x[row, : case.vocab * 4 // 5] = float("-inf")
            elif pattern == 2:
                x[row, 1:] = float("-inf")
            else:
                x[row] = float("-inf")
    elif case.values == "nan":
        for row in range(0, case.rows, 2):
            pattern = row // 2 % 4
            if pattern == 0:
                x[row, 7] = float("nan")
            elif pattern == 1:
                x[row] = float("nan")
            elif pattern == 2:
                x[row, ::2] = float("nan")
                x[row, 1::3] = float("inf")
            else:
                x[row, 3] = float("inf")
    elif case.values == "huge":
        x[:, ::97] = -1e30
        x[:, 5::101] = 1e4 * torch.sign(torch.randn(x[:, 5::101].shape, generator=gen))
    rows = torch.arange(case.rows)
    top_k = torch.tensor(case.top_k, dtype=torch.int32)[rows % len(case.top_k)]
    top_p = torch.tensor(case.top_p, dtype=torch.float32)[rows % len(case.top_p)]
    if case.strided:
        wide = torch.full((case.rows * 2, case.vocab + 13), 7.0)
        wide[::2, 5 : 5 + case.vocab] = x
        logits = wide.to(device)[::2, 5 : 5 + case.vocab]
    else:
        logits = x.to(device)
    return logits, top_k.to(device), top_p.to(device)


def allowed_counts(x: torch.Tensor, top_k: int, top_p: float) -> tuple[int, int]:
    """How many tokens of this row may stay: exactly what top-k and top-p keep in float64,
    give or take the tokens whose running mass lies within ``_MASS_TOLERANCE`` of ``top_p``."""
    values = x.double().sort(descending=True, stable=True).values
    finite = int((values > float("-inf")).sum())
    keep = finite if top_k <= 0 else min(top_k, finite)
    if top_p >= 1.0 or keep == 0:
        return keep, keep
    probs = values[:keep].softmax(-1)
    before = probs.cumsum(-1) - probs
    fewest = int((before < top_p - _MASS_TOLERANCE).sum())
    most = int((before < top_p + _MASS_TOLERANCE).sum())
    return max(fewest, 1), max(most, 1)


def compare(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, got: torch.Tensor
) -> dict[str, object]:
    """The kept tokens are a prefix of the order (logit descending, index ascending) of a
    length that float64 allows; and how many rows differ from the float32 sort's. Rows with
    NaN or +inf logits, whose cut is unspecified, are left out."""
    from cbpipe.worker.sampler import top_k_top_p_reference

    x, got = logits.float().cpu(), got.cpu()
    clean = ~(x.isnan() | (x == float("inf"))).any(-1)
    x, got, top_k, top_p = x[clean], got[clean], top_k.cpu()[clean], top_p.cpu()[clean]
    kept = got > float("-inf")
    order = x.sort(dim=-1, descending=True, stable=True).indices
    wrong = []
    for row in range(x.shape[0]):
        n = int(kept[row].sum())
        fewest, most = allowed_counts(x[row], int(top_k[row]), float(top_p[row]))
        prefix = torch.zeros_like(kept[row])
        prefix[order[row, :n]] = True
        if not (fewest <= n <= most and torch.equal(kept[row], prefix)):
            wrong.append((row, n, fewest, most))
    sort_kept = top_k_top_p_reference(x, top_k, top_p) > float("-inf")
    return {
        "shape_ok": got.shape == x.shape and got.dtype == torch.float32,
        "clean_rows": int(clean.sum()),
        "values_kept": bool(torch.equal(got[kept], x[kept])),
        "wrong_rows": wrong,
        "rows_unlike_the_sort": int((kept != sort_kept).any(-1).sum()),
    }


def check_case(case: Case, device: torch.device) -> dict[str, object]:
    from cbpipe.worker.kernels.truncation import top_k_top_p_cut_triton, top_k_top_p_triton

    logits, top_k, top_p = make_inputs(case, device)
    got = top_k_top_p_triton(logits, top_k, top_p, block=case.block, cap=case.cap)
    result = compare(logits, top_k, top_p, got)
    cut = top_k_top_p_cut_triton(logits, top_k, top_p, block=case.block, cap=case.cap)
    result["cut_masks_the_same"] = cut_masks_the_same(logits, cut, got)
    return result


def cut_masks_the_same(logits: torch.Tensor, cut: torch.Tensor, masked: torch.Tensor) -> bool:
    """The cut alone, applied as the sampler's draw applies it, masks what ``masked`` has."""
    from_cut = torch.where(kept_by_cut(logits.float(), cut), logits.float(), float("-inf"))
    same = (from_cut == masked) | (from_cut.isnan() & masked.isnan())
    return bool(same.all()) and cut.dtype == torch.int32


def kept_by_cut(x: torch.Tensor, cut: torch.Tensor) -> torch.Tensor:
    """``truncation.kept`` in torch: keys above the boundary's, and its ties up to ``last``."""
    bits = x.contiguous().view(torch.int32)
    key = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    idx = torch.arange(x.shape[-1], device=x.device)[None, :]
    boundary, last = cut[:, :1], cut[:, 1:]
    return (key > boundary) | ((key == boundary) & (idx <= last))


def assert_result(case: Case, result: dict[str, Any]) -> None:
    assert "error" not in result, f"{case.name} raised:\n{result['error']}"
    assert result["shape_ok"], f"{case.name}: wrong dtype or shape"
    assert result["values_kept"], f"{case.name}: a kept logit changed"
    assert result["cut_masks_the_same"], f"{case.name}: the cut alone keeps other tokens"
    assert not result["wrong_rows"], (
        f"{case.name}: (row, kept, fewest allowed, most allowed) of the rows that keep what "
        f"top-k and top-p do not: {result['wrong_rows']}"
    )


def _interpreter_main() -> None:
    """Subprocess entry: every CPU case under the interpreter, one JSON line on stdout."""
    emit(check_each(CPU_CASES, lambda case: check_case(case, torch.device("cpu"))))


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, Any]:
    return run_interpreted("tests.unit.test_truncation_kernel")


def test_triton_is_importable() -> None:
    require_triton()


# Its passes loop to the vocabulary, an argument the interpreter hands over as a tensor.
@bounds_from_data
@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.name)
def test_interpreter_matches_the_sort(case: Case, interpreter_results: dict[str, Any]) -> None:
    assert_result(case, interpreter_results[case.name])


def test_the_cases_reach_every_path() -> None:
    """The CPU cases cut inside a tie block longer than the sort capacity, keep everything,
    and keep a single token, so a kernel that skipped any of those paths would be seen."""
    kept = {}
    for case in CPU_CASES:
        logits, top_k, top_p = make_inputs(case, torch.device("cpu"))
        from cbpipe.worker.sampler import top_k_top_p_reference

        kept[case.name] = (top_k_top_p_reference(logits, top_k, top_p) > float("-inf")).sum(-1)
    block = 1500 * 3 // 5
    tie_rows = kept["tie-block"]
    assert ((tie_rows > 32) & (tie_rows < block)).any()  # a cut inside the ties
    assert (kept["top-k"] == 1500).any() and (kept["top-k"] == 1).any()
    assert (kept["flat"][:3] > 32).all()  # the search narrows by many steps


def test_the_reference_cut_masks_what_the_sort_masks() -> None:
    """``sampler.top_k_top_p_cut_reference`` (the cut op off CUDA): its cut, applied as the
    draw applies it, keeps exactly the sort's tokens, on rows with ties, -inf entries, rows
    kept whole and a row all -inf."""
    from cbpipe.worker.sampler import top_k_top_p_cut_reference, top_k_top_p_reference

    gen = torch.Generator().manual_seed(4)
    x = torch.randint(-3, 4, (8, 300), generator=gen).float()
    x[1, :200] = float("-inf")
    x[2] = float("-inf")
    x[3] += torch.randn(300, generator=gen)
    top_k = torch.tensor([0, 5, 3, 0, 40, 0, 1, 299], dtype=torch.int32)
    top_p = torch.tensor([0.5, 1.0, 0.9, 0.95, 1.0, 1.0, 0.3, 0.99])
    cut = top_k_top_p_cut_reference(x, top_k, top_p)
    want = top_k_top_p_reference(x, top_k, top_p)
    assert cut.dtype == torch.int32 and cut.shape == (8, 2)
    assert torch.equal(torch.where(kept_by_cut(x, cut), x, float("-inf")), want)


def test_bad_inputs_are_refused() -> None:
    from cbpipe.worker.kernels.truncation import top_k_top_p_triton

    k, p = torch.zeros(2, dtype=torch.int32), torch.ones(2)
    with pytest.raises(ValueError, match="rows, vocab"):
        top_k_top_p_triton(torch.zeros(2, 3, dtype=torch.bfloat16), k, p)
    with pytest.raises(ValueError, match="top_k and top_p"):
        top_k_top_p_triton(torch.zeros(3, 5), k, p)
    with pytest.raises(ValueError, match="power of two"):
        top_k_top_p_triton(torch.zeros(2, 5), k, p, cap=48)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name)
def test_gpu_matches_the_sort(case: Case) -> None:
    assert_result(case, check_case(case, torch.device("cuda")))


@pytest.mark.gpu
@needs_cuda
def test_gpu_op_takes_the_kernel_and_never_syncs() -> None:
    """Both ops, the masked rows and the cut alone."""
    from cbpipe.worker.sampler import _apply_top_k_top_p

    case = Case("op", 32, _LLAMA3, "bf16", top_k=(0, 50), top_p=(0.9, 0.8))
    logits, top_k, top_p = make_inputs(case, torch.device("cuda"))
    _apply_top_k_top_p(logits, top_k, top_p)  # compiles
    torch.ops.cbpipe.top_k_top_p_cut(logits, top_k, top_p)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = _apply_top_k_top_p(logits, top_k, top_p)
        cut = torch.ops.cbpipe.top_k_top_p_cut(logits, top_k, top_p)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    result = compare(logits, top_k, top_p, got)
    result["cut_masks_the_same"] = cut_masks_the_same(logits, cut, got)
    assert_result(case, result)


@pytest.mark.gpu
@needs_cuda
def test_gpu_cuda_graph_replays_with_rewritten_inputs() -> None:
    from cbpipe.worker.kernels.truncation import top_k_top_p_cut_triton, top_k_top_p_triton

    device = torch.device("cuda")
    first = Case("graph-0", 32, _LLAMA3, "bf16", top_k=(0, 50), top_p=(0.9, 0.8))
    logits, top_k, top_p = make_inputs(first, device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        top_k_top_p_triton(logits, top_k, top_p)  # compiles outside the capture
        top_k_top_p_cut_triton(logits, top_k, top_p)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = top_k_top_p_triton(logits, top_k, top_p)
        cut = top_k_top_p_cut_triton(logits, top_k, top_p)

    for case in [
        Case("graph-flat", 32, _LLAMA3, "flat", top_k=(0, 1000), top_p=(0.5, 0.9), seed=1),
        Case("graph-ties", 32, _LLAMA3, "tie-block", top_k=(0, 7), top_p=(0.6, 1.0), seed=2),
    ]:
        new_logits, new_k, new_p = make_inputs(case, device)
        logits.copy_(new_logits)
        top_k.copy_(new_k)
        top_p.copy_(new_p)
        got.fill_(float("nan"))
        cut.fill_(0)
        graph.replay()
        torch.cuda.synchronize()
        result = compare(logits, top_k, top_p, got)
        result["cut_masks_the_same"] = cut_masks_the_same(logits, cut, got)
        assert_result(case, result)


def knife_edge_top_p(
    cut_count: Any, rows: int, low: float = 0.5, high: float = 0.99
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, two adjacent float32 values of top-p between ``low`` and ``high`` at which the
    kept count changes: the second is where the kernel's comparison of the mass with
    ``top_p * Z`` just flips, the place float rounding decides. ``cut_count(top_p)`` gives
    each row's kept count; by bisection over float32's bit patterns (ordered like the
    values for positive floats)."""
    lo = torch.full((rows,), low).view(torch.int32).long()
    hi = torch.full((rows,), high).view(torch.int32).long()
    as_float = lambda bits: bits.to(torch.int32).view(torch.float32)  # noqa: E731
    count_lo = cut_count(as_float(lo))
    while bool((hi - lo > 1).any()):
        mid = (lo + hi) // 2
        count = cut_count(as_float(mid))
        lower = count == count_lo  # the flip lies above mid
        lo = torch.where(lower, mid, lo)
        hi = torch.where(lower, hi, mid)
    return as_float(lo), as_float(hi)


def test_knife_edges_are_where_the_count_changes() -> None:
    """The GPU test's bisection, on the sort: the two values it returns are adjacent floats,
    and the second keeps more tokens than the first."""
    from cbpipe.worker.sampler import top_k_top_p_reference

    logits, top_k, _ = make_inputs(Case("edge", 8, 3000, "bf16", seed=5), torch.device("cpu"))

    def cut_count(top_p: torch.Tensor) -> torch.Tensor:
        return (top_k_top_p_reference(logits, top_k, top_p) > float("-inf")).sum(-1)

    below, edge = knife_edge_top_p(cut_count, 8)
    assert torch.equal(torch.nextafter(below, torch.ones(8)), edge)
    assert (cut_count(edge) > cut_count(below)).all()


@pytest.mark.gpu
@needs_cuda
def test_gpu_the_cut_is_the_same_in_every_run_at_knife_edges() -> None:
    """Where a row's mass meets ``top_p`` to the last bit, the cut must not depend on the
    order the kernel's atomic gather leaves its candidates in: every run, and every
    tensor-parallel rank, cuts such a row alike. Rows peaked and flat, each at the top-p
    where its kept count changes and the float just below it, 64 runs."""
    from cbpipe.worker.kernels.truncation import top_k_top_p_cut_triton

    device = torch.device("cuda")
    for case in (
        Case("edge-peaked", 128, _LLAMA3, "bf16", seed=5),
        Case("edge-flat", 128, _LLAMA3, "flat", seed=6),
    ):
        logits, top_k, _ = make_inputs(case, device)

        def cut_count(
            top_p: torch.Tensor, logits: torch.Tensor = logits, top_k: torch.Tensor = top_k
        ) -> torch.Tensor:
            cut = top_k_top_p_cut_triton(logits, top_k, top_p.to(device))
            return kept_by_cut(logits, cut).sum(-1).cpu()

        below, edge = knife_edge_top_p(cut_count, case.rows)
        for top_p in (below.to(device), edge.to(device)):
            first = top_k_top_p_cut_triton(logits, top_k, top_p)
            runs = torch.stack([top_k_top_p_cut_triton(logits, top_k, top_p) for _ in range(64)])
            differ = (runs != first).any(-1).any(0)
            assert not differ.any(), (
                f"{case.name}: rows {differ.nonzero().flatten().tolist()} cut differently "
                f"in some of 64 runs at the same top-p"
            )


if __name__ == "__main__":
    _interpreter_main()
