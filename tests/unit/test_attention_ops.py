"""The custom ops that decode graphs and ``torch.compile`` see: their fake (meta) kernels
must describe the real outputs, or inductor's checks fail on models whose query is a
transposed view (gpt-oss, Gemma 2 under ``--compile-decode``)."""

from __future__ import annotations

import pytest
import torch

import cbpipe.worker.attention  # noqa: F401  (registers the ops)


@pytest.mark.parametrize("variant", ["plain", "window-softcap-sinks"])
def test_decode_attention_op_fake_matches_the_kernel(variant: str) -> None:
    torch.manual_seed(0)
    rows, heads, kv_heads, head_dim, bs = 3, 4, 2, 16, 8
    # [heads, rows, head_dim] transposed to [rows, heads, head_dim], as the model hands it.
    query = torch.randn(heads, rows, head_dim).transpose(0, 1)
    k_cache = torch.randn(5 * bs, kv_heads, head_dim)
    v_cache = torch.randn_like(k_cache)
    tables = torch.arange(5, dtype=torch.int32).repeat(rows)[: rows * 5]
    width = torch.tensor([5])
    lens = torch.tensor([3, 17, 40], dtype=torch.int32)
    # The rows' own keys and values, stored at the slot of each row's last position.
    key = torch.randn(kv_heads, rows, head_dim).transpose(0, 1)
    value = torch.randn(rows, kv_heads, head_dim)
    slots = torch.tensor([tables[s * 5 + (n - 1) // bs] * bs + (n - 1) % bs for s, n in
                          enumerate(lens.tolist())])  # fmt: skip
    window, softcap, sinks = (12, 2.0, torch.randn(heads)) if variant != "plain" else (None,) * 3
    args = (query, key, value, k_cache, v_cache, slots, tables, width, lens, bs, 0.25, window,
            softcap, sinks)  # fmt: skip
    torch.library.opcheck(
        torch.ops.cbpipe.decode_attention.default,
        args,
        test_utils=("test_schema", "test_faketensor"),
    )
