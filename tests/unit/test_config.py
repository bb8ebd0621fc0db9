import argparse

import pytest

from cbpipe import config


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    config.add_arguments(p)
    return p


def test_defaults_come_from_the_dataclasses() -> None:
    parsed = config.from_arguments(parser().parse_args([]))
    assert parsed == config.EngineConfig()


def test_every_leaf_field_has_a_flag() -> None:
    args = [
        "--model",
        "random:llama-1b",
        "--device",
        "cpu",
        "--max-num-seqs",
        "4",
        "--max-batch-tokens",
        "64",
        "--block-size",
        "8",
        "--num-blocks",
        "100",
        "--sync",
        "--debug-scheduler-delay-ms",
        "2.5",
        "--address",
        "tcp://127.0.0.1:5555",
        "--dtype",
        "bfloat16",
        "--log-level",
        "debug",
        "--max-model-len",
        "512",
    ]
    parsed = config.from_arguments(parser().parse_args(args))
    assert parsed.model.model == "random:llama-1b" and parsed.model.dtype == "bfloat16"
    assert parsed.scheduler.sync and parsed.scheduler.debug_scheduler_delay_ms == 2.5
    assert parsed.cache.num_blocks == 100 and parsed.cache.block_size == 8
    assert parsed.address == "tcp://127.0.0.1:5555" and parsed.model.max_model_len == 512


def test_unknown_options_and_bad_values_are_errors() -> None:
    with pytest.raises(SystemExit):
        parser().parse_args(["--no-such-option"])
    with pytest.raises(SystemExit):
        parser().parse_args(["--device", "tpu"])
    bad = config.EngineConfig(scheduler=config.SchedulerConfig(max_num_seqs=8, max_batch_tokens=4))
    with pytest.raises(ValueError, match="max-batch-tokens"):
        bad.validate()
    for depth in (1, 9):
        deep = config.EngineConfig(scheduler=config.SchedulerConfig(steps_in_flight=depth))
        with pytest.raises(ValueError, match="steps-in-flight"):
            deep.validate()
    config.EngineConfig(scheduler=config.SchedulerConfig(steps_in_flight=2)).validate()
