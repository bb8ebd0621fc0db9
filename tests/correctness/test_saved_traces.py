"""A sampler's trace saved by one process runs in another without dynamo tracing anything.

That is the whole point of saving it (a warm start-up spent seconds tracing the samplers
again), so the reading process counts dynamo's graphs: none for the buckets the trace's guards
accept, and the same tokens as the writer's compiled sampler and as eager. A variant the trace
was not made for (greedy, through the temperature trace) fails its guards and is compiled
instead, still right. The full sampler with top-k and top-p too: its sort is one opaque op in
its graph.
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
    from cbpipe.worker.sampler import SamplingInputs, sample, sample_full
    from cbpipe.worker.saved_traces import SavedTraces
    from tests.unit.test_full_sampler import full_inputs

    # As torch before 2.13 (the device's 2.11) has it: ``aot_compile`` only where asked for.
    if hasattr(torch._dynamo.config, "enable_aot_compile"):
        torch._dynamo.config.enable_aot_compile = False
    folder, writes, device = Path(sys.argv[1]), sys.argv[2] == "write", sys.argv[3]
    vocab = 4096 if device == "cpu" else 128_256  # Llama 3's on the GPU
    traces = SavedTraces(folder, writes=writes)
    traced = traces.compiled(sample, "temperature", fallback=compile_decode_fn(sample))

    def inputs(rows, greedy=False):
        logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows)) * 4
        return logits.to(device), SamplingInputs(
            temperature=torch.full((rows,), 0.0 if greedy else 0.8, device=device),
            seed=torch.arange(rows, device=device) * 7919,
            output_index=torch.arange(rows, dtype=torch.int32, device=device),
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

        # The full sampler with top-k and top-p: its sort is an opaque op, not a graph break.
        full = traces.compiled(sample_full, "full-top-k-top-p", fallback=sample_full)
        counters.clear()
        report["full"], report["full_eager"] = [], []
        for rows in (6, 4):
            logits, _ = inputs(rows)
            bias = torch.zeros(rows + 1, vocab, device=device)
            counts = torch.zeros(rows + 1, vocab, dtype=torch.int32, device=device)
            args = (logits, bias, counts, counts > 0, full_inputs(
                rows, device, temperature=0.8, top_k=40, top_p=0.9, min_p=0.01, truncation=True))
            report["full"].append(full(*args).ids.tolist())
            report["full_eager"].append(sample_full(*args).ids.tolist())
        report["full_loaded"] = full.loaded is not None
        report["full_graphs"] = counters["stats"]["unique_graphs"]
    print(json.dumps(report))
    """
)


def _run(folder: Path, mode: str, cache: Path, device: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    done = subprocess.run(
        [sys.executable, "-c", _RUN, str(folder), mode, device], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=1500,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="inductor's CPU compiler")
def test_a_saved_sampler_runs_in_another_process_without_tracing(tmp_path: Path) -> None:
    check_saved_samplers(tmp_path, "cpu")


def check_saved_samplers(tmp_path: Path, device: str) -> None:
    """The writer's and the reader's runs on ``device`` (``tests/gpu`` runs it on CUDA)."""
    folder = tmp_path / "traces"
    written = _run(folder, "write", tmp_path / "inductor", device)
    assert written["loaded"], "the writer saved no trace"
    assert list(folder.glob("temperature-*.bin"))
    # Another inductor cache: what loads is the trace alone.
    read = _run(folder, "read", tmp_path / "inductor-of-the-reader", device)
    assert read["loaded"]
    assert read["graphs"] == 0, "the reader traced the sampler again"
    assert read["ids"] == written["ids"] == read["eager"]
    assert read["graphs_after_greedy"] >= 1  # greedy: the guards refused, it compiled
    assert read["greedy"] == read["greedy_eager"]
    assert written["full_loaded"] and read["full_loaded"] and read["full_graphs"] == 0
    assert read["full"] == written["full"] == read["full_eager"]
