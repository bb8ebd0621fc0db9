"""How the launcher starts its children: forked where that is safe, spawned otherwise; and
how it reads its command line."""

import argparse
import subprocess
import sys
from typing import Any

import pytest

from cbpipe import config as config_module
from cbpipe import launcher

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forks on Linux")


def _start_method(setup: str) -> str:
    code = "\n".join(
        [
            setup,
            "from cbpipe.launcher import _child_context",
            "print(_child_context().get_start_method())",
        ]
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()


def test_a_single_threaded_launcher_forks() -> None:
    assert _start_method("") == "fork"


def test_a_launcher_with_another_thread_spawns() -> None:
    """A fork copies only the calling thread: a lock another thread held stays held."""
    setup = (
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()"
    )
    assert _start_method(setup) == "spawn"


def test_packages_imported_from_source_without_bytecode_are_named(tmp_path, monkeypatch) -> None:
    """The launcher's hint for environments that compile their libraries at every start: a
    package with no bytecode, where Python may not write any, is named; one with bytecode
    beside it, or under PYTHONPYCACHEPREFIX, is not."""
    import importlib
    import py_compile

    from cbpipe.launcher import sources_without_bytecode

    for name in ("bare_pkg", "compiled_pkg", "prefixed_pkg"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("VALUE = 1\n")
    py_compile.compile(str(tmp_path / "compiled_pkg" / "__init__.py"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    for name in ("bare_pkg", "compiled_pkg"):
        monkeypatch.delitem(sys.modules, name, raising=False)
        importlib.import_module(name)
    assert sources_without_bytecode(["bare_pkg", "compiled_pkg", "never_imported"]) == ["bare_pkg"]

    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path / "pycache"))
    monkeypatch.delitem(sys.modules, "prefixed_pkg", raising=False)
    source = str(tmp_path / "prefixed_pkg" / "__init__.py")
    py_compile.compile(source, cfile=importlib.util.cache_from_source(source))
    importlib.import_module("prefixed_pkg")
    assert sources_without_bytecode(["prefixed_pkg"]) == []


def test_the_model_may_come_first_as_vllm_serve_takes_it() -> None:
    def model_of(*argv: str) -> str:
        parser = argparse.ArgumentParser()
        config_module.add_arguments(parser)
        return config_module.from_arguments(launcher.parse_args(parser, list(argv))).model.model

    assert model_of("acme/tiny", "--port", "8000") == "acme/tiny"
    assert model_of("--model", "acme/tiny") == "acme/tiny"
    assert model_of() == config_module.DEFAULT_MODEL
    assert model_of("acme/tiny", "--model", "acme/tiny") == "acme/tiny"
    with pytest.raises(SystemExit):
        model_of("acme/tiny", "--model", "acme/other")


def test_a_start_up_past_its_limit_says_so_once_with_the_limit_and_the_flag() -> None:
    """The launcher's limit runs out before the children's own waits: one line, no child's
    traceback, and the limit as given (0.05, not "0")."""
    run = subprocess.run(
        [sys.executable, "-m", "cbpipe.launcher", "--ready-timeout-s", "0.05"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1, run.stderr
    last_line = run.stderr.strip().splitlines()[-1]
    assert last_line.endswith("not ready within 0.05 s (--ready-timeout-s 0.05)"), run.stderr
    assert "start-up timed out" in run.stderr and "Traceback" not in run.stderr, run.stderr


def test_a_child_traceback_is_cut_to_its_exception_as_the_child_logged_it_whole() -> None:
    traceback = 'Traceback (most recent call last):\n  File "x.py", line 1\nValueError: bad\n'
    assert launcher._failure(traceback) == "ValueError: bad (its traceback above)"
    reason = "model acme/tiny is not supported:\nits layers compute attention themselves"
    assert launcher._failure(reason) == reason


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--host", "0.0.0.0", "--port", "0"], 'docs/RELIABILITY.md, "Serving other machines"'),
        (["--no-such-option"], "unrecognized arguments: --no-such-option"),
    ],
)
def test_a_bad_command_line_gets_the_short_usage_and_its_error(
    argv: list[str], error: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CBPIPE_API_KEY", raising=False)
    with pytest.raises(SystemExit) as exited:
        launcher.main(argv)
    assert exited.value.code == 2
    usage, message = capsys.readouterr().err.splitlines()
    assert usage == "usage: cbpipe-launch [MODEL] [options]"
    assert message.startswith("cbpipe-launch: error: ") and error in message


def test_a_bad_profile_span_is_refused_at_the_command_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The workers read it after their start; a typo must not cost a model's load first."""
    monkeypatch.setenv("CBPIPE_PROFILE_STEPS", "20-8")
    with pytest.raises(SystemExit) as exited:
        launcher.main([])
    assert exited.value.code == 2
    assert "CBPIPE_PROFILE_STEPS='20-8'" in capsys.readouterr().err


def _deaf_to_sigterm(deaf: Any) -> None:
    import signal
    import time

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    deaf.set()
    time.sleep(60)


def test_a_child_that_does_not_stop_is_killed_and_named(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A hang in a child's orderly stop ends in SIGKILL, and the launcher says which child."""
    import multiprocessing as mp

    monkeypatch.setattr(launcher, "STOP_TIMEOUT_S", 0.2)
    context = mp.get_context("fork")
    deaf = context.Event()
    process = context.Process(target=_deaf_to_sigterm, args=(deaf,))
    process.start()
    assert deaf.wait(60)
    spec = launcher.ChildSpec("worker", _deaf_to_sigterm)  # type: ignore[arg-type]
    launcher._stop([spec], {"worker": process})
    assert not process.is_alive() and process.exitcode == -9
    assert "the worker did not stop within 0.2 s of SIGTERM; killed it" in capsys.readouterr().err


def test_too_little_shared_memory_is_refused_before_anything_starts(monkeypatch, capsys) -> None:
    """A tmpfs out of room answers a write with SIGBUS: the launcher checks the room first and
    says what to give, instead of dying unexplained (a container's /dev/shm is 64 MB)."""
    from cbpipe.protocol import shm

    real = shm.os.statvfs(shm.SHM_DIR)
    small = type("Stats", (), {"f_bavail": 4, "f_frsize": real.f_frsize})()
    monkeypatch.setattr(shm.os, "statvfs", lambda folder: small)
    monkeypatch.setattr(launcher, "create_segment", None)  # never reached
    assert launcher.Launcher(config_module.EngineConfig()).run() == 2
    error = capsys.readouterr().err
    assert "MB of shared memory" in error and "--shm-size" in error, error
    assert "--max-num-seqs" in error, error
