"""Which of CUDA's BLAS libraries runs the model's matrix products, in which kind of step.

torch sends a product to cuBLAS unless told otherwise. cuBLASLt, the same library's newer
interface, has heuristics of its own, and for the decode step's products (a few dozen rows by
a large weight) they pick better kernels: where cuBLAS splits a product over its inner
dimension and adds the parts in a second kernel, cuBLASLt picks a single kernel that reads the
weight as fast, so a step launches fewer kernels and waits for no reductions
(docs/PERFORMANCE.md has the step's profile both ways). Large products, a prefill's, run the
same either way.

What differs is the host's side of a call. torch asks cuBLASLt's heuristic for an algorithm at
every product, where cuBLAS keeps its own choices: tens to hundreds of microseconds a product
against a few. A decode graph pays that once, at its capture; an eager step pays it at every
product. Running eager steps on cuBLAS was measured and lost (a mixed step 16.2 ms against
14.8 on an H100, docs/PERFORMANCE.md session 32: cuBLAS's own kernels for those products took
longer on the device than the host time saved), so ``auto`` is cuBLASLt for every step.

The choice is torch's, per process, so every worker rank makes it; ``BlasLibraries`` can name
another library for eager steps, which the runner switches to around each (``products_on``).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch

log = logging.getLogger(__name__)

BlasLibrary = Literal["auto", "cublaslt", "cublas"]


@dataclass(frozen=True)
class BlasLibraries:
    """The library of each kind of step's products."""

    graphs: str  # decode steps captured in CUDA graphs; the process's own setting
    eager: str  # steps launched op by op

    def __str__(self) -> str:
        if self.graphs == self.eager:
            return self.graphs
        return f"{self.graphs} (in graphs), {self.eager} (eager steps)"


def use_blas_library(choice: BlasLibrary, device: torch.device) -> BlasLibraries | None:
    """Makes the graphs' library of ``choice`` this process's BLAS library for CUDA products;
    returns the libraries in use. None off CUDA, where nothing is set.

    ``auto`` is cuBLASLt where this torch has it, else cuBLAS.
    """
    if device.type != "cuda":
        return None
    wanted = "cublaslt" if choice == "auto" else choice
    try:
        _set_preference(wanted)
    except RuntimeError as exc:
        if choice != "auto":
            raise ValueError(f"--blas-library {choice} is not available here: {exc}") from exc
        log.debug("cuBLASLt is not available (%s); the products run on cuBLAS", exc)
        _set_preference("cublas")
        return BlasLibraries("cublas", "cublas")
    return BlasLibraries(wanted, wanted)


@contextlib.contextmanager
def products_on(library: str | None) -> Iterator[None]:
    """Products inside run on ``library`` (None: on the process's setting), which is restored
    after."""
    if library is None:  # off CUDA and in runners built without a choice: no call into torch
        yield
        return
    before = torch.backends.cuda.preferred_blas_library()
    if before.name.lower() == library:
        yield
        return
    # Without ``_set_preference``'s filter: torch warns once a process, and the start-up's
    # choice took that warning; a filter here would touch every thread's warnings a step.
    torch.backends.cuda.preferred_blas_library(library)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def _set_preference(library: str) -> None:
    with warnings.catch_warnings():
        # torch calls the setting experimental, at every process that makes it.
        warnings.simplefilter("ignore")
        torch.backends.cuda.preferred_blas_library(library)
