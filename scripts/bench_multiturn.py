"""Multi-turn conversations, with the prefix cache on and off.

Each conversation runs its turns one after another, all conversations at once: a turn sends
the conversation so far (every earlier turn's prompt and answer) plus ``--new-tokens`` new
tokens, and waits for its ``--output-len`` tokens. Reports the time to first token per turn
(median and p90 over the conversations), the wall time and the prefix cache's hit rate; with
the cache, a turn computes only its new tokens.

    python scripts/bench_multiturn.py --model random:llama-1b --conversations 64 --turns 8 \\
        --json out/multiturn.json
    python scripts/bench_multiturn.py --model random:qwen2-tiny --device cpu \\
        --conversations 4 --turns 3 --new-tokens 20 --output-len 4
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from cbpipe.client import Client
from cbpipe.engine_process import EngineProcess

RUNS = ("cached", "uncached")


@dataclass
class RunResult:
    run: str
    startup_s: float
    wall_s: float
    prompt_tokens: int
    output_tokens: int
    prefix_hit_rate: float | None  # prompt tokens found in the cache over those looked up
    median_ttft_ms: list[float]  # per turn, over the conversations
    p90_ttft_ms: list[float]
    errors: int  # turns that failed or did not produce their output length


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:llama-1b")
    p.add_argument("--conversations", type=int, default=64)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=100, help="new prompt tokens per turn")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per turn")
    p.add_argument("--runs", default="cached,uncached", help="comma list of cached, uncached")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--launch-arg", action="append", default=[], metavar="FLAG",
        help="extra cbpipe-launch flag, repeatable",
    )  # fmt: skip
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds for one turn")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    args.runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    if not args.runs or any(r not in RUNS for r in args.runs):
        p.error(f"--runs is a comma list of {', '.join(RUNS)}")
    return args


def launcher_args(args: argparse.Namespace, run: str) -> list[str]:
    flags = ["--model", args.model]
    for name in ("device", "dtype"):
        if getattr(args, name) is not None:
            flags += [f"--{name}", getattr(args, name)]
    if run == "uncached":
        flags.append("--no-prefix-caching")
    return flags + list(args.launch_arg)


def converse(
    client: Client,
    args: argparse.Namespace,
    index: int,
    ttft_s: list[list[float | None]],
    counts: list[int],
) -> None:
    """One conversation's turns: turn t's time to first token goes to ``ttft_s[t][index]``,
    its prompt and output tokens and errors are added to ``counts``, the conversation's own."""
    rng = random.Random(args.seed * 100_003 + index)
    history: list[int] = []
    for turn in range(args.turns):
        prompt = history + [rng.randrange(client.vocab_size) for _ in range(args.new_tokens)]
        sent = time.perf_counter()
        try:
            job = client.submit(prompt, max_new_tokens=args.output_len, ignore_eos=True)
            first = None
            for _ in job.stream(timeout=args.timeout):
                first = time.perf_counter()
                break
            result = job.result(timeout=args.timeout)
        except Exception as exc:  # counted; the conversation cannot go on without its answer
            print(f"conversation {index} turn {turn}: {exc}", file=sys.stderr)
            counts[2] += args.turns - turn
            return
        if first is not None:
            ttft_s[turn][index] = first - sent
        counts[0] += len(prompt)
        counts[1] += len(result.token_ids)
        counts[2] += len(result.token_ids) != args.output_len
        history = prompt + result.token_ids


def run_once(args: argparse.Namespace, run: str) -> RunResult:
    started = time.perf_counter()
    with EngineProcess.start(launcher_args(args, run), timeout=args.ready_timeout) as engine:
        startup_s = time.perf_counter() - started
        with Client(engine.address) as client:
            longest = args.turns * (args.new_tokens + args.output_len)
            if longest > client.max_model_len:
                raise SystemExit(
                    f"the last turn's {longest} tokens exceed max_model_len {client.max_model_len}"
                )
            client.generate([[1] * 16], max_new_tokens=8, ignore_eos=True, timeout=600)
            before = client.stats()
            n = args.conversations
            ttft_s: list[list[float | None]] = [[None] * n for _ in range(args.turns)]
            counts = [[0, 0, 0] for _ in range(n)]  # prompt tokens, output tokens, errors
            threads = [
                threading.Thread(target=converse, args=(client, args, i, ttft_s, counts[i]))
                for i in range(n)
            ]
            start = time.perf_counter()
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            wall_s = time.perf_counter() - start
            after = client.stats()
    prompt_tokens, output_tokens, errors = (sum(c[i] for c in counts) for i in range(3))
    measured = [[t for t in turn if t is not None] for turn in ttft_s]
    queried = after.num_prefix_query_tokens - before.num_prefix_query_tokens
    hits = after.num_prefix_hit_tokens - before.num_prefix_hit_tokens

    def quantile(values: list[float], q: float) -> float:
        if not values:
            return float("nan")
        ordered = sorted(values)
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3, 2)

    return RunResult(
        run=run,
        startup_s=round(startup_s, 2),
        wall_s=round(wall_s, 3),
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        prefix_hit_rate=round(hits / queried, 4) if queried else None,
        median_ttft_ms=[quantile(t, 0.5) for t in measured],
        p90_ttft_ms=[quantile(t, 0.9) for t in measured],
        errors=errors,
    )


def print_table(args: argparse.Namespace, results: list[RunResult]) -> None:
    print(
        f"\nmodel {args.model}, {args.conversations} conversations x {args.turns} turns, "
        f"{args.new_tokens} new prompt tokens and {args.output_len} output tokens per turn"
    )
    for r in results:
        rate = "n/a" if r.prefix_hit_rate is None else f"{r.prefix_hit_rate:.1%}"
        print(
            f"{r.run:>9}: wall {r.wall_s:.2f} s, {r.prompt_tokens} prompt + {r.output_tokens} "
            f"output tokens, prefix hit rate {rate}, errors {r.errors}, start-up {r.startup_s} s"
        )
    print(f"{'turn':>6}" + "".join(f"{r.run + ' p50/p90 ms':>28}" for r in results))
    for turn in range(args.turns):
        cells = "".join(
            f"{f'{r.median_ttft_ms[turn]:.1f} / {r.p90_ttft_ms[turn]:.1f}':>28}" for r in results
        )
        print(f"{turn + 1:>6}{cells}")
    by_run = {r.run: r for r in results}
    if set(by_run) == set(RUNS):
        cached, uncached = by_run["cached"], by_run["uncached"]
        ratio = uncached.median_ttft_ms[-1] / cached.median_ttft_ms[-1]
        print(
            f"last turn's median TTFT {ratio:.2f}x shorter with the cache; "
            f"wall {uncached.wall_s / cached.wall_s:.2f}x shorter"
        )
    print(flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    results: list[RunResult] = []
    for run in args.runs:
        print(f"--- {run}: cbpipe-launch {' '.join(launcher_args(args, run))}", flush=True)
        results.append(run_once(args, run))
        print(json.dumps(asdict(results[-1])), flush=True)
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            settings = {k: str(v) for k, v in vars(args).items() if k != "json"}
            report = {"settings": settings, "runs": [asdict(r) for r in results]}
            args.json.write_text(json.dumps(report, indent=2) + "\n")
    print_table(args, results)
    return 1 if any(r.errors for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
