"""The decode path's compile settings (``cbpipe.worker.compiling``)."""

from __future__ import annotations

import pytest
import torch
from packaging.version import Version

from cbpipe.worker import compiling

# Before torch 2.13 inductor's C++ (CPU) backend ignores ``emulate_precision_casts``: its
# ``to_dtype`` caches every float32 -> bfloat16 cast's inverse as the unrounded float32 value,
# so the emulated round trip is folded away (pytorch/pytorch#136896, fixed by #182882 in
# 2.13). The engine compiles only for CUDA graphs, whose Triton backend keeps the round trips.
_CPU_INDUCTOR_ROUNDS_AS_EAGER = Version(torch.__version__) >= Version("2.13")


def _gate_and_residual(
    up: torch.Tensor, gate: torch.Tensor, residual: torch.Tensor
) -> torch.Tensor:
    # A decoder layer's element-wise tail in miniature: eager rounds each op's result to the
    # inputs' dtype, a fused kernel keeps them in float32 unless told otherwise.
    return (torch.nn.functional.silu(gate) * up + residual) * 1.37


@pytest.mark.skipif(
    not _CPU_INDUCTOR_ROUNDS_AS_EAGER,
    reason="torch < 2.13's CPU inductor ignores emulate_precision_casts (pytorch/pytorch#136896, "
    "fixed in 2.13 by #182882)",
)
def test_compiled_bfloat16_rounds_as_eager_does() -> None:
    """The prefill runs the compiled layers, and its keys are cached: they must be the ones
    transformers computes, or greedy replies part from ``generate`` at near-ties."""
    torch.manual_seed(0)
    up, gate, residual = (torch.randn(64, 512, dtype=torch.bfloat16) for _ in range(3))
    eager = _gate_and_residual(up, gate, residual)

    torch._dynamo.reset()
    compiled = compiling.compile_decode_fn(_gate_and_residual)(up, gate, residual)
    assert torch.equal(compiled, eager)

    # The check can fail: without the option the fused kernel rounds once, at the end.
    torch._dynamo.reset()
    options = compiling._COMPILE_OPTIONS | {"emulate_precision_casts": False}
    fused = torch.compile(_gate_and_residual, dynamic=True, options=options)(up, gate, residual)
    assert not torch.equal(fused, eager)
