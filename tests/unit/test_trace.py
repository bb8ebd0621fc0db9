import json
from dataclasses import replace

from cbpipe.trace import (
    StepRecord,
    busy_stats,
    decode_phase,
    kind_stats,
    load_steps,
    main,
    write_chrome_trace,
)

MS = 1_000_000


def record(step: int, device_start_ms: float, device_end_ms: float) -> StepRecord:
    start, end = int(device_start_ms * MS), int(device_end_ms * MS)
    update_end = end + MS // 2
    return StepRecord(
        step, 4, 4, 4, 400, start - MS, start, end, update_end, start, end,
        publish_start_ns=update_end + MS, publish_end_ns=update_end + MS + MS // 4,
    )  # fmt: skip


def test_busy_fraction_and_gaps() -> None:
    # Busy 0-10, idle 10-12, busy 12-22: 20 of 22 ms.
    stats = busy_stats([record(1, 12, 22), record(0, 0, 10)])
    assert stats.num_steps == 2
    assert abs(stats.busy_fraction - 20 / 22) < 1e-9
    assert abs(stats.median_gap_ms - 2.0) < 1e-9 and abs(stats.median_step_ms - 10.0) < 1e-9
    assert abs(stats.median_scheduler_ms - 1.75) < 1e-9  # schedule 1 + update 0.5 + publish 0.25
    assert busy_stats([]).num_steps == 0


def test_idle_time_goes_to_the_first_link_that_was_late() -> None:
    def step(n: int, start_ms: float, sent_ms: float, launched_ms: float) -> StepRecord:
        return replace(
            record(n, start_ms, start_ms + 10),
            pack_end_ns=int(sent_ms * MS),
            worker_recv_ns=int(sent_ms * MS) + 1,
            worker_launched_ns=int(launched_ms * MS),
        )

    steps = [
        step(0, 0, -5, -4),
        step(1, 11, 10.5, 10.8),  # sent 0.5 ms after step 0 ended: the scheduler's 1 ms
        step(2, 23, 15, 22),  # enqueued 1 ms after step 1 ended: the worker's 2 ms
        step(3, 36, 20, 25),  # enqueued in time, started 3 ms late: the device's
        step(4, 46, 30, 35),  # no gap
    ]
    stats = busy_stats(steps)
    assert (stats.idle_scheduler_ms, stats.idle_worker_ms, stats.idle_device_ms) == (1, 2, 3)
    # An older trace, without the worker's times: what is not the scheduler's is the worker's.
    older = busy_stats([replace(s, worker_launched_ns=0) for s in steps])
    assert (older.idle_scheduler_ms, older.idle_worker_ms, older.idle_device_ms) == (1, 5, 0)


def test_chrome_trace_has_cpu_and_gpu_rows_and_round_trips(tmp_path) -> None:
    records = [record(0, 0, 10), record(1, 12, 22)]
    path = tmp_path / "trace.json"
    write_chrome_trace(records, path)
    events = json.loads(path.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["cat"] for e in spans} == {"schedule+pack", "update", "publish", "step"}
    assert {e["pid"] for e in spans} == {1, 2}
    gpu = sorted((e for e in spans if e["cat"] == "step"), key=lambda e: e["ts"])
    assert gpu[0]["dur"] == 10_000 and gpu[1]["ts"] - gpu[0]["ts"] == 12_000  # microseconds
    assert load_steps(path) == records


def test_the_worker_row_and_a_steps_round_trip(tmp_path) -> None:
    step = record(0, 0, 10)  # sent at 0 ms, results received at 10 ms
    timed = replace(
        step, worker_recv_ns=MS // 10, worker_launched_ns=MS // 2, worker_reported_ns=9 * MS
    )
    stats = busy_stats([timed])
    assert abs(stats.median_to_worker_ms - 0.1) < 1e-9
    assert abs(stats.median_launch_ms - 0.4) < 1e-9
    assert abs(stats.median_to_scheduler_ms - 1.0) < 1e-9
    assert busy_stats([step]).median_launch_ms == 0  # an older trace: no worker times
    path = tmp_path / "trace.json"
    write_chrome_trace([timed], path)
    worker = [e for e in json.loads(path.read_text())["traceEvents"] if e["pid"] == 3]
    assert {e["name"] for e in worker} == {"process_name", "launch 0", "report 0"}


def test_decode_phase_keeps_mixed_steps_between_decodes() -> None:
    prefill = StepRecord(0, 4, 64, 0, 400, 0, 0, 0, 0, 0, 10 * MS)
    decode = record(1, 11, 15)
    mixed = StepRecord(2, 4, 30, 3, 400, 0, 0, 0, 0, 15 * MS, 25 * MS)
    last = record(3, 25, 30)
    tail = StepRecord(4, 1, 20, 0, 400, 0, 0, 0, 0, 30 * MS, 40 * MS)
    phase = decode_phase([tail, last, mixed, decode, prefill])
    assert [r.step for r in phase] == [1, 2, 3]
    # The mixed step's device time is busy time, not a gap.
    assert busy_stats(phase).busy_fraction == 1.0
    assert decode_phase([prefill]) == []


def test_each_kind_of_step_has_its_device_time(tmp_path, capsys) -> None:
    decodes = [record(i, 10 * i, 10 * i + 2) for i in range(10)]  # 2 ms each
    # Decodes beside a chunk: 3 decodes and 27 prompt rows, then 1 and 63.
    mixed = [
        StepRecord(10, 4, 30, 3, 400, 0, 0, 0, 0, 100 * MS, 108 * MS),
        StepRecord(11, 2, 64, 1, 400, 0, 0, 0, 0, 110 * MS, 130 * MS),
    ]
    prefill = StepRecord(12, 1, 20, 0, 400, 0, 0, 0, 0, 130 * MS, 135 * MS)
    stats = {k.kind: k for k in kind_stats([*mixed, prefill, *decodes])}
    assert list(stats) == ["decode", "mixed", "prefill"]
    assert stats["decode"].count == 10 and stats["decode"].p50_ms == stats["decode"].max_ms == 2
    assert (stats["mixed"].min_rows, stats["mixed"].max_rows) == (30, 64)
    assert (stats["mixed"].min_decodes, stats["mixed"].max_decodes) == (1, 3)
    assert stats["mixed"].p50_ms == 20 and stats["mixed"].max_ms == 20  # the upper of two
    assert stats["prefill"].count == 1 and stats["prefill"].p99_ms == 5
    assert stats["decode"].launch_p50_ms == 0  # no worker times in these records
    assert kind_stats([]) == []
    # The worker's launch: 0.4 ms from a graph, 20 ms eagerly.
    launched = [
        replace(mixed[0], worker_recv_ns=100 * MS, worker_launched_ns=100 * MS + 4 * MS // 10),
        replace(mixed[1], worker_recv_ns=110 * MS, worker_launched_ns=130 * MS),
    ]
    mixed_stats = kind_stats(launched)[0]
    assert (mixed_stats.launch_p50_ms, mixed_stats.launch_p99_ms) == (20, 20)
    assert kind_stats(launched[:1])[0].launch_p50_ms == 0.4

    path = tmp_path / "trace.json"
    write_chrome_trace([*decodes, *mixed, prefill], path)
    assert main([str(path), "--skip-steps", "5"]) == 0
    out = capsys.readouterr().out
    assert "8 steps" in out  # steps 5-12
    assert out.count("\ndecode ") == 1 and "   30-64  " in out and "20.00 / 20.00" in out
