"""The BLAS library choice: nothing set off CUDA, cuBLASLt where torch has it, a clear error
where a user asked for a library this torch lacks."""

from __future__ import annotations

import argparse

import pytest
import torch

from cbpipe.config import add_arguments, from_arguments
from cbpipe.worker.blas import use_blas_library


@pytest.fixture
def restore_preference():
    before = torch.backends.cuda.preferred_blas_library()
    yield
    torch.backends.cuda.preferred_blas_library(before)


def test_nothing_is_set_off_cuda(restore_preference) -> None:
    before = torch.backends.cuda.preferred_blas_library()
    assert use_blas_library("cublaslt", torch.device("cpu")) is None
    assert torch.backends.cuda.preferred_blas_library() == before


def test_auto_takes_cublaslt_where_torch_has_it_else_cublas(restore_preference) -> None:
    chosen = use_blas_library("auto", torch.device("cuda"))
    assert chosen in ("cublaslt", "cublas")
    assert torch.backends.cuda.preferred_blas_library().name.lower() == chosen
    if not torch.backends.cuda.is_built():  # a CPU build has no cuBLASLt to choose
        assert chosen == "cublas"


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
