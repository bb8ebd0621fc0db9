"""Soak the engine: many clients for a long time, with cancels, disconnects and junk mixed in.

Starts ``cbpipe-launch`` (or uses ``--address``), runs ``--clients`` threads for ``--minutes``,
each submitting random jobs (greedy and seeded sampling, random lengths and options, now and
then a bad one), cancelling some, sometimes closing its connection mid-job (a new client
replaces it) or sending a junk frame. Greedy jobs of a fixed reference prompt must always
return the reference tokens. Every ``--sample-s`` it records each engine process's memory
(RSS). At the end it prints requests done, errors by kind, wrong answers and memory over
time, and exits non-zero if any job hung, any answer was wrong, or the engine died.

    python scripts/soak.py --minutes 30 --clients 16
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from collections import Counter
from pathlib import Path

import zmq

from cbpipe.client import Client, EngineBusy, EngineError, RequestError
from cbpipe.engine_process import EngineProcess
from cbpipe.protocol import SamplingParams, Submit, encode

REFERENCE_PROMPT = [5, 6, 7, 8, 9]
REFERENCE_TOKENS = 12
JOB_TIMEOUT_S = 300.0  # a job not done by then counts as hung


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--sample-s", type=float, default=30.0, help="memory sampling period")
    p.add_argument("--address", help="an engine already running (else one is launched)")
    p.add_argument(
        "--engine-args",
        default="--model random:qwen2-tiny --device cpu --num-blocks 1024",
        help="flags for the launched engine",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the figures here")
    return p.parse_args()


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.wrong: list[str] = []

    def add(self, what: str) -> None:
        with self.lock:
            self.counts[what] += 1


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except FileNotFoundError:
        return None
    return None


def random_job(rng: random.Random) -> tuple[list[int], dict[str, object]]:
    prompt = [rng.randrange(3, 500) for _ in range(rng.randint(1, 300))]
    params: dict[str, object] = {
        "max_new_tokens": rng.choice([1, 4, 16, 64, 256]),
        "ignore_eos": rng.random() < 0.7,
    }
    if rng.random() < 0.5:
        params.update(temperature=rng.choice([0.5, 1.0]), seed=rng.randrange(1000))
        if rng.random() < 0.3:
            params.update(top_p=0.9, top_k=rng.choice([0, 20]))
    if rng.random() < 0.1:
        params["n"] = rng.randint(2, 3)
    if rng.random() < 0.05:
        params["max_new_tokens"] = 0  # refused
    return prompt, params


def client_loop(address: str, deadline: float, seed: int, tally: Tally, reference: list[int]):
    rng = random.Random(seed)
    client = Client(address)
    try:
        while time.monotonic() < deadline:
            action = rng.random()
            if action < 0.02:
                vanish(address, rng)
                tally.add("disconnects")
                continue
            if action < 0.04:
                junk(address, rng)
                tally.add("junk frames")
                continue
            if action < 0.10:
                job = client.submit(REFERENCE_PROMPT, max_new_tokens=REFERENCE_TOKENS)
                tokens = job.result(timeout=JOB_TIMEOUT_S).token_ids
                tally.add("reference jobs")
                if tokens != reference:
                    with tally.lock:
                        tally.wrong.append(f"reference job gave {tokens}")
                continue
            prompt, params = random_job(rng)
            try:
                job = client.submit(prompt, **params)  # type: ignore[arg-type]
                if rng.random() < 0.1:
                    next(iter(job.deltas(timeout=JOB_TIMEOUT_S)), None)
                    job.cancel()
                    tally.add("cancels")
                job.results(timeout=JOB_TIMEOUT_S)
                tally.add("jobs done")
            except RequestError:
                tally.add("refused (request error)")
            except EngineBusy:
                tally.add("refused (busy)")
            except TimeoutError:
                tally.add("HUNG")
    except EngineError as exc:
        tally.add(f"engine error: {exc}")
    finally:
        client.close()


def vanish(address: str, rng: random.Random) -> None:
    """A client that starts long jobs, sees them stream, and is gone without a goodbye (as a
    killed process is): the engine must cancel them."""
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.connect(address)
    for request_id in range(rng.randint(1, 5)):
        params = SamplingParams(2000, ignore_eos=True)
        socket.send(encode(Submit(request_id, [5, 6, request_id], params)))
    socket.poll(10_000)
    socket.close(linger=0)
    context.term()


def junk(address: str, rng: random.Random) -> None:
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 200)
    socket.connect(address)
    socket.send(rng.randbytes(rng.randint(0, 200)))
    socket.close()
    context.term()


def engine_counters(address: str) -> dict[str, int | str]:
    """The engine's own counters at the end: whether a soak with a small KV cache preempted,
    and how much the prefix cache found. An engine that does not answer fails the soak, with
    its figures still written."""
    try:
        with Client(address) as client:
            stats = client.stats()
    except EngineError as exc:
        return {"error": str(exc)}
    return {
        "steps": stats.num_steps,
        "preemptions": stats.num_preemptions,
        "prompt_tokens": stats.num_prompt_tokens,
        "generation_tokens": stats.num_generation_tokens,
        "prefix_hit_tokens": stats.num_prefix_hit_tokens,
    }


def main() -> None:
    args = parse_args()
    engine = None
    if args.address is None:
        engine = EngineProcess.start(args.engine_args.split(), timeout=600)
        address, pids = engine.address, {"scheduler": engine.scheduler_pid,
                                         "worker": engine.worker_pid}  # fmt: skip
        pids["launcher"] = engine.pid
    else:
        address, pids = args.address, {}
    tally = Tally()
    with Client(address) as client:
        reference = (
            client.submit(REFERENCE_PROMPT, max_new_tokens=REFERENCE_TOKENS)
            .result(timeout=JOB_TIMEOUT_S)
            .token_ids
        )
    started = time.monotonic()
    deadline = started + args.minutes * 60
    threads = [
        threading.Thread(
            target=client_loop,
            args=(address, deadline, args.seed + i, tally, reference),
            daemon=True,
        )  # fmt: skip
        for i in range(args.clients)
    ]
    for thread in threads:
        thread.start()
    memory: list[dict[str, float | None]] = []
    while any(t.is_alive() for t in threads):
        sample = {"t_min": round((time.monotonic() - started) / 60, 2)}
        sample.update({name: rss_mb(pid) for name, pid in pids.items()})
        memory.append(sample)
        print(json.dumps(sample), dict(tally.counts), flush=True)
        for thread in threads:
            thread.join(timeout=args.sample_s / len(threads))
    alive = engine.running if engine is not None else True
    counters = engine_counters(address) if alive else None
    figures = {
        "minutes": args.minutes,
        "clients": args.clients,
        "counts": dict(tally.counts),
        "wrong": tally.wrong,
        "engine_alive_at_end": alive,
        "engine_counters": counters,
        "memory_mb": memory,
    }
    if engine is not None:
        figures["engine_exit"] = engine.stop()
        figures["engine_stderr_tail"] = engine.stderr[-2000:]
        engine.close()
    print(json.dumps({k: v for k, v in figures.items() if k != "memory_mb"}, indent=2))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    failed = (
        tally.wrong
        or tally.counts["HUNG"]
        or not alive
        or (counters is not None and "error" in counters)
        or any(k.startswith("engine error") for k in tally.counts)
    )
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
