"""Offline throughput benchmark, in the spirit of ``vllm bench throughput``.

For each mode (async, sync) it starts its own ``cbpipe-launch``, sends one warm-up request,
then submits every request at once from one client, waits for all results, and measures the
wall time from the first submit to the last result. Prompts are seeded random token ids and
every request runs to its full output length (``ignore_eos``), so both modes do the same work.

    python scripts/bench.py --model random:qwen2-tiny --device cpu --num-requests 8 \\
        --prompt-len 16 --output-len 16
    python scripts/bench.py --model random:llama-8b --num-requests 32 --prompt-len 128 \\
        --output-len 1024 --json out/bench.json

A shared system prompt, with the prefix cache on and off (``--compare-prefix-caching`` runs
each mode again with ``--no-prefix-caching``):

    python scripts/bench.py --model random:llama-8b --num-requests 512 --modes async \\
        --shared-prefix-len 2000 --random-prompt-len 50,150 --output-len 128 \\
        --compare-prefix-caching
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from hf_baseline import BaselineResult, run_transformers  # scripts/, beside this file

from cbpipe.client import Client, Job
from cbpipe.engine_process import EngineProcess
from cbpipe.roofline import DecodeBytes, copy_bandwidth, decode_bytes, floor_seconds
from cbpipe.trace import StepRecord, busy_stats, decode_phase, load_steps

MODES = ("async", "sync")
WARMUP_PROMPT_LEN = 16
WARMUP_OUTPUT_LEN = 8


@dataclass(frozen=True)
class Workload:
    """Per-request prompt and output lengths; the prompts themselves need the vocabulary.
    Every prompt starts with the same ``shared_prefix_len`` tokens, then has its own."""

    prompt_lens: list[int]  # the prompts' own tokens, after the shared prefix
    output_lens: list[int]
    seed: int
    shared_prefix_len: int = 0

    def prompts(self, vocab_size: int) -> list[list[int]]:
        rng = random.Random(self.seed)
        prefix = [rng.randrange(vocab_size) for _ in range(self.shared_prefix_len)]
        return [prefix + [rng.randrange(vocab_size) for _ in range(n)] for n in self.prompt_lens]


@dataclass
class ModeResult:
    mode: str
    num_requests: int
    startup_s: float
    wall_s: float
    prompt_tokens: int
    output_tokens: int
    output_tok_s: float
    total_tok_s: float
    mean_ttft_ms: float
    median_ttft_ms: float
    length_errors: int  # results that did not have exactly their output length
    # Prompt tokens found in the prefix cache over those looked up, during the measurement
    prefix_hit_rate: float | None
    start_ns: int  # perf_counter_ns at the first submit (the clock of the engine's trace)
    submitted_ns: int  # ... and after the last submit returned
    # From the engine's step trace, over the steps planned once every request was submitted
    # (before that, the engine may already step a few early arrivals while the rest are
    # still on their way: one H200 run decoded one request alone for two steps). The decode
    # phase runs from the first decode-only step to the last, with any mixed (prefill +
    # decode) steps in between:
    decode_steps: int = 0  # decode-only steps
    phase_steps: int = 0  # all steps of the decode phase
    device_busy: float = 0.0  # device compute time over the decode phase's span
    median_idle_gap_ms: float = 0.0  # device idle between consecutive steps of the phase
    p99_idle_gap_ms: float = 0.0
    median_step_ms: float = 0.0  # decode-only steps
    p99_step_ms: float = 0.0
    median_scheduler_ms: float = 0.0  # scheduler CPU per step: plan + pack + apply + stream
    # A step's round trip on the host, medians (cbpipe.trace.BusyStats)
    median_to_worker_ms: float = 0.0
    median_launch_ms: float = 0.0
    median_to_scheduler_ms: float = 0.0
    # The phase's idle time by the link that was late for it (cbpipe.trace.BusyStats)
    idle_scheduler_ms: float = 0.0
    idle_worker_ms: float = 0.0
    idle_device_ms: float = 0.0
    # On CUDA only (None elsewhere), over the decode-only steps:
    decode_s: float | None = None  # their device time
    decode_floor_s: float | None = None  # their bytes over the measured bandwidth
    floor_ratio: float | None = None  # decode_s / decode_floor_s
    # With --rehearse: requests whose tokens equal the rehearsal's, on the same engine
    same_as_rehearsal: int | None = None
    # What the wall time holds besides the decode phase: the ramp, from the first submit to
    # the first decode-only step (the prompts' prefill, in steps with prefill rows), and the
    # tail, from the last step's end to the last result in the client's hands.
    ramp_s: float = 0.0
    ramp_steps: int = 0
    ramp_device_s: float = 0.0  # those steps' device time
    tail_ms: float = 0.0


# --- arguments and workload -----------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:llama-1b")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument(
        "--random-prompt-len",
        type=_range,
        metavar="LO,HI",
        help="draw each prompt length uniformly from [LO, HI]",
    )
    p.add_argument(
        "--random-output-len",
        type=_range,
        metavar="LO,HI",
        help="draw each output length uniformly from [LO, HI]",
    )
    p.add_argument("--seed", type=int, default=0, help="seed for lengths and prompts")
    p.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        metavar="N",
        help="every prompt starts with the same N tokens (a system prompt), then has its own",
    )
    p.add_argument(
        "--compare-prefix-caching",
        action="store_true",
        help="run each mode again with --no-prefix-caching",
    )
    p.add_argument("--modes", type=_modes, default=MODES, help="comma list of async, sync")
    p.add_argument(
        "--rehearse",
        action="store_true",
        help="run each mode's workload three times on its engine and report the third, with "
        "how many requests generated the same tokens in the second and third: the mode's "
        "agreement with itself, where only the moments requests reach the scheduler differ "
        "(the first run fills the prefix cache, which the other two read alike)",
    )
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-batch-tokens", type=int)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"))
    p.add_argument(
        "--launch-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="extra cbpipe-launch flag, repeatable: --launch-arg=--block-size=32",
    )
    p.add_argument(
        "--client-tokenizer",
        metavar="PATH",
        help="the client makes the text itself from this tokenizer (a folder, as the HTTP "
        "server does), and the engine sends token ids; without it, an engine that has a "
        "tokenizer makes the text",
    )
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to start")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds for all results")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument(
        "--compare-transformers",
        action="store_true",
        help="also run the workload through transformers' generate_batch and generate on the "
        "same weights, in this process (fixed output length only)",
    )
    p.add_argument(
        "--trace-dir",
        type=Path,
        help="keep each mode's step trace here (trace_MODE.json; default: a temporary folder)",
    )
    args = p.parse_args(argv)
    if args.compare_transformers and args.random_output_len is not None:
        p.error("--compare-transformers needs a fixed --output-len")
    return args


def _range(text: str) -> tuple[int, int]:
    lo, hi = (int(v) for v in text.split(","))
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"need 1 <= LO <= HI, got {text!r}")
    return lo, hi


def _modes(text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    if not modes or any(m not in MODES for m in modes):
        raise argparse.ArgumentTypeError(f"modes are a comma list of {', '.join(MODES)}")
    return modes


def make_workload(args: argparse.Namespace) -> Workload:
    rng = random.Random(args.seed)

    def lengths(fixed: int, drawn: tuple[int, int] | None) -> list[int]:
        if drawn is None:
            return [fixed] * args.num_requests
        return [rng.randint(*drawn) for _ in range(args.num_requests)]

    prompt_lens = lengths(args.prompt_len, args.random_prompt_len)
    output_lens = lengths(args.output_len, args.random_output_len)
    return Workload(prompt_lens, output_lens, args.seed + 1, args.shared_prefix_len)


NO_CACHE = " no-cache"  # the suffix of a run's name with the prefix cache off


def run_names(args: argparse.Namespace) -> list[str]:
    """The runs: each mode, and each again without the prefix cache when comparing."""
    names = list(args.modes)
    if args.compare_prefix_caching:
        names += [mode + NO_CACHE for mode in args.modes]
    return names


def launcher_args(args: argparse.Namespace, run: str) -> list[str]:
    cmd = ["--model", args.model]
    for flag in ("device", "dtype", "max_num_seqs", "max_batch_tokens"):
        value = getattr(args, flag)
        if value is not None:
            cmd += ["--" + flag.replace("_", "-"), str(value)]
    if run.startswith("sync"):
        cmd.append("--sync")
    if run.endswith(NO_CACHE):
        cmd.append("--no-prefix-caching")
    return cmd + list(args.launch_arg)


# --- one mode -------------------------------------------------------------------------------

# What a worker logs at --log-level info about where its start-up went, and what else about
# the run's speed it reports.
_STARTUP_MARKS = (
    "start-up:",
    "compile cache",
    "warmed up",
    "captured ",
    "compile phases",
    "imports and checks",
    "weights read from",
    " ready: ",
    "compiled ahead",
    "saved trace's guards",  # a sampler compiled again: its trace was refused
    "inductor cache",
    "triton cache",
    " WARNING ",  # at every log level: what the engine warned of, at its start or stop
    "caching allocator",  # at --log-level debug: the steps whose launch it stalled
)


def startup_lines(engine_log: str) -> list[str]:
    """The worker's start-up breakdown in an engine's log (empty below --log-level info),
    and the engine's warnings."""
    return [line for line in engine_log.splitlines() if any(m in line for m in _STARTUP_MARKS)]


def run_mode(
    args: argparse.Namespace, mode: str, workload: Workload, trace_dir: Path, floor: Floor | None
) -> tuple[ModeResult, list[list[int]]]:
    """Measure one mode; also returns every request's generated token ids."""
    trace = trace_dir / f"trace_{mode.replace(' ', '_')}.json"
    flags = [*launcher_args(args, mode), "--trace", str(trace)]
    started = time.perf_counter()
    with EngineProcess.start(flags, timeout=args.ready_timeout) as engine:
        try:
            result, outputs = _run_on(engine, args, mode, workload, time.perf_counter() - started)
        except Exception:
            print(f"engine log:\n{engine.stderr}", file=sys.stderr)
            raise
    for line in startup_lines(engine.stderr):  # the stop's lines too
        print(f"{mode} engine: {line}")
    # The scheduler writes the trace as it stops; steps of the warm-up come before the
    # measurement's first submit, and steps of a ramp before its last (ModeResult).
    steps = load_steps(trace)
    measured = [r for r in steps if r.schedule_start_ns >= result.submitted_ns]
    phase = decode_phase(measured)
    decodes = [r for r in phase if r.is_decode_only]
    ramp = ramp_steps(steps, result, phase)
    result = replace(result, **ramp_and_tail(ramp, result, phase))
    print_ramp(mode, ramp)
    stats, decode_stats = busy_stats(phase), busy_stats(decodes)
    if floor is not None and decodes:
        decode_s = sum(r.device_end_ns - r.device_start_ns for r in decodes) / 1e9
        floor_s = floor_seconds(decodes, floor.sizes, floor.bytes_per_second)
        result = replace(
            result,
            decode_s=round(decode_s, 3),
            decode_floor_s=round(floor_s, 3),
            floor_ratio=round(decode_s / floor_s, 3),
        )
    result = replace(
        result,
        decode_steps=len(decodes),
        phase_steps=len(phase),
        device_busy=round(stats.busy_fraction, 4),
        median_idle_gap_ms=round(stats.median_gap_ms, 3),
        p99_idle_gap_ms=round(stats.p99_gap_ms, 3),
        median_step_ms=round(decode_stats.median_step_ms, 3),
        p99_step_ms=round(decode_stats.p99_step_ms, 3),
        median_scheduler_ms=round(stats.median_scheduler_ms, 3),
        median_to_worker_ms=round(stats.median_to_worker_ms, 3),
        median_launch_ms=round(stats.median_launch_ms, 3),
        median_to_scheduler_ms=round(stats.median_to_scheduler_ms, 3),
        idle_scheduler_ms=round(stats.idle_scheduler_ms, 1),
        idle_worker_ms=round(stats.idle_worker_ms, 1),
        idle_device_ms=round(stats.idle_device_ms, 1),
    )
    return result, outputs


def ramp_steps(
    steps: list[StepRecord], result: ModeResult, phase: list[StepRecord]
) -> list[StepRecord]:
    """The steps from the first submit to the decode phase, in device order."""
    if not phase:
        return []
    ordered = sorted(steps, key=lambda r: r.device_start_ns)
    return [r for r in ordered if result.start_ns <= r.device_start_ns < phase[0].device_start_ns]


def ramp_and_tail(
    ramp: list[StepRecord], result: ModeResult, phase: list[StepRecord]
) -> dict[str, float | int]:
    """``ModeResult``'s ramp and tail, on the trace's clock (the client's ``perf_counter``)."""
    if not phase:
        return {}
    end_ns = result.start_ns + result.wall_s * 1e9
    return {
        "ramp_s": round((phase[0].device_start_ns - result.start_ns) / 1e9, 4),
        "ramp_steps": len(ramp),
        "ramp_device_s": round(sum(r.device_end_ns - r.device_start_ns for r in ramp) / 1e9, 4),
        "tail_ms": round((end_ns - phase[-1].device_end_ns) / 1e6, 2),
    }


def print_ramp(mode: str, ramp: list[StepRecord], most: int = 40) -> None:
    """One line a ramp step: its make-up, its device time and the worker's host time to
    enqueue it (a step whose launch takes as long as its device time is bound by the host)."""
    for r in ramp[:most]:
        line = (
            f"{mode} ramp step {r.step}: {r.num_tokens} rows ({r.num_decodes} decodes of "
            f"{r.num_seqs} sequences), device {(r.device_end_ns - r.device_start_ns) / 1e6:.2f} ms"
        )
        if r.worker_recv_ns:  # 0 in traces older than the worker's host times
            line += f", launch {(r.worker_launched_ns - r.worker_recv_ns) / 1e6:.2f} ms"
        print(line)
    if len(ramp) > most:
        print(f"{mode} ramp: {len(ramp) - most} more steps")


def _run_on(
    engine: EngineProcess, args: argparse.Namespace, mode: str, workload: Workload, startup_s: float
) -> tuple[ModeResult, list[list[int]]]:
    with Client(engine.address, tokenizer=args.client_tokenizer) as client:
        lens = zip(workload.prompt_lens, workload.output_lens, strict=True)
        longest = workload.shared_prefix_len + max(p + o for p, o in lens)
        if longest > client.max_model_len:
            raise SystemExit(
                f"prompt + output of {longest} tokens exceeds the engine's "
                f"max_model_len of {client.max_model_len}"
            )
        vocab = client.vocab_size
        warm_up(client, vocab)
        prompts = workload.prompts(vocab)
        run = functools.partial(measure, client, mode, prompts, workload.output_lens, startup_s)
        if not args.rehearse:
            return run(args.timeout)
        # The first run computes the prompts that the later ones find in the prefix cache:
        # a run after it prefills along another path, whose rounding differs in bfloat16.
        run(args.timeout)
        _, rehearsed = run(args.timeout)
        result, outputs = run(args.timeout)
        same = sum(a == b for a, b in zip(rehearsed, outputs, strict=True))
        return replace(result, same_as_rehearsal=same), outputs


def warm_up(client: Client, vocab: int) -> None:
    prompt = [random.Random(-1).randrange(vocab) for _ in range(WARMUP_PROMPT_LEN)]
    client.generate([prompt], max_new_tokens=WARMUP_OUTPUT_LEN, ignore_eos=True, timeout=600)


def measure(
    client: Client,
    mode: str,
    prompts: list[list[int]],
    output_lens: list[int],
    startup_s: float,
    timeout: float,
) -> tuple[ModeResult, list[list[int]]]:
    before = client.stats()
    start_ns = time.perf_counter_ns()
    start = time.perf_counter()
    jobs = [
        client.submit(p, max_new_tokens=n, ignore_eos=True)
        for p, n in zip(prompts, output_lens, strict=True)
    ]
    submitted_ns = time.perf_counter_ns()
    first_token: list[float | None] = [None] * len(jobs)
    watchers = [
        threading.Thread(
            target=_watch_first_token, args=(job, i, first_token, timeout), daemon=True
        )
        for i, job in enumerate(jobs)
    ]
    for watcher in watchers:
        watcher.start()
    deadline = start + timeout
    results = [job.result(timeout=max(deadline - time.perf_counter(), 0.0)) for job in jobs]
    wall_s = time.perf_counter() - start
    after = client.stats()
    queried = after.num_prefix_query_tokens - before.num_prefix_query_tokens
    hits = after.num_prefix_hit_tokens - before.num_prefix_hit_tokens
    ttft_ms = [(t - start) * 1e3 for t in first_token if t is not None]
    num_prompt = sum(len(p) for p in prompts)
    num_output = sum(len(r.token_ids) for r in results)
    errors = sum(
        len(r.token_ids) != n or r.finish_reason != "length"
        for r, n in zip(results, output_lens, strict=True)
    )
    result = ModeResult(
        mode=mode,
        num_requests=len(jobs),
        startup_s=round(startup_s, 2),
        wall_s=round(wall_s, 4),
        prompt_tokens=num_prompt,
        output_tokens=num_output,
        output_tok_s=round(num_output / wall_s, 1),
        total_tok_s=round((num_prompt + num_output) / wall_s, 1),
        mean_ttft_ms=round(statistics.fmean(ttft_ms), 2) if ttft_ms else float("nan"),
        median_ttft_ms=round(statistics.median(ttft_ms), 2) if ttft_ms else float("nan"),
        length_errors=errors,
        prefix_hit_rate=round(hits / queried, 4) if queried else None,
        start_ns=start_ns,
        submitted_ns=submitted_ns,
    )
    return result, [r.token_ids for r in results]


def _watch_first_token(
    job: Job, index: int, first_token: list[float | None], timeout: float
) -> None:
    with contextlib.suppress(Exception):  # the main thread reports failures through result()
        for _ in job.stream(timeout=timeout):
            first_token[index] = time.perf_counter()
            return


# --- report ---------------------------------------------------------------------------------


ROWS = (
    ("wall s", "wall_s", "{:.2f}"),
    ("output tok/s", "output_tok_s", "{:.1f}"),
    ("total tok/s", "total_tok_s", "{:.1f}"),
    ("mean TTFT ms", "mean_ttft_ms", "{:.1f}"),
    ("median TTFT ms", "median_ttft_ms", "{:.1f}"),
    ("engine start s", "startup_s", "{:.1f}"),
    ("length errors", "length_errors", "{}"),
    ("prefix hit rate", "prefix_hit_rate", "{:.2%}"),
    ("decode-only steps", "decode_steps", "{}"),
    ("decode phase steps", "phase_steps", "{}"),
    ("device busy", "device_busy", "{:.2%}"),
    ("idle gap ms p50", "median_idle_gap_ms", "{:.3f}"),
    ("idle gap ms p99", "p99_idle_gap_ms", "{:.3f}"),
    ("step ms p50", "median_step_ms", "{:.2f}"),
    ("step ms p99", "p99_step_ms", "{:.2f}"),
    ("idle ms, sched. late", "idle_scheduler_ms", "{:.1f}"),
    ("idle ms, worker late", "idle_worker_ms", "{:.1f}"),
    ("idle ms, device late", "idle_device_ms", "{:.1f}"),
    ("sched. CPU ms/step", "median_scheduler_ms", "{:.2f}"),
    ("to worker ms", "median_to_worker_ms", "{:.3f}"),
    ("worker launch ms", "median_launch_ms", "{:.3f}"),
    ("to scheduler ms", "median_to_scheduler_ms", "{:.3f}"),
    ("decode-only device s", "decode_s", "{:.2f}"),
    ("decode floor s", "decode_floor_s", "{:.2f}"),
    ("x floor", "floor_ratio", "{:.2f}"),
    ("same as rehearsal", "same_as_rehearsal", "{}"),
    ("ramp s (to decode-only)", "ramp_s", "{:.3f}"),
    ("ramp steps", "ramp_steps", "{}"),
    ("ramp device s", "ramp_device_s", "{:.3f}"),
    ("tail ms", "tail_ms", "{:.1f}"),
)


@dataclass(frozen=True)
class Floor:
    """What the bandwidth floor needs: bytes per decode step and the device's copy rate."""

    sizes: DecodeBytes
    bytes_per_second: float


def measure_floor(args: argparse.Namespace) -> Floor | None:
    """On CUDA: the model's decode bytes and this device's copy bandwidth, measured now."""
    import torch

    from cbpipe.models import resolve_model

    if args.device == "cpu" or not torch.cuda.is_available():
        return None
    dtype = {"float32": torch.float32, "float16": torch.float16}.get(args.dtype, torch.bfloat16)
    sizes = decode_bytes(resolve_model(args.model).config, dtype)
    bandwidth = copy_bandwidth(torch.device("cuda"))
    torch.cuda.empty_cache()
    print(
        f"device copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write); "
        f"{sizes.weight_bytes / 1e9:.2f} GB of weights and "
        f"{sizes.kv_bytes_per_token} KV bytes per token read per decode step",
        flush=True,
    )
    return Floor(sizes, bandwidth)


def same_outputs(
    outputs: dict[str, list[list[int]]], first: str = "async", second: str = "sync"
) -> int | None:
    """How many requests generated the same tokens in two runs (None: one did not run)."""
    if first not in outputs or second not in outputs:
        return None
    return sum(a == s for a, s in zip(outputs[first], outputs[second], strict=True))


def speedup(results: dict[str, ModeResult]) -> float | None:
    if "async" in results and "sync" in results:
        return round(results["async"].output_tok_s / results["sync"].output_tok_s, 3)
    return None


def print_table(
    args: argparse.Namespace,
    workload: Workload,
    results: dict[str, ModeResult],
    outputs: dict[str, list[list[int]]],
) -> None:
    order = ("sync", "async", "sync" + NO_CACHE, "async" + NO_CACHE)
    runs = [m for m in order if m in results]
    num_requests = len(workload.prompt_lens)
    prompt_tokens = sum(workload.prompt_lens) + workload.shared_prefix_len * num_requests
    shared = f" ({workload.shared_prefix_len} shared)" if workload.shared_prefix_len else ""
    print(
        f"\nmodel {args.model}, {num_requests} requests, {prompt_tokens} prompt tokens"
        f"{shared} + {sum(workload.output_lens)} output tokens"
    )
    width = max(12, *(len(m) + 2 for m in runs))
    print(f"{'':20}" + "".join(f"{m:>{width}}" for m in runs))
    for label, key, fmt in ROWS:
        values = [getattr(results[m], key) for m in runs]
        cells = "".join(f"{'n/a' if v is None else fmt.format(v):>{width}}" for v in values)
        print(f"{label:20}{cells}")
    if (gain := speedup(results)) is not None:
        print(f"async speed-up (output tok/s): {gain:.3f}x")
    if (num_same := same_outputs(outputs)) is not None:
        print(f"same tokens in sync and async: {num_same}/{num_requests} requests")
    for mode in ("async", "sync"):
        cached, uncached = results.get(mode), results.get(mode + NO_CACHE)
        if cached is None or uncached is None:
            continue
        same = same_outputs(outputs, mode, mode + NO_CACHE)
        print(
            f"{mode} with the prefix cache: {uncached.wall_s / cached.wall_s:.2f}x faster, "
            f"median TTFT {uncached.median_ttft_ms / cached.median_ttft_ms:.2f}x shorter, "
            f"same tokens as without it: {same}/{num_requests} requests"
        )
    print(flush=True)


def write_json(
    path: Path,
    args: argparse.Namespace,
    results: dict[str, ModeResult],
    outputs: dict[str, list[list[int]]],
    baselines: list[BaselineResult] | None = None,
) -> None:
    settings = {k: v for k, v in vars(args).items() if k != "json"}
    report = {
        "settings": settings,
        "modes": {m: asdict(r) for m, r in results.items()},
        "async_speedup": speedup(results),
        "same_tokens_in_both_modes": same_outputs(outputs),
        "same_tokens_without_the_prefix_cache": {
            mode: same_outputs(outputs, mode, mode + NO_CACHE) for mode in MODES
        },
        "transformers": [asdict(b) for b in baselines or []],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # A SIGTERM (say, from `timeout`) unwinds through the finally blocks that stop the engine.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    workload = make_workload(args)
    results: dict[str, ModeResult] = {}
    outputs: dict[str, list[list[int]]] = {}
    floor = measure_floor(args)
    temporary = tempfile.TemporaryDirectory(prefix="cbpipe-bench-")
    trace_dir = args.trace_dir or Path(temporary.name)
    trace_dir.mkdir(parents=True, exist_ok=True)
    for run in run_names(args):
        print(f"--- {run}: cbpipe-launch {' '.join(launcher_args(args, run))}", flush=True)
        results[run], outputs[run] = run_mode(args, run, workload, trace_dir, floor)
        print(json.dumps(asdict(results[run])), flush=True)
        if args.json is not None:  # after each mode, so a timeout keeps what was measured
            write_json(args.json, args, results, outputs)
    print_table(args, workload, results, outputs)
    if args.compare_transformers:
        baselines = compare_transformers(args, workload, outputs)
        if args.json is not None:
            write_json(args.json, args, results, outputs, baselines)
    return 1 if any(r.length_errors for r in results.values()) else 0


def compare_transformers(
    args: argparse.Namespace, workload: Workload, outputs: dict[str, list[list[int]]]
) -> list[BaselineResult]:
    engine_outputs = outputs.get("async") or outputs.get("sync")
    prompts = workload.prompts(_vocab_size(args.model))
    baselines = run_transformers(
        args.model,
        args.device or "auto",
        args.dtype or "auto",
        prompts,
        workload.output_lens[0],
        engine_outputs,
    )
    print("transformers on the same weights and prompts (greedy, full output length):")
    for b in baselines:
        if b.error is not None:
            print(f"  {b.method:15} failed: {b.error}")
            continue
        same = "" if b.same_as_cbpipe is None else f", same tokens as cbpipe {b.same_as_cbpipe}"
        print(f"  {b.method:15} {b.wall_s:9.2f} s {b.output_tok_s:10.1f} output tok/s{same}")
    print(flush=True)
    return baselines


def _vocab_size(model: str) -> int:
    from cbpipe.models import resolve_model

    return int(resolve_model(model).config.get_text_config().vocab_size)


if __name__ == "__main__":
    sys.exit(main())
