"""``--trace`` writes every step's CPU phases and device span on one clock."""

from __future__ import annotations

from pathlib import Path

from cbpipe.client import Client
from cbpipe.engine_process import EngineProcess
from cbpipe.trace import busy_stats, load_steps


def test_trace_records_every_step_in_causal_order(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    flags = ["--model", "random:qwen2-tiny", "--device", "cpu", "--num-blocks", "128",
             "--max-batch-tokens", "64", "--max-num-seqs", "8", "--trace", str(path)]  # fmt: skip
    with EngineProcess.start(flags) as engine, Client(engine.address) as client:
        client.generate([[5] * 100, [6, 7]], max_new_tokens=20, ignore_eos=True, timeout=60)
    steps = load_steps(path)
    # 100 prompt tokens at 64 a step: 2 prefill steps, then decodes until 20 tokens each.
    assert len(steps) >= 20 and any(s.num_tokens == 64 for s in steps)
    assert [s.step for s in steps] == sorted(s.step for s in steps)
    for s in steps:
        assert s.schedule_start_ns <= s.pack_end_ns <= s.device_start_ns <= s.device_end_ns
        assert s.device_end_ns <= s.done_recv_ns <= s.update_end_ns
        # Streaming to clients waits until the next step is sent.
        assert s.update_end_ns <= s.publish_start_ns <= s.publish_end_ns
        # The worker's side; on the CPU it computes the step while launching it.
        assert s.pack_end_ns <= s.worker_recv_ns <= s.device_start_ns
        assert s.device_end_ns <= s.worker_launched_ns <= s.worker_reported_ns <= s.done_recv_ns
    # In the middle of the run the worker's queue is refilled first: between receiving a
    # step's results and streaming them, the next step is sent.
    sent = sorted(s.pack_end_ns for s in steps)
    for s in steps[2:-4]:
        assert any(s.done_recv_ns <= t <= s.publish_start_ns for t in sent), f"step {s.step}"
    stats = busy_stats([s for s in steps if s.is_decode_only])
    assert 0 < stats.busy_fraction <= 1
    assert stats.median_to_worker_ms > 0 and stats.median_to_scheduler_ms > 0
    assert stats.median_launch_ms > 0
