"""The decode samplers compiled ahead in another process are what the worker's graphs load.

On the CPU as on CUDA, inductor keys a compiled graph by its code, its inputs' shapes and
strides, and its settings: if a compile-ahead process compiled anything the runner's own
first run does not meet exactly, the runner would compile it again and the processes would
only have cost time. So the runner's first runs must find the processes' graphs in the cache.
"""

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from cbpipe.protocol.slots import SlotLimits
from cbpipe.worker.compile_ahead import CompileAhead, CompileJob, shares
from cbpipe.worker.cuda_graphs import FULL_VARIANTS, RANDOM

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forks on Linux")


def test_variants_are_dealt_in_turn_and_no_process_is_left_empty() -> None:
    variants = (RANDOM, *FULL_VARIANTS)
    assert shares(variants, 2) == [variants[0::2], variants[1::2]]
    assert shares(variants[:1], 3) == [variants[:1]]


def _job(variants: tuple = (RANDOM, *FULL_VARIANTS)) -> CompileJob:
    return CompileJob(
        variants=variants,
        limits=SlotLimits(64, 6, 64),
        num_slots=3,
        max_seqs=6,
        vocab=1000,
        logits_dtype="float32",
        device="cpu",
        first_batch=4,
        cache_env={},
        log_level="warning",
    )


class _Pipe:
    """A process's end of the pipe, as ``CompileAhead.start`` uses it."""

    def __init__(self) -> None:
        self.sent: list[CompileJob | None] = []
        self.closed = False

    def send(self, job: CompileJob | None) -> None:
        self.sent.append(job)

    def close(self) -> None:
        self.closed = True


def test_a_start_deals_the_variants_over_the_processes_it_may_use() -> None:
    pipes = [_Pipe() for _ in range(5)]
    ahead = CompileAhead([(None, pipe) for pipe in pipes])  # type: ignore[misc]
    job = _job()
    ahead.start(job, processes=2)
    given = [pipe.sent for pipe in pipes]
    assert [sent[0].variants for sent in given[:2]] == shares(job.variants, 2)
    assert given[2:] == [[None]] * 3  # told there is nothing to do
    assert ahead._working == 2
    assert all(pipe.closed for pipe in pipes)
    threads = {sent[0].compile_threads for sent in given[:2]}
    assert len(threads) == 1 and threads.pop() >= 1


def test_only_the_processes_the_device_has_room_for_start() -> None:
    """Each process's device memory, with as much again to spare for the worker."""
    job = _job()
    each = 2 * job.device_bytes(1)
    assert job.device_bytes(3) == 3 * job.device_bytes(1)
    assert job.processes_with_room(3 * each + each // 2, most=5) == 3
    assert job.processes_with_room(each - 1, most=5) == 0
    assert job.processes_with_room(100 * each, most=5) == 5


_STOP = textwrap.dedent(
    """
    from cbpipe.worker.compile_ahead import CompileAhead

    ahead = CompileAhead.fork(2)  # in a fresh process: the test runner may have threads
    assert ahead is not None and len(ahead) == 2
    processes = [process for process, _ in ahead._processes]
    ahead.stop()
    print([p.exitcode for p in processes])
    """
)


def test_processes_told_there_is_nothing_to_do_end_at_once() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _STOP], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip().splitlines()[-1] == "[0, 0]"


def test_a_process_with_threads_forks_none() -> None:
    """This test's own process may or may not have threads; one it starts surely does."""
    thread = threading.Thread(target=time.sleep, args=(5,), daemon=True)
    thread.start()
    assert CompileAhead.fork(1) is None


_RUN = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path

    from torch._dynamo.utils import counters

    from cbpipe.models import resolve_model
    from cbpipe.protocol.slots import SlotLayout, SlotLimits
    from cbpipe.worker.compile_ahead import CompileAhead, CompileJob, cache_is_cold
    from cbpipe.worker.cuda_graphs import RANDOM, bucket_sizes, compiled_bucket_sizes, tuning_batch
    from cbpipe.worker.saved_traces import SavedTraces
    from tests.harness import InProcessEngine

    traces = SavedTraces(Path(sys.argv[1])) if len(sys.argv) > 1 else None

    ahead = CompileAhead.fork(1)  # first, while this process has one thread
    assert ahead is not None
    assert cache_is_cold()
    max_num_seqs, max_batch_tokens, max_model_len, block_size = 6, 64, 1024, 16
    vocab = resolve_model("default").config.vocab_size
    limits = SlotLimits(
        max_batch_tokens, max_num_seqs, -(-max_model_len // block_size), vocab_size=vocab
    )
    job = CompileJob(
        variants=(RANDOM,),
        limits=limits,
        num_slots=3,  # as InProcessEngine lays its slots out
        max_seqs=max_num_seqs,
        vocab=vocab,
        logits_dtype="float32",
        device="cpu",
        first_batch=tuning_batch(compiled_bucket_sizes(bucket_sizes(max_num_seqs))),
        cache_env={"TORCHINDUCTOR_CACHE_DIR": os.environ["TORCHINDUCTOR_CACHE_DIR"]},
        log_level="warning",
        traces_folder=None if traces is None else str(traces.folder),
    )
    ahead.start(job)
    engine = InProcessEngine(
        "default",
        max_batch_tokens=max_batch_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        block_size=block_size,
        attention_backend="triton",
        compile_decode=True,
        full_sampling_graphs=False,
        before_sampler_compiles=ahead.wait,
        saved_traces=traces,
    )
    assert engine.layout == job.layout
    report = {k: v for k, v in counters["inductor"].items() if "fxgraph" in k}
    temperature = engine.runner.sampling._graph_samplers[RANDOM.sampling]
    report["trace_loaded"] = getattr(temperature, "loaded", None) is not None
    print(json.dumps(report))
    """
)


def _start_an_engine_after_a_process(tmp_path: Path, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", _RUN, *args], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=1500,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_runner_loads_the_sampler_a_process_compiled_ahead(tmp_path: Path) -> None:
    """Greedy's first run compiles the forward (a miss: the cache is cold); the temperature
    sampler's, after the runner waited for the process, is a hit."""
    counts = _start_an_engine_after_a_process(tmp_path)
    assert counts.get("fxgraph_cache_hit", 0) >= 1, counts
    assert not counts["trace_loaded"]


def test_the_runner_loads_the_trace_a_process_saved_ahead(tmp_path: Path) -> None:
    """With a folder for traces, the process saves the temperature sampler's, and the
    runner's first run of it loads that trace rather than tracing the sampler itself."""
    traces = tmp_path / "traces"
    report = _start_an_engine_after_a_process(tmp_path / "inductor", str(traces))
    assert report["trace_loaded"], report
    assert list(traces.glob("temperature-*.bin"))
