"""How the decode path compiles: ``torch.compile``'s settings, and what compiling cost.

The worker's decode graphs and the compile-ahead processes (``compile_ahead.py``) compile
through these alone: a setting that differed between them would key their artifacts apart.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch._dynamo import config as dynamo_config
from torch.fx.experimental import _config as symbolic_shapes_config

# Inductor picks each element-wise kernel's tiles by timing a handful of candidates on its
# first launch; kernels of a few microseconds time too noisily for that to settle. On the
# H200 the same 8B rotary kernel got other tiles, nearly twice as slow, from one start-up to
# the next (docs/PERFORMANCE.md). Without the timing every start-up gets inductor's first
# candidate, the same each time; reductions are still timed.
# Combo kernels: independent element-wise kernels share one launch. In a decode layer the
# rotary embeddings of q and of the keys read the q|k|v product and nothing of each other;
# at decode sizes each is a microsecond of work behind a launch of its own (the 8B step
# measured 1% shorter with them combined, docs/PERFORMANCE.md).
# Eager casts emulated: eager PyTorch rounds every bfloat16 op's result to bfloat16, and a
# fused kernel keeps its intermediates in float32 unless told to round them as eager does.
# The prefill runs these layers too, so without it a bfloat16 model's prompts were cached
# with keys other than transformers' own, and greedy replies parted from `generate` at
# near-ties far more often; the casts cost the step nothing measurable (docs/PERFORMANCE.md).
# float32 is untouched.
_COMPILE_OPTIONS = {
    "triton.autotune_pointwise": False,
    "combo_kernels": True,
    "emulate_precision_casts": True,
}


def compile_decode_fn(fn: Callable, *, fullgraph: bool = False) -> Callable:
    """``fn`` through ``torch.compile``: dynamic shapes, element-wise tiles not timed,
    independent element-wise kernels combined, eager's low-precision rounding kept.
    ``fullgraph``: one graph or an error (what ``aot_compile`` needs)."""
    return torch.compile(fn, dynamic=True, fullgraph=fullgraph, options=_COMPILE_OPTIONS)


@contextlib.contextmanager
def decode_compile_settings() -> Iterator[None]:
    """What dynamo traces the decode path with; the bodies' first runs happen inside it.

    Every input size its own symbol: by default dynamo gives sizes that are equal at the
    first call one symbol ("duck sizing"), and a graph body's inputs are slices of fixed
    buffers: where the first batch equalled the length of one of them (the slot header's
    four fields at a batch of 4, the per-sequence rows at the largest bucket), the body
    compiled for that size only, and every other bucket compiled it again.

    Python floats as constants: with dynamic shapes dynamo makes a module's float attributes
    (an RMSNorm's epsilon, attention's scale) symbols too, then finds that our attention op
    needs its scale as a number, specialises it, and traces the whole layer again from the
    start, on a warm cache as on a cold one (docs/PERFORMANCE.md).
    """
    with (
        symbolic_shapes_config.patch(use_duck_shape=False),
        dynamo_config.patch(specialize_float=True),
    ):
        yield


def dynamo_graphs() -> int:
    """How many graphs dynamo has compiled in this process."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compile_phases(top: int = 10) -> str:
    """Where dynamo and inductor have spent their time in this process, in seconds."""
    from torch._dynamo.utils import compile_times

    names, totals = compile_times(repr="csv", aggregate=True)
    longest = sorted(zip(names, map(float, totals), strict=True), key=lambda p: -p[1])
    return ", ".join(f"{name} {seconds:.1f}" for name, seconds in longest[:top])
