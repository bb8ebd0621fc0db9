"""The samplers' saved traces on CUDA, at Llama 3's vocabulary: what a warm start-up loads
samples what the writer's compiled samplers and eager ones sample, and traces nothing."""

from pathlib import Path

import pytest

from tests.correctness.test_saved_traces import check_saved_samplers

pytestmark = pytest.mark.gpu


def test_saved_samplers_run_on_cuda_without_tracing(tmp_path: Path) -> None:
    check_saved_samplers(tmp_path, "cuda")
