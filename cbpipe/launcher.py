"""``cbpipe-launch``: start the engine's processes, watch them, clean up after them.

The processes are a list of named ``ChildSpec`` entries (the worker, the scheduler, and
whatever else serves: an HTTP front end is one more entry). Each starts once the children it
comes ``after`` have reported ready, and must report ready itself within the time limit.
The launcher owns everything that must not outlive the run: the shared-memory segment and the
folder of ipc sockets. It creates both before the children start and removes both in a
``finally`` block, whatever ends the run: a signal, a child's death, or an error at start.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import functools
import importlib.util
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType

from cbpipe import config as config_module
from cbpipe import env
from cbpipe.config import LARGE_DEVICE_MEMORY, EngineConfig
from cbpipe.leftovers import remove_dead_launches, run_dir_prefix
from cbpipe.lifetime import end_with_parent, fork_is_safe, process_age_s
from cbpipe.logs import setup_logging
from cbpipe.models import fetch_model, resolve_model
from cbpipe.models.support import check_config, check_tensor_parallel, length_limit
from cbpipe.protocol.launch import EngineAddresses, Rendezvous, RunSpec, worker_names
from cbpipe.protocol.liveness import HeartbeatTable
from cbpipe.protocol.shm import (
    SharedMemoryTooSmall,
    check_room,
    create_segment,
    free_bytes,
    new_segment_name,
    remove_segment,
    unlink_segment,
)
from cbpipe.protocol.slots import SlotLayout, SlotLimits

log = logging.getLogger("cbpipe.launcher")

# Sent by the kernel to each child when the launcher dies. Not SIGHUP: a terminal's hang-up
# reaches the whole group, and under nohup the launcher would live on without its children.
PARENT_DIED = signal.SIGUSR1

STOP_TIMEOUT_S = 10.0
# The children's own start-up waits (the scheduler's for the workers) get this much longer
# than --ready-timeout-s: the launcher enforces the limit, with one message, and stops them
# before theirs run out.
READY_TIMEOUT_GRACE_S = 5.0
PEER_STOP_GRACE_S = 3.0  # for a child to act on the shutdown message of the one that stops it

ChildTarget = Callable[..., None]  # (spec, ready connection, *args) -> None


@dataclass(frozen=True)
class ChildSpec:
    """One process of the engine.

    ``after``: children that must be ready before this one starts. ``stopped_by``: the child
    that tells this one to stop (the scheduler sends the worker a shutdown message), so the
    launcher gives it a moment after stopping that one before signalling it. Children stop
    in the reverse of their order in the list. Every child stamps its heartbeat from its main
    loop once it is ready (``protocol/liveness.py``); the launcher ends the run when one goes
    stale.
    """

    name: str
    target: ChildTarget
    args: tuple[object, ...] = ()
    after: tuple[str, ...] = ()
    stopped_by: str | None = None
    watched_by: str | None = None  # the child that notices first when this one is stuck


def engine_children(
    config: EngineConfig, http_socket: socket.socket | None = None
) -> list[ChildSpec]:
    """The processes a run of ``config`` needs, in start order; the HTTP servers accept on
    ``http_socket`` (the launcher opens it, so that a port in use fails at once)."""
    from cbpipe.scheduler.process import scheduler_main
    from cbpipe.worker.process import worker_main

    # The scheduler waits for the workers' handshakes itself, so all start at once: the
    # workers' model loading is most of start-up. One worker per tensor-parallel rank.
    names = worker_names(config.worker.tensor_parallel_size)
    children = [
        ChildSpec(name, worker_main, (rank,), stopped_by="scheduler", watched_by="scheduler")
        for rank, name in enumerate(names)
    ]
    children.append(ChildSpec("scheduler", scheduler_main))
    if http_socket is not None:
        from cbpipe.server.process import server_main

        children += [
            ChildSpec(f"api_server_{i}", server_main, args=(http_socket, i), after=("scheduler",))
            for i in range(config.server.num_processes)
        ]
    return children


class LaunchError(RuntimeError):
    pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="cbpipe-launch",
        # Not argparse's generated usage: every flag, some 40 lines above each error.
        usage="%(prog)s [MODEL] [options]",
        description="Serve a Hugging Face causal LM with asynchronous continuous batching.",
    )
    config_module.add_arguments(parser)
    config = config_module.from_arguments(parse_args(parser, argv))
    try:
        config.validate()
        env.profile_steps()  # read by the workers after their start: refused here, not there
    except ValueError as exc:
        parser.error(str(exc))
    setup_logging(config.log_level, "launcher")
    code = Launcher(config).run()
    # Everything is stopped and removed. Python puts its own handlers back to the default
    # as it finalizes (a second or more after torch's imports), and a signal then, a second
    # Ctrl-C say, would end a clean stop as "killed by SIGTERM"; ignored ones it leaves.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(code)


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The flags, and the model as vLLM's ``vllm serve MODEL`` takes it: a first word that is
    not a flag stands for ``--model``."""
    parser.add_argument(
        "positional_model", nargs="?", metavar="MODEL", help="the same as --model MODEL"
    )
    args = parser.parse_args(argv)
    model = args.__dict__.pop("positional_model")
    if model is not None:
        if args.model__model not in (config_module.DEFAULT_MODEL, model):
            parser.error(f"two models: {model} and --model {args.model__model}")
        args.model__model = model
    return args


def resolve_limits(config: EngineConfig) -> EngineConfig:
    """``config`` with its length limit resolved against the model's, once for every process
    (``--max-model-len`` as given, never rounded to a block: the scheduler enforces it).

    A Hub model is downloaded first, unless cached. Raises ``ValueError`` for a model that
    cannot be resolved or fetched, and ``UnsupportedModel`` (a ``ValueError`` too) for one
    cbpipe cannot serve, before any child starts.
    """
    fetch_model(config.model.model, config.model.revision)
    source = resolve_model(config.model.model, config.model.revision, config.model.tokenizer)
    max_model_len = check_config(source.config, config.model.max_model_len)
    check_tensor_parallel(source.config, config.worker.tensor_parallel_size)
    model_len = length_limit(source.config)
    if model_len is not None and max_model_len > model_len:
        raise ValueError(
            f"--max-model-len {max_model_len} exceeds the {model_len} positions "
            f"{config.model.model} was trained for"
        )
    return dataclasses.replace(
        config, model=dataclasses.replace(config.model, max_model_len=max_model_len)
    )


def sources_without_bytecode(modules: list[str]) -> list[str]:
    """Those of the imported packages ``modules`` that Python loaded from source and could
    not cache: no bytecode beside (or under ``PYTHONPYCACHEPREFIX`` for) their
    ``__init__.py`` even now that they are imported. Docker images often ship their packages
    so (``pip install --no-compile``, ``PYTHONDONTWRITEBYTECODE=1``)."""
    missing = []
    for name in modules:
        source = getattr(sys.modules.get(name), "__file__", None)
        if not source or not source.endswith(".py"):
            continue  # not imported, or loaded from bytecode alone
        if not os.path.exists(importlib.util.cache_from_source(source)):
            missing.append(name)
    return missing


def plan_layout(config: EngineConfig, *, room: int | None = None) -> SlotLayout:
    """Slot capacities from the engine limits and the (resolved) maximum length.

    The worker picks a step's limits by its device's memory, once it has seen it: the slots
    hold the largest limits it can pick. Where that takes more than ``room`` bytes (the
    shared memory free) and a small device's defaults fit, the slots hold those, and the
    worker keeps within them: a container's 64 MB ``/dev/shm`` serves 256 sequences a step
    where 1,024 need more."""
    assert config.model.max_model_len is not None, "resolve_limits first"
    block_size = config.cache.block_size
    source = resolve_model(config.model.model, config.model.revision)
    num_slots = max(2, config.scheduler.max_in_flight)

    def layout(device_memory: int | None) -> SlotLayout:
        limits = SlotLimits(
            max_tokens=config.scheduler.batch_tokens(device_memory),
            max_seqs=config.scheduler.num_seqs(device_memory),
            max_blocks_per_seq=-(-config.model.max_model_len // block_size),
            vocab_size=int(source.config.get_text_config().vocab_size),
        )
        # One slot per step in flight (the scheduler writes a slot only once its last step
        # is back), and two at least: the layout double-buffers.
        return SlotLayout.build(limits, num_slots=num_slots)

    if config.model.device == "cpu":
        return layout(None)
    largest = layout(LARGE_DEVICE_MEMORY)
    if room is None or largest.segment_nbytes <= room:
        return largest
    small = layout(None)
    if small.segment_nbytes > room:
        return largest  # neither fits: check_room says what the largest needs
    log.info(
        "the shared memory has %.0f MB free: slots for %d sequences and %d tokens a step "
        "(%.0f MB), not %d and %d (%.0f MB)",
        room / 1e6,
        small.limits.max_seqs,
        small.limits.max_tokens,
        small.segment_nbytes / 1e6,
        largest.limits.max_seqs,
        largest.limits.max_tokens,
        largest.segment_nbytes / 1e6,
    )
    return small


class Launcher:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.stop_requested = False

    def run(self) -> int:
        """Serve until a signal (exit 0) or a child's death (exit 1)."""
        try:
            self.config = resolve_limits(self.config)
            room = free_bytes()
            layout = plan_layout(self.config, room=room)
            check_room(layout.segment_nbytes, room)
        except (ValueError, SharedMemoryTooSmall) as exc:
            print(f"cbpipe-launch: {exc}", file=sys.stderr)
            return 2
        server = self.config.server
        try:
            http_socket = None if server.port is None else _listen(server.host, server.port)
        except OSError as exc:
            print(f"cbpipe-launch: cannot serve HTTP on {server.host}:{server.port}: {exc}",
                  file=sys.stderr)  # fmt: skip
            return 2
        # Start-up, as the ready line gives it, counts from this process's own start: its
        # imports and the model's configuration are part of the wait.
        age = process_age_s() or 0.0
        started = time.monotonic() - age
        log.info("imports and checks took %.1f s; starting the engine's processes", age)
        if missing := sources_without_bytecode(["torch", "transformers"]):
            folders = [os.path.dirname(sys.modules[name].__file__ or "") for name in missing]
            log.warning(
                "no bytecode for %s, and Python may not write it: every launch compiles their "
                "sources again (the imports took %.1f s, a few times what bytecode takes). "
                "Compile them once (python -m compileall -q %s), or let Python keep bytecode "
                "elsewhere (PYTHONPYCACHEPREFIX=DIR, PYTHONDONTWRITEBYTECODE unset)",
                " and ".join(missing),
                age,
                " ".join(folders),
            )
        remove_dead_launches()
        run_dir = tempfile.mkdtemp(prefix=run_dir_prefix())
        segment = create_segment(new_segment_name(), layout.segment_nbytes)
        children: dict[str, mp.process.BaseProcess] = {}
        specs = engine_children(self.config, http_socket)
        heartbeats: HeartbeatTable | None = None
        try:
            spec = RunSpec(
                dataclasses.replace(
                    self.config, ready_timeout_s=self.config.ready_timeout_s + READY_TIMEOUT_GRACE_S
                ),
                EngineAddresses.in_directory(run_dir, self.config.address),
                segment.name,
                layout.limits,
                layout.num_slots,
                launcher_pid=os.getpid(),
                run_dir=run_dir,
                process_names=tuple(child.name for child in specs),
                rendezvous=_rendezvous(self.config.worker.tensor_parallel_size),
            )
            assert segment.buf is not None
            heartbeats = spec.heartbeats(segment.buf)
            self._install_signal_handlers()
            spec, details = self._start_children(spec, specs, children)
            if self.stop_requested:
                return 0
            print(_ready_line(spec, children, details, time.monotonic() - started), flush=True)
            return self._watch(specs, children, heartbeats)
        except LaunchError as exc:
            print(f"cbpipe-launch: {exc}", file=sys.stderr)
            return 1
        finally:
            _stop(specs, children)
            if http_socket is not None:
                http_socket.close()
            if heartbeats is not None:
                heartbeats.close()
            remove_segment(segment)
            shutil.rmtree(run_dir, ignore_errors=True)

    def _install_signal_handlers(self) -> None:
        def request_stop(signum: int, frame: FrameType | None) -> None:
            self.stop_requested = True

        signal.signal(signal.SIGTERM, request_stop)
        signal.signal(signal.SIGINT, request_stop)

    def _start_children(
        self,
        spec: RunSpec,
        specs: list[ChildSpec],
        children: dict[str, mp.process.BaseProcess],
    ) -> tuple[RunSpec, dict[str, str]]:
        """Start every child once those it comes after are ready; wait until all are.

        ``children`` fills as they start (the caller stops them whatever happens); returns
        the run's spec with the client address the scheduler bound (children started after
        it were given that one), and what each child reported with its readiness.
        """
        context = _child_context()
        pending = list(specs)
        waiting: dict[str, mp.connection.Connection] = {}
        ready: dict[str, str] = {}
        limit_s = self.config.ready_timeout_s
        deadline = time.monotonic() + limit_s
        while (pending or waiting) and not self.stop_requested:
            for child in [c for c in pending if all(a in ready for a in c.after)]:
                receiver, sender = context.Pipe(duplex=False)
                process = context.Process(
                    target=_child, args=(child.target, spec, sender, child.args), name=child.name
                )
                process.start()
                sender.close()
                children[child.name], waiting[child.name] = process, receiver
                pending.remove(child)
            if time.monotonic() > deadline:
                late = ", ".join([*waiting, *(c.name for c in pending)])
                raise LaunchError(
                    f"start-up timed out: {late} not ready within {limit_s:g} s "
                    f"(--ready-timeout-s {limit_s:g})"
                )
            left_s = max(0.0, deadline - time.monotonic())
            for conn in mp.connection.wait(list(waiting.values()), timeout=min(0.2, left_s)):
                name = next(n for n, c in waiting.items() if c is conn)
                status, detail = _read_status(conn)
                if status != "ready":
                    raise LaunchError(f"the {name} failed to start: {_failure(detail)}")
                log.info("%s ready: %s", name, detail)
                ready[name] = detail
                del waiting[name]
                if name == "scheduler":  # it reports the address it listens on
                    spec = spec.with_client_address(detail)
        return spec, ready

    def _watch(
        self,
        specs: list[ChildSpec],
        children: dict[str, mp.process.BaseProcess],
        heartbeats: HeartbeatTable,
    ) -> int:
        """Until a signal: a child that exits, or whose heartbeat goes stale, ends the run."""
        sentinels = {p.sentinel: name for name, p in children.items()}
        timeout_s = self.config.liveness_timeout_s
        while not self.stop_requested:
            for sentinel in mp.connection.wait(list(sentinels), timeout=0.2):
                if self.stop_requested:
                    break  # a signal to the whole group may reach the children first
                name = sentinels[sentinel]
                children[name].join(1)
                code = children[name].exitcode
                print(
                    f"cbpipe-launch: the {name} exited unexpectedly (code {code})", file=sys.stderr
                )
                return 1
            for child in specs:
                # A child that another one watches (the scheduler watches the worker) gets
                # time to report the failure to the clients itself.
                limit = timeout_s * (2 if child.watched_by else 1)
                silent = heartbeats.silent_for_s(child.name)
                if silent is not None and silent > limit and not self.stop_requested:
                    print(
                        f"cbpipe-launch: the {child.name} stopped responding (no heartbeat for "
                        f"{silent:.1f} s; --liveness-timeout-s {timeout_s:g})",
                        file=sys.stderr,
                    )
                    _kill(children[child.name])
                    return 1
        log.info("stopping")
        return 0


def _ready_line(
    spec: RunSpec,
    children: dict[str, mp.process.BaseProcess],
    details: dict[str, str],
    startup_s: float,
) -> str:
    """``cbpipe ready address=... scheduler=PID worker=PID [name=PID ...] [key=value ...]
    startup_s=S``: the client address, every child's pid (the scheduler's and the worker's
    first; with tensor parallelism ``worker`` is rank 0, and ``worker0``.. follow), what a
    child serves besides when its readiness says ``key=value`` (an HTTP URL),
    and how long start-up took."""
    workers = spec.worker_names
    others = [n for n in children if n != "scheduler" and n not in workers]
    fields = [f"address={spec.addresses.client}", f"scheduler={children['scheduler'].pid}"]
    # ``worker=`` is rank 0 whatever the ranks are called: the line's fixed prefix.
    fields.append(f"worker={children[workers[0]].pid}")
    fields += [f"{name}={children[name].pid}" for name in [*workers, *others]]
    fields += [d for d in details.values() if re.fullmatch(r"[a-z_]+=\S+", d)]
    fields.append(f"startup_s={startup_s:.1f}")
    return "cbpipe ready " + " ".join(dict.fromkeys(fields))


def _rendezvous(tensor_parallel_size: int) -> Rendezvous | None:
    """A free port on this host for the worker ranks' ``torch.distributed`` store (rank 0
    binds it; between this probe and that bind another process could take it, and rank 0
    then fails to start with the error)."""
    if tensor_parallel_size == 1:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return Rendezvous("127.0.0.1", port, tensor_parallel_size)


def _listen(host: str, port: int) -> socket.socket:
    from cbpipe.server.process import listen

    return listen(host, port)


def _child_context() -> mp.context.BaseContext:
    """Fork the children where that is safe (``lifetime.fork_is_safe``), so that they start
    with what this process has imported (``engine_children`` imports their modules): torch,
    transformers and triton take seconds to import again, and the worker's imports come
    before all its other start-up. Spawn otherwise."""
    if fork_is_safe():
        return mp.get_context("fork")
    log.debug("spawning the children: this process has threads or CUDA")
    return mp.get_context("spawn")


def _child(target, spec: RunSpec, ready, args) -> None:  # type: ignore[no-untyped-def]
    # A forked child has the launcher's handler for SIGTERM, which would only set a flag.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # Ctrl-C reaches the whole process group; the launcher alone decides how to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A launcher killed outright stops and cleans up nothing: its children do, on a signal of
    # their own from the kernel (SIGTERM alone could not tell them who must clean up).
    signal.signal(PARENT_DIED, functools.partial(_on_launcher_death, spec))
    end_with_parent(spec.launcher_pid, PARENT_DIED)
    _stdout_to_stderr()
    code = 1
    try:
        target(spec, ready, *args)
        code = 0
    except SystemExit as exc:
        code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        # The child has released what it holds; skip the interpreter's teardown, which
        # spends seconds collecting torch's and transformers' objects.
        logging.shutdown()
        sys.stderr.flush()
        os._exit(code)


def _stdout_to_stderr() -> None:
    """Point this child's stdout at its stderr. The launcher's stdout carries its ready line,
    and the program that started it may read no further (``EngineProcess`` stops at that
    line): whatever a child wrote there (uvicorn's access log, at --log-level debug) filled
    the pipe and blocked the child in a write, serving nothing, and once the launcher was
    killed it could not stop until its watchdog ended it."""
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())


def _on_launcher_death(spec: RunSpec, signum: int, frame: FrameType | None) -> None:
    """Remove what the launcher would have, then stop as if it had asked (SIGTERM).

    Both children do it; whichever comes second finds nothing left. The mappings and the
    connected sockets the processes hold keep working until they exit. No launcher is left
    to kill a child whose orderly stop hangs, so a watchdog thread does: after
    ``STOP_TIMEOUT_S`` it prints every thread's stack to stderr and exits.
    """
    unlink_segment(spec.segment_name)
    shutil.rmtree(spec.run_dir, ignore_errors=True)
    faulthandler.dump_traceback_later(STOP_TIMEOUT_S, exit=True)
    os.kill(os.getpid(), signal.SIGTERM)


def _failure(detail: str) -> str:
    """What a child reported with its failure to start: its own reason whole, or of a
    traceback, which the child has logged already, the last line (the exception)."""
    lines = detail.strip().splitlines()
    if lines and lines[0].startswith("Traceback (most recent call last)"):
        return f"{lines[-1]} (its traceback above)"
    return detail


def _read_status(conn: mp.connection.Connection) -> tuple[str, str]:
    try:
        return conn.recv()
    except EOFError:
        return "failed", "the process exited before reporting"


def _stop(specs: list[ChildSpec], children: dict[str, mp.process.BaseProcess]) -> None:
    """In the reverse of the start order; a child stopped by another gets a moment to act
    on that one's message first (unless that one is gone). Whatever is left is killed."""
    for child in reversed(specs):
        process = children.get(child.name)
        if process is None or not process.is_alive():
            continue
        stopper = children.get(child.stopped_by) if child.stopped_by else None
        if stopper is not None and stopper.exitcode == 0:
            process.join(PEER_STOP_GRACE_S)
        if process.is_alive():
            process.terminate()
            _resume(process)  # a stopped process acts on SIGTERM only once it runs
            process.join(STOP_TIMEOUT_S)
            if process.is_alive():  # a hang in its orderly stop: a defect, said so
                print(
                    f"cbpipe-launch: the {child.name} did not stop within {STOP_TIMEOUT_S:g} s "
                    "of SIGTERM; killed it",
                    file=sys.stderr,
                )
    for process in children.values():
        if process.is_alive():
            _kill(process)


def _resume(process: mp.process.BaseProcess) -> None:
    with contextlib.suppress(ProcessLookupError, TypeError):
        os.kill(process.pid, signal.SIGCONT)  # type: ignore[arg-type]


def _kill(process: mp.process.BaseProcess) -> None:
    """SIGKILL, which a stopped process gets too, and reap."""
    with contextlib.suppress(ProcessLookupError):
        process.kill()
    process.join()


if __name__ == "__main__":
    main()
