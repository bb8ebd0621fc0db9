"""The byte layout of the shared-memory slots, defined once for both sides.

The segment holds a small heartbeat table (``liveness.py``), then ``num_slots`` slots back to
back. A slot has three regions, each a
dataclass below whose fields describe its arrays (dtype, capacity, meaning):

- ``StepInputs``, written by the scheduler and copied host-to-device by the worker in one
  transfer of its used prefix (``block_tables`` comes last and is packed with a per-step row
  width, so a step copies only ``input_nbytes_used(...)`` bytes);
- ``StepExtras``, written by the scheduler only for steps that need them (logit-bias entries,
  structured output's token masks, prompt log-probability targets) and copied only then,
  each field up to what the step uses;
- ``StepOutputs``, written device-to-host by the worker as one range, read by the scheduler.
  Its fields come in groups (``OUTPUT_GROUPS``) ordered so that what a step asks for is
  always a prefix: the sampled ids, then top alternatives, then prompt log-probabilities.

Every field is a fixed-capacity flat array at a fixed, 64-byte aligned offset; a step fills a
prefix of each and the step message says how long the prefixes are. Both sides build typed
views of these classes (``StepInputs[np.ndarray]`` here, ``StepInputs[torch.Tensor]`` in the
worker), so a misspelled field is an attribute error that mypy reports, not a ``KeyError``.

Ownership (who may touch a slot when) is written next to the code that hands it over: the
scheduler's step loop and the worker's step runner.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

import numpy as np

from cbpipe.protocol.liveness import TABLE_NBYTES
from cbpipe.protocol.sampling import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS, MAX_TOP_LOGPROBS

ALIGN = 64
HEADER_FIELDS = ("step", "num_tokens", "num_seqs", "block_table_width")
# EOS ids a model may declare (generation configs list a handful at most).
MAX_EOS_TOKEN_IDS = 16
# Logit-bias entries one sequence may need in a step: its logit_bias, then the ban of its EOS
# and stop tokens while it is short of min_tokens (or the entries that lift that ban).
MAX_BIAS_ENTRIES_PER_SEQ = MAX_LOGIT_BIAS + MAX_STOP_TOKEN_IDS + MAX_EOS_TOKEN_IDS

A = TypeVar("A")  # the array type of a view: numpy arrays, or torch tensors in the worker
Region = Literal["inputs", "extras", "outputs"]


@dataclass(frozen=True)
class SlotLimits:
    """Capacities a slot is sized for; they are the engine's per-step limits."""

    max_tokens: int  # tokens per step (prefill chunks + decode rows)
    max_seqs: int  # sequences per step
    max_blocks_per_seq: int  # KV blocks a sequence can hold (max_model_len / block_size)
    # Tokens a structured-output mask covers (the model's vocabulary); 0: no room for masks.
    vocab_size: int = 0

    def __post_init__(self) -> None:
        for name in ("max_tokens", "max_seqs", "max_blocks_per_seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"SlotLimits.{name} must be >= 1")
        if self.vocab_size < 0:
            raise ValueError("SlotLimits.vocab_size must be >= 0")

    @property
    def mask_words(self) -> int:
        """int32 words of one token mask: a bit per token of the vocabulary."""
        return -(-self.vocab_size // 32)


@dataclass(frozen=True)
class FieldSpec:
    name: str
    dtype: str  # numpy dtype name
    length: Callable[[SlotLimits], int]
    region: Region
    doc: str


def _per_token(limits: SlotLimits) -> int:
    return limits.max_tokens


def _per_seq(limits: SlotLimits) -> int:
    return limits.max_seqs


def _slot_field(dtype: str, length: Callable[[SlotLimits], int], doc: str) -> Any:
    return field(metadata={"dtype": dtype, "length": length, "doc": doc})


@dataclass(frozen=True)
class StepInputs(Generic[A]):
    """What a step computes on: written by the scheduler, copied to the device as a prefix."""

    header: A = _slot_field(
        "int64",
        lambda _: len(HEADER_FIELDS),
        "step number and sizes, repeated from the Step message to detect a stale slot; the "
        "device reads num_seqs and block_table_width from its copy (CUDA graphs take no "
        "host arguments)",
    )
    input_ids: A = _slot_field(
        "int64", _per_token, "token id per row; ignored where carry_mask is set"
    )
    positions: A = _slot_field("int64", _per_token, "position of each row in its sequence")
    slot_mapping: A = _slot_field(
        "int64", _per_token, "flat KV-cache index (block * block_size + offset) each row writes"
    )
    carry_mask: A = _slot_field(
        "bool", _per_token, "row takes its token from the previous step's sampled ids"
    )
    carry_src: A = _slot_field(
        "int32", _per_token, "sequence index in the previous step whose sampled id this row takes"
    )
    query_start: A = _slot_field(
        "int32",
        lambda lim: lim.max_seqs + 1,
        "row offset of each sequence; sequence s has rows [query_start[s], [s+1])",
    )
    context_lens: A = _slot_field(
        "int32", _per_seq, "KV length of each sequence once this step's rows are written"
    )
    temperature: A = _slot_field("float32", _per_seq, "0 means greedy")
    top_p: A = _slot_field("float32", _per_seq, "nucleus mass; 1 keeps all")
    top_k: A = _slot_field("int32", _per_seq, "0 keeps all")
    min_p: A = _slot_field(
        "float32", _per_seq, "drop tokens below min_p times the top token's probability"
    )
    presence_penalty: A = _slot_field("float32", _per_seq, "subtracted once a token was output")
    frequency_penalty: A = _slot_field("float32", _per_seq, "subtracted per time it was output")
    repetition_penalty: A = _slot_field(
        "float32", _per_seq, "divides positive (multiplies negative) logits of seen tokens"
    )
    seed: A = _slot_field("int64", _per_seq, "per-sample sampling seed")
    output_index: A = _slot_field(
        "int32",
        _per_seq,
        "index among the sample's outputs of the token sampled here (keys the RNG)",
    )
    request_row: A = _slot_field(
        "int32",
        _per_seq,
        "the request's row in the device's per-request state (token counts, logit bias), "
        "stable while it runs",
    )
    resets_row: A = _slot_field(
        "bool",
        _per_seq,
        "the request took its request_row in this step (new, or resumed after a preemption, "
        "from position 0 or after a cached prefix): the row's state is cleared first",
    )
    num_prompt_tokens: A = _slot_field(
        "int32",
        _per_seq,
        "prompt length: recomputed rows at or past it are outputs, counted for the penalties",
    )
    has_prompt_logprobs: A = _slot_field(
        "bool", _per_seq, "every row of this sequence gets logits for prompt log-probabilities"
    )
    block_tables: A = _slot_field(
        "int32",
        lambda lim: lim.max_seqs * lim.max_blocks_per_seq,
        "row-major [num_seqs, block_table_width] KV block ids",
    )


@dataclass(frozen=True)
class StepExtras(Generic[A]):
    """Inputs few steps need; written and copied only by steps that use them."""

    bias_rows: A = _slot_field(
        "int32",
        lambda lim: lim.max_seqs * MAX_BIAS_ENTRIES_PER_SEQ,
        "request_row of each logit-bias entry; entries [0, Step.num_bias_entries) are set, in "
        "order, after the rows of sequences with resets_row are cleared",
    )
    bias_token_ids: A = _slot_field(
        "int32", lambda lim: lim.max_seqs * MAX_BIAS_ENTRIES_PER_SEQ, "token of each entry"
    )
    bias_values: A = _slot_field(
        "float32",
        lambda lim: lim.max_seqs * MAX_BIAS_ENTRIES_PER_SEQ,
        "the bias the entry's row holds for its token from now on (-inf bans it)",
    )
    prompt_targets: A = _slot_field(
        "int64",
        _per_token,
        "the token that follows each row's, for rows of sequences with prompt_logprobs",
    )
    mask_seqs: A = _slot_field(
        "int32",
        _per_seq,
        "sequence index of each token mask; masks [0, Step.num_token_masks) are set, and "
        "applied before the logit-bias entries",
    )
    token_masks: A = _slot_field(
        "int32",
        lambda lim: lim.max_seqs * lim.mask_words,
        "row-major [num_token_masks, mask_words] bits: token t may be sampled where bit t % 32 "
        "of word t // 32 is set (llguidance's layout); the row's bias is -inf elsewhere",
    )


def _top_per_seq(limits: SlotLimits) -> int:
    return limits.max_seqs * MAX_TOP_LOGPROBS


def _top_per_token(limits: SlotLimits) -> int:
    return limits.max_tokens * MAX_TOP_LOGPROBS


@dataclass(frozen=True)
class StepOutputs(Generic[A]):
    """What a step produced: copied device-to-host as one range, a prefix of the groups."""

    sampled_ids: A = _slot_field("int64", _per_seq, "token sampled for each sequence")
    sampled_logprobs: A = _slot_field(
        "float32", _per_seq, "log-probability of the sampled token under the model's distribution"
    )
    top_ids: A = _slot_field(
        "int32",
        _top_per_seq,
        f"[max_seqs, {MAX_TOP_LOGPROBS}] most likely tokens of each sequence, best first",
    )
    top_logprobs: A = _slot_field("float32", _top_per_seq, "their log-probabilities")
    prompt_logprobs: A = _slot_field(
        "float32",
        _per_token,
        "log-probability of each row's prompt_target, for sequences with prompt_logprobs",
    )
    prompt_top_ids: A = _slot_field(
        "int32", _top_per_token, f"[max_tokens, {MAX_TOP_LOGPROBS}] most likely next tokens"
    )
    prompt_top_logprobs: A = _slot_field("float32", _top_per_token, "their log-probabilities")


REGIONS: dict[Region, type] = {
    "inputs": StepInputs,
    "extras": StepExtras,
    "outputs": StepOutputs,
}
# A step copies back the output fields up to the last one of the last group it needs.
OUTPUT_GROUPS = {
    "sampled": ("sampled_ids", "sampled_logprobs"),
    "top": ("top_ids", "top_logprobs"),
    "prompt": ("prompt_logprobs", "prompt_top_ids", "prompt_top_logprobs"),
}


def _specs() -> tuple[FieldSpec, ...]:
    specs = []
    for region, cls in REGIONS.items():
        for f in dataclasses.fields(cls):
            meta = f.metadata
            specs.append(FieldSpec(f.name, meta["dtype"], meta["length"], region, meta["doc"]))
    # Layouts are keyed by name: one name in two regions would give both views one array.
    names = [spec.name for spec in specs]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise TypeError(f"slot fields named in more than one region: {duplicates}")
    return tuple(specs)


FIELDS: tuple[FieldSpec, ...] = _specs()


@dataclass(frozen=True)
class FieldLayout:
    spec: FieldSpec
    offset: int  # from the start of the slot
    length: int  # capacity in elements

    @property
    def itemsize(self) -> int:
        return np.dtype(self.spec.dtype).itemsize

    @property
    def nbytes(self) -> int:
        return self.length * self.itemsize


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class SlotLayout:
    """Offsets of every field of one slot, and of the slots within the segment."""

    limits: SlotLimits
    num_slots: int
    fields: Mapping[str, FieldLayout]
    region_offsets: Mapping[Region, tuple[int, int]]  # [start, end) of each region in a slot
    slot_nbytes: int

    @classmethod
    def build(cls, limits: SlotLimits, num_slots: int = 2) -> SlotLayout:
        if num_slots < 2:
            raise ValueError("double buffering needs at least two slots")
        fields: dict[str, FieldLayout] = {}
        regions: dict[Region, tuple[int, int]] = {}
        offset = 0
        for region in REGIONS:
            start = offset
            for spec in (f for f in FIELDS if f.region == region):
                layout = FieldLayout(spec, offset, spec.length(limits))
                fields[spec.name] = layout
                offset = _align(offset + layout.nbytes)
            regions[region] = (start, offset)
        return cls(limits, num_slots, fields, regions, offset)

    @property
    def segment_nbytes(self) -> int:
        """The heartbeat table (``liveness.TABLE_NBYTES``), then the slots."""
        return TABLE_NBYTES + self.num_slots * self.slot_nbytes

    def slot_offset(self, slot: int) -> int:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.num_slots})")
        return TABLE_NBYTES + slot * self.slot_nbytes

    def region(self, name: Region) -> tuple[int, int]:
        """``[start, end)`` of a region, in bytes from the start of a slot."""
        return self.region_offsets[name]

    def input_nbytes_used(self, num_seqs: int, block_table_width: int) -> int:
        """Bytes of the input region a step actually uses: everything up to its block tables."""
        tables = self.fields["block_tables"]
        return tables.offset + num_seqs * block_table_width * tables.itemsize

    def output_nbytes_used(self, *, top_logprobs: bool, prompt_logprobs: bool) -> int:
        """Bytes from the output region's start that a step's copy back must cover."""
        group = "prompt" if prompt_logprobs else "top" if top_logprobs else "sampled"
        last = self.fields[OUTPUT_GROUPS[group][-1]]
        return last.offset + last.nbytes - self.region("outputs")[0]

    def views(self, cls: type[Any], make: Callable[[FieldLayout], Any]) -> Any:
        """An instance of region class ``cls`` whose fields are ``make(field_layout)``."""
        return cls(**{f.name: make(self.fields[f.name]) for f in dataclasses.fields(cls)})


@dataclass(frozen=True)
class SlotViews(Generic[A]):
    """Typed views of one slot's three regions."""

    inputs: StepInputs[A]
    extras: StepExtras[A]
    outputs: StepOutputs[A]


def numpy_views(buffer: memoryview, layout: SlotLayout, slot: int) -> SlotViews[np.ndarray]:
    """Writable numpy arrays over one slot's fields (full capacity, flat)."""
    base = layout.slot_offset(slot)

    def array(f: FieldLayout) -> np.ndarray:
        return np.frombuffer(buffer, dtype=f.spec.dtype, count=f.length, offset=base + f.offset)

    return SlotViews(
        layout.views(StepInputs, array),
        layout.views(StepExtras, array),
        layout.views(StepOutputs, array),
    )
