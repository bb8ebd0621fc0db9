"""How a step's attention reaches every layer of an unmodified transformers model.

Each model gets an attention function of its own, registered with transformers'
``AttentionInterface`` under a name unique to the model's ``StepBinding``; the model is loaded
with that ``attn_implementation``. While the runner's forward runs, the binding holds the step
(``with binding.bind(step): model(...)``), and every layer's attention call goes to it.

Why not keyword arguments of the model's forward, the way transformers' own continuous
batching passes its metadata? They reach attention only through decoder layers that pass
``**kwargs`` on, and some do not (StableLM's layers drop them): the metadata never arrives.
The binding is the one piece of state this adds, and it is scoped: ``bind`` sets it and always
clears it (also when the forward raises), refuses to nest, and an attention call outside a
``bind`` raises instead of reusing an old step. It is owned by the loaded model's
``ModelAttention`` and passed explicitly to the runner; nothing about it is module-level.

Under ``torch.compile`` dynamo traces the attribute reads through the binding like reads of a
forward argument: the step's tensors become graph inputs, with one compiled graph for every
step (checked on the CPU in ``tests/unit/test_attention_binding.py``). The runner's compiled
forward binds an ``OpaqueStep`` (``paged.py``), which shows dynamo one custom op per layer
and nothing of the step: the op finds the step again through ``bound_step``, by the
binding's number.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import weakref
from collections.abc import Iterator
from typing import Protocol

import torch
from transformers import AttentionInterface

from cbpipe.worker.attention.variant import AttentionVariant, read_call

ATTN_IMPLEMENTATION_PREFIX = "cbpipe_paged"


class StepAttention(Protocol):
    """A step's attention, prepared once per step, called by every layer."""

    def attend(
        self,
        layer: torch.nn.Module,  # the layer's attention module (``paged.layer_cache``)
        variant: AttentionVariant,
        query: torch.Tensor,  # [num_tokens, heads, head_dim]
        key: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
        value: torch.Tensor,
    ) -> torch.Tensor:  # [num_tokens, heads, head_dim]
        """Store the rows' keys and values (where the step has a cache) and attend."""
        ...


# Numbers bindings in the order a process makes them. The registered name must be the same
# in every launch of a model: it is part of the path by which dynamo reaches the attention
# function's arguments, and dynamo names its shape symbols by a hash of that path, so a name
# with an ``id()`` in it changed the compiled forward's cache key in every process and the
# compile cache never served it.
_binding_numbers = itertools.count()
_bindings: weakref.WeakValueDictionary[int, StepBinding] = weakref.WeakValueDictionary()


class StepBinding:
    """The step whose forward is running, for the attention calls of one model."""

    def __init__(self) -> None:
        self._step: StepAttention | None = None
        self.number = next(_binding_numbers)
        _bindings[self.number] = self

    @property
    def attn_implementation(self) -> str:
        """The name this binding's attention function is registered under."""
        return f"{ATTN_IMPLEMENTATION_PREFIX}_{self.number}"

    @contextlib.contextmanager
    def bind(self, step: StepAttention) -> Iterator[None]:
        """Route the attention calls to ``step`` for the duration of the block, then clear."""
        if self._step is not None:
            raise RuntimeError("a step is already bound: forwards of one model do not nest")
        self._step = step
        try:
            yield
        finally:
            self._step = None

    @property
    def bound(self) -> bool:
        return self._step is not None

    @property
    def step(self) -> StepAttention:
        if self._step is None:
            raise RuntimeError(
                "an attention layer ran outside StepBinding.bind: the model was called "
                "without a step"
            )
        return self._step


def bound_step(number: int) -> StepAttention:
    """The step bound now to the binding numbered ``number``: how a custom op, which takes
    no Python objects, reaches the step of the forward it runs in."""
    binding = _bindings.get(number)
    if binding is None:
        raise RuntimeError(f"no attention binding numbered {number} in this process")
    return binding.step


def register(binding: StepBinding) -> str:
    """Register ``binding``'s attention function; returns the ``attn_implementation`` name.

    transformers' registry is global, so each binding gets its own name; the function it
    maps to holds the binding, not a global.
    """
    name = binding.attn_implementation
    AttentionInterface.register(name, functools.partial(paged_attention_forward, binding))
    return name


def paged_attention_forward(
    binding: StepBinding,
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, heads, num_tokens, head_dim]
    key: torch.Tensor,  # [1, kv_heads, num_tokens, head_dim]
    value: torch.Tensor,
    attention_mask: object,
    *args: object,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """The attention function transformers calls; the step bound to ``binding`` answers it."""
    variant = read_call(module, query, key, value, attention_mask, args, kwargs)
    out = binding.step.attend(
        module,
        variant,
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
    )
    return out[None], None  # [1, num_tokens, heads, head_dim]
