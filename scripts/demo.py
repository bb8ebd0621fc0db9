"""``make run``: start cbpipe on the embedded model and stream a few generations.

python scripts/demo.py [launcher flags...]
"""

from __future__ import annotations

import signal
import sys
import time

from cbpipe.client import Client
from cbpipe.engine_process import EngineProcess, EngineStartError

PROMPTS = [
    "Return the",
    "The list of",
    "This module provides",
    "Raise an exception if",
]


def main(argv: list[str]) -> None:
    print("starting cbpipe-launch", " ".join(argv), flush=True)
    # Entered before the wait, so that a Ctrl-C during start-up stops the engine too.
    with EngineProcess.spawn(argv) as engine:
        engine.wait_ready(timeout=120)
        with Client(engine.address) as client:
            print(f"engine ready at {engine.address}\n", flush=True)
            stream(client)


def stream(client: Client) -> None:
    for prompt in PROMPTS:
        job = client.submit(prompt, max_new_tokens=48)
        print(f"\033[1m{prompt}\033[0m", end="", flush=True)
        for delta in job.deltas():  # the text as it streams, step by step
            print(delta.text, end="", flush=True)
        result = job.result()
        print(f"  [{result.finish_reason}, {len(result.token_ids)} tokens]\n", flush=True)
    start = time.perf_counter()
    results = client.generate(PROMPTS * 16, max_new_tokens=48, temperature=0.8, seed=0)
    elapsed = time.perf_counter() - start
    tokens = sum(len(r.token_ids) for r in results)
    print(
        f"{len(results)} sampled jobs at once: {tokens} tokens in {elapsed:.2f} s "
        f"({tokens / elapsed:.0f} tokens/s on the engine's device)"
    )


def _interrupted(signum: int, frame: object) -> None:
    # The first Ctrl-C ends the demo; the engine's stop on the way out is not cut short.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


if __name__ == "__main__":
    signal.signal(signal.SIGINT, _interrupted)
    try:
        main(sys.argv[1:])
    except KeyboardInterrupt:  # Ctrl-C: the engine has stopped, no traceback to show
        print(flush=True)
        sys.exit(130)
    except EngineStartError as exc:  # the launcher's own message says why
        sys.exit(str(exc))
