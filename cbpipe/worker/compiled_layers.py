"""The decode forward under ``torch.compile``, one decoder layer at a time.

Compiling the whole forward traces and lowers every layer: for an 8B model 32 copies of one
graph, which took most of a cold start-up (docs/PERFORMANCE.md). A transformers model's
layers are instances of one class (``_no_split_modules`` names it), and dynamo compiles a
module's forward as a function of its parameters and buffers, so the graph compiled for the
first layer serves every layer that passes its guards: the same shapes and the same
attention variant (Gemma 2's sliding and global layers are two graphs). The KV cache is
reached the same way, as buffers of each attention module (``attention.attach_kv_cache``).

The layers' siblings in the decoder, the modules that run once a step between the embedding
and the head (the final norm, the rotary tables), are compiled too, each its own small
graph: eagerly each is a handful of kernels of a microsecond or two (the final norm's mean a
float32 reduction over the rows), which inductor makes one. The embedding, the head and the
glue in the decoder's own forward run eagerly; inside a CUDA graph that costs no launches,
only the fusions across those edges.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

ModuleCompiler = Callable[[torch.nn.Module], torch.nn.Module]


def compile_layers(
    model: torch.nn.Module, compile_module: ModuleCompiler, *, siblings: bool = True
) -> torch.nn.Module:
    """A forward of ``model`` in which each decoder layer, and each of their siblings but the
    embeddings (unless ``siblings`` is false: ``profile_step.py``'s comparison), runs
    ``compile_module(module)``.

    ``model`` itself is untouched (prefill steps run it eagerly): the result is a shallow copy
    of the module tree down to the compiled modules, sharing every parameter and buffer. A
    model that names no layer class is compiled whole.
    """
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())

    def is_layer_list(module: torch.nn.Module | None) -> bool:
        return isinstance(module, torch.nn.ModuleList) and any(
            type(child).__name__ in layer_classes for child in module
        )

    def rebuilt(module: torch.nn.Module) -> torch.nn.Module:
        if type(module).__name__ in layer_classes:
            return compile_module(module)
        decoder = siblings and any(is_layer_list(c) for c in module._modules.values())

        def replaced(child: torch.nn.Module) -> torch.nn.Module:
            if decoder and _runs_once_a_step(child):
                return compile_module(child)
            return rebuilt(child)  # the layer list among them

        children = {
            name: child if child is None else replaced(child)
            for name, child in module._modules.items()
        }
        if all(children[name] is child for name, child in module._modules.items()):
            return module  # nothing below it compiled: share it as it is
        clone = copy.copy(module)
        clone._modules = children  # type: ignore[assignment]
        return clone

    decode = rebuilt(model)
    return decode if decode is not model else compile_module(model)


def _runs_once_a_step(module: torch.nn.Module) -> bool:
    """Whether a sibling of the layers is worth a graph of its own: not an embedding (one
    gather, and the prefill's token lookups share it), not a container (the layer list is
    one), and holding work."""
    if isinstance(module, torch.nn.Embedding | torch.nn.ModuleList | torch.nn.ModuleDict):
        return False
    return not isinstance(module, torch.nn.Dropout | torch.nn.Identity)
