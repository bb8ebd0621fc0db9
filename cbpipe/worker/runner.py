"""Runs one step: copy in, carry over, forward, sample, copy out, on three streams.

Slot ownership on the worker side (the scheduler's side is in ``scheduler/loop.py``):

- The host input region of slot k is the worker's from the ``Step`` message until the H2D copy
  that reads it completes; the worker never reads it after that.
- The device input buffer of slot k is written by the H2D copy only after the compute of the
  step that last used slot k is done (``compute_done[k]``).
- The device output buffer of slot k is written by sampling only after the D2H copy of the
  step that last used it is done (``d2h_done[k]``).
- ``last_sampled`` (device) is written by every step's sampling and read by the next step's
  carry-over; both run on the compute stream, in launch order, and the scheduler only ever
  carries over from the step it sent just before (checked against ``carry_from_slot``).
- The host output region of slot k is written by the D2H copy; ``StepDone`` is sent only after
  ``d2h_done[k]`` has completed, and from then on it is the scheduler's.

On the CPU the streams and events are absent and each call runs to completion.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedModel

from cbpipe.protocol.messages import Step, StepDone
from cbpipe.protocol.slots import HEADER_FIELDS, SlotLayout
from cbpipe.worker.attention import (
    DecodeGraphStep,
    DecodeKernel,
    KVCache,
    ModelAttention,
    PagedStep,
    PrefillKernel,
    StepAttention,
)
from cbpipe.worker.cuda_graphs import DecodeGraphs, tuning_batch
from cbpipe.worker.sampler import SamplingInputs, sample

Sampler = Callable[[torch.Tensor, SamplingInputs], tuple[torch.Tensor, torch.Tensor]]

log = logging.getLogger(__name__)

_NUM_SEQS = HEADER_FIELDS.index("num_seqs")
_WIDTH = HEADER_FIELDS.index("block_table_width")


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


# Inductor picks each element-wise kernel's tiles by timing a handful of candidates on its
# first launch; kernels of a few microseconds time too noisily for that to settle. On the
# H200 the same 8B rotary kernel of q got 32 x 32 tiles (2.9 us) in one start-up and 128 x 32
# (5.1 us) in the next, and before the cache writes left inductor's graph the keys' kernel
# swung from 7 to 19 us a layer (session 6 in docs/PERFORMANCE.md). Without the timing every
# start-up gets inductor's first candidate, the same each time; reductions are still timed.
_COMPILE_OPTIONS = {"triton.autotune_pointwise": False}


def _compile(fn: Callable) -> Callable:
    """``fn`` through ``torch.compile``: dynamic shapes, element-wise tiles not timed."""
    return torch.compile(fn, dynamic=True, options=_COMPILE_OPTIONS)


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
    launched_ns: int
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
        return StepDone(
            self.step.step,
            self.step.slot,
            self.recv_ns,
            start_ns,
            end_ns,
            launched_ns=self.launched_ns,
            reported_ns=time.perf_counter_ns(),
        )


class StepRunner:
    def __init__(
        self,
        model: PreTrainedModel,
        attention: ModelAttention,
        kv_cache: KVCache,
        layout: SlotLayout,
        segment: memoryview,
        device: torch.device,
        *,
        decode_kernel: DecodeKernel | None = None,
        prefill_kernel: PrefillKernel | None = None,
        graph_batch_sizes: Sequence[int] = (),
        compile_decode: bool = False,
    ) -> None:
        """``attention``: the model's layers as the load-time probe found them, and the binding
        through which each step's attention reaches them.

        ``graph_batch_sizes``: decode batch sizes to capture CUDA graphs for (none: eager).

        On the CPU they are not captured but run as the same fixed-size body (for tests).
        ``compile_decode``: run the graphs' forward through ``torch.compile``, which fuses the
        small element-wise kernels between the matrix products and the attention op.
        """
        self.model = model
        self.attention = attention
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
        self._last_d2h: torch.cuda.Event | None = None  # the last launched step's outputs copied
        self.decode_kernel = decode_kernel
        self.prefill_kernel = prefill_kernel
        # Sizes vary only by bucket; dynamic shapes give one compiled graph for all of them.
        self._compiled = compile_decode
        self._decode_model = _compile(model) if compile_decode else model
        # Sampling too: its reductions over the vocabulary fuse into a kernel or two. Only in
        # graphs, whose variants (greedy or not, no top-k/top-p) all compile at capture.
        self._decode_sample = _compile(sample) if compile_decode else sample
        max_seqs = layout.limits.max_seqs
        # The sampled ids of the step launched last; the next step's carry-over reads them,
        # ordered after the write by the compute stream.
        self.last_sampled = torch.zeros(max_seqs, dtype=torch.int64, device=device)
        self._row_ids = torch.arange(max_seqs, device=device)
        self._last_slot: int | None = None
        self.graphs = DecodeGraphs()
        if graph_batch_sizes and decode_kernel is None:
            raise ValueError("decode graphs need the Triton decode kernel")
        if self.cuda and (decode_kernel is not None or prefill_kernel is not None):
            self.warm_up()
        if graph_batch_sizes:
            self._capture_graphs(graph_batch_sizes)

    def warm_up(self) -> None:
        """Run eager steps of every shape class a server meets, before it serves.

        Triton compiles a kernel on the host the first time a launch needs a new variant
        (tile sizes follow the longest query; whether a decode splits its keys follows the
        batch size; arguments that change between steps are not specialised, see
        ``kernels.tiles.jit_varying``), for a second or more each: in an H200 run the first
        prefill steps took 1.3-1.7 s instead of 70 ms, with the device idle. So each eager
        step's variants are met here: one decode row beside a prefill of every power-of-two
        length up to the slots' token limit, and decode-only steps of every power-of-two
        batch up to the slots' width. The steps read and write only the cache's padding
        block, through slot 0's own buffers, and nothing is in flight yet.
        """
        started = time.perf_counter()
        limits = self.layout.limits
        beside = min(1, limits.max_seqs - 1)  # a decode row beside each prefill
        longest = limits.max_tokens - beside
        lengths = sorted({1 << i for i in range(longest.bit_length())} | {longest})
        widest = min(limits.max_seqs, limits.max_tokens)
        # Decode-only batches of every power of two: the split count follows the batch size.
        batches = sorted({1 << i for i in range(widest.bit_length())} | {widest})
        shapes = [(beside, n) for n in lengths] + [(b, 0) for b in batches]
        with self._on(self.compute_stream):  # the slot's fills and the steps, in order
            for num_decodes, prefill_len in shapes:
                self._run_padding_step(num_decodes, prefill_len)
        if self.cuda:
            torch.cuda.synchronize(self.device)
        log.info(
            "warmed up %d eager step shapes (prefill up to %d tokens) in %.1f s",
            len(shapes),
            longest,
            time.perf_counter() - started,
        )

    def _run_padding_step(self, num_decodes: int, prefill_len: int) -> None:
        """One eager step through slot 0: ``num_decodes`` decode rows, then a prefill of
        ``prefill_len`` tokens, every row writing and reading the cache's padding block."""
        limits = self.layout.limits
        bs = self.kv_cache.block_size
        width = max(1, -(-prefill_len // bs))
        if width > limits.max_blocks_per_seq:
            return  # longer than a sequence may be
        num_seqs = num_decodes + (1 if prefill_len else 0)
        num_tokens = num_decodes + prefill_len
        query_start = list(range(num_decodes + 1)) + ([num_tokens] if prefill_len else [])
        inputs = self.slots[0].inputs
        inputs["header"][_WIDTH] = width
        inputs["header"][_NUM_SEQS] = num_seqs
        inputs["input_ids"][:num_tokens] = 0
        inputs["carry_mask"][:num_tokens] = False
        inputs["positions"][:num_tokens].copy_(
            torch.tensor([0] * num_decodes + list(range(prefill_len)))
        )
        inputs["slot_mapping"][:num_tokens] = self.kv_cache.padding_slot
        inputs["query_start"][: num_seqs + 1].copy_(torch.tensor(query_start))
        inputs["context_lens"][:num_decodes] = 1
        inputs["context_lens"][num_decodes:num_seqs] = prefill_len
        inputs["block_tables"][: num_seqs * width] = self.kv_cache.num_blocks  # padding
        inputs["temperature"][:num_seqs] = 0.0
        step = Step(
            step=-1,
            slot=0,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            num_single_token_seqs=num_decodes,
            max_query_len=max(prefill_len, 1),
            max_context_len=max(prefill_len, 1),
            block_table_width=width,
            carry_from_slot=None,
            all_greedy=True,
            needs_top_k_top_p=False,
        )
        self._compute(step, self.slots[0])

    def _capture_graphs(self, batch_sizes: Sequence[int]) -> None:
        if max(batch_sizes) > self.layout.limits.max_seqs:
            raise ValueError(
                f"graph batch sizes {list(batch_sizes)} exceed the slots' "
                f"{self.layout.limits.max_seqs} sequences"
            )
        started = time.perf_counter()
        self.graphs.capture(
            self._decode_graph_body,
            batch_sizes=batch_sizes,
            slots=self.slots,
            stream=self.compute_stream,
            first_batch=tuning_batch(batch_sizes) if self._compiled else None,
        )
        log.info(
            "captured %d decode graphs (batch sizes %s) in %.1f s",
            len(self.graphs),
            self.graphs.batch_sizes,
            time.perf_counter() - started,
        )

    def _event(self, timing: bool = False) -> torch.cuda.Event | None:
        return torch.cuda.Event(enable_timing=timing) if self.cuda else None

    def _slot_buffers(self, host: torch.Tensor, slot: int) -> SlotBuffers:
        layout = self.layout
        base = layout.slot_offset(slot)
        host_input = host[base : base + layout.input_nbytes]
        host_output = host[base + layout.output_offset : base + layout.slot_nbytes]
        # Zeros, not garbage: graph replays read rows past a step's own (their ids must be
        # valid indices), before any step has written them.
        device_input = torch.zeros_like(host_input, device=self.device)
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

    def recalibrate_clock(self) -> None:
        """Anchor the device clock anew if the device is idle (nothing launched is still
        running); called when no step has come for a while. Host and device clocks drift
        apart by parts per million, which over a compiling start-up of 100 s or more is
        tenths of a millisecond: enough to misplace device spans against the CPU's in a
        trace of 3 ms steps. A step in flight keeps the clock it was launched with."""
        if self.cuda and (self._last_d2h is None or self._last_d2h.query()):
            self.clock = DeviceClock(self.device)

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
        if header != (step.step, step.num_tokens, step.num_seqs, step.block_table_width):
            raise RuntimeError(
                f"slot {step.slot} holds step/tokens/seqs/width {header}, "
                f"but step {step.step} was announced"
            )
        if step.carry_from_slot is not None and step.carry_from_slot != self._last_slot:
            raise RuntimeError(
                f"step {step.step} carries over from slot {step.carry_from_slot}, "
                f"but the step launched last used slot {self._last_slot}"
            )
        self._last_slot = step.slot
        graph = self.graphs.find(step)
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
            if graph is not None:
                graph.replay()
            else:
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
        self._last_d2h = self.d2h_done[k]
        launched_ns = time.perf_counter_ns()
        if not self.cuda:
            return LaunchedStep(step, recv_ns, launched_ns, compute_ns=(start_ns, end_ns))
        assert compute_start is not None and compute_end is not None
        return LaunchedStep(
            step, recv_ns, launched_ns, self.d2h_done[k], (compute_start, compute_end), self.clock
        )

    @torch.inference_mode()
    def _compute(self, step: Step, slot: SlotBuffers) -> None:
        """Any step, eagerly; shapes follow the step's sizes."""
        t, s = step.num_tokens, step.num_seqs
        inputs = slot.inputs
        input_ids = self._carry_over(inputs, t, valid=None)
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
            block_table_width=inputs["header"][_WIDTH : _WIDTH + 1],
            num_single_token_seqs=step.num_single_token_seqs,
            max_query_len=step.max_query_len,
            max_context_len=step.max_context_len,
            kv_group_size=self.attention.kv_group_size,
            windows=self.attention.windows,
            decode_kernel=self.decode_kernel,
            prefill_kernel=self.prefill_kernel,
        )
        # Only each sequence's last row needs logits; a decode-only step needs them all.
        decode_only = step.num_single_token_seqs == s
        logits_rows = 0 if decode_only else query_start[1:].long() - 1
        logits = self._forward(self.model, input_ids, positions, paged, logits_rows)
        self._sample(slot, logits, s, step.all_greedy, step.needs_top_k_top_p)

    @torch.inference_mode()
    def _decode_graph_body(self, slot: SlotBuffers, batch: int, all_greedy: bool) -> None:
        """A decode-only step padded to ``batch`` rows, with no host value that varies.

        How many rows are real and how wide the block tables are come from the slot header's
        device copy; padding rows write their keys to the cache's padding block and attend
        nothing, and their samples land past the ``num_seqs`` rows anyone reads.
        """
        inputs = slot.inputs
        valid = self._row_ids[:batch] < inputs["header"][_NUM_SEQS]  # [batch]
        input_ids = self._carry_over(inputs, batch, valid)
        slot_mapping = torch.where(
            valid, inputs["slot_mapping"][:batch], self.kv_cache.padding_slot
        )
        context_lens = torch.where(valid, inputs["context_lens"][:batch], 0)
        paged = DecodeGraphStep(
            self.kv_cache,
            slot_mapping,
            context_lens,
            inputs["block_tables"],
            inputs["header"][_WIDTH : _WIDTH + 1],
        )
        positions = inputs["positions"][:batch]
        logits = self._forward(self._decode_model, input_ids, positions, paged, logits_rows=0)
        self._sample(
            slot, logits, batch, all_greedy, needs_top_k_top_p=False, sampler=self._decode_sample
        )

    def _carry_over(
        self, inputs: dict[str, torch.Tensor], num_rows: int, valid: torch.Tensor | None
    ) -> torch.Tensor:
        """Input ids with the carried rows' tokens taken from the last step's samples."""
        carry = inputs["carry_mask"][:num_rows]
        if valid is not None:
            carry = carry & valid
        carried = self.last_sampled[inputs["carry_src"][:num_rows].long()]
        return torch.where(carry, carried, inputs["input_ids"][:num_rows])

    def _forward(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        paged: StepAttention,
        logits_rows: torch.Tensor | int,
    ) -> torch.Tensor:
        # The step reaches every layer's attention through the binding, whatever the model's
        # layers pass on (attention/binding.py); it is unbound when the forward returns.
        with self.attention.binding.bind(paged):
            return model(
                input_ids=input_ids[None],
                position_ids=positions[None],
                logits_to_keep=logits_rows,
                use_cache=False,
            ).logits[0]

    def _sample(
        self,
        slot: SlotBuffers,
        logits: torch.Tensor,  # [num_seqs, vocab]
        num_seqs: int,
        all_greedy: bool,
        needs_top_k_top_p: bool,
        sampler: Sampler = sample,
    ) -> None:
        inputs = slot.inputs
        ids, logprobs = sampler(
            logits,
            SamplingInputs(
                temperature=inputs["temperature"][:num_seqs],
                top_p=inputs["top_p"][:num_seqs],
                top_k=inputs["top_k"][:num_seqs],
                seed=inputs["seed"][:num_seqs],
                output_index=inputs["output_index"][:num_seqs],
                all_greedy=all_greedy,
                needs_top_k_top_p=needs_top_k_top_p,
            ),
        )
        slot.outputs["sampled_ids"][:num_seqs].copy_(ids)
        slot.outputs["sampled_logprobs"][:num_seqs].copy_(logprobs)
        self.last_sampled[:num_seqs].copy_(ids)

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
