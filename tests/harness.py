"""Drive the scheduler core, the packer and the worker's step runner in one process.

No sockets and no shared memory segment: a bytearray stands in for the slots. The order of
calls is the engine's own: in asynchronous mode step N+1 is scheduled and packed before step
N's results are applied, so carry-over, pending tokens and slot reuse are exercised exactly as
the processes exercise them, only faster and deterministically.
"""

from __future__ import annotations

import mmap
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from cbpipe.models import resolve_model
from cbpipe.models.support import reference_attention
from cbpipe.protocol.messages import Step
from cbpipe.protocol.sampling import SamplingParams
from cbpipe.protocol.slots import SlotLayout, SlotLimits
from cbpipe.scheduler.block_manager import BlockManager
from cbpipe.scheduler.core import Scheduler, StepPlan
from cbpipe.scheduler.packer import BatchPacker
from cbpipe.scheduler.request import Request
from cbpipe.scheduler.structured import Grammars
from cbpipe.worker import attention
from cbpipe.worker.blas import BlasLibrary, use_blas_library
from cbpipe.worker.cuda_graphs import Replayable, bucket_sizes
from cbpipe.worker.model_loader import allocate_kv_cache, load_model, load_paged_model
from cbpipe.worker.runner import LaunchedStep, StepRunner
from cbpipe.worker.saved_traces import SavedTraces

CPU = torch.device("cpu")


@cache
def paged_model(
    name: str,
    device: torch.device = CPU,
    dtype: torch.dtype = torch.float32,
    fuse: bool = True,
    max_model_len: int | None = None,
) -> tuple[torch.nn.Module, attention.ModelAttention]:
    return load_paged_model(
        resolve_model(name), device, dtype, fuse=fuse, max_model_len=max_model_len
    )


@cache
def reference_model(
    name: str, device: torch.device = CPU, dtype: torch.dtype = torch.float32
) -> torch.nn.Module:
    """transformers' own attention: SDPA, or eager where the model does not support SDPA or
    soft-caps its attention (``support.reference_attention``)."""
    source = resolve_model(name)
    implementation = reference_attention(source.config)
    return load_model(source, device, dtype, attn_implementation=implementation)


def reference_greedy(
    name: str,
    prompt: list[int],
    max_new_tokens: int,
    eos_token_ids: list[int] | None,
    processors: list[LogitsProcessor] | None = None,
    device: torch.device = CPU,
    **generate_options: object,
) -> list[int]:
    """What transformers' ``generate`` returns for one prompt, greedy, in float32 (on the CPU
    unless ``device`` says otherwise), with ``processors`` and ``generate_options``
    (``repetition_penalty=...``) if given."""
    model = reference_model(name, device)
    output = model.generate(
        torch.tensor([prompt], device=device),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos_token_ids or None,
        pad_token_id=0,
        logits_processor=LogitsProcessorList(processors or []),
        **generate_options,
    )
    return output[0, len(prompt) :].tolist()


def _decode_kernel(backend: str, device: torch.device) -> attention.DecodeKernel | None:
    """The worker's choice; on the CPU, ``triton`` means the kernel under Triton's interpreter
    (``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` there before anything imports it)."""
    if backend == "triton" and device.type == "cpu":
        from cbpipe.worker.kernels.paged_decode import paged_decode_attention

        return paged_decode_attention
    return attention.load_decode_kernel(backend, device)


def _prefill_kernel(backend: str, device: torch.device) -> attention.PrefillKernel | None:
    if backend == "triton" and device.type == "cpu":
        from cbpipe.worker.kernels.paged_prefill import paged_prefill_attention

        return paged_prefill_attention
    return attention.load_prefill_kernel(backend, device)


@dataclass(frozen=True)
class MixedGraphLookup:
    """One lookup of the runner's mixed graphs: the step, its split, the graph (None: eager)."""

    step: Step
    split: bool
    graph: Replayable | None

    @property
    def num_chunks(self) -> int:
        return self.step.num_seqs - self.step.num_single_token_seqs


@dataclass
class InProcessEngine:
    model_name: str
    num_blocks: int = 256
    block_size: int = 16
    max_num_seqs: int = 16
    max_batch_tokens: int = 128
    max_model_len: int = 1024
    eos_token_ids: frozenset[int] = frozenset()
    device: torch.device = CPU
    dtype: torch.dtype = torch.float32
    attention_backend: str = "auto"  # the worker's choice: the Triton kernel on CUDA
    cuda_graphs: bool = True  # on CUDA with the kernel; ignored elsewhere, as in the worker
    compile_decode: bool = False
    prefill_backend: str = "auto"  # "triton" on the CPU: the varlen kernel, interpreted
    fuse_projections: bool = True
    steps_in_flight: int = 3  # in async mode, as the engine's default
    prefix_caching: bool = True  # as the engine's default
    full_sampling_graphs: bool = True
    mixed_graph_tokens: int = 1024  # as the worker's default; needs both Triton kernels
    # As the worker's --blas-library: set for this whole process, the reference's products too.
    blas_library: BlasLibrary = "auto"
    before_sampler_compiles: Callable[[], None] | None = None
    saved_traces: SavedTraces | None = None
    scheduler: Scheduler = field(init=False)
    _next_id: int = 0
    _grammars: Grammars | None = None

    def __post_init__(self) -> None:
        blas = use_blas_library(self.blas_library, self.device)
        model, paged = paged_model(
            self.model_name, self.device, self.dtype, self.fuse_projections, self.max_model_len
        )
        self.vocab_size = int(model.config.get_text_config().vocab_size)
        limits = SlotLimits(
            self.max_batch_tokens,
            self.max_num_seqs,
            -(-self.max_model_len // self.block_size),
            vocab_size=self.vocab_size,
        )
        self.layout = SlotLayout.build(limits, num_slots=self.steps_in_flight)
        # Page-aligned, like a shared-memory segment, so CUDA can register it.
        self.segment = memoryview(mmap.mmap(-1, self.layout.segment_nbytes))
        self.blocks = BlockManager(
            self.num_blocks, self.block_size, prefix_caching=self.prefix_caching
        )
        self.scheduler = Scheduler(
            self.blocks, max_num_seqs=self.max_num_seqs, max_batch_tokens=self.max_batch_tokens
        )
        self.packer = BatchPacker(self.segment, self.layout, self.block_size)
        kv = allocate_kv_cache(paged, self.num_blocks, self.block_size, self.device, self.dtype)
        kernel = _decode_kernel(self.attention_backend, self.device)
        graphs = self.cuda_graphs and kernel is not None
        self.runner = StepRunner(
            model,
            paged,
            kv,
            self.layout,
            self.segment,
            self.device,
            decode_kernel=kernel,
            prefill_kernel=_prefill_kernel(self.prefill_backend, self.device),
            graph_batch_sizes=bucket_sizes(self.max_num_seqs) if graphs else (),
            compile_decode=self.compile_decode,
            full_sampling_graphs=self.full_sampling_graphs,
            before_sampler_compiles=self.before_sampler_compiles,
            saved_traces=self.saved_traces,
            blas=blas,
            mixed_graph_tokens=self.mixed_graph_tokens,
        )

    def record_mixed_graph_lookups(self) -> list[MixedGraphLookup]:
        """From now on, every lookup of the mixed graphs, in order, into the list returned."""
        mixed = self.runner.mixed_graphs
        find, lookups = mixed.find, []

        def recording_find(step: Step, *, split: bool) -> Replayable | None:
            lookups.append(MixedGraphLookup(step, split, find(step, split=split)))
            return lookups[-1].graph

        mixed.find = recording_find  # type: ignore[method-assign]
        return lookups

    def close(self) -> None:
        self.runner.close()

    @property
    def grammars(self) -> Grammars:
        """Structured output's compiler for the model's tokenizer, as the scheduler has it."""
        if self._grammars is None:
            from transformers import AutoTokenizer

            source = resolve_model(self.model_name)
            assert source.tokenizer_path is not None, f"{self.model_name} has no tokenizer"
            tokenizer = AutoTokenizer.from_pretrained(source.tokenizer_path)
            self._grammars = Grammars(tokenizer, self.vocab_size, self.eos_token_ids)
        return self._grammars

    def add(self, prompt: list[int], params: SamplingParams) -> Request:
        self._next_id += 1
        grammar = None
        if params.structured_output is not None:
            grammar = self.grammars.start(params.structured_output)
        req = Request(
            request_id=self._next_id,
            prompt_token_ids=list(prompt),
            params=params,
            seed=params.seed if params.seed is not None else self._next_id,
            max_total_tokens=min(self.max_model_len, self.num_blocks * self.block_size),
            eos_token_ids=self.eos_token_ids,
            grammar=grammar,
        )
        self.scheduler.add_request(req)
        return req

    def run(
        self,
        *,
        mode: str = "async",
        rng: random.Random | None = None,
        arrivals: dict[int, list[tuple[list[int], SamplingParams]]] | None = None,
        cancel_probability: float = 0.0,
        max_steps: int = 100_000,
    ) -> list[Request]:
        """Run until idle. ``mode`` "random" picks anew at every step how many steps may be in
        flight, from sync (one) to ``steps_in_flight``.

        On CUDA the steps really are in flight at once in async mode, as in the worker.

        ``arrivals`` maps a step number to requests submitted just before it.
        """
        rng = rng or random.Random(0)
        arrivals = dict(arrivals or {})
        added: list[Request] = []
        in_flight: deque[tuple[StepPlan, int, LaunchedStep]] = deque()
        slot, steps = 0, 0
        while self.scheduler.requests or in_flight or arrivals:
            steps += 1
            assert steps < max_steps, "engine made no progress"
            for prompt, params in arrivals.pop(steps, []):
                added.append(self.add(prompt, params))
            if not arrivals and not self.scheduler.requests and not in_flight:
                break
            depth = 1 if mode == "sync" else self.steps_in_flight
            if mode == "random":
                depth = rng.randint(1, self.steps_in_flight)
            if len(in_flight) < depth and self.scheduler.has_work:
                plan = self.scheduler.schedule()
                if plan.seqs:
                    previous = in_flight[-1][1] if in_flight else None
                    step = self.packer.pack(plan, slot, previous)
                    # Like the worker: enqueue now, wait only when the results are needed.
                    in_flight.append((plan, slot, self.runner.launch(step)))
                    slot = (slot + 1) % self.layout.num_slots
                    if len(in_flight) < depth:
                        continue
            if in_flight:
                plan, done_slot, launched = in_flight.popleft()
                launched.wait()
                self.scheduler.update(plan, self.packer.read_output(done_slot, launched.step))
                self.scheduler.check_invariants()
            if cancel_probability and self.scheduler.requests and rng.random() < cancel_probability:
                self.scheduler.cancel(rng.choice(list(self.scheduler.requests)))
        return added

    def generate(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        mode: str = "async",
        rng: random.Random | None = None,
    ) -> list[list[int]]:
        reqs = [self.add(p, sp) for p, sp in zip(prompts, params, strict=True)]
        self.run(mode=mode, rng=rng)
        return [r.output_token_ids for r in reqs]
