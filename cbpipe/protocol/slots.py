"""The byte layout of the shared-memory slots, defined once for both sides.

The segment holds ``num_slots`` slots back to back. A slot is an input region (written by the
scheduler, copied host-to-device by the worker in one transfer) followed by an output region
(written device-to-host by the worker, read by the scheduler). Every field is a fixed-capacity
array at a fixed, 64-byte aligned offset; the scheduler fills a prefix of each and the step
message says how long the prefixes are.

``block_tables`` comes last in the input region and is packed with a per-step row width, so
the worker copies only ``input_nbytes_used(...)`` bytes rather than the whole capacity.

Ownership (who may touch a slot when) is written next to the code that hands it over: the
scheduler's step loop and the worker's step runner.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np

ALIGN = 64
HEADER_FIELDS = ("step", "num_tokens", "num_seqs", "block_table_width")


@dataclass(frozen=True)
class SlotLimits:
    """Capacities a slot is sized for; they are the engine's per-step limits."""

    max_tokens: int  # tokens per step (prefill chunks + decode rows)
    max_seqs: int  # sequences per step
    max_blocks_per_seq: int  # KV blocks a sequence can hold (max_model_len / block_size)

    def __post_init__(self) -> None:
        for name in ("max_tokens", "max_seqs", "max_blocks_per_seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"SlotLimits.{name} must be >= 1")


@dataclass(frozen=True)
class FieldSpec:
    name: str
    dtype: str  # numpy dtype name
    length: Callable[[SlotLimits], int]
    region: Literal["input", "output"]
    doc: str


def _tokens(limits: SlotLimits) -> int:
    return limits.max_tokens


def _seqs(limits: SlotLimits) -> int:
    return limits.max_seqs


FIELDS: tuple[FieldSpec, ...] = (
    FieldSpec(
        "header",
        "int64",
        lambda _: len(HEADER_FIELDS),
        "input",
        "step number and sizes, repeated from the Step message to detect a stale slot; the "
        "device reads num_seqs and block_table_width from its copy (CUDA graphs take no "
        "host arguments)",
    ),
    FieldSpec(
        "input_ids", "int64", _tokens, "input", "token id per row; ignored where carry_mask is set"
    ),
    FieldSpec("positions", "int64", _tokens, "input", "position of each row in its sequence"),
    FieldSpec(
        "slot_mapping",
        "int64",
        _tokens,
        "input",
        "flat KV-cache index (block * block_size + offset) each row writes",
    ),
    FieldSpec("token_seq", "int32", _tokens, "input", "sequence index of each row"),
    FieldSpec(
        "carry_mask",
        "bool",
        _tokens,
        "input",
        "row takes its token from the previous step's sampled ids",
    ),
    FieldSpec(
        "carry_src",
        "int32",
        _tokens,
        "input",
        "sequence index in the previous step whose sampled id this row takes",
    ),
    FieldSpec(
        "query_start",
        "int32",
        lambda lim: lim.max_seqs + 1,
        "input",
        "row offset of each sequence; sequence s has rows [query_start[s], [s+1])",
    ),
    FieldSpec(
        "context_lens",
        "int32",
        _seqs,
        "input",
        "KV length of each sequence once this step's rows are written",
    ),
    FieldSpec("temperature", "float32", _seqs, "input", "0 means greedy"),
    FieldSpec("top_p", "float32", _seqs, "input", "nucleus mass; 1 keeps all"),
    FieldSpec("top_k", "int32", _seqs, "input", "0 keeps all"),
    FieldSpec("seed", "int64", _seqs, "input", "per-request sampling seed"),
    FieldSpec(
        "output_index",
        "int32",
        _seqs,
        "input",
        "index among the request's outputs of the token sampled here (keys the RNG)",
    ),
    FieldSpec(
        "block_tables",
        "int32",
        lambda lim: lim.max_seqs * lim.max_blocks_per_seq,
        "input",
        "row-major [num_seqs, block_table_width] KV block ids",
    ),
    FieldSpec("sampled_ids", "int64", _seqs, "output", "token sampled for each sequence"),
    FieldSpec(
        "sampled_logprobs",
        "float32",
        _seqs,
        "output",
        "log-probability of the sampled token under the unmodified distribution",
    ),
)


@dataclass(frozen=True)
class FieldLayout:
    spec: FieldSpec
    offset: int  # from the start of the slot
    length: int  # capacity in elements

    @property
    def nbytes(self) -> int:
        return self.length * np.dtype(self.spec.dtype).itemsize


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class SlotLayout:
    """Offsets of every field of one slot, and of the slots within the segment."""

    limits: SlotLimits
    num_slots: int
    fields: Mapping[str, FieldLayout]
    input_nbytes: int  # the input region is [0, input_nbytes)
    slot_nbytes: int

    @classmethod
    def build(cls, limits: SlotLimits, num_slots: int = 2) -> SlotLayout:
        if num_slots < 2:
            raise ValueError("double buffering needs at least two slots")
        fields: dict[str, FieldLayout] = {}
        offset = 0
        for region in ("input", "output"):
            for spec in (f for f in FIELDS if f.region == region):
                layout = FieldLayout(spec, offset, spec.length(limits))
                fields[spec.name] = layout
                offset = _align(offset + layout.nbytes)
            if region == "input":
                input_nbytes = offset
        return cls(limits, num_slots, fields, input_nbytes, offset)

    @property
    def segment_nbytes(self) -> int:
        return self.num_slots * self.slot_nbytes

    def slot_offset(self, slot: int) -> int:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.num_slots})")
        return slot * self.slot_nbytes

    @property
    def output_offset(self) -> int:
        return self.input_nbytes

    def input_nbytes_used(self, num_seqs: int, block_table_width: int) -> int:
        """Bytes of the input region a step actually uses: everything up to its block tables."""
        tables = self.fields["block_tables"]
        return tables.offset + num_seqs * block_table_width * np.dtype(tables.spec.dtype).itemsize


def numpy_views(buffer: memoryview, layout: SlotLayout, slot: int) -> dict[str, np.ndarray]:
    """Writable numpy arrays over one slot's fields (full capacity, flat)."""
    base = layout.slot_offset(slot)
    return {
        name: np.frombuffer(buffer, dtype=f.spec.dtype, count=f.length, offset=base + f.offset)
        for name, f in layout.fields.items()
    }
