"""Paged attention for unmodified transformers models.

- ``variant.py``: what one layer's attention computes (scaling, sliding window, soft-cap,
  sinks), read from the arguments transformers passes the attention function; anything else
  is refused.
- ``binding.py``: the attention function registered with ``AttentionInterface`` for each
  model, and the scoped ``StepBinding`` through which a step reaches every layer.
- ``paged.py``: the steps the runner binds (``PagedStep`` eagerly, ``DecodeGraphStep`` in CUDA
  graphs, either behind ``OpaqueStep`` in a compiled forward) and the ``RowsAttention`` seam
  between a step and a backend.
- ``torch_rows.py`` and ``triton_rows.py``: the backends (gather + SDPA; the Triton kernels).
- ``probe.py``: the load-time probe that refuses models paged attention would serve wrongly.
"""

from cbpipe.worker.attention.binding import StepAttention, StepBinding, register
from cbpipe.worker.attention.paged import (
    DecodeGraphStep,
    KVCache,
    OpaqueStep,
    PagedStep,
    RowsAttention,
    attach_kv_cache,
    layer_cache,
)
from cbpipe.worker.attention.probe import LayerAttention, ModelAttention, probe_model
from cbpipe.worker.attention.torch_rows import GatheredRows, attend_gathered, attend_math
from cbpipe.worker.attention.triton_rows import (
    DecodeKernel,
    PrefillKernel,
    load_decode_kernel,
    load_prefill_kernel,
)
from cbpipe.worker.attention.variant import AttentionVariant, UnsupportedAttention, read_call

__all__ = [
    "AttentionVariant",
    "DecodeGraphStep",
    "DecodeKernel",
    "GatheredRows",
    "KVCache",
    "LayerAttention",
    "ModelAttention",
    "OpaqueStep",
    "PagedStep",
    "PrefillKernel",
    "RowsAttention",
    "StepAttention",
    "StepBinding",
    "UnsupportedAttention",
    "attach_kv_cache",
    "attend_gathered",
    "attend_math",
    "layer_cache",
    "load_decode_kernel",
    "load_prefill_kernel",
    "probe_model",
    "read_call",
    "register",
]
