"""Tensor parallelism: the worker ranks' process group, and each rank's shard of the model.

Every rank runs the same unmodified transformers model over the same packed step; what
differs is which slice of each weight it holds, following the model's own tensor-parallel
plan (``config.base_model_tp_plan`` for the decoder, the model class's ``_tp_plan`` for the
output head), megatron-style:

- ``colwise`` (q, k, v, gate, up): each rank keeps its rows of the weight, i.e. its heads or
  its MLP columns; the layer's output is the rank's part and stays local. The attention
  modules reshape with ``-1`` heads, so they run on the local heads unchanged, and the
  paged KV cache holds only this rank's kv heads.
- ``rowwise`` (o, down): each rank keeps its columns, multiplies its local input part, and
  one all-reduce sums the parts (the bias, if any, is added once, after it).
- ``colwise_gather_output`` (the output head): each rank computes its slice of the
  vocabulary and an all-gather joins them, so every rank holds the same full logits and
  samples the same tokens (the sampler hashes per-request seeds; nothing else is random,
  and the sampler's kernels reduce in fixed orders: the top-k/top-p kernel sums the
  candidates its atomics gather in fixed point, so their order cannot move a cut).
- everything else (embeddings, norms, rotary tables) is replicated.

Why not transformers' own ``tp_plan="auto"``: in transformers 5.24 it needs ``accelerate``
(not a dependency of ours), it exists only in ``from_pretrained`` (the random-weight presets
are built ``from_config``), and it makes the weights ``DTensor``s, whose per-operation
dispatch the decode step would pay and which the fused projections, the CUDA graph capture
and ``torch.compile`` of the decode body do not handle. The plan's names are the model's
own, so we follow them and do the slicing ourselves with plain tensors.

All-reduce and all-gather results are bitwise the same on every rank (gloo and NCCL both
compute each element once and distribute it), so the replicated parts stay identical and the
ranks' carry-over of sampled tokens agrees. With NCCL the collectives are ordinary CUDA
kernels on the current stream, so a decode graph captured on the compute stream contains
them (the communicator is created before capture: ``TensorParallel.join`` runs one
all-reduce).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn
from transformers import PreTrainedModel

from cbpipe.models.support import UnsupportedModel, architecture_name, check_tensor_parallel
from cbpipe.protocol.launch import Rendezvous

log = logging.getLogger(__name__)

COLWISE, ROWWISE, GATHERED = "colwise", "rowwise", "colwise_gather_output"
# Styles we keep whole on every rank: replicating is always correct. The input embeddings
# (``embedding_rowwise``, a vocabulary-parallel lookup) stay whole, so the lookup needs no
# all-reduce, at the cost of their memory on every rank; the other style the plans mark
# for training's gradients.
REPLICATED = frozenset({"embedding_rowwise", "replicated_with_grad_allreduce"})
# A rank that waits this long in a collective gives up (gloo; NCCL aborts too): the
# launcher has long stopped the run by then, this is only the last resort.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
# One all-gather into one tensor: ``all_gather_single`` where torch has it (2.13 deprecates
# the older name with a warning), else ``all_gather_into_tensor`` (torch 2.11 has only that).
_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class TensorParallel:
    """This process's place among the worker ranks; ``group`` is None for a single rank,
    which never touches ``torch.distributed``."""

    rank: int = 0
    world_size: int = 1
    group: dist.ProcessGroup | None = None

    @classmethod
    def join(cls, rendezvous: Rendezvous, rank: int, device: torch.device) -> TensorParallel:
        """Join the run's process group (blocks until every rank has): NCCL on CUDA, gloo on
        the CPU; ranks and world size are given, nothing is read from the environment."""
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=rendezvous.init_method,
            rank=rank,
            world_size=rendezvous.world_size,
            timeout=COLLECTIVE_TIMEOUT,
            device_id=device if device.type == "cuda" else None,
        )
        tp = cls(rank, rendezvous.world_size, dist.group.WORLD)
        # The first collective sets up the communicator: now, not inside a graph capture.
        tp.all_reduce_(torch.ones(1, device=device))
        log.info("rank %d of %d joined over %s", rank, tp.world_size, backend)
        return tp

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place."""
        if self.group is not None:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' ``x`` joined along the last dimension, in rank order."""
        if self.group is None:
            return x
        parts = x.reshape(-1, x.shape[-1]).contiguous()  # [rows, local]
        rows, local = parts.shape
        # Concatenated along the first dimension (gloo takes no other output shape).
        gathered = parts.new_empty((self.world_size * rows, local))  # [ranks * rows, local]
        _all_gather_into(gathered, parts, group=self.group)
        joined = gathered.view(self.world_size, rows, local).permute(1, 0, 2)
        return joined.reshape(*x.shape[:-1], self.world_size * local)

    def min_int(self, value: int, device: torch.device) -> int:
        """The smallest ``value`` any rank passes."""
        t = torch.tensor([value], dtype=torch.int64, device=device)
        if self.group is not None:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def rows(self, size: int) -> slice:
        per_rank = size // self.world_size
        return slice(self.rank * per_rank, (self.rank + 1) * per_rank)


class RowParallelLinear(nn.Linear):
    """This rank's input columns of a linear layer; the output is summed over the ranks.
    An ``nn.Linear`` to transformers' weight initialisation (random presets)."""

    def __init__(self, linear: nn.Linear, tp: TensorParallel) -> None:
        columns = tp.rows(linear.in_features)
        super().__init__(
            columns.stop - columns.start,
            linear.out_features,
            bias=linear.bias is not None,
            device="meta",
            dtype=linear.weight.dtype,
        )
        self.tp = tp
        self.weight = nn.Parameter(linear.weight.detach()[:, columns].contiguous(), False)
        if linear.bias is not None:
            self.bias = nn.Parameter(linear.bias.detach().clone(), False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce_(F.linear(x, self.weight))  # [..., out], the ranks' sum
        return y if self.bias is None else y + self.bias


class GatheredLinear(nn.Linear):
    """This rank's output rows of a linear layer (the output head's slice of the
    vocabulary); the output is every rank's, joined. ``out_features`` is the whole width."""

    def __init__(self, linear: nn.Linear, tp: TensorParallel) -> None:
        rows = tp.rows(linear.out_features)
        super().__init__(
            linear.in_features,
            rows.stop - rows.start,
            bias=linear.bias is not None,
            device="meta",
            dtype=linear.weight.dtype,
        )
        self.tp = tp
        self.full_out_features = linear.out_features
        # A view: a head tied to the (replicated) input embeddings stays tied, in no memory.
        self.weight = nn.Parameter(linear.weight.detach()[rows], False)
        if linear.bias is not None:
            self.bias = nn.Parameter(linear.bias.detach()[rows].clone(), False)

    def tie_to(self, embedding: nn.Embedding) -> None:
        self.weight = nn.Parameter(embedding.weight.detach()[self.tp.rows(self.full_out_features)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_last(F.linear(x, self.weight, self.bias))


def model_tp_plan(model: PreTrainedModel) -> dict[str, str]:
    """The model's tensor-parallel plan over its module names (``model.layers.*.mlp.up_proj``
    -> ``colwise``): the decoder's from the configuration, the head's from the class (an
    instance's ``_tp_plan`` already holds both)."""
    text_config = model.config.get_text_config()
    base = getattr(text_config, "base_model_tp_plan", None) or {}
    prefix = model.base_model_prefix
    plan = {f"{prefix}.{name}" if prefix else name: style for name, style in base.items()}
    plan.update(getattr(model, "_tp_plan", None) or {})
    return plan


def _pattern(name: str) -> re.Pattern[str]:
    return re.compile(re.escape(name).replace(r"\*", r"\d+") + "$")


def check_shardable(model: PreTrainedModel, world_size: int) -> dict[str, str]:
    """Each linear module's style under the plan; raises ``UnsupportedModel`` (naming the
    architecture and the reason) when the ranks cannot split the model exactly."""

    def refuse(reason: str) -> UnsupportedModel:
        arch = architecture_name(model.config)
        return UnsupportedModel(arch, [f"at --tensor-parallel-size {world_size}, {reason}"])

    check_tensor_parallel(model.config, world_size)
    plan = model_tp_plan(model)
    known = {COLWISE, ROWWISE, GATHERED, *REPLICATED}
    unsupported = sorted({s for s in plan.values() if s not in known})
    if unsupported:
        raise refuse(
            f"its tensor-parallel plan uses {', '.join(unsupported)}, which cbpipe does not "
            "shard (it shards colwise, rowwise and colwise_gather_output)"
        )
    patterns = [(_pattern(name), style) for name, style in plan.items()]
    styles: dict[str, str] = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        style = next((s for p, s in patterns if p.match(name)), None)
        if style is None:
            # A product the plan leaves whole would read a sharded input as if it were whole.
            raise refuse(f"its tensor-parallel plan does not say how to split {name}")
        size = module.in_features if style == ROWWISE else module.out_features
        if style not in REPLICATED and size % world_size:
            side = "inputs" if style == ROWWISE else "outputs"
            raise refuse(f"{name}'s {size} {side} do not divide into {world_size} ranks")
        styles[name] = style
    return styles


def shard_model(model: PreTrainedModel, tp: TensorParallel) -> dict[str, str]:
    """Keep this rank's shard of every planned linear layer of ``model`` (in place; the rest
    of each weight is freed, unless a tied module still holds it); returns each linear
    module's style."""
    styles = check_shardable(model, tp.world_size)
    for name, style in styles.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = getattr(parent, child)
        if style == COLWISE:
            rows = tp.rows(linear.out_features)
            linear.weight = nn.Parameter(linear.weight.detach()[rows].contiguous(), False)
            if linear.bias is not None:
                linear.bias = nn.Parameter(linear.bias.detach()[rows].contiguous(), False)
            linear.out_features = rows.stop - rows.start
        elif style == ROWWISE:
            setattr(parent, child, RowParallelLinear(linear, tp))
        elif style == GATHERED:
            setattr(parent, child, GatheredLinear(linear, tp))
    counts = {s: sum(v == s for v in styles.values()) for s in sorted(set(styles.values()))}
    log.info(
        "rank %d of %d: sharded %d linear layers (%s)",
        tp.rank,
        tp.world_size,
        sum(n for s, n in counts.items() if s not in REPLICATED),
        ", ".join(f"{s} {n}" for s, n in counts.items()),
    )
    return styles


def checkpoint_tensors(model: PreTrainedModel, folder: Path) -> dict[str, Path] | None:
    """Where each of ``model``'s parameters lies in the checkpoint's safetensors files, or
    None when the checkpoint is not safetensors or its tensor names are not the model's own
    (transformers converts some checkpoints' weights while loading: those load whole)."""
    where = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt", device="cpu") as handle:
            where.update(dict.fromkeys(handle.keys(), file))
    if not where:
        return None
    tied = model.config.get_text_config().tie_word_embeddings
    head = model.get_output_embeddings()
    head_weight = next((f"{n}.weight" for n, m in model.named_modules() if m is head), None)
    missing = [
        name
        for name, _ in model.named_parameters()
        if name not in where and not (tied and name == head_weight)
    ]
    if missing:
        log.info("%d parameters (%s, ...) are not in the checkpoint under their own names: "
                 "loading it whole", len(missing), missing[0])  # fmt: skip
        return None
    return where


def read_shard(
    model: PreTrainedModel, where: dict[str, Path], styles: dict[str, str], tp: TensorParallel
) -> None:
    """Fill ``model``'s sharded parameters (``shard_model``, materialised) with this rank's
    slices of the checkpoint (``checkpoint_tensors``), reading only those slices: each
    rank's host memory holds its shard, never the whole model."""
    with contextlib.ExitStack() as stack:
        handles = {
            file: stack.enter_context(safe_open(str(file), "pt", device="cpu"))
            for file in set(where.values())
        }
        for name, param in model.named_parameters():
            if name not in where:
                continue  # the tied head: it views the input embeddings (retie_output_head)
            module, _, leaf = name.rpartition(".")
            style, piece = styles.get(module), handles[where[name]].get_slice(name)
            if style in (COLWISE, GATHERED):
                rows = tp.rows(piece.get_shape()[0])
                part = piece[rows.start : rows.stop]
            elif style == ROWWISE and leaf == "weight":
                columns = tp.rows(piece.get_shape()[1])
                part = piece[:, columns.start : columns.stop]
            else:
                part = piece[:]
            with torch.no_grad():
                param.copy_(part)


def retie_output_head(model: PreTrainedModel) -> None:
    """After the weights were materialised anew (``to_empty``): the sharded head of a model
    with tied embeddings views the input embeddings again."""
    head = model.get_output_embeddings()
    if isinstance(head, GatheredLinear) and model.config.get_text_config().tie_word_embeddings:
        embedding = model.get_input_embeddings()
        assert isinstance(embedding, nn.Embedding)
        head.tie_to(embedding)
