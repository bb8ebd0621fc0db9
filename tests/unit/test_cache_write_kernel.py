"""The Triton cache-write kernel against index assignment.

CPU cases run under Triton's interpreter in one subprocess (``tests/unit/triton_interpreter.py``
says why); with CUDA they run on the GPU too, with a CUDA graph replay after rewriting the
slots. ``pytest tests/unit/test_cache_write_kernel.py -m gpu`` runs the GPU ones.
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


@dataclass(frozen=True)
class Case:
    name: str
    rows: int
    kv_heads: int
    head_dim: int
    num_slots: int
    dtype: str = "float32"
    # How the rows are laid out: "rows" [rows, heads, dim] contiguous; "heads" as the model
    # hands them, a transposed [1, heads, rows, dim]; "fused" slices of one q|k|v product.
    layout: str = "rows"
    shared_slots: bool = False  # several rows on one slot (padding rows)


CPU_CASES = [
    Case("one-row", 1, 1, 8, 4),
    Case("heads-major", 5, 2, 16, 40, layout="heads"),
    Case("fused-product", 6, 2, 32, 30, layout="fused"),
    Case("odd-heads-and-dim", 7, 3, 80, 50),
    Case("bf16", 9, 4, 64, 64, "bfloat16", layout="heads"),
    Case("padding-rows-share-a-slot", 8, 2, 16, 12, shared_slots=True),
    Case("no-rows", 0, 2, 16, 12),
]
GPU_CASES = [
    *CPU_CASES,
    Case("llama8b-batch32", 32, 8, 128, 5000, "bfloat16", layout="fused"),
    Case("llama8b-prefill", 4096, 8, 128, 9000, "bfloat16", layout="heads"),
]


@dataclass
class Inputs:
    key: torch.Tensor
    value: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    slot_mapping: torch.Tensor


def make_inputs(case: Case, device: torch.device) -> Inputs:
    gen = torch.Generator().manual_seed(case.rows * 31 + case.head_dim)
    dtype = _DTYPES[case.dtype]
    rows, heads, dim = case.rows, case.kv_heads, case.head_dim

    def new_rows(offset: int) -> torch.Tensor:
        if case.layout == "heads":
            return torch.randn(1, heads, rows, dim, generator=gen)[0].transpose(0, 1)
        if case.layout == "fused":  # q (2 heads), k, v of one product, then k's or v's part
            fused = torch.randn(rows, (2 + 2 * heads) * dim, generator=gen)
            part = fused[:, (2 + offset * heads) * dim : (2 + (offset + 1) * heads) * dim]
            return part.view(rows, heads, dim)
        return torch.randn(rows, heads, dim, generator=gen)

    key, value = new_rows(0), new_rows(1)
    if case.shared_slots:
        slots = torch.randint(0, 3, (rows,), generator=gen)
    else:
        slots = torch.randperm(case.num_slots, generator=gen)[:rows]
    caches = [torch.randn(case.num_slots, heads, dim, generator=gen) for _ in range(2)]
    return Inputs(
        key.to(dtype).to(device),
        value.to(dtype).to(device),
        *(c.to(dtype).to(device) for c in caches),
        slots.to(device),
    )


def check_case(case: Case, device: torch.device) -> dict[str, object]:
    from cbpipe.worker.kernels.cache_write import write_kv_cache

    x = make_inputs(case, device)
    want_k, want_v = x.key_cache.clone(), x.value_cache.clone()
    for row, slot in enumerate(x.slot_mapping.tolist()):  # the last row on a slot wins
        want_k[slot] = x.key[row]
        want_v[slot] = x.value[row]
    write_kv_cache(x.key, x.value, x.key_cache, x.value_cache, x.slot_mapping)
    if case.shared_slots:  # which row of those sharing a slot is left there is not defined
        written = set(x.slot_mapping.tolist())
        untouched = [s for s in range(case.num_slots) if s not in written]
        return {
            "keys_equal": bool(torch.equal(x.key_cache[untouched], want_k[untouched])),
            "values_equal": bool(torch.equal(x.value_cache[untouched], want_v[untouched])),
        }
    return {
        "keys_equal": bool(torch.equal(x.key_cache, want_k)),
        "values_equal": bool(torch.equal(x.value_cache, want_v)),
    }


def assert_result(case: Case, result: dict[str, object]) -> None:
    assert "error" not in result, f"{case.name} raised:\n{result['error']}"
    assert result["keys_equal"], f"{case.name}: the key cache differs from index assignment"
    assert result["values_equal"], f"{case.name}: the value cache differs"


def _interpreter_main() -> None:
    emit(check_each(CPU_CASES, lambda case: check_case(case, torch.device("cpu"))))


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, Any]:
    return run_interpreted("tests.unit.test_cache_write_kernel")


def test_triton_is_importable() -> None:
    require_triton()


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.name)
def test_interpreter_matches_index_assignment(
    case: Case, interpreter_results: dict[str, Any]
) -> None:
    assert_result(case, interpreter_results[case.name])


def test_mismatched_shapes_are_refused() -> None:
    from cbpipe.worker.kernels.cache_write import write_kv_cache

    x = make_inputs(Case("refused", 4, 2, 16, 20), torch.device("cpu"))
    with pytest.raises(ValueError, match="must agree"):
        write_kv_cache(x.key, x.value[:3], x.key_cache, x.value_cache, x.slot_mapping)
    with pytest.raises(ValueError, match="do not hold"):
        write_kv_cache(x.key, x.value, x.key_cache[:, :1], x.value_cache, x.slot_mapping)
    with pytest.raises(ValueError, match="dtypes must be the same"):
        write_kv_cache(x.key, x.value, x.key_cache.bfloat16(), x.value_cache, x.slot_mapping)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name)
def test_gpu_matches_index_assignment(case: Case) -> None:
    assert_result(case, check_case(case, torch.device("cuda")))


@pytest.mark.gpu
@needs_cuda
def test_gpu_graph_replay_follows_rewritten_slots() -> None:
    from cbpipe.worker.kernels.cache_write import write_kv_cache

    x = make_inputs(
        Case("graph", 32, 8, 128, 500, "bfloat16", layout="fused"), torch.device("cuda")
    )
    args = (x.key, x.value, x.key_cache, x.value_cache, x.slot_mapping)
    write_kv_cache(*args)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        write_kv_cache(*args)
    x.slot_mapping.copy_(torch.randperm(500, device="cuda")[:32])
    x.key.copy_(torch.randn_like(x.key))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(x.key_cache[x.slot_mapping], x.key)
    assert torch.equal(x.value_cache[x.slot_mapping], x.value)


if __name__ == "__main__":
    _interpreter_main()
