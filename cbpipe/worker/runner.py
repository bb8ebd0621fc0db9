"""Runs one step: copy in, carry over, forward, sample, copy out, on three streams.

Slot ownership on the worker side (the scheduler's side is in ``scheduler/loop.py``):

- The host input region of slot k is the worker's from the ``Step`` message until the H2D copy
  that reads it completes; the worker never reads it after that.
- The device input buffer of slot k is written by the H2D copy only after the compute of the
  step that last used slot k is done (``compute_done[k]``).
- The device output buffer of slot k is written by sampling only after the D2H copy of the
  step that last used it is done (``d2h_done[k]``), and it is read by the next step's
  carry-over on the compute stream, which orders it after the sampling that wrote it.
- The host output region of slot k is written by the D2H copy; ``StepDone`` is sent only after
  ``d2h_done[k]`` has completed, and from then on it is the scheduler's.

On the CPU the streams and events are absent and each call runs to completion.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedModel

from cbpipe.protocol.messages import Step, StepDone
from cbpipe.protocol.slots import SlotLayout
from cbpipe.worker.attention import KVCache, PagedStep
from cbpipe.worker.sampler import SamplingInputs, sample


def _typed_views(buffer: torch.Tensor, layout: SlotLayout, region_offset: int) -> dict:
    """Typed tensors over the fields of one region held in a flat uint8 ``buffer``."""
    views = {}
    for name, f in layout.fields.items():
        start = f.offset - region_offset
        if start < 0 or start + f.nbytes > buffer.numel():
            continue  # the field lives in the other region
        dtype = torch.from_numpy(np.empty(0, dtype=f.spec.dtype)).dtype
        views[name] = buffer[start : start + f.nbytes].view(dtype)
    return views


@dataclass
class SlotBuffers:
    host_input: torch.Tensor  # uint8 view of the shared slot's input region
    host_output: torch.Tensor  # uint8 view of the shared slot's output region
    device_input: torch.Tensor
    device_output: torch.Tensor
    inputs: dict[str, torch.Tensor]  # typed views of device_input
    outputs: dict[str, torch.Tensor]  # typed views of device_output
    header: np.ndarray  # host header, read to check the slot holds the announced step


class DeviceClock:
    """Places CUDA events on the host's ``perf_counter_ns`` clock.

    A reference event is recorded on an idle device and waited for; an event's host time is
    then the reference's host time plus the device time between the two. The error is the
    latency of that one wait (microseconds), and the clocks drift by parts per million.
    """

    def __init__(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)
        self.reference = torch.cuda.Event(enable_timing=True)
        self.reference.record(torch.cuda.current_stream(device))
        self.reference.synchronize()
        self.reference_ns = time.perf_counter_ns()

    def host_ns(self, event: torch.cuda.Event) -> int:
        return self.reference_ns + int(self.reference.elapsed_time(event) * 1e6)


@dataclass
class LaunchedStep:
    """A step whose work is enqueued; ``wait()`` blocks until its outputs are in shared memory.

    On the CPU the work is already done and the compute span is given in host time.
    """

    step: Step
    recv_ns: int
    d2h_done: torch.cuda.Event | None = None
    compute_events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
    clock: DeviceClock | None = None
    compute_ns: tuple[int, int] = (0, 0)

    def wait(self) -> StepDone:
        start_ns, end_ns = self.compute_ns
        if self.d2h_done is not None and self.compute_events is not None:
            assert self.clock is not None
            self.d2h_done.synchronize()
            start_ns, end_ns = (self.clock.host_ns(e) for e in self.compute_events)
        return StepDone(self.step.step, self.step.slot, self.recv_ns, start_ns, end_ns)


class StepRunner:
    def __init__(
        self,
        model: PreTrainedModel,
        kv_cache: KVCache,
        layout: SlotLayout,
        segment: memoryview,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.layout = layout
        self.device = device
        self.cuda = device.type == "cuda"
        host = torch.frombuffer(segment, dtype=torch.uint8, count=layout.segment_nbytes)
        self._registered_ptr: int | None = None
        if self.cuda:
            # Page-lock the shared segment so copies to and from it are asynchronous DMA.
            status = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel(), 0)
            if int(status) != 0:
                raise RuntimeError(f"cudaHostRegister failed with status {status}")
            self._registered_ptr = host.data_ptr()
        self.slots = [self._slot_buffers(host, k) for k in range(layout.num_slots)]
        self.h2d_stream = torch.cuda.Stream(device) if self.cuda else None
        self.compute_stream = torch.cuda.Stream(device) if self.cuda else None
        self.d2h_stream = torch.cuda.Stream(device) if self.cuda else None
        num_slots = layout.num_slots
        self.compute_done = [self._event() for _ in range(num_slots)]
        self.d2h_done = [self._event() for _ in range(num_slots)]
        self.clock = DeviceClock(device) if self.cuda else None

    def _event(self, timing: bool = False) -> torch.cuda.Event | None:
        return torch.cuda.Event(enable_timing=timing) if self.cuda else None

    def _slot_buffers(self, host: torch.Tensor, slot: int) -> SlotBuffers:
        layout = self.layout
        base = layout.slot_offset(slot)
        host_input = host[base : base + layout.input_nbytes]
        host_output = host[base + layout.output_offset : base + layout.slot_nbytes]
        device_input = torch.empty_like(host_input, device=self.device)
        device_output = torch.zeros_like(host_output, device=self.device)
        header = host_input[: layout.fields["header"].nbytes].numpy().view(np.int64)
        return SlotBuffers(
            host_input,
            host_output,
            device_input,
            device_output,
            _typed_views(device_input, layout, 0),
            _typed_views(device_output, layout, layout.output_offset),
            header,
        )

    def close(self) -> None:
        if self._registered_ptr is not None:
            torch.cuda.synchronize(self.device)
            torch.cuda.cudart().cudaHostUnregister(self._registered_ptr)
            self._registered_ptr = None

    def launch(self, step: Step) -> LaunchedStep:
        """Enqueue ``step``; returns at once on CUDA, after the whole step on the CPU."""
        recv_ns = time.perf_counter_ns()
        slot = self.slots[step.slot]
        header = tuple(int(v) for v in slot.header)
        if header != (step.step, step.num_tokens, step.num_seqs):
            raise RuntimeError(
                f"slot {step.slot} holds step/tokens/seqs {header}, "
                f"but step {step.step} was announced"
            )
        used = self.layout.input_nbytes_used(step.num_seqs, step.block_table_width)
        k = step.slot
        with self._on(self.h2d_stream):
            self._wait(self.compute_done[k])
            slot.device_input[:used].copy_(slot.host_input[:used], non_blocking=True)
            h2d_done = self._record()

        compute_start, compute_end = self._event(timing=True), self._event(timing=True)
        with self._on(self.compute_stream):
            self._wait(h2d_done)
            self._wait(self.d2h_done[k])
            self._record(compute_start)
            start_ns = time.perf_counter_ns()
            self._compute(step, slot)
            end_ns = time.perf_counter_ns()
            self._record(compute_end)
            self._record(self.compute_done[k])

        num_seqs = step.num_seqs
        out = self.layout
        with self._on(self.d2h_stream):
            self._wait(self.compute_done[k])
            for name in ("sampled_ids", "sampled_logprobs"):
                f = out.fields[name]
                start = f.offset - out.output_offset
                nbytes = num_seqs * f.nbytes // f.length
                slot.host_output[start : start + nbytes].copy_(
                    slot.device_output[start : start + nbytes], non_blocking=True
                )
            self._record(self.d2h_done[k])
        if not self.cuda:
            return LaunchedStep(step, recv_ns, compute_ns=(start_ns, end_ns))
        assert compute_start is not None and compute_end is not None
        return LaunchedStep(
            step, recv_ns, self.d2h_done[k], (compute_start, compute_end), self.clock
        )

    @torch.inference_mode()
    def _compute(self, step: Step, slot: SlotBuffers) -> None:
        t, s = step.num_tokens, step.num_seqs
        inputs = slot.inputs
        input_ids = inputs["input_ids"][:t]
        if step.carry_from_slot is not None:
            previous = self.slots[step.carry_from_slot].outputs["sampled_ids"]
            carried = previous[inputs["carry_src"][:t].long()]
            input_ids = torch.where(inputs["carry_mask"][:t], carried, input_ids)
        positions = inputs["positions"][:t]
        query_start = inputs["query_start"][: s + 1]
        width = step.block_table_width
        paged = PagedStep.build(
            self.kv_cache,
            slot_mapping=inputs["slot_mapping"][:t],
            positions=positions,
            query_start=query_start,
            context_lens=inputs["context_lens"][:s],
            block_tables=inputs["block_tables"][: s * width].view(s, width),
            num_single_token_seqs=step.num_single_token_seqs,
            max_query_len=step.max_query_len,
            max_context_len=step.max_context_len,
        )
        logits_rows = query_start[1:].long() - 1  # each sequence's last row
        logits = self.model(
            input_ids=input_ids[None],
            position_ids=positions[None],
            logits_to_keep=logits_rows,
            use_cache=False,
            paged=paged,
        ).logits[0]  # [num_seqs, vocab]
        ids, logprobs = sample(
            logits,
            SamplingInputs(
                temperature=inputs["temperature"][:s],
                top_p=inputs["top_p"][:s],
                top_k=inputs["top_k"][:s],
                seed=inputs["seed"][:s],
                output_index=inputs["output_index"][:s],
                all_greedy=step.all_greedy,
                needs_top_k_top_p=step.needs_top_k_top_p,
            ),
        )
        slot.outputs["sampled_ids"][:s].copy_(ids)
        slot.outputs["sampled_logprobs"][:s].copy_(logprobs)

    # --- stream helpers that do nothing on the CPU ----------------------------------------

    def _on(self, stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def _wait(self, event: torch.cuda.Event | None) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def _record(self, event: torch.cuda.Event | None = None) -> torch.cuda.Event | None:
        if not self.cuda:
            return None
        event = event if event is not None else torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event
