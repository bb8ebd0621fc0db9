"""The BLAS library choice: nothing set off CUDA, cuBLASLt where torch has it, a clear error
where a user asked for a library this torch lacks."""

from __future__ import annotations

import argparse

import pytest
import torch

from cbpipe.config import add_arguments, from_arguments
from cbpipe.worker.blas import BlasLibraries, products_on, use_blas_library


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
