"""Fused q|k|v and gate|up products give the unfused model's outputs, and fall back safely."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cbpipe.models import EMBEDDED_MODEL_DIR, resolve_model
from cbpipe.worker.fused_projections import FusedLinear, FusedPart, fuse_projections
from cbpipe.worker.model_loader import load_model


def _load(name: str, fuse: bool) -> nn.Module:
    return load_model(resolve_model(name), torch.device("cpu"), torch.float32, fuse=fuse)


@pytest.mark.parametrize("name", [str(EMBEDDED_MODEL_DIR), "random:qwen2-tiny"])
def test_fused_model_gives_the_same_logits(name: str) -> None:
    plain, fused = _load(name, fuse=False), _load(name, fuse=True)
    layers = plain.config.num_hidden_layers
    assert sum(isinstance(m, FusedLinear) for m in fused.modules()) == 2 * layers
    assert not any(isinstance(m, FusedLinear) for m in plain.modules())
    # The same parameters, once each: the parts' weights are views, not copies.
    assert sum(p.numel() for p in fused.parameters()) == sum(p.numel() for p in plain.parameters())
    ids = torch.randint(
        0, plain.config.vocab_size, (3, 21), generator=torch.Generator().manual_seed(0)
    )
    torch.testing.assert_close(fused(ids).logits, plain(ids).logits, rtol=1e-5, atol=1e-5)
    # Nothing of the step is kept once every part has had its slice.
    assert all(m._input is None for m in fused.modules() if isinstance(m, FusedLinear))


class _Siblings(nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.q_proj = nn.Linear(8, 6, bias=bias)
        self.k_proj = nn.Linear(8, 2, bias=bias)
        self.v_proj = nn.Linear(8, 2, bias=bias)


@pytest.mark.parametrize("bias", [False, True])
def test_parts_called_in_any_order_or_on_other_inputs_are_correct(bias: bool) -> None:
    torch.manual_seed(0)
    module = _Siblings(bias)
    q, k, v = (module.q_proj, module.k_proj, module.v_proj)
    expected = {name: getattr(module, name) for name in ("q_proj", "k_proj", "v_proj")}
    x, other = torch.randn(4, 8), torch.randn(4, 8)
    want = {name: lin(x) for name, lin in expected.items()}
    want_other = {name: lin(other) for name, lin in expected.items()}
    assert fuse_projections(module) == 1
    assert all(isinstance(getattr(module, n), FusedPart) for n in expected)
    del q, k, v

    # Out of order, interleaved with another input, one part asked twice.
    calls = [("v_proj", x), ("k_proj", other), ("q_proj", x), ("q_proj", x), ("k_proj", x),
             ("v_proj", other), ("q_proj", other)]  # fmt: skip
    for name, inp in calls:
        got = getattr(module, name)(inp)
        torch.testing.assert_close(got, (want if inp is x else want_other)[name])
    weight = module.k_proj.weight
    torch.testing.assert_close(weight, expected["k_proj"].weight)
    assert weight.data_ptr() == module.q_proj.fused.weight[6:].data_ptr()  # a view


def test_groups_that_do_not_match_are_left_alone() -> None:
    module = _Siblings(bias=False)
    module.v_proj = nn.Linear(4, 2)  # another input width: not siblings
    assert fuse_projections(module) == 0
    assert isinstance(module.q_proj, nn.Linear)
