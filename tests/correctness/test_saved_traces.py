"""A sampler's trace saved by one process runs in another without dynamo tracing anything.

That is the whole point of saving it (a warm start-up spent seconds tracing the samplers
again), so the reading process counts dynamo's graphs: none for the buckets the trace's guards
accept, and the same tokens as the writer's compiled sampler and as eager. A variant the trace
was not made for (greedy, through the temperature trace) fails its guards and is compiled
instead, still right.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_RUN = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path

    import torch
    from torch._dynamo.utils import counters

    from cbpipe.worker.compiling import compile_decode_fn, decode_compile_settings
    from cbpipe.worker.sampler import SamplingInputs, sample
    from cbpipe.worker.saved_traces import SavedTraces

    # As torch before 2.13 (the device's 2.11) has it: ``aot_compile`` only where asked for.
    if hasattr(torch._dynamo.config, "enable_aot_compile"):
        torch._dynamo.config.enable_aot_compile = False
    folder, writes = Path(sys.argv[1]), sys.argv[2] == "write"
    traces = SavedTraces(folder, writes=writes)
    traced = traces.compiled(sample, "temperature", fallback=compile_decode_fn(sample))

    def inputs(rows, greedy=False):
        logits = torch.randn(rows, 4096, generator=torch.Generator().manual_seed(rows)) * 4
        return logits, SamplingInputs(
            temperature=torch.full((rows,), 0.0 if greedy else 0.8),
            seed=torch.arange(rows) * 7919,
            output_index=torch.arange(rows, dtype=torch.int32),
            all_greedy=greedy,
        )

    report = {"ids": [], "eager": []}
    with decode_compile_settings(), torch.inference_mode():
        for rows in (6, 4, 3):
            args = inputs(rows)
            report["ids"].append(traced(*args)[0].tolist())
            report["eager"].append(sample(*args)[0].tolist())
        report["loaded"] = traced.loaded is not None
        report["graphs"] = counters["stats"]["unique_graphs"]
        args = inputs(4, greedy=True)
        report["greedy"] = traced(*args)[0].tolist()
        report["greedy_eager"] = sample(*args)[0].tolist()
        report["graphs_after_greedy"] = counters["stats"]["unique_graphs"]
    print(json.dumps(report))
    """
)


def _run(folder: Path, mode: str, cache: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    done = subprocess.run(
        [sys.executable, "-c", _RUN, str(folder), mode], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=1500,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="inductor's CPU compiler")
def test_a_saved_sampler_runs_in_another_process_without_tracing(tmp_path: Path) -> None:
    folder = tmp_path / "traces"
    written = _run(folder, "write", tmp_path / "inductor")
    assert written["loaded"], "the writer saved no trace"
    assert list(folder.glob("temperature-*.bin"))
    # Another inductor cache: what loads is the trace alone.
    read = _run(folder, "read", tmp_path / "inductor-of-the-reader")
    assert read["loaded"]
    assert read["graphs"] == 0, "the reader traced the sampler again"
    assert read["ids"] == written["ids"] == read["eager"]
    assert read["graphs_after_greedy"] >= 1  # greedy: the guards refused, it compiled
    assert read["greedy"] == read["greedy_eager"]
