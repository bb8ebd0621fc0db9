"""What transformers passes the attention function: each argument understood or refused."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cbpipe.worker.attention import AttentionVariant, GatheredRows, UnsupportedAttention, read_call
from cbpipe.worker.attention.torch_rows import gather_index

HEADS, KV_HEADS, TOKENS, HEAD_DIM = 4, 2, 3, 8


class _Attention(torch.nn.Module):
    is_causal = True


def _read(mask: object = None, *args: object, module: Any = None, **kwargs: object):  # type: ignore[no-untyped-def]
    query = torch.zeros(1, HEADS, TOKENS, HEAD_DIM)
    key = value = torch.zeros(1, KV_HEADS, TOKENS, HEAD_DIM)
    return read_call(module or _Attention(), query, key, value, mask, args, kwargs)


def test_plain_call_gets_the_default_scaling() -> None:
    variant = _read(dropout=0.0, position_ids=torch.zeros(1, 3), use_cache=False)
    assert variant.scaling == HEAD_DIM**-0.5
    assert (variant.sliding_window, variant.softcap, variant.sinks) == (None, None, None)


def test_variant_arguments_are_read() -> None:
    sinks = torch.zeros(HEADS)
    variant = _read(scaling=0.1, sliding_window=4096, softcap=50.0, s_aux=sinks)
    assert (variant.scaling, variant.sliding_window, variant.softcap) == (0.1, 4096, 50.0)
    assert variant.sinks is sinks
    assert _read(sinks=sinks).sinks is sinks  # the other name models use


@pytest.mark.parametrize(
    ("call", "reason"),
    [
        (dict(mask=torch.zeros(1, 1, 3, 3)), "builds its own attention mask"),
        (dict(dropout=0.1), "dropout"),
        (dict(is_causal=False), "bidirectional"),
        (dict(position_bias=torch.zeros(1, HEADS, 3, 3)), "position bias"),
        (dict(output_attentions=True), "output_attentions"),
        (dict(sliding_window=0), "sliding_window=0"),
        (dict(softcap=-1.0), "softcap=-1.0"),
        (dict(s_aux=torch.zeros(HEADS + 1)), "s_aux of shape (5,)"),
        (dict(block_sparse_layout=torch.ones(2)), "block_sparse_layout=tensor(2,)"),
        (dict(attention_chunk_size=8192), "attention_chunk_size=8192"),
    ],
    ids=lambda v: next(iter(v)) if isinstance(v, dict) else None,
)
def test_arguments_cbpipe_does_not_compute_are_refused(call: dict, reason: str) -> None:
    mask = call.pop("mask", None)
    with pytest.raises(UnsupportedAttention, match=reason.replace("(", r"\(").replace(")", r"\)")):
        _read(mask, **call)


def test_features_turned_off_are_accepted() -> None:
    """None and False are how transformers passes a feature that is off."""
    _read(output_router_logits=False, cu_seq_lens_q=None, position_bias=None, softcap=None)


def test_bidirectional_modules_are_refused() -> None:
    module = _Attention()
    module.is_causal = False
    with pytest.raises(UnsupportedAttention, match="bidirectional"):
        _read(module=module)


def test_latent_attention_head_sizes_are_refused() -> None:
    query = key = torch.zeros(1, HEADS, TOKENS, 24)
    value = torch.zeros(1, HEADS, TOKENS, 16)
    with pytest.raises(UnsupportedAttention, match="latent attention"):
        read_call(_Attention(), query, key, value, None, (), {})


def _allowed(n: int, window: int) -> torch.Tensor:
    from transformers.masking_utils import sliding_window_causal_mask_function

    pos = torch.arange(n)
    return sliding_window_causal_mask_function(window)(0, 0, pos[:, None], pos[None, :])


@pytest.mark.parametrize("window", [1, 5, 8, 9, 30])
def test_torch_path_masks_match_transformers_sliding_window_masks(window: int) -> None:
    """Prefill rows at every position of one sequence, and decode rows of every length, see
    exactly the keys transformers' sliding-window mask lets them see (blocks of 8)."""
    n, bs = 21, 8
    tables = torch.arange(3, dtype=torch.int32)[None]  # one sequence, blocks 0, 1, 2
    key_pos, kv_index = gather_index(tables, n, bs)
    prefill = GatheredRows.prefill(
        kv_index, key_pos, torch.arange(n), torch.tensor([0, n]), 0, n, 1, [window, None]
    )
    assert torch.equal(prefill.masks[window][0, 0], _allowed(n, window))
    assert torch.equal(prefill.masks[None][0, 0], torch.ones(n, n, dtype=torch.bool).tril())
    lens = torch.arange(1, n + 1)
    decode = GatheredRows.decode(kv_index.expand(n, -1), key_pos, lens, 1, [window])
    assert torch.equal(decode.masks[window][:, 0, 0], _allowed(n, window))


def test_variant_description() -> None:
    variant = AttentionVariant(0.0625, sliding_window=4096, softcap=50.0)
    assert variant.describe() == "scaling 0.0625, sliding window 4096, soft-cap 50"
