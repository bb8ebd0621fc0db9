"""Online serving benchmark over HTTP (and the same workload through ZeroMQ), in the spirit
of ``vllm bench serve``.

It starts one ``cbpipe-launch --port 0`` (or uses ``--url`` and ``--address`` of a running
one), then for each backend (``http``: the OpenAI completions API, streamed; ``zmq``:
``AsyncClient``) and each load (``--max-concurrency C`` streams at a time, or Poisson
arrivals at ``--request-rates``, ``inf`` for all at once) it sends ``--num-prompts``
requests of random token ids (random-weight models have no tokenizer), every one running to
its output length (``ignore_eos``; greedy, or with ``--sampling``'s parameters), and reports
throughput, time to first token
(TTFT), time per output token after the first (TPOT) and inter-token latency (ITL: the gap
between successive chunks that carry tokens; a chunk carries more than one token when the
server's reader fell behind), p50/p90/p99.

The HTTP load comes from ``--client-processes`` processes with a minimal asyncio HTTP/1.1
client each (a Python client in one process parses fewer server-sent events per second
than a fast engine streams); the ZeroMQ load from one ``AsyncClient`` in this process.

    python scripts/bench_serving.py --model random:qwen2-tiny --device cpu \\
        --num-prompts 16 --prompt-len 16 --output-len 32 --max-concurrency 8
    python scripts/bench_serving.py --model random:llama-1b --num-prompts 256 \\
        --max-concurrency 256 --output-len 1024 --backends http,zmq --api-server-count 4
    python scripts/bench_serving.py --model random:llama-8b --backends http \\
        --request-rates 2,8,32 --num-prompts 128 --output-len 1024
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import random
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from cbpipe.client import AsyncClient
from cbpipe.engine_process import EngineProcess

START_DELAY_S = 2.0  # for every client process to be up before the first arrival


@dataclass
class RequestSpec:
    index: int
    prompt: list[int]
    output_len: int
    arrival_s: float  # after the start; 0 for every request of a concurrency run


@dataclass
class RequestRecord:
    index: int
    ok: bool
    error: str = ""
    start_s: float = 0.0  # perf_counter (one clock for every process of a host)
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    output_tokens: int = 0
    chunk_gaps_s: list[float] = field(default_factory=list)  # between chunks with tokens
    chunk_tokens: list[int] = field(default_factory=list)


@dataclass
class RunResult:
    backend: str
    load: str  # "concurrency 256" or "rate 8/s"
    num_requests: int
    failed: int
    wall_s: float
    output_tokens: int
    prompt_tokens: int
    request_s: float
    output_tok_s: float
    total_tok_s: float
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    tokens_per_chunk: float
    errors: list[str]


# --- the HTTP client ---------------------------------------------------------------------------


async def http_request(url: str, body: dict, api_key: str | None) -> RequestRecord:
    """POST one streamed completion and time its chunks (one connection per request)."""
    parts = urlsplit(url)
    record = RequestRecord(index=body.pop("_index"), ok=False, start_s=time.perf_counter())
    payload = json.dumps(body).encode()
    headers = [
        f"POST {parts.path.rstrip('/')}/v1/completions HTTP/1.1",
        f"Host: {parts.netloc}",
        "Content-Type: application/json",
        f"Content-Length: {len(payload)}",
        "Accept: text/event-stream",
        "Connection: close",
    ]
    if api_key:
        headers.append(f"Authorization: Bearer {api_key}")
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port or 80)
    try:
        writer.write(("\r\n".join(headers) + "\r\n\r\n").encode() + payload)
        status = await reader.readline()
        while (await reader.readline()) not in (b"\r\n", b""):
            pass
        if b" 200 " not in status:
            record.error = status.decode(errors="replace").strip()
            record.error += " " + (await reader.read(2000)).decode(errors="replace")
            return record
        buffer, last = b"", None
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                break
            buffer += (await reader.readexactly(size + 2))[:-2]
            *events, buffer = buffer.split(b"\n\n")
            now = time.perf_counter()
            for event in events:
                if not event.startswith(b"data: ") or event == b"data: [DONE]":
                    continue
                message = json.loads(event[6:])
                if "error" in message:
                    record.error = str(message["error"])
                    return record
                tokens = sum(len(c.get("token_ids") or ()) for c in message.get("choices", ()))
                if not tokens:
                    continue
                if last is None:
                    record.ttft_s = now - record.start_s
                else:
                    record.chunk_gaps_s.append(now - last)
                record.chunk_tokens.append(tokens)
                record.output_tokens += tokens
                last = now
        record.e2e_s = time.perf_counter() - record.start_s
        record.ok = True
        return record
    except Exception as exc:  # a benchmark reports failures; it does not stop at one
        record.error = repr(exc)
        return record
    finally:
        writer.close()


def http_worker(
    url: str,
    api_key: str | None,
    specs: list[RequestSpec],
    concurrency: int,
    start_at: float,
    sampling: dict[str, float] | None = None,
) -> list[RequestRecord]:
    """One client process: its share of the requests, at their arrival times."""

    def body(spec: RequestSpec) -> dict:  # no "model": the server's one model
        return {
            "_index": spec.index,
            "prompt": spec.prompt,
            "max_tokens": spec.output_len,
            "temperature": 0,
            **(sampling or {}),
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }

    return asyncio.run(
        _schedule(specs, concurrency, start_at, lambda spec: http_request(url, body(spec), api_key))
    )


# --- the ZeroMQ client -----------------------------------------------------------------------


async def zmq_request(
    client: AsyncClient, spec: RequestSpec, sampling: dict[str, float]
) -> RequestRecord:
    record = RequestRecord(index=spec.index, ok=False, start_s=time.perf_counter())
    try:
        job = client.submit(
            spec.prompt,
            max_new_tokens=spec.output_len,
            ignore_eos=True,
            detokenize=client.has_tokenizer,
            **sampling,  # type: ignore[typeddict-item]
        )
        last = None
        async for batch in job.delta_batches():
            tokens = sum(len(d.token_ids) for d in batch)
            if not tokens:
                continue
            now = time.perf_counter()
            if last is None:
                record.ttft_s = now - record.start_s
            else:
                record.chunk_gaps_s.append(now - last)
            record.chunk_tokens.append(tokens)
            record.output_tokens += tokens
            last = now
        await job.result()
        record.e2e_s = time.perf_counter() - record.start_s
        record.ok = True
    except Exception as exc:
        record.error = repr(exc)
    return record


async def zmq_run(
    address: str,
    specs: list[RequestSpec],
    concurrency: int,
    start_at: float,
    sampling: dict[str, float],
) -> list[RequestRecord]:
    async with await AsyncClient.connect(address) as client:
        return await _schedule(
            specs, concurrency, start_at, lambda s: zmq_request(client, s, sampling)
        )


# --- load shapes -------------------------------------------------------------------------------


async def _schedule(specs, concurrency, start_at, send):  # type: ignore[no-untyped-def]
    """Send each request at ``start_at + arrival_s``, at most ``concurrency`` at a time."""
    limit = asyncio.Semaphore(concurrency)

    async def one(spec: RequestSpec) -> RequestRecord:
        delay = start_at + spec.arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        async with limit:
            return await send(spec)

    return list(await asyncio.gather(*(one(spec) for spec in specs)))


def make_specs(args: argparse.Namespace, vocab_size: int, rate: float) -> list[RequestSpec]:
    rng = random.Random(args.seed)

    def length(fixed: int, spread: float) -> int:
        return max(1, round(fixed * rng.uniform(1 - spread, 1 + spread)))

    arrival, specs = 0.0, []
    for i in range(args.num_prompts):
        if math.isfinite(rate) and i:
            arrival += rng.expovariate(rate)
        prompt = [
            rng.randrange(vocab_size) for _ in range(length(args.prompt_len, args.range_ratio))
        ]
        specs.append(RequestSpec(i, prompt, length(args.output_len, args.range_ratio), arrival))
    return specs


def run_load(args, pool, backend, vocab_size, rate, concurrency):  # type: ignore[no-untyped-def]
    specs = make_specs(args, vocab_size, rate)
    start_at = time.perf_counter() + START_DELAY_S
    if backend == "zmq":
        records = asyncio.run(zmq_run(args.address, specs, concurrency, start_at, args.sampling))
    else:
        processes = max(1, min(args.client_processes, len(specs)))
        shares = [specs[i::processes] for i in range(processes)]
        per_process = max(1, -(-concurrency // processes))
        futures = [
            pool.submit(
                http_worker, args.url, args.api_key, share, per_process, start_at, args.sampling
            )
            for share in shares
        ]
        records = [r for f in futures for r in f.result()]
    load = f"rate {rate:g}/s" if math.isfinite(rate) else f"concurrency {concurrency}"
    return summarise(backend, load, specs, records)


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3

    return {
        "mean": statistics.fmean(ordered) * 1e3,
        "p50": at(0.5),
        "p90": at(0.9),
        "p99": at(0.99),
    }


def summarise(backend, load, specs, records) -> RunResult:  # type: ignore[no-untyped-def]
    ok = [r for r in records if r.ok]
    begin = min((r.start_s for r in records), default=0.0)
    end = max((r.start_s + r.e2e_s for r in ok), default=begin)
    wall = max(end - begin, 1e-9)
    output = sum(r.output_tokens for r in ok)
    prompt = sum(len(specs[r.index].prompt) for r in ok)
    tpot = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    chunks = sum(len(r.chunk_tokens) for r in ok)
    return RunResult(
        backend=backend,
        load=load,
        num_requests=len(records),
        failed=len(records) - len(ok),
        wall_s=wall,
        output_tokens=output,
        prompt_tokens=prompt,
        request_s=len(ok) / wall,
        output_tok_s=output / wall,
        total_tok_s=(output + prompt) / wall,
        ttft_ms=percentiles([r.ttft_s for r in ok]),
        tpot_ms=percentiles(tpot),
        itl_ms=percentiles([g for r in ok for g in r.chunk_gaps_s]),
        tokens_per_chunk=output / chunks if chunks else 0.0,
        errors=sorted({r.error for r in records if not r.ok})[:5],
    )


def print_table(results: list[RunResult]) -> None:
    def trio(d: dict[str, float]) -> str:
        return f"{d['p50']:.1f}/{d['p90']:.1f}/{d['p99']:.1f}"

    print(
        f"{'backend':8} {'load':17} {'reqs':>5} {'fail':>4} {'wall s':>8} {'out tok/s':>10} "
        f"{'req/s':>7} {'TTFT ms p50/p90/p99':>22} {'TPOT ms p50/p90/p99':>20} "
        f"{'ITL ms p50/p90/p99':>20} {'tok/chunk':>9}"
    )
    for r in results:
        print(
            f"{r.backend:8} {r.load:17} {r.num_requests:5d} {r.failed:4d} {r.wall_s:8.2f} "
            f"{r.output_tok_s:10.1f} {r.request_s:7.2f} {trio(r.ttft_ms):>22} "
            f"{trio(r.tpot_ms):>20} {trio(r.itl_ms):>20} {r.tokens_per_chunk:9.2f}"
        )
        for error in r.errors:
            print(f"    error: {error[:200]}")
    by_load: dict[str, dict[str, RunResult]] = {}
    for r in results:
        by_load.setdefault(r.load, {})[r.backend] = r
    for load, pair in by_load.items():
        if "http" in pair and "zmq" in pair and pair["zmq"].output_tok_s:
            ratio = pair["http"].output_tok_s / pair["zmq"].output_tok_s
            print(f"{load}: HTTP throughput {ratio:.3f}x ZeroMQ's")


SAMPLING_OPTIONS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
)


def sampling_options(text: str) -> dict[str, float]:
    """``--sampling``'s JSON object, its names checked."""
    try:
        options = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(options, dict):
        raise argparse.ArgumentTypeError(f"a JSON object, not {text!r}")
    unknown = sorted(set(options) - set(SAMPLING_OPTIONS))
    if unknown:
        known = ", ".join(SAMPLING_OPTIONS)
        raise argparse.ArgumentTypeError(f"unknown {unknown}; known: {known}")
    return options


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:llama-1b")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"))
    p.add_argument("--url", help="an HTTP server already running (with --address)")
    p.add_argument("--address", help="its engine's ZeroMQ address (the zmq backend, vocab)")
    p.add_argument("--api-key")
    p.add_argument("--api-server-count", type=int, default=1)
    p.add_argument(
        "--launch-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="extra cbpipe-launch flag, repeatable: --launch-arg=--max-num-seqs=512",
    )
    p.add_argument("--backends", default="http", help="comma list of http, zmq")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=1024)
    p.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="draw lengths uniformly from len*(1-r) to len*(1+r)",
    )
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="streams at a time (default: all; with rates, a cap)",
    )
    p.add_argument(
        "--request-rates",
        default="inf",
        help="comma list of Poisson arrival rates per second; inf: all at once",
    )
    p.add_argument("--client-processes", type=int, default=min(8, max(1, mp.cpu_count() // 2)))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument(
        "--sampling",
        type=sampling_options,
        default={},
        help="sampling parameters of every request, a JSON object with the names both APIs "
        f"take ({', '.join(SAMPLING_OPTIONS)}), as a chat model's generation_config sets "
        'them: \'{"temperature": 0.6, "top_p": 0.9}\'; default: greedy',
    )
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument(
        "--engine-log",
        type=Path,
        help="write what the engine it started logged here, once it stopped "
        "(with --launch-arg=--log-level=debug: why a step ran eagerly, and more)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rates = [float(r) for r in args.request_rates.split(",")]
    backends = args.backends.split(",")
    engine = None
    if args.url is None:
        flags = [
            "--model",
            args.model,
            "--port",
            "0",
            "--api-server-count",
            str(args.api_server_count),
            *args.launch_arg,
        ]
        if args.device:
            flags += ["--device", args.device]
        if args.api_key:
            flags += ["--api-key", args.api_key]
        started = time.monotonic()
        engine = EngineProcess.start(flags, timeout=args.ready_timeout)
        print(f"engine ready in {time.monotonic() - started:.1f} s: {engine.http_url}", flush=True)
        args.url, args.address = engine.http_url, engine.address
    try:
        assert args.address, "--address is needed with --url"

        async def welcome() -> int:
            async with await AsyncClient.connect(args.address) as client:
                return client.vocab_size

        vocab_size = asyncio.run(welcome())
        print(
            f"model {args.model}  prompts {args.num_prompts} x {args.prompt_len} + "
            f"{args.output_len} tokens  backends {','.join(backends)}  "
            f"client processes {args.client_processes}  api servers {args.api_server_count}  "
            f"sampling {json.dumps(args.sampling) if args.sampling else 'greedy'}",
            flush=True,
        )
        results = []
        pool = ProcessPoolExecutor(args.client_processes, mp_context=mp.get_context("spawn"))
        with pool:
            for rate in rates:
                concurrency = args.max_concurrency or args.num_prompts
                for backend in backends:
                    # Warm: the engine's first steps, and every client process started.
                    warm = argparse.Namespace(
                        **{**vars(args), "output_len": 4, "num_prompts": 2 * args.client_processes}
                    )
                    run_load(warm, pool, backend, vocab_size, math.inf, warm.num_prompts)
                    result = run_load(args, pool, backend, vocab_size, rate, concurrency)
                    results.append(result)
                    print(
                        f"done: {backend}, {result.load}: {result.output_tok_s:.1f} output "
                        f"tokens/s, {result.failed} failed",
                        flush=True,
                    )
        print()
        print_table(results)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps([asdict(r) for r in results], indent=2))
        return 0 if all(r.failed == 0 for r in results) else 1
    finally:
        if engine is not None:
            engine.close()
            if args.engine_log:
                args.engine_log.parent.mkdir(parents=True, exist_ok=True)
                args.engine_log.write_text(engine.stderr)


if __name__ == "__main__":
    sys.exit(main())
