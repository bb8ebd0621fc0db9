"""The Triton paged prefill kernel against its plain-torch reference.

Without CUDA the kernel runs under Triton's CPU interpreter. ``TRITON_INTERPRET=1`` only takes
effect if it is set before the kernel module's ``@triton.jit`` decorators run, which a test
module cannot guarantee (another test may have imported the kernel already), so every CPU
case runs in one subprocess started with the variable set: ``python -m`` on this module. The
subprocess prints one JSON line of results; each parametrised test checks its own case.

With CUDA the same cases (and larger ones) run on the GPU in this process, plus a check that
a call never synchronises with the host and a CUDA graph capture replayed after rewriting the
chunk starts, context lengths and tables in place. Run them with
``pytest tests/unit/test_paged_prefill_kernel.py -m gpu``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
# Error allowed against the float32 reference: |got - want| <= atol + rtol * |want|. 16-bit
# outputs are rounded to 8 (bf16) or 11 (fp16) mantissa bits, one unit of which is rtol; the
# probabilities are rounded likewise before the P @ V product, which atol covers (outputs
# are O(1), but the first rows of a first chunk average only a few values, up to about 4).
_ATOL = {"float32": 1e-4, "bfloat16": 1e-2, "float16": 2e-3}
_RTOL = {"float32": 0.0, "bfloat16": 2.0**-7, "float16": 2.0**-10}


@dataclass(frozen=True)
class Case:
    name: str
    dtype: str
    block_size: int
    seqs: tuple[tuple[int, int], ...]  # (q_len, context_len) per sequence, in packing order
    num_kv_heads: int
    group: int  # query heads per KV head
    head_dim: int
    block_rows: int | None = None  # None: the kernel's default tiles
    block_n: int | None = None
    spare_width: int = 3  # table entries per sequence beyond what its context needs
    strided_query: bool = False  # query as a view into a wider [rows, ..., head_dim] buffer
    given_out: bool = False
    # Rows ahead of the first sequence's (decode rows in a mixed step): no sequence owns
    # them, and a given out must keep them as they were.
    row_offset: int = 0
    seed: int = 0
    # The layer's variant: a sliding window, a soft-cap, per-head sink logits.
    window: int | None = None
    softcap: float | None = None
    sinks: bool = False
    variant_matters: bool = True  # the variant moves the output (checked against the plain one)
    # Queries times this. Over thousands of keys, random scores of unit spread weigh them all
    # about alike, so the output is an average that hardly moves when the window drops a
    # third of the keys (0.08 for Gemma 2's shape, under the check's 0.1): sharper scores
    # make the variant matter, as trained models' do.
    query_scale: float = 1.0


CPU_CASES = [
    # First chunks (q_len == context), later chunks, a single row, default tiles.
    Case(
        "mix-bs16-g4-fp32", "float32", 16, ((5, 5), (7, 40), (1, 33), (20, 20), (3, 17)), 2, 4, 64
    ),
    # 16-row tiles: chunks of 15, 16, 17 and 33 rows end before, on and past tile edges.
    Case(
        "row-tile-edges-bs8-g1-fp32",
        "float32",
        8,
        ((15, 15), (16, 16), (17, 17), (33, 40), (1, 1), (16, 47)),
        2,
        1,
        32,
        block_rows=16,
        block_n=16,
    ),
    # Contexts end before, on and past 16-key tiles and 32-key blocks.
    Case(
        "key-tile-edges-bs32-g8-fp32",
        "float32",
        32,
        ((1, 15), (2, 16), (3, 17), (16, 31), (1, 32), (4, 33), (20, 64), (7, 65)),
        1,
        8,
        64,
        block_n=16,
    ),
    # The default tiles of G = 1, head_dim 32 in float32: 128 rows by 128 keys, both crossed.
    Case("default-tiles-g1-d32-fp32", "float32", 16, ((130, 130), (129, 200), (2, 130)), 1, 1, 32),
    Case(
        "empty-and-single-rows-fp32",
        "float32",
        16,
        ((0, 12), (1, 1), (0, 0), (1, 100), (2, 2)),
        2,
        4,
        64,
    ),
    Case("group-3-bs8-fp32", "float32", 8, ((9, 9), (6, 30), (1, 8)), 2, 3, 64, block_rows=8),
    Case("head-dim-80-fp32", "float32", 16, ((10, 10), (12, 50)), 2, 2, 80),
    Case(
        "wide-table-strided-query-out",
        "float32",
        16,
        ((8, 8), (11, 60), (1, 17)),
        2,
        4,
        64,
        spare_width=9,
        strided_query=True,
        given_out=True,
        row_offset=3,
    ),
    Case("mix-bs16-g4-bf16", "bfloat16", 16, ((5, 5), (7, 40), (1, 33), (20, 20)), 2, 4, 64),
    Case(
        "edges-bs32-g8-bf16",
        "bfloat16",
        32,
        ((17, 17), (9, 41), (1, 64), (33, 65)),
        1,
        8,
        64,
        block_rows=4,
        block_n=32,
    ),
    Case("bs8-g1-d32-bf16", "bfloat16", 8, ((24, 24), (5, 29)), 2, 1, 32, block_rows=16),
    Case("long-chunk-bs16-g4-bf16", "bfloat16", 16, ((64, 96), (40, 40)), 2, 4, 64),
    Case("mix-bs16-g4-fp16", "float16", 16, ((9, 9), (4, 70)), 2, 4, 64),
    # Sliding windows that end inside a block (20 with blocks of 16; 5 inside a 16-key tile),
    # on a tile edge (16, 32), of one key; chunks that start before, inside and past the
    # window, row tiles whose rows' windows start in different key tiles.
    *[
        Case(
            f"window{w}-bs16-g4-rows{r}",
            "float32",
            16,
            ((40, 40), (7, 60), (1, 33), (20, 20), (33, 90), (3, 5)),
            2,
            4,
            64,
            block_rows=r,
            block_n=16,
            window=w,
        )
        for w, r in ((20, 4), (20, 16), (5, 8), (16, 16), (32, 4), (1, 4))
    ],  # fmt: skip
    Case(
        "window-default-tiles-g1",
        "float32",
        16,
        ((130, 130), (129, 300), (2, 130)),
        1,
        1,
        32,
        window=70,
    ),  # fmt: skip
    Case(
        "window-past-context",
        "float32",
        8,
        ((9, 9), (6, 30), (1, 8)),
        2,
        3,
        64,
        block_rows=8,
        window=500,
        variant_matters=False,
    ),  # fmt: skip
    Case("softcap-fp32", "float32", 16, ((5, 5), (7, 40), (1, 33)), 2, 4, 64, softcap=0.7),
    Case("sinks-fp32", "float32", 16, ((5, 5), (7, 40), (1, 33), (0, 3)), 2, 4, 64, sinks=True),
    Case(
        "window-softcap-sinks-bf16",
        "bfloat16",
        16,
        ((17, 17), (9, 41), (1, 64), (33, 65)),
        1,
        8,
        64,
        block_rows=4,
        block_n=32,
        window=24,
        softcap=1.5,
        sinks=True,
    ),  # fmt: skip
    Case(
        "gemma2-like-bf16", "bfloat16", 16, ((40, 40), (20, 90)), 1, 2, 256, window=24, softcap=1.5
    ),  # fmt: skip
]

GPU_CASES = [
    *CPU_CASES,
    Case("llama1b-one-2048-bf16", "bfloat16", 16, ((2048, 2048),), 8, 4, 64),
    Case(
        "llama1b-chunks-bf16",
        "bfloat16",
        16,
        ((512, 1024), (500, 1012), (512, 512), (1, 9)),
        8,
        4,
        64,
    ),
    Case(
        "llama8b-d128-bf16",
        "bfloat16",
        16,
        ((1000, 1000), (300, 2300), (1, 777), (129, 129), (0, 40)),
        8,
        4,
        128,
    ),
    Case("head-dim-80-bf16", "bfloat16", 16, ((200, 200), (77, 500), (3, 3)), 4, 2, 80),
    Case("g8-d128-fp32", "float32", 16, ((300, 300), (65, 1000)), 2, 8, 128),
    Case("g1-d128-bs32-bf16", "bfloat16", 32, ((513, 513), (31, 4000)), 8, 1, 128),
    Case("head-dim-256-bf16", "bfloat16", 16, ((100, 300), (64, 64)), 2, 4, 256),
    Case("group-6-d64-fp16", "float16", 8, ((257, 257), (40, 600)), 2, 6, 64),
    # Gemma 2 2B's attention (head_dim 256, window 4096, soft-cap 50) and gpt-oss's (head_dim
    # 64, window 128, sinks) over long prompts and chunks that cross the window.
    Case(
        "gemma2-2b-window-bf16",
        "bfloat16",
        16,
        ((2048, 6000), (1000, 4096), (512, 512)),
        4,
        2,
        256,
        window=4096,
        softcap=50.0,
        query_scale=2.0,  # the window moves the output by 1.3, the soft-cap by 0.13
    ),  # fmt: skip
    Case(
        "gpt-oss-window-sinks-bf16",
        "bfloat16",
        16,
        ((1024, 1024), (300, 2000), (1, 129)),
        8,
        8,
        64,
        window=128,
        sinks=True,
    ),  # fmt: skip
    Case(
        "llama1b-wide-table-strided-out-bf16",
        "bfloat16",
        16,
        ((512, 1024), (77, 77)),
        8,
        4,
        64,
        spare_width=40,
        strided_query=True,
        given_out=True,
        row_offset=32,
    ),
]

# (group, head_dim, itemsize, max_query_len) and the default launch it should get.
LAUNCH_DEFAULTS = [
    ((4, 64, 2, 2048), {"BLOCK_ROWS": 32, "BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8}),
    ((4, 128, 2, 2048), {"BLOCK_ROWS": 32, "BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8}),
    ((8, 128, 2, 512), {"BLOCK_ROWS": 16, "BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8}),
    ((4, 64, 2, 1), {"BLOCK_ROWS": 4, "BLOCK_M": 16, "BLOCK_N": 128, "num_warps": 4}),
    ((4, 64, 2, 20), {"BLOCK_ROWS": 32, "BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8}),
    ((32, 64, 2, 2048), {"BLOCK_ROWS": 4, "BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8}),
    ((3, 80, 2, 2048), {"BLOCK_G": 4, "BLOCK_D": 128, "BLOCK_ROWS": 32, "BLOCK_N": 64}),
    ((4, 256, 2, 2048), {"BLOCK_ROWS": 16, "BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4}),
    ((1, 128, 4, 2048), {"BLOCK_ROWS": 64, "BLOCK_M": 64, "BLOCK_N": 32}),
]


@dataclass
class Inputs:
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    query_start: torch.Tensor
    context_lens: torch.Tensor
    max_query_len: int
    out: torch.Tensor | None
    sinks: torch.Tensor | None


def make_inputs(case: Case, device: torch.device) -> Inputs:
    """Random caches, and block tables that scatter each sequence over shuffled blocks."""
    gen = torch.Generator().manual_seed(case.seed)
    dtype = _DTYPES[case.dtype]
    num_seqs = len(case.seqs)
    num_heads = case.num_kv_heads * case.group
    bs = case.block_size
    width = max(-(-n // bs) for _, n in case.seqs) + case.spare_width
    num_blocks = num_seqs * width + 5
    shape = (num_blocks * bs, case.num_kv_heads, case.head_dim)
    key_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    value_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    # Distinct shuffled block ids fill every entry, including the unused tail of each row,
    # so a kernel that reads past a sequence's blocks picks up real (wrong) data.
    tables = torch.randperm(num_blocks, generator=gen)[: num_seqs * width].to(torch.int32)
    q_lens = [q for q, _ in case.seqs]
    starts = [case.row_offset]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    num_rows = starts[-1]
    query_shape = (num_rows, num_heads + 3 if case.strided_query else num_heads, case.head_dim)
    query = torch.randn(query_shape, generator=gen) * case.query_scale
    query = query.to(dtype).to(device)[:, :num_heads]
    out = None
    if case.given_out:
        out = torch.full((num_rows, num_heads, case.head_dim), float("nan"), dtype=dtype)
        out = out.to(device)
    # Sinks of the size of the scores, so some rows give them most of the weight.
    sinks = (2 * torch.randn(num_heads, generator=gen)).to(dtype).to(device) if case.sinks else None
    return Inputs(
        query,
        key_cache,
        value_cache,
        tables.view(num_seqs, width).to(device),
        torch.tensor(starts, dtype=torch.int32, device=device),
        torch.tensor([n for _, n in case.seqs], dtype=torch.int32, device=device),
        max(q_lens),
        out,
        sinks,
    )


def check_case(case: Case, device: torch.device) -> dict[str, Any]:
    """Run the kernel and the reference; returns the error and the properties tests check."""
    from cbpipe.worker.kernels.paged_prefill import (
        paged_prefill_attention,
        paged_prefill_reference,
    )

    x = make_inputs(case, device)
    scale = case.head_dim**-0.5
    args = (x.query, x.key_cache, x.value_cache, x.block_tables, x.query_start, x.context_lens)
    common: dict[str, Any] = dict(
        block_size=case.block_size, scale=scale, max_query_len=x.max_query_len
    )
    variant: dict[str, Any] = dict(sliding_window=case.window, softcap=case.softcap, sinks=x.sinks)
    got = paged_prefill_attention(
        *args, **common, **variant, out=x.out, block_rows=case.block_rows, block_n=case.block_n
    )
    want = paged_prefill_reference(*args, **common, **variant)
    plain = paged_prefill_reference(*args, **common)
    owned = slice(case.row_offset, None)
    err = (got[owned].float() - want[owned]).abs()
    return {
        "max_err": err.max().item(),
        # How far the variant moves the output: a case whose variant changes nothing tests
        # nothing about it.
        "variant_effect": (want[owned] - plain[owned]).abs().max().item(),
        "max_scaled_err": (err - _RTOL[case.dtype] * want[owned].abs()).max().item(),
        "finite": bool(torch.isfinite(got[owned]).all()),
        "unowned_untouched": x.out is None or bool(got[: case.row_offset].isnan().all()),
        "dtype_ok": got.dtype == x.query.dtype and got.shape == x.query.shape,
        "returned_out": x.out is None or got is x.out,
    }


def assert_result(case: Case, result: dict[str, Any]) -> None:
    assert "error" not in result, f"{case.name} raised:\n{result['error']}"
    assert result["finite"], f"{case.name}: NaN or inf in the output"
    assert result["unowned_untouched"], f"{case.name}: rows no sequence owns were written"
    assert result["dtype_ok"], f"{case.name}: wrong output dtype or shape"
    assert result["returned_out"], f"{case.name}: the given out was not returned"
    assert result["max_scaled_err"] <= _ATOL[case.dtype], (
        f"{case.name}: max error {result['max_err']}, beyond rtol {result['max_scaled_err']}"
    )
    has_variant = case.window is not None or case.softcap is not None or case.sinks
    if has_variant and case.variant_matters:
        assert result["variant_effect"] > 10 * _ATOL[case.dtype], f"{case.name}: no effect"


def _rejected_inputs() -> dict[str, bool]:
    """Whether each malformed call raises ValueError before launching anything."""
    from cbpipe.worker.kernels.paged_prefill import paged_prefill_attention

    x = make_inputs(CPU_CASES[0], torch.device("cpu"))
    good: dict[str, Any] = dict(
        query=x.query,
        key_cache=x.key_cache,
        value_cache=x.value_cache,
        block_tables=x.block_tables,
        query_start=x.query_start,
        context_lens=x.context_lens,
    )
    bad: dict[str, dict[str, Any]] = {
        "flat-block-tables": dict(block_tables=x.block_tables.reshape(-1)),
        "int64-block-tables": dict(block_tables=x.block_tables.long()),
        "short-query-start": dict(query_start=x.query_start[:-1]),
        "float-context-lens": dict(context_lens=x.context_lens.float()),
        "heads-not-a-multiple": dict(query=x.query[:, :7]),
        "wrong-out-dtype": dict(out=torch.empty(x.query.shape, dtype=torch.float64)),
        "block-rows-not-power-of-2": dict(block_rows=3),
        "dot-under-16-rows": dict(block_rows=2),
    }
    rejected = {}
    for name, change in bad.items():
        kwargs = good | change
        try:
            paged_prefill_attention(
                **kwargs, block_size=16, scale=1.0, max_query_len=x.max_query_len
            )
        except ValueError:
            rejected[name] = True
        else:
            rejected[name] = False
    return rejected


def _interpreter_main() -> None:
    """Subprocess entry: every CPU case under the interpreter, one JSON line on stdout."""
    from cbpipe.worker.kernels.paged_prefill import launch_config

    results = check_each(CPU_CASES, lambda case: check_case(case, torch.device("cpu")))
    results["launch_config"] = [launch_config(*args) for args, _ in LAUNCH_DEFAULTS]
    results["rejected"] = _rejected_inputs()
    emit(results)


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, Any]:
    return run_interpreted("tests.unit.test_paged_prefill_kernel")


def test_triton_is_importable() -> None:
    require_triton()


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.name)
def test_interpreter_matches_reference(case: Case, interpreter_results: dict[str, Any]) -> None:
    assert_result(case, interpreter_results[case.name])


def test_default_launch_config(interpreter_results: dict[str, Any]) -> None:
    for (args, want), got in zip(
        LAUNCH_DEFAULTS, interpreter_results["launch_config"], strict=True
    ):
        assert {k: got[k] for k in want} == want, f"launch_config{args}: {got}"


def test_malformed_inputs_are_rejected(interpreter_results: dict[str, Any]) -> None:
    not_rejected = [name for name, ok in interpreter_results["rejected"].items() if not ok]
    assert not not_rejected, f"accepted without a ValueError: {not_rejected}"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name)
def test_gpu_matches_reference(case: Case) -> None:
    assert_result(case, check_case(case, torch.device("cuda")))


@pytest.mark.gpu
@needs_cuda
def test_gpu_call_never_syncs() -> None:
    """After compiling, a call raises nothing under the strictest sync debug mode."""
    from cbpipe.worker.kernels.paged_prefill import paged_prefill_attention

    case = next(c for c in GPU_CASES if c.name == "llama1b-chunks-bf16")
    x = make_inputs(case, torch.device("cuda"))
    args = (x.query, x.key_cache, x.value_cache, x.block_tables, x.query_start, x.context_lens)
    kwargs: dict[str, Any] = dict(
        block_size=case.block_size, scale=0.125, max_query_len=x.max_query_len
    )
    out = paged_prefill_attention(*args, **kwargs)  # compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        paged_prefill_attention(*args, **kwargs, out=out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.gpu
@needs_cuda
def test_gpu_cuda_graph_replays_with_new_metadata() -> None:
    """Capture once; new chunk starts, context lengths and tables written in place are used."""
    from cbpipe.worker.kernels.paged_prefill import (
        paged_prefill_attention,
        paged_prefill_reference,
    )

    device = torch.device("cuda")
    torch.manual_seed(0)
    num_seqs, kv_heads, group, head_dim, bs = 4, 8, 4, 64, 16
    num_blocks, width, num_rows, max_q = 600, 128, 1024, 512
    dtype = torch.bfloat16
    key_cache = torch.randn(num_blocks * bs, kv_heads, head_dim, dtype=dtype, device=device)
    value_cache = torch.randn_like(key_cache)
    query = torch.randn(num_rows, kv_heads * group, head_dim, dtype=dtype, device=device)
    tables = torch.zeros(num_seqs, width, dtype=torch.int32, device=device)
    query_start = torch.zeros(num_seqs + 1, dtype=torch.int32, device=device)
    context_lens = torch.zeros(num_seqs, dtype=torch.int32, device=device)
    out = torch.empty_like(query)
    kwargs: dict[str, Any] = dict(block_size=bs, scale=head_dim**-0.5, max_query_len=max_q)

    def fill(seqs: list[tuple[int, int]]) -> None:
        blocks = torch.randperm(num_blocks, device=device)[: num_seqs * width]
        tables.copy_(blocks.view(num_seqs, width).to(torch.int32))
        starts = torch.tensor([0, *[q for q, _ in seqs]]).cumsum(0)
        query_start.copy_(starts.to(torch.int32))
        context_lens.copy_(torch.tensor([n for _, n in seqs], dtype=torch.int32))
        query.normal_()

    def args() -> tuple[torch.Tensor, ...]:
        return (query, key_cache, value_cache, tables, query_start, context_lens)

    def run() -> None:
        paged_prefill_attention(*args(), **kwargs, out=out)

    layouts = [
        [(512, 512), (100, 700), (1, 33), (300, 300)],
        [(7, 2000), (512, 1536), (0, 0), (200, 201)],
    ]
    fill(layouts[0])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()

    for seqs in layouts:
        fill(seqs)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        owned = sum(q for q, _ in seqs)
        want = paged_prefill_reference(*args(), **kwargs)
        err = (out[:owned].float() - want[:owned]).abs()
        scaled = (err - _RTOL["bfloat16"] * want[:owned].abs()).max().item()
        assert torch.isfinite(out[:owned]).all()
        assert scaled <= _ATOL["bfloat16"], f"{seqs}: max error {err.max()}, {scaled} past rtol"


if __name__ == "__main__":
    _interpreter_main()
