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


def test_max_model_len_is_resolved_once_and_never_rounded() -> None:
    from cbpipe.launcher import plan_layout, resolve_limits
    from cbpipe.models import resolve_model

    EngineConfig, ModelConfig = config.EngineConfig, config.ModelConfig
    resolved = resolve_limits(EngineConfig(model=ModelConfig(max_model_len=100)))
    assert resolved.model.max_model_len == 100  # what the scheduler enforces
    assert plan_layout(resolved).limits.max_blocks_per_seq == 7  # room for it in 16-token blocks
    default = resolve_limits(EngineConfig())
    assert default.model.max_model_len == resolve_model("default").max_position_embeddings
    with pytest.raises(ValueError, match="exceeds"):
        resolve_limits(EngineConfig(model=ModelConfig(max_model_len=10**7)))


def test_server_flags_and_the_api_key_from_the_environment() -> None:
    import argparse

    from cbpipe.env import Environment

    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    args = ["--port", "0", "--api-server-count", "3", "--chat-template", "t.jinja"]
    parsed = config.from_arguments(parser.parse_args(args))
    assert (parsed.server.port, parsed.server.api_server_count) == (0, 3)
    assert (parsed.server.host, parsed.server.chat_template) == ("127.0.0.1", "t.jinja")
    assert config.EngineConfig().server.port is None  # no HTTP server unless asked
    keyed = Environment.read({"CBPIPE_API_KEY": "sk-env"}).apply(parsed)
    assert keyed.server.api_key == "sk-env"
    flagged = config.from_arguments(parser.parse_args([*args, "--api-key", "sk-flag"]))
    assert Environment.read({"CBPIPE_API_KEY": "sk-env"}).apply(flagged).server.api_key == "sk-flag"
    assert Environment.read({}).apply(parsed).server.api_key is None
    for bad in (["--port", "70000"], ["--api-server-count", "0"]):
        with pytest.raises(ValueError, match=bad[0]):
            config.from_arguments(parser.parse_args(bad)).validate()
