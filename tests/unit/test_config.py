import argparse
import re
from pathlib import Path

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


def test_the_step_limits_follow_the_device_unless_given() -> None:
    from cbpipe.launcher import plan_layout, resolve_limits

    gib = 1 << 30
    default = config.SchedulerConfig()
    assert default.batch_tokens(None) == 2048  # the CPU
    assert default.batch_tokens(40 * gib) == 2048  # an A100 40 GB
    assert default.batch_tokens(140 * gib) == 8192  # an H200
    assert default.num_seqs(None) == default.num_seqs(40 * gib) == 256
    assert default.num_seqs(80 * gib) == 1024  # an H100
    assert config.SchedulerConfig(max_num_seqs=4096).batch_tokens(None) == 4096  # a row each
    given = config.SchedulerConfig(max_batch_tokens=512)
    assert given.batch_tokens(None) == given.batch_tokens(140 * gib) == 512
    assert given.num_seqs(None) == 256 and given.num_seqs(140 * gib) == 512  # a row each
    assert config.SchedulerConfig(max_batch_tokens=100).num_seqs(None) == 100
    seqs = config.SchedulerConfig(max_num_seqs=64)
    assert seqs.num_seqs(None) == seqs.num_seqs(140 * gib) == 64
    # The launcher sizes the slots before the worker has seen its device: room for the
    # largest, unless the device is the CPU.
    plan = lambda **kw: plan_layout(resolve_limits(config.EngineConfig(**kw))).limits  # noqa: E731
    assert (plan().max_tokens, plan().max_seqs) == (8192, 1024)
    assert (plan(scheduler=given).max_tokens, plan(scheduler=given).max_seqs) == (512, 512)
    assert plan(scheduler=seqs).max_seqs == 64
    cpu = plan(model=config.ModelConfig(device="cpu"))
    assert (cpu.max_tokens, cpu.max_seqs) == (2048, 256)


def test_slots_for_a_small_device_where_the_shared_memory_has_no_room_for_a_large_one() -> None:
    from cbpipe.launcher import plan_layout, resolve_limits

    resolved = resolve_limits(config.EngineConfig())
    cpu = config.EngineConfig(model=config.ModelConfig(device="cpu"))
    large, small = plan_layout(resolved), plan_layout(resolve_limits(cpu))
    assert small.segment_nbytes < large.segment_nbytes
    fits = lambda room: plan_layout(resolved, room=room).limits  # noqa: E731
    assert fits(large.segment_nbytes) == large.limits
    assert fits(large.segment_nbytes - 1) == small.limits == fits(small.segment_nbytes)
    # Neither fits: the largest, for the launcher's refusal to say what it needs.
    assert fits(small.segment_nbytes - 1) == large.limits


def test_the_worker_keeps_within_the_slots_and_says_why(caplog) -> None:
    from cbpipe.protocol.slots import SlotLimits
    from cbpipe.worker.process import step_limits

    h200 = 140 << 30
    defaults = config.SchedulerConfig()
    roomy = SlotLimits(max_tokens=8192, max_seqs=1024, max_blocks_per_seq=8)
    assert step_limits(defaults, h200, roomy) == (1024, 8192)
    assert step_limits(defaults, None, roomy) == (256, 2048)  # the CPU under slots for a GPU
    assert not caplog.records
    cramped = SlotLimits(max_tokens=2048, max_seqs=256, max_blocks_per_seq=8)
    assert step_limits(defaults, h200, cramped) == (256, 2048)
    assert "--shm-size" in caplog.text and "1024 sequences" in caplog.text


def test_limits_given_together_must_leave_a_row_for_every_sequence() -> None:
    both = config.SchedulerConfig(max_batch_tokens=64, max_num_seqs=128)
    with pytest.raises(ValueError, match="max-batch-tokens must be >= --max-num-seqs"):
        config.EngineConfig(scheduler=both).validate()
    for bad in (config.SchedulerConfig(max_batch_tokens=0), config.SchedulerConfig(max_num_seqs=0)):
        with pytest.raises(ValueError, match="must be >= 1"):
            config.EngineConfig(scheduler=bad).validate()
    config.EngineConfig(scheduler=config.SchedulerConfig(max_batch_tokens=64)).validate()


def test_max_model_len_is_resolved_once_and_never_rounded() -> None:
    from cbpipe.launcher import plan_layout, resolve_limits
    from cbpipe.models import resolve_model

    EngineConfig, ModelConfig = config.EngineConfig, config.ModelConfig
    resolved = resolve_limits(EngineConfig(model=ModelConfig(max_model_len=100)))
    assert resolved.model.max_model_len == 100  # what the scheduler enforces
    assert plan_layout(resolved).limits.max_blocks_per_seq == 7  # room for it in 16-token blocks
    default = resolve_limits(EngineConfig())
    assert default.model.max_model_len == resolve_model("default").config.max_position_embeddings
    with pytest.raises(ValueError, match="exceeds"):
        resolve_limits(EngineConfig(model=ModelConfig(max_model_len=10**7)))


def test_server_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse
    import dataclasses

    monkeypatch.delenv("CBPIPE_API_KEY", raising=False)
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    args = ["--port", "0", "--api-server-count", "3", "--chat-template", "t.jinja"]
    parsed = config.from_arguments(parser.parse_args(args))
    assert (parsed.server.port, parsed.server.api_server_count) == (0, 3)
    assert (parsed.server.host, parsed.server.chat_template) == ("127.0.0.1", "t.jinja")
    assert config.EngineConfig().server.port is None  # no HTTP server unless asked
    for bad in (["--port", "70000"], ["--api-server-count", "0"]):
        with pytest.raises(ValueError, match=bad[0]):
            config.from_arguments(parser.parse_args(bad)).validate()
    # Beyond this host, HTTP too is asked for, and keyed.
    remote = config.from_arguments(parser.parse_args(["--port", "0", "--host", "0.0.0.0"]))
    with pytest.raises(ValueError, match="--allow-remote"):
        remote.validate()
    with pytest.raises(ValueError, match="--api-key"):
        dataclasses.replace(remote, allow_remote=True).validate()
    dataclasses.replace(remote, allow_remote=True, api_key="k").validate()


@pytest.mark.parametrize(
    ("address", "local"),
    [
        ("ipc:///tmp/cbpipe-1-x/client.sock", True),
        ("tcp://127.0.0.1:5555", True),
        ("tcp://localhost:5555", True),
        ("tcp://[::1]:5555", True),
        ("tcp://0.0.0.0:5555", False),
        ("tcp://*:5555", False),
        ("tcp://eth0:5555", False),
        ("tcp://10.1.2.3:5555", False),
    ],
)
def test_addresses_beyond_this_host_need_allow_remote_and_a_key(address: str, local: bool) -> None:
    import dataclasses

    from cbpipe.protocol.security import is_local_address

    assert is_local_address(address) == local
    engine = config.EngineConfig(address=address)
    if local:
        engine.validate()
        return
    with pytest.raises(ValueError, match="--allow-remote"):
        engine.validate()
    with pytest.raises(ValueError, match="--api-key"):
        dataclasses.replace(engine, allow_remote=True).validate()
    keyed = dataclasses.replace(engine, allow_remote=True, api_key="secret")
    keyed.validate()
    assert "secret" not in repr(keyed)


@pytest.mark.parametrize(
    ("requested", "bound", "reachable"),
    [
        ("tcp://127.0.0.1:0", "tcp://127.0.0.1:41935", "tcp://127.0.0.1:41935"),
        ("tcp://127.0.0.1:*", "tcp://127.0.0.1:41935", "tcp://127.0.0.1:41935"),
        # The host stays as given, not as ZeroMQ resolved it.
        ("tcp://localhost:0", "tcp://127.0.0.1:41935", "tcp://localhost:41935"),
        ("tcp://0.0.0.0:0", "tcp://0.0.0.0:41935", "tcp://0.0.0.0:41935"),
        ("tcp://[::1]:0", "tcp://[::1]:41935", "tcp://[::1]:41935"),
        ("tcp://localhost:5555", "tcp://127.0.0.1:5555", "tcp://localhost:5555"),
        ("ipc:///tmp/run/client.sock", "ipc:///tmp/run/client.sock", "ipc:///tmp/run/client.sock"),
    ],
)
def test_clients_are_told_the_port_a_socket_chose(
    requested: str, bound: str, reachable: str
) -> None:
    from cbpipe.protocol.security import reachable_address

    assert reachable_address(requested, bound) == reachable


@pytest.mark.parametrize(("cores", "processes"), [(1, 1), (2, 1), (8, 2), (16, 4), (128, 4)])
def test_http_server_processes_follow_the_host_unless_given(
    monkeypatch: pytest.MonkeyPatch, cores: int, processes: int
) -> None:
    monkeypatch.setattr(config.os, "cpu_count", lambda: cores)
    assert config.ServerConfig().num_processes == processes
    assert config.ServerConfig(api_server_count=3).num_processes == 3


def test_a_chat_template_that_names_no_file_or_does_not_compile_is_refused(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As vLLM reads --chat-template: a file's text, else the value itself if it could be a
    template; and a template that does not compile is refused before the engine starts."""
    from cbpipe.server.text import read_chat_template

    monkeypatch.chdir(tmp_path)

    def checked(template: str) -> None:
        config.EngineConfig(server=config.ServerConfig(port=0, chat_template=template)).validate()

    with pytest.raises(ValueError, match=f"cannot read {tmp_path / 'my_template.jinja'}"):
        checked("my_template.jinja")
    (tmp_path / "my_template.jinja").write_text("{{ messages[0]['content'] }}")
    checked("my_template.jinja")
    assert read_chat_template("my_template.jinja") == "{{ messages[0]['content'] }}"
    literal = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    checked(literal)
    assert read_chat_template(literal) == literal
    assert read_chat_template("line one\nline two") == "line one\nline two"
    for broken in ("{% for x %}", "{{ messages[0] "):
        with pytest.raises(ValueError, match="--chat-template does not compile"):
            checked(broken)
    (tmp_path / "broken.jinja").write_text("{% if add_generation_prompt %}\n<|assistant|>")
    with pytest.raises(ValueError, match=r"does not compile: .*endif.* \(line 2\)"):
        checked("broken.jinja")
    # transformers' own extension: the tag that marks the assistant's tokens compiles.
    checked("{% generation %}{{ messages[0]['content'] }}{% endgeneration %}")


README = Path(__file__).parents[2] / "README.md"


def test_every_flag_is_in_the_readme_option_table() -> None:
    text = README.read_text()
    table = text[text.index("## Launcher options") : text.index("### Tensor parallelism")]
    flags = {
        option
        for action in parser()._actions
        for option in action.option_strings
        if option.startswith("--") and not option.startswith("--no-") and option != "--help"
    }
    missing = sorted(f for f in flags if not re.search(re.escape(f) + r"(?![\w-])", table))
    assert not missing, f"README's option table lacks {missing}"


def test_the_readme_chat_examples_template_is_shipped_and_compiles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The README's HTTP examples chat with the embedded model, which has no template."""
    (shipped,) = set(re.findall(r"--chat-template (\S+\.jinja)", README.read_text()))
    monkeypatch.chdir(README.parent)  # the examples run from the repository root
    config.EngineConfig(server=config.ServerConfig(port=0, chat_template=shipped)).validate()
