"""The scheduler's CPU time per step, without a worker: plan, pack, apply and publish, as the
loop does.

The scheduler core and the packer run in the engine's asynchronous call order (step N+1 is
planned and packed before step N's sampled ids are applied) over a mixed workload; the
sampled ids are whatever the output region holds, since only the bookkeeping is timed. Jobs
come in through the frontend, and each step's updates are published through it to a socket
that encodes every frame (``--num-clients`` clients, jobs dealt round robin); the clients'
part of a step, decoding those frames into their jobs' states, is timed apart. Times are
process CPU time, so a busy machine disturbs them less than wall time would.

    python scripts/bench_scheduler.py --num-requests 1024 --max-num-seqs 256

With ``--detokenize --tokenizer T`` every request streams text, as requests to a model with a
tokenizer do by default: the scheduler's text stage (``cbpipe/detokenizer.py``) decodes each
sampled id (drawn at random across T's vocabulary) and matches stop strings. Add
``--text-here`` for clients that make the text themselves from T (as the HTTP server does):
the scheduler sends ids only, and the text's cost moves to the clients' part.

With ``--step-interval-ms D`` the loop sleeps D ms between steps, as the engine's scheduler
waits for the worker between its bursts: a step's bookkeeping costs more CPU when its data
has gone cold in the meantime than when steps run back to back (docs/PERFORMANCE.md, session
42: on one 2-core CPU, 20 ms between steps made a step's CPU 1.5-2.6x; 3 ms, about 1.1x).

With ``--structured F --tokenizer T`` a fraction F of the requests follow a JSON schema
(structured output): their masks are computed by llguidance over T's vocabulary when their
steps are packed, and their sampled ids are drawn from those masks, untimed, as a worker
would sample them.
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import random
import select
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from cbpipe.client import SamplingOptions
from cbpipe.client.jobs import JobState, submit_frame
from cbpipe.collector import CollectorPacing
from cbpipe.detokenizer import Detokenizer
from cbpipe.protocol.messages import Finished, Step, Tokens, decode
from cbpipe.protocol.slots import SlotLayout, SlotLimits, SlotViews
from cbpipe.scheduler.block_manager import BlockManager
from cbpipe.scheduler.core import RequestUpdate, Scheduler, StepPlan
from cbpipe.scheduler.frontend import Frontend, ModelInfo
from cbpipe.scheduler.loop import young_threshold
from cbpipe.scheduler.packer import BatchPacker
from cbpipe.scheduler.structured import Grammars

PARTS = ("schedule", "pack", "update", "publish", "clients")


class ClientsSocket:
    """The frontend's client socket: the frames are built and encoded, and kept for the
    clients' part until ``deliver`` routes them into the jobs' states."""

    def __init__(self, inbox: list[list[bytes]]) -> None:
        self.inbox = inbox
        self.outbox: list[bytes] = []
        self.jobs: dict[int, JobState] = {}  # by request id: unique over the clients here

    def recv_multipart(self, copy: bool = True) -> list[bytes]:
        return self.inbox.pop()

    def send_multipart(self, parts: list[bytes], flags: int = 0) -> None:
        self.outbox.append(parts[1])

    def deliver(self) -> None:
        """What the clients do with the frames: decode each, apply it to its jobs."""
        jobs = self.jobs
        for frame in self.outbox:
            message = decode(frame)
            if isinstance(message, Tokens):
                for entry, request_id in enumerate(message.request_ids):
                    jobs[request_id].on_tokens(message, entry)
            elif isinstance(message, Finished):
                jobs[message.request_id].on_finished(message)
        self.outbox.clear()


# A record of the kind tool calls and extraction ask for, whose strings and arrays have no
# bound: with sampled tokens drawn at random from the masks, most outputs run to their length.
SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city"],
            },
        },
        "required": ["name", "age", "tags", "address"],
    }
)


def load_tokenizer(path: str) -> Any:
    """A Hugging Face tokenizer (a folder or a tokenizer.json), or ``synthetic:N``: a
    byte-level BPE of N tokens trained on this Python's own sources, for machines without a
    real one (Llama 3's size is 128000 and some: ``synthetic:128000``)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if path.startswith("synthetic:"):
        path = str(synthetic_tokenizer(int(path.removeprefix("synthetic:"))))
    if path.endswith(".json"):
        return PreTrainedTokenizerFast(tokenizer_file=path)
    return AutoTokenizer.from_pretrained(path)


def synthetic_tokenizer(size: int) -> Path:
    """A tokenizer.json of ``size`` tokens, trained once (tens of seconds) and kept in the
    system's temporary folder."""
    import sysconfig
    import tempfile

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = Path(tempfile.gettempdir()) / f"cbpipe-synthetic-tokenizer-{size}.json"
    if path.exists():
        return path
    paths = sysconfig.get_paths()
    folders = sorted({Path(paths["stdlib"]), Path(paths["purelib"])})
    sources = sorted(f for folder in folders for f in folder.rglob("*.py"))

    def texts(limit: int = 150_000_000) -> Any:
        total = 0
        for source in sources:
            text = source.read_text(errors="ignore")
            total += len(text)
            yield text
            if total > limit:
                return

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts(), trainer)
    tokenizer.save(str(path))
    return path


def sample_from_masks(
    views: SlotViews[np.ndarray], step: Step, layout: SlotLayout, rng: random.Random
) -> None:
    """Each constrained sequence's sampled id, drawn from its mask, as a worker would sample
    it (the other sequences' ids are whatever the output region holds)."""
    words = layout.limits.mask_words
    for index in range(step.num_token_masks):
        mask = views.extras.token_masks[index * words : (index + 1) * words]
        # A random allowed token: of a random word that allows any, a random bit.
        nonzero = np.flatnonzero(mask)
        word = int(nonzero[rng.randrange(len(nonzero))])
        bits = [bit for bit in range(32) if (int(mask[word]) >> bit) & 1]
        views.outputs.sampled_ids[views.extras.mask_seqs[index]] = word * 32 + rng.choice(bits)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-batch-tokens", type=int, default=2048)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(64, 1024), metavar=("LO", "HI"))
    p.add_argument("--output-len", type=int, nargs=2, default=(64, 512), metavar=("LO", "HI"))
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the engine's default; prompts share --shared-prefix tokens",
    )
    p.add_argument("--shared-prefix", type=int, default=0, help="tokens every prompt starts with")
    p.add_argument("--num-clients", type=int, default=1, help="clients the jobs come from")
    p.add_argument(
        "--structured", type=float, default=0.0, help="fraction of requests under a JSON schema"
    )
    p.add_argument(
        "--detokenize",
        action="store_true",
        help="requests stream text as well as token ids (the default of a model with a "
        "tokenizer): the scheduler's text stage, over --tokenizer's vocabulary",
    )
    p.add_argument(
        "--text-here",
        action="store_true",
        help="with --detokenize: the clients make the text (as the HTTP server does), the "
        "scheduler sends token ids",
    )
    p.add_argument(
        "--tokenizer",
        help="a Hugging Face tokenizer (a folder or a tokenizer.json), or synthetic:N (a "
        "byte-level BPE of N tokens trained here on Python's sources)",
    )
    p.add_argument(
        "--step-interval-ms",
        type=float,
        default=0.0,
        help="sleep this long between steps, as the engine's scheduler waits for the device "
        "(0: back to back)",
    )
    p.add_argument(
        "--gc",
        choices=("paced", "default"),
        default="paced",
        help="paced: the engine's CollectorPacing (full collections off the step path, the "
        "young generation sized for the steps); "
        "default: Python's automatic collections",
    )
    args = p.parse_args()
    if args.step_interval_ms < 0:
        p.error(f"--step-interval-ms must be 0 or more, not {args.step_interval_ms:g}")
    return args


def main() -> None:
    args = parse_args()
    max_len = args.shared_prefix + args.prompt_len[1] + args.output_len[1]
    blocks_per_seq = -(-max_len // args.block_size)
    tokenizer, vocab, grammars = None, 32000, None
    if args.text_here and not args.detokenize:
        raise SystemExit("--text-here needs --detokenize")
    if args.structured or args.detokenize:
        if not args.tokenizer:
            raise SystemExit("--structured and --detokenize need --tokenizer")
        tokenizer = load_tokenizer(args.tokenizer)
        vocab = len(tokenizer)
    if args.structured:
        grammars = Grammars(tokenizer, vocab, [])
    limits = SlotLimits(args.max_batch_tokens, args.max_num_seqs, blocks_per_seq, vocab_size=vocab)
    layout = SlotLayout.build(limits)
    segment = memoryview(mmap.mmap(-1, layout.segment_nbytes))
    # Room for every running sequence at full length: no preemption in the measurement.
    blocks = BlockManager(
        args.max_num_seqs * blocks_per_seq, args.block_size, prefix_caching=args.prefix_caching
    )
    scheduler = Scheduler(
        blocks, max_num_seqs=args.max_num_seqs, max_batch_tokens=args.max_batch_tokens
    )
    packer = BatchPacker(segment, layout, args.block_size)
    inbox: list[list[bytes]] = []
    clients = ClientsSocket(inbox)
    detokenizer = Detokenizer(tokenizer) if args.text_here else None
    frontend = Frontend(
        clients,  # type: ignore[arg-type]
        scheduler,
        ModelInfo("bench", vocab, max_len, frozenset()),
        tokenizer=tokenizer,
        max_waiting_requests=args.num_requests,
        grammars=grammars,
    )
    rng = random.Random(args.seed)
    np_rng = np.random.default_rng(args.seed)
    shared = [rng.randrange(vocab) for _ in range(args.shared_prefix)]
    # The intake's CPU a submit, on each side of the socket: the client builds and encodes
    # the frame (``submit_frame``), the frontend decodes, checks and queues it.
    client_s = frontend_s = 0.0
    for i in range(args.num_requests):
        prompt = shared + [rng.randrange(vocab) for _ in range(rng.randint(*args.prompt_len))]
        constrained = rng.random() < args.structured
        options: SamplingOptions = {"ignore_eos": True, "seed": i, "detokenize": args.detokenize}
        if constrained:
            options["structured_output"] = {"json": SCHEMA}
        client = f"client-{i % args.num_clients}".encode()
        start = time.process_time()
        params, frame = submit_frame(
            i, prompt, rng.randint(*args.output_len), options, 1 << 30, text_here=args.text_here
        )
        client_s += time.process_time() - start
        clients.jobs[i] = JobState(i, params, detokenizer)
        inbox.append([client, frame])
        start = time.process_time()
        frontend.receive()
        frontend_s += time.process_time() - start
    while frontend.preparation is not None and frontend._preparing:  # constraints compiling
        select.select([frontend.preparation.fileno()], [], [], 60)
        frontend.on_jobs_prepared()

    cpu_ms: dict[str, list[float]] = {"decode-only": [], "with prefill": []}
    # Each part's CPU time in steps of a full engine, by kind of step.
    part_ms: dict[tuple[str, str], list[float]] = defaultdict(list)
    # Full-batch steps by step number, and the blocks cached at each.
    full_batch_ms: dict[tuple[str, int], list[float]] = defaultdict(list)
    cached_blocks: list[int] = []
    full_batch_sizes: dict[str, list[tuple[int, int]]] = defaultdict(list)
    # Full decode-only steps by whether sequences in them took a new block (and published
    # the one they filled), and how many did: a block's end costs the plan extra bookkeeping.
    crossing_ms: dict[bool, list[float]] = {True: [], False: []}
    blocks_taken: list[int] = []
    pauses_ms: dict[int, list[float]] = {0: [], 1: [], 2: []}
    collector_started = [0.0]

    def on_collection(phase: str, info: dict) -> None:
        if phase == "start":
            collector_started[0] = time.perf_counter()
        else:
            pauses_ms[info["generation"]].append((time.perf_counter() - collector_started[0]) * 1e3)

    collector = CollectorPacing()
    if args.gc == "paced":
        collector.start(young_threshold(args.max_num_seqs))
    gc.callbacks.append(on_collection)
    in_flight: list[tuple[StepPlan, int, Step]] = []

    def apply_oldest() -> tuple[float, list[RequestUpdate]]:
        plan, slot, packed = in_flight.pop(0)
        start = time.process_time()
        updates = scheduler.update(plan, packer.read_output(slot, packed))
        return time.process_time() - start, updates

    started = time.perf_counter()
    step = 0
    while scheduler.requests:
        if args.step_interval_ms:
            time.sleep(args.step_interval_ms / 1e3)
        free_blocks = blocks.num_free_blocks
        start = time.process_time()
        plan = scheduler.schedule()
        num_taken = free_blocks - blocks.num_free_blocks
        if not plan.seqs:  # everything left waits on the step in flight
            frontend.publish(apply_oldest()[1])
            continue
        planned = time.process_time()
        previous = in_flight[-1][1] if in_flight else None
        packed = packer.pack(plan, step % 2, previous)
        packed_at = time.process_time()
        views = packer.views(step % 2)
        if args.detokenize:  # text of tokens drawn across the vocabulary, not of token 0
            views.outputs.sampled_ids[: packed.num_seqs] = np_rng.integers(
                0, vocab, packed.num_seqs
            )
        sample_from_masks(views, packed, layout, rng)
        parts = {"schedule": planned - start, "pack": packed_at - planned}
        in_flight.append((plan, step % 2, packed))
        updates: list[RequestUpdate] = []
        if len(in_flight) == 2:
            parts["update"], updates = apply_oldest()
        elapsed = sum(parts.values())
        # The loop streams a step's results after the next step is sent, as here.
        start = time.process_time()
        frontend.publish(updates)
        published = time.process_time()
        parts["publish"] = published - start
        clients.deliver()
        clients_s = time.process_time() - published
        if args.gc == "paced":
            collector.between_steps()
        kind = "decode-only" if packed.is_decode_only else "with prefill"
        cpu_ms[kind].append(elapsed * 1e3)
        # A full engine: comparable steps (a constrained request waiting for its token is
        # running but not in the step).
        if len(scheduler.running) == args.max_num_seqs:
            full_batch_ms[kind, step].append(elapsed * 1e3)
            if packed.is_decode_only:
                crossing_ms[num_taken > 0].append(elapsed * 1e3)
                if num_taken > 0:
                    blocks_taken.append(num_taken)
            full_batch_sizes[kind].append((packed.num_seqs, packed.num_token_masks))
            cached_blocks.append(blocks.num_cached_blocks)
            for part, seconds in parts.items():
                part_ms[kind, part].append(seconds * 1e3)
            part_ms[kind, "clients"].append(clients_s * 1e3)
        step += 1
    while in_flight:
        frontend.publish(apply_oldest()[1])
    clients.deliver()
    unfinished = [job.request_id for job in clients.jobs.values() if not job.done]
    assert not unfinished, f"jobs the clients never saw finish: {unfinished[:8]}"

    gc.callbacks.remove(on_collection)
    collector.stop()
    interval = f", {args.step_interval_ms:g} ms between steps" if args.step_interval_ms else ""
    print(f"{args.num_requests} requests, {step} steps in {time.perf_counter() - started:.1f} s"
          f" (garbage collection: {args.gc}{interval})")  # fmt: skip
    print(
        f"intake: {client_s / args.num_requests * 1e6:.1f} us of CPU a submit in the client, "
        f"{frontend_s / args.num_requests * 1e6:.1f} us in the scheduler's frontend"
    )
    print(
        f"prefix cache: {blocks.num_cached_blocks} blocks cached at the end, "
        f"{blocks.num_hit_tokens} of {blocks.num_query_tokens} prompt tokens found"
    )
    half = step // 2
    for kind in cpu_ms:  # does a step cost more as the run goes on, and the cache fills?
        early = [t for (k, n), ts in full_batch_ms.items() if k == kind and n < half for t in ts]
        late = [t for (k, n), ts in full_batch_ms.items() if k == kind and n >= half for t in ts]
        if early and late:
            print(
                f"{kind:>13}: full-batch steps in the run's first half: median "
                f"{statistics.median(early):.3f} ms ({len(early)}), second half "
                f"{statistics.median(late):.3f} ms ({len(late)})"
            )
    if cached_blocks:
        print(
            f"  blocks cached during full-batch steps: {min(cached_blocks)} to {max(cached_blocks)}"
        )
    if crossing_ms[True]:
        others = crossing_ms[False]
        print(
            f"  decode-only: full-batch steps in which sequences took a new block: "
            f"{len(crossing_ms[True])} ({statistics.mean(blocks_taken):.1f} blocks a step), "
            f"median {statistics.median(crossing_ms[True]):.3f} ms; the others: {len(others)}"
            + (f", median {statistics.median(others):.3f} ms" if others else "")
        )
    for kind, values in cpu_ms.items():
        if values:
            values.sort()
            p90 = values[int(0.9 * (len(values) - 1))]
            p99 = values[int(0.99 * (len(values) - 1))]
            print(f"{kind:>13}: {len(values):5d} steps, CPU per step (plan + pack + apply) "
                  f"median {statistics.median(values):.3f} ms, p90 {p90:.3f} ms, "
                  f"p99 {p99:.3f} ms, max {values[-1]:.3f} ms")  # fmt: skip
    for kind in cpu_ms:
        medians = [
            f"{part} {statistics.median(part_ms[kind, part]):.3f}"
            for part in PARTS
            if part_ms[kind, part]
        ]
        if medians:
            print(f"{kind:>13}: full-batch steps, median CPU ms per part: " + ", ".join(medians)
                  + " (the clients' part is not the scheduler's)")  # fmt: skip
            seqs, masks = zip(*full_batch_sizes[kind], strict=True)
            print(f"{kind:>13}: full-batch steps, {statistics.mean(seqs):.1f} sequences and "
                  f"{statistics.mean(masks):.1f} token masks a step")  # fmt: skip
    for generation, values in pauses_ms.items():
        longest = f", longest {max(values):.3f} ms" if values else ""
        print(f"  generation {generation} collections: {len(values)}{longest}")


if __name__ == "__main__":
    main()
