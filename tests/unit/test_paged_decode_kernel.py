"""The Triton paged decode kernel against its plain-torch reference.

Without CUDA the kernel runs under Triton's CPU interpreter. ``TRITON_INTERPRET=1`` only takes
effect if it is set before the kernel module's ``@triton.jit`` decorators run, which a test
module cannot guarantee (another test may have imported the kernel already), so every CPU
case runs in one subprocess started with the variable set: ``python -m`` on this module. The
subprocess prints one JSON line of results; each parametrised test checks its own case.

With CUDA the same cases (and larger ones) run on the GPU in this process, plus a test that
captures the kernel in a CUDA graph and replays it after rewriting lengths, tables and width
in place. Run them with ``pytest tests/unit/test_paged_decode_kernel.py -m gpu``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any
from unittest import mock

import pytest
import torch

from tests.unit.triton_interpreter import (
    check_each,
    emit,
    needs_cuda,
    require_triton,
    run_interpreted,
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Worst absolute error allowed against the float32 reference (outputs are O(1)). 16-bit
# inputs round the probabilities and the output to 8 (bf16) or 11 (fp16) mantissa bits.
_ATOL = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 4e-3}


@dataclass(frozen=True)
class Case:
    name: str
    dtype: str
    block_size: int
    context_lens: tuple[int, ...]
    num_kv_heads: int
    group: int  # query heads per KV head
    head_dim: int
    num_splits: int | None
    spare_width: int = 3  # table entries per sequence beyond what its context needs
    strided_query: bool = False  # query as a view into a wider [num_seqs, ..., head_dim] buffer
    given_out: bool = False
    seed: int = 0
    # The layer's variant: a sliding window, a soft-cap, per-head sink logits.
    window: int | None = None
    softcap: float | None = None
    sinks: bool = False
    variant_matters: bool = True  # the variant moves the output (checked against the plain one)
    heads_per_program: int | None = None  # adjacent KV heads a program packs; None: the default
    # Each sequence's own key and value given apart, for the kernel to store (``NewRows``).
    new_rows: bool = False
    # The memory the launch allocates (the splits' state) starts as NaN, as garbage may: a
    # split that stores no state must not be read.
    poisoned_scratch: bool = False


def _edges(block_size: int) -> tuple[int, ...]:
    return (1, block_size - 1, block_size, block_size + 1)


_PACKED_WINDOW_SINKS = Case(
    "packed2-window-sinks-fp32",
    "float32",
    16,
    (1, 17, 130, 0, 64),
    4,
    4,
    64,
    2,
    window=20,
    sinks=True,
    heads_per_program=2,
)  # fmt: skip

CPU_CASES = [
    Case("edges-bs8-g1-fp32", "float32", 8, _edges(8), 2, 1, 64, 1),
    Case("edges-bs16-g4-fp32-split3", "float32", 16, _edges(16), 2, 4, 64, 3),
    Case("edges-bs32-g8-fp32-split2", "float32", 32, _edges(32), 1, 8, 64, 2),
    Case("tile-edges-bs16-fp32", "float32", 16, (63, 64, 65, 127, 128, 129, 257), 2, 4, 64, 2),
    Case("tiles-per-split-fp32", "float32", 16, (700, 300, 0, 1), 1, 4, 64, 3),
    Case("mix-bs8-g4-fp32-split4", "float32", 8, (0, 7, 200, 1, 65, 0, 33), 2, 4, 64, 4),
    Case("mix-bs16-g8-d128-fp32", "float32", 16, (200, 0, 17, 48), 1, 8, 128, 3),
    Case("mix-bs32-g1-d128-fp32", "float32", 32, (199, 5, 0, 96), 2, 1, 128, 1),
    Case("auto-splits-fp32", "float32", 16, (0, 3, 150, 64), 2, 4, 64, None),
    Case("more-splits-than-tiles", "float32", 8, (17, 1, 0, 70), 2, 4, 64, 7),
    # Most of 16 splits past short contexts attend nothing, in memory that starts as NaN.
    *[
        Case(
            f"empty-splits-poisoned{'-sinks' if sinks else ''}",
            "float32",
            16,
            (1, 0, 40, 3),
            2,
            4,
            64,
            16,
            sinks=sinks,
            poisoned_scratch=True,
        )
        for sinks in (False, True)
    ],
    Case("all-empty", "float32", 16, (0, 0, 0), 2, 4, 64, 3),
    Case("all-empty-one-split", "float32", 16, (0, 0), 2, 4, 64, 1),
    Case("head-dim-80", "float32", 16, (40, 0, 90), 2, 2, 80, 2),
    Case("wide-table-strided-query-out", "float32", 16, (30, 100), 2, 4, 64, 2, 9, True, True),
    Case("group-32", "float32", 16, (50, 7), 1, 32, 64, 2),
    Case("head-dim-256-bf16", "bfloat16", 16, (300, 0, 5), 1, 4, 256, 2),
    Case("edges-bs16-g4-bf16", "bfloat16", 16, _edges(16), 2, 4, 64, 1),
    Case("mix-bs8-g8-d128-bf16-split3", "bfloat16", 8, (0, 200, 9, 64), 1, 8, 128, 3),
    Case("mix-bs32-g1-bf16-split5", "bfloat16", 32, (33, 0, 180), 2, 1, 64, 5),
    Case("mix-bs16-g4-fp16-split2", "float16", 16, (70, 0, 15), 2, 4, 64, 2),
    # Sliding windows: ending inside a block (20 with blocks of 16) and on a tile edge, of one
    # key, larger than every context, split or not; contexts below, at and past the window.
    *[
        Case(
            f"window{w}-bs16-split{sp}",
            "float32",
            16,
            (1, 15, 16, 17, 20, 21, 40, 129, 300, 0),
            2,
            4,
            64,
            sp,
            window=w,
        )
        for w in (20, 64, 1)
        for sp in (1, 3)
    ],  # fmt: skip
    Case(
        "window-past-context",
        "float32",
        16,
        (5, 100, 0, 33),
        2,
        4,
        64,
        2,
        window=1000,
        variant_matters=False,
    ),  # fmt: skip
    Case("window7-bs8-g1-d128-split5", "float32", 8, (6, 7, 8, 90, 200), 2, 1, 128, 5, window=7),
    Case("softcap-fp32", "float32", 16, (1, 17, 130, 0), 2, 4, 64, 2, softcap=0.7),
    Case("sinks-fp32", "float32", 16, (1, 17, 130, 0), 2, 4, 64, 1, sinks=True),
    Case("sinks-fp32-split4", "float32", 16, (1, 17, 130, 0, 64), 2, 4, 64, 4, sinks=True),
    Case(
        "gemma2-like-bf16", "bfloat16", 16, (40, 0, 17, 150), 1, 2, 256, 2, window=24, softcap=1.5
    ),  # fmt: skip
    Case(
        "gpt-oss-like-bf16", "bfloat16", 16, (40, 0, 17, 150), 2, 4, 64, 3, window=32, sinks=True
    ),  # fmt: skip
    # Packed heads: one program for 1, 2 or 4 adjacent KV heads (the default packs head_dim
    # 64 in pairs, so the cases above with two KV heads of 64 run packed; these pin it).
    Case("unpacked-d64-fp32", "float32", 16, _edges(16), 2, 4, 64, 1, heads_per_program=1),
    Case("unpacked-d64-bf16-split3", "bfloat16", 16, (70, 0, 15), 4, 4, 64, 3, heads_per_program=1),
    Case("packed2-g1-fp32", "float32", 16, (1, 33, 0, 130), 4, 1, 64, 1, heads_per_program=2),
    Case(
        "packed4-d32-fp32-split3", "float32", 8, (0, 9, 100, 64), 4, 2, 32, 3, heads_per_program=4
    ),
    Case("packed4-g8-bf16", "bfloat16", 16, (50, 1, 129), 4, 8, 32, 2, heads_per_program=4),
    Case(
        "packed2-strided-query-out",
        "float32",
        16,
        (30, 100),
        4,
        4,
        64,
        2,
        9,
        True,
        True,
        heads_per_program=2,
    ),  # fmt: skip
    _PACKED_WINDOW_SINKS,
    Case(
        "packed2-softcap-bf16",
        "bfloat16",
        16,
        (40, 0, 150),
        2,
        2,
        64,
        1,
        softcap=0.7,
        heads_per_program=2,
    ),  # fmt: skip
    # Each row's own key and value given apart: the kernel attends them and stores them. The
    # slot holds stale data until then, only the split that owns the last position attends
    # and stores them, and rows with context 0 store nothing.
    Case("store-edges-fp32", "float32", 16, (*_edges(16), 0), 2, 4, 64, 1, new_rows=True),
    Case("store-split3-fp32", "float32", 16, (700, 300, 0, 1), 1, 4, 64, 3, new_rows=True),
    Case("store-split7-more-than-tiles", "float32", 8, (17, 1, 0, 70), 2, 4, 64, 7, new_rows=True),
    Case("store-head-dim-80", "float32", 16, (40, 0, 90), 2, 2, 80, 2, new_rows=True),
    Case(
        "store-unpacked-bf16",
        "bfloat16",
        16,
        (70, 0, 15),
        4,
        4,
        64,
        3,
        heads_per_program=1,
        new_rows=True,
    ),  # fmt: skip
    Case(
        "store-packed4-d32-fp32",
        "float32",
        8,
        (0, 9, 100, 64),
        4,
        2,
        32,
        3,
        heads_per_program=4,
        new_rows=True,
    ),  # fmt: skip
    replace(_PACKED_WINDOW_SINKS, name="store-packed2-window-sinks-fp32", new_rows=True),
    Case(
        "store-gemma2-like-bf16",
        "bfloat16",
        16,
        (40, 0, 17, 150),
        1,
        2,
        256,
        2,
        window=24,
        softcap=1.5,
        new_rows=True,
    ),  # fmt: skip
]

GPU_CASES = [
    *CPU_CASES,
    Case("llama8b-bf16-auto", "bfloat16", 16, (2048, 1, 0, 517, 4000, 16, 17), 8, 4, 128, None),
    Case("llama8b-bf16-split16", "bfloat16", 16, (8192, 3000, 0, 1), 8, 4, 128, 16),
    Case("llama8b-fp32-split4", "float32", 16, (1500, 33, 999), 8, 4, 128, 4),
    Case("batch64-bf16-bs32", "bfloat16", 32, tuple(range(0, 64 * 37, 37)), 8, 4, 128, None),
    Case("batch2-bf16-auto-many-splits", "bfloat16", 16, (5000, 77), 8, 4, 128, None),
    Case(
        "store-llama8b-bf16-auto",
        "bfloat16",
        16,
        (2048, 1, 0, 517, 4000, 16, 17),
        8,
        4,
        128,
        None,
        new_rows=True,
    ),  # fmt: skip
    Case(
        "store-batch2-bf16-many-splits",
        "bfloat16",
        16,
        (5000, 77),
        8,
        4,
        128,
        None,
        new_rows=True,
    ),  # fmt: skip
    Case(
        "store-llama1b-bf16-batch256",
        "bfloat16",
        16,
        tuple(range(1, 256 * 5, 5)),
        8,
        4,
        64,
        None,
        new_rows=True,
    ),  # fmt: skip
    Case("head-dim-256-fp32", "float32", 16, (1000, 3), 2, 4, 256, None),
    # Gemma 2 2B's attention (8 heads, 4 KV heads, head_dim 256, window 4096, soft-cap 50) and
    # gpt-oss's (64 heads, 8 KV heads, head_dim 64, window 128, sinks), at long contexts.
    Case(
        "gemma2-2b-window-bf16",
        "bfloat16",
        16,
        (8192, 4097, 4095, 1, 6000),
        4,
        2,
        256,
        None,
        window=4096,
        softcap=50.0,
    ),  # fmt: skip
    Case(
        "gemma2-2b-full-bf16-batch2",
        "bfloat16",
        16,
        (8192, 300),
        4,
        2,
        256,
        None,
        softcap=50.0,
        variant_matters=False,
    ),  # a cap of 50 barely touches scores of ~1
    Case(
        "gpt-oss-window-sinks-bf16",
        "bfloat16",
        16,
        (5000, 129, 128, 127, 1, 0),
        8,
        8,
        64,
        None,
        window=128,
        sinks=True,
    ),  # fmt: skip
    Case(
        "gpt-oss-full-sinks-bf16", "bfloat16", 16, (5000, 129, 1), 8, 8, 64, None, sinks=True
    ),  # fmt: skip
    # Llama-3.2-1B's attention at a server's batch, packed by default and not.
    Case("llama1b-bf16-batch256", "bfloat16", 16, tuple(range(1, 256 * 5, 5)), 8, 4, 64, None),
    Case(
        "llama1b-bf16-unpacked",
        "bfloat16",
        16,
        (640, 1, 0, 129),
        8,
        4,
        64,
        None,
        heads_per_program=1,
    ),  # fmt: skip
    Case(
        "llama1b-bf16-packed8", "bfloat16", 16, (640, 1, 0, 129), 8, 4, 64, 2, heads_per_program=8
    ),
]
# (sequence, KV head) pairs, SMs, and the split count the default heuristic should give.
SPLIT_HEURISTIC = [(256, 132, 1), (132, 132, 1), (2048, 132, 1), (128, 132, 3), (32, 132, 9)]
SPLIT_HEURISTIC += [(8, 132, 33), (1, 132, 64), (0, 132, 64), (5, 1, 1)]


@dataclass
class Inputs:
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    width: torch.Tensor
    context_lens: torch.Tensor
    out: torch.Tensor | None
    sinks: torch.Tensor | None
    new_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # keys, values, slots


def make_inputs(case: Case, device: torch.device) -> Inputs:
    """Random caches, and block tables that scatter each sequence over shuffled blocks."""
    gen = torch.Generator().manual_seed(case.seed)
    dtype = _DTYPES[case.dtype]
    num_seqs = len(case.context_lens)
    num_heads = case.num_kv_heads * case.group
    bs = case.block_size
    width = max(-(-n // bs) for n in case.context_lens) + case.spare_width
    num_blocks = num_seqs * width + 5
    shape = (num_blocks * bs, case.num_kv_heads, case.head_dim)
    key_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    value_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    # Distinct shuffled block ids fill every entry, including the unused tail of each row,
    # so a kernel that reads past a sequence's blocks picks up real (wrong) data.
    tables = torch.randperm(num_blocks, generator=gen)[: num_seqs * width].to(torch.int32)
    # A view into a larger header buffer, as the engine passes it.
    header = torch.tensor([7, width, 7], dtype=torch.int64, device=device)
    query_shape = (num_seqs, num_heads + 3 if case.strided_query else num_heads, case.head_dim)
    query = torch.randn(query_shape, generator=gen).to(dtype).to(device)[:, :num_heads]
    out = None
    if case.given_out:
        out = torch.full((num_seqs, num_heads, case.head_dim), float("nan"), dtype=dtype)
        out = out.to(device)
    # Sinks of the size of the scores, so some rows give them most of the weight.
    sinks = (2 * torch.randn(num_heads, generator=gen)).to(dtype).to(device) if case.sinks else None
    new_rows = None
    if case.new_rows:
        rows_shape = (case.num_kv_heads, num_seqs, case.head_dim)
        # The keys transposed from [kv_heads, rows, head_dim], as the model's output is.
        keys = torch.randn(rows_shape, generator=gen).to(dtype).to(device).transpose(0, 1)
        values = torch.randn(rows_shape, generator=gen).to(dtype).transpose(0, 1).contiguous()
        # The slot of each row's last position; an empty row's points at a slot another
        # sequence attends, so a store it should not make changes an output.
        used = tables[0].item() * bs if case.context_lens[0] else 0
        slots = [
            tables[s * width + (n - 1) // bs].item() * bs + (n - 1) % bs if n else used
            for s, n in enumerate(case.context_lens)
        ]
        new_rows = (keys, values.to(device), torch.tensor(slots, device=device))
    return Inputs(
        query,
        key_cache,
        value_cache,
        tables.to(device),
        header[1:2],
        torch.tensor(case.context_lens, dtype=torch.int32, device=device),
        out,
        sinks,
        new_rows,
    )


def stored(x: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The caches as they should be once the rows with a context are stored."""
    key_cache, value_cache = x.key_cache.clone(), x.value_cache.clone()
    if x.new_rows is not None:
        keys, values, slots = x.new_rows
        has_context = x.context_lens > 0
        key_cache[slots[has_context]] = keys[has_context]
        value_cache[slots[has_context]] = values[has_context]
    return key_cache, value_cache


@contextlib.contextmanager
def poisoned_allocations() -> Iterator[None]:
    """``torch.empty`` and ``torch.empty_like`` return NaN-filled floating tensors."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

    with (
        mock.patch("torch.empty", lambda *a, **k: poison(empty(*a, **k))),
        mock.patch("torch.empty_like", lambda *a, **k: poison(empty_like(*a, **k))),
    ):
        yield


def check_case(case: Case, device: torch.device) -> dict[str, object]:
    """Run the kernel and the reference; returns the error and the properties tests check."""
    from cbpipe.worker.kernels.paged_decode import (
        NewRows,
        paged_decode_attention,
        paged_decode_reference,
    )

    x = make_inputs(case, device)
    scale = case.head_dim**-0.5
    key_cache, value_cache = stored(x)
    # The reference reads caches that already hold the new rows; the kernel stores them.
    want_args = (x.query, key_cache, value_cache, x.block_tables, x.width, x.context_lens)
    variant: dict[str, Any] = dict(sliding_window=case.window, softcap=case.softcap, sinks=x.sinks)
    with poisoned_allocations() if case.poisoned_scratch else contextlib.nullcontext():
        got = paged_decode_attention(
            x.query, x.key_cache, x.value_cache, x.block_tables, x.width, x.context_lens,
            block_size=case.block_size, scale=scale, num_splits=case.num_splits, out=x.out,
            heads_per_program=case.heads_per_program,
            new_rows=NewRows(*x.new_rows) if x.new_rows else None, **variant,
        )  # fmt: skip
    want = paged_decode_reference(*want_args, block_size=case.block_size, scale=scale, **variant)
    plain = paged_decode_reference(*want_args, block_size=case.block_size, scale=scale)
    empty = x.context_lens == 0
    return {
        # Every slot as index assignment leaves it: the rows stored, nothing else touched.
        "caches_stored": bool(
            torch.equal(x.key_cache, key_cache) and torch.equal(x.value_cache, value_cache)
        ),
        "max_err": (got.float() - want).abs().max().item(),
        # How far the variant moves the output: a case whose variant changes nothing tests
        # nothing about it.
        "variant_effect": (want - plain).abs().max().item(),
        "finite": bool(torch.isfinite(got).all()),
        "empty_rows_zero": bool((got[empty] == 0).all()),
        "dtype_ok": got.dtype == x.query.dtype and got.shape == x.query.shape,
        "returned_out": x.out is None or got is x.out,
    }


def assert_result(case: Case, result: dict[str, object]) -> None:
    assert "error" not in result, f"{case.name} raised:\n{result['error']}"
    assert result["finite"], f"{case.name}: NaN or inf in the output"
    assert result["empty_rows_zero"], f"{case.name}: a context_len 0 row is not zeros"
    assert result["dtype_ok"], f"{case.name}: wrong output dtype or shape"
    assert result["returned_out"], f"{case.name}: the given out was not returned"
    assert result["caches_stored"], f"{case.name}: the caches differ from the rows stored"
    assert result["max_err"] <= _ATOL[case.dtype], f"{case.name}: max error {result['max_err']}"
    has_variant = case.window is not None or case.softcap is not None or case.sinks
    if has_variant and case.variant_matters:
        # The variant must move the reference by more than the tolerance, so that a kernel
        # that ignored it would fail the check above. Not by a fixed multiple: in bfloat16 a
        # window of 4096 over random keys moves an average of thousands of values by ~0.06.
        assert result["variant_effect"] > 2 * _ATOL[case.dtype], f"{case.name}: no effect"


def _interpreter_main() -> None:
    """Subprocess entry: every CPU case under the interpreter, one JSON line on stdout."""
    from cbpipe.worker.kernels.paged_decode import num_splits_for

    results = check_each(CPU_CASES, lambda case: check_case(case, torch.device("cpu")))
    results["num_splits_for"] = [num_splits_for(pairs, sms) for pairs, sms, _ in SPLIT_HEURISTIC]
    results["bad_packing"] = _bad_packing_errors()
    emit(results)


def _bad_packing_errors() -> list[str]:
    """The errors of packings the caches do not allow (empty string: it ran)."""
    from cbpipe.worker.kernels.paged_decode import paged_decode_attention

    errors = []
    packings = [
        (4, 64, 3, False),
        (2, 64, 4, False),
        (4, 80, 2, False),
        (4, 8, 2, False),
        (4, 64, 2, True),
    ]
    for num_kv_heads, head_dim, pack, strided in packings:
        query = torch.randn(1, num_kv_heads, head_dim)
        cache = torch.randn(16, num_kv_heads, head_dim + 8 if strided else head_dim)
        cache = cache[..., :head_dim]
        try:
            paged_decode_attention(
                query, cache, cache, torch.zeros(1, dtype=torch.int32),
                torch.ones(1, dtype=torch.int64), torch.ones(1, dtype=torch.int32),
                block_size=16, scale=1.0, heads_per_program=pack,
            )  # fmt: skip
            errors.append("")
        except ValueError as error:
            errors.append(str(error))
    return errors


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, Any]:
    return run_interpreted("tests.unit.test_paged_decode_kernel")


def test_triton_is_importable() -> None:
    require_triton()


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.name)
def test_interpreter_matches_reference(case: Case, interpreter_results: dict[str, Any]) -> None:
    assert_result(case, interpreter_results[case.name])


def test_default_split_heuristic(interpreter_results: dict[str, Any]) -> None:
    want = [splits for _, _, splits in SPLIT_HEURISTIC]
    assert interpreter_results["num_splits_for"] == want


def test_packing_the_caches_do_not_allow_is_refused(interpreter_results: dict[str, Any]) -> None:
    """3 does not divide 4 heads; 2 heads cannot make 4; head_dim 80 leaves gaps, and 8 a
    padded tile of 16; nor do rows that are views into wider ones: each is a ValueError, never
    a wrong answer."""
    errors = interpreter_results["bad_packing"]
    assert all("heads_per_program" in error for error in errors), errors


def test_default_packing() -> None:
    from cbpipe.worker.kernels.paged_decode import default_heads_per_program

    assert [default_heads_per_program(d, 8) for d in (32, 64, 128, 256)] == [4, 2, 1, 1]
    assert default_heads_per_program(64, 1) == 1  # one KV head (a tensor-parallel rank's)


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])],
)
def test_compiled_op_stores_into_the_caches_in_place(device: str) -> None:
    """Under torch.compile ``cbpipe::decode_attention`` stores into the caches themselves:
    a copy of a cache (in a server gigabytes a layer) would show as a clone or a copy back in
    inductor's code. On the CPU the kernel runs under the interpreter (``tests/conftest.py``)."""
    from torch._inductor.utils import run_and_get_code

    import cbpipe.worker.attention  # noqa: F401  (registers the op)
    from cbpipe.worker.kernels.paged_decode import paged_decode_reference

    if device == "cpu" and torch.cuda.is_available():
        pytest.skip("the kernel runs interpreted only where there is no CUDA device")
    case = Case("compiled", "float32", 16, (5, 0, 40), 2, 4, 64, 1, new_rows=True)
    x = make_inputs(case, torch.device(device))
    assert x.new_rows is not None
    key_cache, value_cache = stored(x)
    keys, values, slots = x.new_rows

    def step(query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        keys = keys * 2  # an element-wise kernel produces the keys
        return torch.ops.cbpipe.decode_attention(
            query, keys, values, x.key_cache, x.value_cache, slots, x.block_tables, x.width,
            x.context_lens, case.block_size, 0.125, None, None, None,
        )  # fmt: skip

    got, code = run_and_get_code(torch.compile(step, fullgraph=True), x.query, keys / 2)
    assert torch.equal(x.key_cache, key_cache) and torch.equal(x.value_cache, value_cache)
    args = (x.query, key_cache, value_cache, x.block_tables, x.width, x.context_lens)
    want = paged_decode_reference(*args, block_size=case.block_size, scale=0.125)
    assert (got - want).abs().max().item() <= _ATOL["float32"]
    source = "\n".join(code)
    assert "decode_attention" in source
    assert "clone" not in source and "copy_" not in source, source


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name)
def test_gpu_matches_reference(case: Case) -> None:
    assert_result(case, check_case(case, torch.device("cuda")))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "variant",
    [{}, {"sliding_window": 100, "softcap": 2.0}, {"sliding_window": 33, "sinks": True}],
    ids=["plain", "window-softcap", "window-sinks"],
)
def test_gpu_cuda_graph_replays_with_new_metadata(variant: dict[str, Any]) -> None:
    """Capture once; new context lengths, block tables and width written in place are used."""
    from cbpipe.worker.kernels.paged_decode import paged_decode_attention, paged_decode_reference

    device = torch.device("cuda")
    torch.manual_seed(0)
    num_seqs, kv_heads, group, head_dim, bs = 6, 8, 4, 128, 16
    num_blocks, max_width = 400, 64
    dtype = torch.bfloat16
    key_cache = torch.randn(num_blocks * bs, kv_heads, head_dim, dtype=dtype, device=device)
    value_cache = torch.randn_like(key_cache)
    query = torch.randn(num_seqs, kv_heads * group, head_dim, dtype=dtype, device=device)
    header = torch.zeros(4, dtype=torch.int64, device=device)
    width = header[2:3]
    tables = torch.zeros(num_seqs * max_width, dtype=torch.int32, device=device)
    context_lens = torch.zeros(num_seqs, dtype=torch.int32, device=device)
    out = torch.empty_like(query)
    if variant.pop("sinks", False):
        variant["sinks"] = torch.randn(kv_heads * group, device=device) * 2

    def fill(lens: list[int], table_width: int) -> None:
        blocks = torch.randperm(num_blocks, device=device)[: num_seqs * table_width]
        tables.zero_()
        tables[: num_seqs * table_width].copy_(blocks.to(torch.int32))
        width.fill_(table_width)
        context_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        query.normal_()

    def expected() -> torch.Tensor:
        args = (query, key_cache, value_cache, tables, width, context_lens)
        return paged_decode_reference(*args, block_size=bs, scale=head_dim**-0.5, **variant)

    def run() -> None:
        paged_decode_attention(
            query,
            key_cache,
            value_cache,
            tables,
            width,
            context_lens,
            block_size=bs,
            scale=head_dim**-0.5,
            num_splits=8,
            out=out,
            **variant,
        )

    fill([5, 100, 0, 300, 17, 16], 20)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()

    for lens, table_width in [([5, 100, 0, 300, 17, 16], 20), ([900, 1, 33, 0, 64, 1000], 64)]:
        fill(lens, table_width)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        err = (out.float() - expected()).abs().max().item()
        assert torch.isfinite(out).all()
        assert err <= _ATOL["bfloat16"], f"lens {lens}, width {table_width}: max error {err}"


if __name__ == "__main__":
    _interpreter_main()
