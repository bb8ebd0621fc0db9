"""The BLAS library choice: nothing set off CUDA, cuBLASLt where torch has it, a clear error
where a user asked for a library this torch lacks."""

from __future__ import annotations

import argparse

import pytest
import torch

from cbpipe.config import add_arguments, from_arguments
from cbpipe.worker.blas import (
    BlasLibraries,
    products_on,
    row_grid,
    use_blas_library,
    warm_product_plans,
)


@pytest.fixture
def restore_preference():
    before = torch.backends.cuda.preferred_blas_library()
    yield
    torch.backends.cuda.preferred_blas_library(before)


def test_nothing_is_set_off_cuda(restore_preference) -> None:
    before = torch.backends.cuda.preferred_blas_library()
    assert use_blas_library("cublaslt", torch.device("cpu")) is None
    assert torch.backends.cuda.preferred_blas_library() == before


def _preference() -> str:
    return torch.backends.cuda.preferred_blas_library().name.lower()


def test_auto_takes_cublaslt_for_every_step(restore_preference) -> None:
    chosen = use_blas_library("auto", torch.device("cuda"))
    if not torch.backends.cuda.is_built():  # a CPU build has no cuBLASLt to choose
        assert chosen == BlasLibraries("cublas", "cublas")
    else:
        assert chosen == BlasLibraries("cublaslt", "cublaslt")
    assert chosen is not None and _preference() == chosen.graphs


def test_a_library_asked_for_runs_every_step(restore_preference) -> None:
    assert use_blas_library("cublas", torch.device("cuda")) == BlasLibraries("cublas", "cublas")
    if torch.backends.cuda.is_built():
        chosen = use_blas_library("cublaslt", torch.device("cuda"))
        assert chosen == BlasLibraries("cublaslt", "cublaslt")


def test_products_on_switches_for_its_block_and_restores(restore_preference) -> None:
    use_blas_library("cublas", torch.device("cuda"))
    with products_on(None):
        assert _preference() == "cublas"
    with products_on("cublas"):
        assert _preference() == "cublas"
    if not torch.backends.cuda.is_built():
        return
    with pytest.raises(KeyError), products_on("cublaslt"):
        assert _preference() == "cublaslt"
        raise KeyError("a step that fails")
    assert _preference() == "cublas"


def test_an_unavailable_library_asked_for_is_a_clear_error(restore_preference) -> None:
    if torch.backends.cuda.is_built():
        pytest.skip("this torch has cuBLASLt")
    with pytest.raises(ValueError, match="--blas-library cublaslt is not available"):
        use_blas_library("cublaslt", torch.device("cuda"))


def test_the_launcher_flag_reaches_the_worker_config() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert from_arguments(parser.parse_args([])).worker.blas_library == "auto"
    chosen = from_arguments(parser.parse_args(["--blas-library", "cublas"]))
    assert chosen.worker.blas_library == "cublas"
    with pytest.raises(SystemExit):
        parser.parse_args(["--blas-library", "mkl"])


def test_the_warm_up_grid_covers_every_octave_up_to_its_limit() -> None:
    grid = row_grid(8192)
    assert grid[0] == 1 and grid[-1] == 8192 and grid == sorted(set(grid))
    # No two neighbours more than a quarter of an octave apart (rounding aside).
    assert all(b / a <= 2**0.25 + 0.1 for a, b in zip(grid[8:], grid[9:], strict=False))
    assert row_grid(1) == [1] and row_grid(300)[-1] == 300


def _small_llama(bias: bool = False) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=120,
        attention_bias=bias,
    )
    return LlamaForCausalLM(config).eval()


def test_each_kind_of_product_is_warmed_once_at_every_row_count() -> None:
    from cbpipe.worker.fused_projections import fuse_projections

    model = _small_llama()
    fuse_projections(model)
    calls: list[tuple[tuple[int, ...], tuple[int, ...], bool]] = []
    real_linear = torch.nn.functional.linear

    def counting(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:  # noqa: ANN001
        calls.append((tuple(x.shape), tuple(weight.shape), bias is not None))
        assert x.is_contiguous()  # a step's activations are: the heuristic keys on the layout
        return real_linear(x, weight, bias)

    torch.nn.functional.linear = counting
    try:
        count = warm_product_plans(model, max_rows=64, max_head_rows=8)
    finally:
        torch.nn.functional.linear = real_linear
    # q|k|v fused, o, gate|up fused, down: one each, three layers alike; the head apart.
    layers = {(128, 64), (64, 64), (192, 64), (64, 96)}
    assert {w for _, w, _ in calls} == layers | {(120, 64)}
    for weight in layers:
        assert sorted(x[0] for x, w, _ in calls if w == weight) == row_grid(64)
    assert sorted(x[0] for x, w, _ in calls if w == (120, 64)) == row_grid(8)
    assert count == len(calls) == 4 * len(row_grid(64)) + len(row_grid(8))


def test_a_bias_makes_a_product_of_its_own_kind() -> None:
    from cbpipe.worker.blas import _distinct_products

    model = _small_llama(bias=True)
    for layer in model.model.layers:
        layer.self_attn.o_proj.bias = None  # q_proj keeps its bias, o_proj has none
    kinds = [(tuple(w.shape), b is not None) for w, b in _distinct_products(model)]
    assert kinds.count(((64, 64), True)) == 1 and kinds.count(((64, 64), False)) == 1


def test_layers_kept_in_another_dtype_are_warmed_in_theirs() -> None:
    model = _small_llama().to(torch.bfloat16)
    model.lm_head.float()  # as models with modules kept in float32 have them
    count = warm_product_plans(model, max_rows=16, max_head_rows=4)
    assert count == 4 * len(row_grid(16)) + len(row_grid(4))
