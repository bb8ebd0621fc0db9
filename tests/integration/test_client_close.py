"""A client that closes takes its jobs with it: they stop and free their KV blocks."""

from __future__ import annotations

import itertools
from pathlib import Path

from cbpipe.client import Client
from cbpipe.engine_process import EngineProcess
from cbpipe.trace import load_steps


def test_jobs_of_a_closed_client_are_cancelled(tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    flags = ["--model", "random:qwen2-tiny", "--device", "cpu", "--num-blocks", "1024",
             "--trace", str(trace)]  # fmt: skip
    with EngineProcess.start(flags) as engine:
        leaving = Client(engine.address)
        jobs = [leaving.submit([7, 8, i], max_new_tokens=1500, ignore_eos=True) for i in range(4)]
        list(itertools.islice(jobs[0].stream(timeout=60), 5))  # the jobs are running
        leaving.close()
        with Client(engine.address) as staying:
            result = staying.submit([9, 9], max_new_tokens=30, ignore_eos=True).result(60)
        assert len(result.token_ids) == 30
    last_steps = load_steps(trace)[-10:]
    assert [s.num_seqs for s in last_steps] == [1] * 10, "the closed client's jobs still ran"
