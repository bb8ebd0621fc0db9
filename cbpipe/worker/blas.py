"""Which of CUDA's BLAS libraries runs the model's matrix products.

torch sends a product to cuBLAS unless told otherwise. cuBLASLt, the same library's newer
interface, has heuristics of its own, and for the decode step's products (a few dozen rows by
a large weight) they pick better kernels: where cuBLAS splits a product over its inner
dimension and adds the parts in a second kernel, cuBLASLt picks a single kernel that reads the
weight as fast, so a step launches fewer kernels and waits for no reductions
(docs/PERFORMANCE.md has the step's profile both ways). Large products, a prefill's, run the
same either way. The choice is torch's, per process, so every worker rank makes it.
"""

from __future__ import annotations

import logging
import warnings
from typing import Literal

import torch

log = logging.getLogger(__name__)

BlasLibrary = Literal["auto", "cublaslt", "cublas"]


def use_blas_library(choice: BlasLibrary, device: torch.device) -> str | None:
    """Makes ``choice`` this process's BLAS library for CUDA products; returns the one in use.

    ``auto`` is cuBLASLt where this torch has it, else cuBLAS. None off CUDA, where nothing
    is set.
    """
    if device.type != "cuda":
        return None
    wanted = "cublaslt" if choice == "auto" else choice
    try:
        with warnings.catch_warnings():
            # torch calls the setting experimental, at every process that makes it.
            warnings.simplefilter("ignore")
            torch.backends.cuda.preferred_blas_library(wanted)
    except RuntimeError as exc:
        if choice != "auto":
            raise ValueError(f"--blas-library {choice} is not available here: {exc}") from exc
        log.debug("cuBLASLt is not available (%s); the products run on cuBLAS", exc)
        torch.backends.cuda.preferred_blas_library("cublas")
        return "cublas"
    return wanted
