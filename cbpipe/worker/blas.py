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

from cbpipe.worker.fused_projections import FusedLinear

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


# Row counts a warm-up runs each product at, per doubling: enough that a kernel the library
# picks for some range of rows is met at one of them (docs/PERFORMANCE.md, session 33).
WARM_ROWS_PER_OCTAVE = 4


def warm_product_plans(model: torch.nn.Module, max_rows: int, max_head_rows: int) -> int:
    """Run each distinct matrix product of ``model``'s linear layers once at row counts from 1
    to ``max_rows`` (the head's to ``max_head_rows``: it sees the sampled rows alone); returns
    how many products ran.

    An eager step's products have as many rows as the step has tokens, which differ from step
    to step. The first time a process meets a (rows, weight shape) pair, cuBLASLt's heuristic
    chooses a kernel (about 0.3 ms on the host), and the first time it chooses a kernel, CUDA
    loads that kernel's module (4-7 ms: modules load lazily): a mixed step of a row count
    never seen spent 10-20 ms more on the host than its repeats. Products are what runs
    here, so the kernels these row counts pick are loaded before serving; a row count
    between two of them costs the heuristic alone, where it picks a kernel already loaded.
    """
    products = _distinct_products(model)
    if not products:
        return 0
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_weight = getattr(head, "weight", None)
    widest = max(weight.shape[1] for weight, _ in products)
    inputs: dict[torch.dtype, torch.Tensor] = {}  # a model may keep some layers in float32
    count = 0
    with torch.inference_mode():
        for weight, bias in products:
            if weight.dtype not in inputs:
                flat = torch.empty(max_rows * widest, dtype=weight.dtype, device=weight.device)
                inputs[weight.dtype] = flat.normal_()
            limit = max_head_rows if weight is head_weight else max_rows
            width = weight.shape[1]
            for rows in row_grid(limit):
                # Contiguous rows, as a step's activations are: the heuristic's choice
                # depends on the layout.
                x = inputs[weight.dtype][: rows * width].view(rows, width)
                torch.nn.functional.linear(x, weight, bias)
                count += 1
    return count


def row_grid(limit: int) -> list[int]:
    """1 to ``limit`` in ``WARM_ROWS_PER_OCTAVE`` steps a doubling, ``limit`` included."""
    steps = WARM_ROWS_PER_OCTAVE * max(limit, 1).bit_length()
    rows = {round(2 ** (i / WARM_ROWS_PER_OCTAVE)) for i in range(steps + 1)}
    return sorted({r for r in rows if r <= limit} | {limit})


def _distinct_products(model: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """One (weight, bias) for each kind of product the model's linear layers make: what the
    library's choice depends on (the weight's shape, strides and dtype; a bias or none)."""
    seen: dict[tuple, tuple[torch.Tensor, torch.Tensor | None]] = {}
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear | FusedLinear) or module.weight.is_meta:
            continue
        weight, bias = module.weight, module.bias
        key = (tuple(weight.shape), weight.stride(), weight.dtype, bias is not None)
        seen.setdefault(key, (weight, bias))
    return list(seen.values())
