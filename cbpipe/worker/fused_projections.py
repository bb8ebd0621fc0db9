"""One matrix product for the projections that read the same input: q|k|v, and gate|up.

A decode step multiplies a few rows by every weight, so each product should take the time to
read its weight; small ones do not (on an H200 at batch 32, Llama-3-8B's 8 MB k and v
projections read at 28% of the copy rate, the 48 MB q|k|v matrix at 74%, the 224 MB gate|up
matrix at 93%: ``scripts/bench_matmul.py``). Model code calls ``q_proj(x)``, ``k_proj(x)``,
``v_proj(x)`` one after another, and we keep transformers' modules unmodified, so the fusion
happens below them: the projections of a group are replaced by parts of one ``FusedLinear``.
The first part called with an input computes the whole product and keeps the other parts'
slices for that same input tensor; the others hand them out. A part called with any other
tensor computes its own product, so a model that does not call the group together on one
input still gets correct results, only no faster. The parts' weights are views into the
fused matrix, so fusing takes no extra memory.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

# Sibling projections that read the same input in the models transformers ships (Llama,
# Mistral, Qwen2/3, Gemma, Phi-3's unfused variants, ...).
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class FusedLinear(nn.Module):
    """The concatenated weight of a group, and the product of the input it last saw."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.cat([m.weight for m in linears]), requires_grad=False)
        has_bias = linears[0].bias is not None
        self.bias = (
            nn.Parameter(torch.cat([m.bias for m in linears]), requires_grad=False)
            if has_bias
            else None
        )
        self.sizes = [m.out_features for m in linears]
        # Plain attributes, not buffers: a cached product is one step's activation.
        self._input: torch.Tensor | None = None
        self._outputs: list[torch.Tensor | None] = []  # None: handed out

    def take(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Part ``index`` of the product of ``x``, computed unless it waits in the cache."""
        outputs = self._outputs if self._input is x else []
        if not outputs or outputs[index] is None:
            outputs = list(F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1))
        out = outputs[index]
        assert out is not None
        outputs[index] = None
        if all(o is None for o in outputs):  # every part has had its slice: let go of them
            self._input, self._outputs = None, []
        else:
            self._input, self._outputs = x, outputs
        return out


class FusedPart(nn.Module):
    """Stands in for one projection of a group; ``weight`` and ``bias`` view the fused ones."""

    def __init__(self, fused: FusedLinear, index: int, start: int) -> None:
        super().__init__()
        self.fused = fused
        self.index = index
        end = start + fused.sizes[index]
        self.in_features = fused.weight.shape[1]
        self.out_features = fused.sizes[index]
        # Views of the fused weight, for model code that reads a projection's weight (its
        # dtype, its shape); buffers, so parameters() still counts every weight once, and
        # not persistent, so state_dict() keeps only the fused matrix.
        self.register_buffer("weight", fused.weight[start:end], persistent=False)
        bias = None if fused.bias is None else fused.bias[start:end]
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.take(self.index, x)

    def extra_repr(self) -> str:
        return f"part {self.index} of a fused product, out_features={self.out_features}"


def _fusable(linears: list[nn.Module]) -> bool:
    if not all(type(m) is nn.Linear for m in linears):
        return False
    first = linears[0]
    return all(
        m.in_features == first.in_features
        and m.weight.dtype == first.weight.dtype
        and m.weight.device == first.weight.device
        and (m.bias is None) == (first.bias is None)
        for m in linears
    )


def fuse_projections(model: nn.Module) -> int:
    """Replaces every group of sibling projections in ``model`` by parts of one product.

    Returns the number of groups fused. Modules without such groups are left alone.
    """
    fused_groups = 0
    for module in list(model.modules()):
        for names in GROUPS:
            linears = [getattr(module, name, None) for name in names]
            if not _fusable(linears):
                continue
            fused = FusedLinear(linears)  # type: ignore[arg-type]
            start = 0
            for index, name in enumerate(names):
                setattr(module, name, FusedPart(fused, index, start))
                start += fused.sizes[index]
            fused_groups += 1
    log.debug("fused %d groups of projections into single products", fused_groups)
    return fused_groups
