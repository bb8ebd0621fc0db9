"""The decode forward under ``torch.compile``, one decoder layer at a time.

Compiling the whole forward traces and lowers every layer: for an 8B model 32 copies of one
graph, which took most of a cold start-up (docs/PERFORMANCE.md). A transformers model's
layers are instances of one class (``_no_split_modules`` names it), and dynamo compiles a
module's forward as a function of its parameters and buffers, so the graph compiled for the
first layer serves every layer that passes its guards: the same shapes and the same
attention variant (Gemma 2's sliding and global layers are two graphs). The KV cache is
reached the same way, as buffers of each attention module (``attention.attach_kv_cache``).

What lies outside the layers (the embedding, the rotary tables, the final norm, the logits)
runs eagerly; inside a CUDA graph that costs no launches, only the fusions across a layer's
edges.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

ModuleCompiler = Callable[[torch.nn.Module], torch.nn.Module]


def compile_layers(model: torch.nn.Module, compile_module: ModuleCompiler) -> torch.nn.Module:
    """A forward of ``model`` in which each decoder layer runs ``compile_module(layer)``.

    ``model`` itself is untouched (prefill steps run it eagerly): the result is a shallow copy
    of the module tree down to the layers, sharing every parameter and buffer, with each
    layer replaced by its compiled wrapper. A model that names no layer class is compiled
    whole.
    """
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())

    def rebuilt(module: torch.nn.Module) -> torch.nn.Module:
        if type(module).__name__ in layer_classes:
            return compile_module(module)
        children = {
            name: child if child is None else rebuilt(child)
            for name, child in module._modules.items()
        }
        if all(children[name] is child for name, child in module._modules.items()):
            return module  # nothing below it compiled: share it as it is
        clone = copy.copy(module)
        clone._modules = children  # type: ignore[assignment]
        return clone

    decode = rebuilt(model)
    return decode if decode is not model else compile_module(model)
