"""A step's sampling on the device, and the device slot it reads and writes.

``StepSampling`` holds the samplers (compiled for decode graphs when the decode path is),
the full sampler's per-request state and the sampled ids the next step's carry-over reads.
The runner's decode graph bodies and the compile-ahead processes (``compile_ahead.py``) run
the same ``sample_decode_rows`` on the same kind of ``DeviceSlot``, so what those processes
compile is what the worker's graphs meet.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from cbpipe.protocol.messages import SamplingMode
from cbpipe.protocol.sampling import MAX_TOP_LOGPROBS
from cbpipe.protocol.slots import (
    HEADER_FIELDS,
    REGIONS,
    FieldLayout,
    Region,
    SlotLayout,
    StepExtras,
    StepInputs,
    StepOutputs,
)
from cbpipe.worker.compiling import compile_decode_fn
from cbpipe.worker.cuda_graphs import GraphVariant
from cbpipe.worker.sampler import (
    FullSample,
    FullSamplingInputs,
    SamplingInputs,
    sample,
    sample_full,
    top_alternatives,
)
from cbpipe.worker.sampling_state import SamplingState
from cbpipe.worker.saved_traces import SavedTrace, SavedTraces

_NUM_SEQS = HEADER_FIELDS.index("num_seqs")

Sampler = Callable[[torch.Tensor, SamplingInputs], tuple[torch.Tensor, torch.Tensor]]
FullSampler = Callable[..., FullSample]


@dataclass
class DeviceSlot:
    """A slot's regions in device memory, and typed views of them: what a step's device work
    reads and writes."""

    device_input: torch.Tensor  # uint8, laid out as the shared slot's regions
    device_extras: torch.Tensor
    device_output: torch.Tensor
    inputs: StepInputs[torch.Tensor]
    extras: StepExtras[torch.Tensor]
    outputs: StepOutputs[torch.Tensor]


def device_slot(layout: SlotLayout, device: torch.device) -> DeviceSlot:
    # Zeros, not garbage: graph replays read rows past a step's own (their ids must be valid
    # indices), before any step has written them.
    buffers = {}
    for name in REGIONS:
        start, end = layout.region(name)
        buffers[name] = torch.zeros(end - start, dtype=torch.uint8, device=device)
    return DeviceSlot(
        device_input=buffers["inputs"],
        device_extras=buffers["extras"],
        device_output=buffers["outputs"],
        inputs=typed_views(buffers["inputs"], layout, StepInputs, "inputs"),
        extras=typed_views(buffers["extras"], layout, StepExtras, "extras"),
        outputs=typed_views(buffers["outputs"], layout, StepOutputs, "outputs"),
    )


def real_rows(slot: DeviceSlot, row_ids: torch.Tensor, batch: int) -> torch.Tensor:
    """Which of a padded decode body's ``batch`` rows are the step's own (``[batch]`` bool),
    from the slot header's device copy; ``row_ids`` is ``arange`` over the slot's rows."""
    return row_ids[:batch] < slot.inputs.header[_NUM_SEQS]


def typed_views(buffer: torch.Tensor, layout: SlotLayout, cls: type, region: Region) -> Any:
    """Typed tensors over the fields of one region held in a flat uint8 ``buffer``."""
    region_start = layout.region(region)[0]

    def tensor(f: FieldLayout) -> torch.Tensor:
        start = f.offset - region_start
        dtype = torch.from_numpy(np.empty(0, dtype=f.spec.dtype)).dtype
        return buffer[start : start + f.nbytes].view(dtype)

    return layout.views(cls, tensor)


# The saved trace (``saved_traces.py``) of each sampling variant's compiled sampler: greedy and
# temperature are two specialisations of ``sample``, the full sampler's two with and without
# the sort for top-k and top-p.
_SAMPLE_TRACES = {SamplingMode.GREEDY: "greedy", SamplingMode.RANDOM: "temperature"}
_FULL_TRACES = {False: "full", True: "full-top-k-top-p"}
SAVED_SAMPLERS = (*_SAMPLE_TRACES.values(), *_FULL_TRACES.values())


class StepSampling:
    def __init__(
        self,
        state: SamplingState,
        max_seqs: int,
        device: torch.device,
        *,
        compiled: bool,
        saved: SavedTraces | None = None,
    ) -> None:
        """``compiled``: decode graphs sample through ``torch.compile``d samplers, whose
        reductions over the vocabulary fuse into a kernel or two (eager steps never do).
        ``saved``: where those samplers' traces are loaded from (or saved to, by a writer)."""
        self.state = state
        # The sampled ids of the step launched last; the next step's carry-over reads them,
        # ordered after the write by the compute stream.
        self.last_sampled = torch.zeros(max_seqs, dtype=torch.int64, device=device)

        traces = saved if compiled else None  # eager samplers have no trace

        def graph_sampler(fn: Callable, compiled_fn: Callable, trace: str) -> Callable:
            return compiled_fn if traces is None else traces.compiled(fn, trace, compiled_fn)

        compiled_sample = compile_decode_fn(sample) if compiled else sample
        compiled_full = compile_decode_fn(sample_full) if compiled else sample_full
        self._graph_samplers: dict[SamplingMode, Sampler] = {
            mode: graph_sampler(sample, compiled_sample, trace)
            for mode, trace in _SAMPLE_TRACES.items()
        }
        self._graph_full_samplers: dict[bool, FullSampler] = {
            truncation: graph_sampler(sample_full, compiled_full, trace)
            for truncation, trace in _FULL_TRACES.items()
        }

    def warm_up_eager(self) -> None:
        """Run each eager sampler once on a row of zeros, so that the first request of each
        kind compiles nothing: a prefill or mixed step samples through these, where the
        decode graphs (when there are any) compiled their own variants at capture. The
        kernels do not specialise on the row count (``kernels/full_sample.py``), so one row
        stands for every batch. Of the state, touches the spare row only, which no request
        reads: the counts' updates run on it too."""
        state = self.state
        device = state.bias.device
        logits = torch.zeros(1, state.vocab, dtype=torch.float32, device=device)

        def column(value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.full((1,), value, dtype=dtype, device=device)

        # Zeros in the slot's dtypes (ids and positions int64, the rest int32), of which the
        # kernels compile a variant each.
        zero64, zero32 = column(0, torch.int64), column(0, torch.int32)
        seed, output_index = zero64, zero32
        sample(logits, SamplingInputs(column(1.0), seed, output_index, all_greedy=False))
        spare = column(state.spare_row, torch.int64)
        state.count_inputs(spare, zero64, zero64, num_prompt_tokens=zero32)
        state.count_sampled(spare, zero64, context_lens=zero32, samples=column(1, torch.bool))
        for truncation in (False, True):
            sample_full(
                logits,
                state.bias,
                state.output_counts,
                state.seen,
                FullSamplingInputs(
                    temperature=column(1.0), top_p=column(0.9), top_k=column(0, torch.int32),
                    min_p=column(0.1), presence_penalty=column(0.0),
                    frequency_penalty=column(0.0), repetition_penalty=column(1.0), seed=seed,
                    output_index=output_index, rows=spare,
                    truncation=truncation,
                ),
            )  # fmt: skip

    def loaded_traces(self) -> list[str]:
        """The samplers that run a saved trace (``saved_traces.py``), for the start-up log."""
        samplers = [*self._graph_samplers.values(), *self._graph_full_samplers.values()]
        return [s.name for s in samplers if isinstance(s, SavedTrace) and s.loaded is not None]

    def sample_decode_rows(
        self,
        slot: DeviceSlot,
        logits: torch.Tensor,  # [batch, vocab]
        batch: int,
        variant: GraphVariant,
        valid: torch.Tensor,  # [batch] bool: the real rows
        input_ids: torch.Tensor,  # [batch] after carry-over
    ) -> None:
        """The sampling half of a padded decode graph body. With the full sampler the rows'
        tokens are counted first (a sequence of one prompt row may be new), and padding rows
        use the spare state row."""
        if variant.sampling is not SamplingMode.FULL:
            all_greedy = variant.sampling is SamplingMode.GREEDY
            sampler = self._graph_samplers[variant.sampling]
            self.sample(slot, logits, batch, all_greedy, sampler=sampler)
            return
        inputs = slot.inputs
        rows = torch.where(valid, inputs.request_row[:batch].long(), self.state.spare_row)
        positions = inputs.positions[:batch]
        self.state.count_inputs(rows, input_ids, positions, inputs.num_prompt_tokens[:batch])
        self.sample_full(
            slot,
            logits,
            batch,
            rows,
            variant.truncation,
            variant.top_logprobs,
            valid,
            sampler=self._graph_full_samplers[variant.truncation],
        )

    def sample(
        self,
        slot: DeviceSlot,
        logits: torch.Tensor,  # [num_seqs, vocab]
        num_seqs: int,
        all_greedy: bool,
        sampler: Sampler = sample,
    ) -> None:
        inputs = slot.inputs
        ids, logprobs = sampler(
            logits,
            SamplingInputs(
                temperature=inputs.temperature[:num_seqs],
                seed=inputs.seed[:num_seqs],
                output_index=inputs.output_index[:num_seqs],
                all_greedy=all_greedy,
            ),
        )
        slot.outputs.sampled_ids[:num_seqs].copy_(ids)
        slot.outputs.sampled_logprobs[:num_seqs].copy_(logprobs)
        self.last_sampled[:num_seqs].copy_(ids)

    def sample_full(
        self,
        slot: DeviceSlot,
        logits: torch.Tensor,  # [num_seqs, vocab]
        num_seqs: int,
        rows: torch.Tensor,  # [num_seqs] int64 state rows (the spare row for padding)
        truncation: bool,
        top_logprobs: bool,
        valid: torch.Tensor | None = None,  # [num_seqs] bool in a padded graph body
        sampler: FullSampler = sample_full,
    ) -> None:
        """The full sampler, its outputs, and the sampled tokens counted in the state."""
        inputs, n, state = slot.inputs, num_seqs, self.state
        result = sampler(
            logits,
            state.bias,
            state.output_counts,
            state.seen,
            FullSamplingInputs(
                temperature=inputs.temperature[:n],
                top_p=inputs.top_p[:n],
                top_k=inputs.top_k[:n],
                min_p=inputs.min_p[:n],
                presence_penalty=inputs.presence_penalty[:n],
                frequency_penalty=inputs.frequency_penalty[:n],
                repetition_penalty=inputs.repetition_penalty[:n],
                seed=inputs.seed[:n],
                output_index=inputs.output_index[:n],
                rows=rows,
                truncation=truncation,
            ),
        )
        out = slot.outputs
        out.sampled_ids[:n].copy_(result.ids)
        out.sampled_logprobs[:n].copy_(result.logprobs)
        if top_logprobs:  # outside the sampler, whose compiled graph is then the same
            top_ids, top_values = top_alternatives(logits.float(), result.lse)
            k = MAX_TOP_LOGPROBS
            out.top_ids[: n * k].view(n, k).copy_(top_ids)
            out.top_logprobs[: n * k].view(n, k).copy_(top_values)
        self.last_sampled[:n].copy_(result.ids)
        # A sequence samples an output when its rows reach the end of its tokens.
        context_lens = inputs.context_lens[:n]
        samples = context_lens == inputs.num_prompt_tokens[:n] + inputs.output_index[:n]
        if valid is not None:
            samples = samples & valid
        state.count_sampled(rows, result.ids, context_lens, samples)
