"""``cbpipe-launch``: start the scheduler and the worker, watch them, clean up after them.

The launcher owns everything that must not outlive the run: the shared-memory segment and the
folder of ipc sockets. It creates both before the children start and removes both in a
``finally`` block, whatever ends the run: a signal, a child's death, or an error at start.
"""

from __future__ import annotations

import argparse
import functools
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from types import FrameType

from cbpipe import config as config_module
from cbpipe.config import EngineConfig
from cbpipe.lifetime import end_with_parent
from cbpipe.logs import setup_logging
from cbpipe.models import resolve_model
from cbpipe.models.support import check_config
from cbpipe.protocol.launch import EngineAddresses, RunSpec
from cbpipe.protocol.shm import (
    create_segment,
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
WORKER_GRACE_S = 3.0  # for the worker to act on the scheduler's shutdown message


class LaunchError(RuntimeError):
    pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="cbpipe-launch",
        description="Serve a Hugging Face causal LM with asynchronous continuous batching.",
    )
    config_module.add_arguments(parser)
    config = config_module.from_arguments(parser.parse_args(argv))
    try:
        config.validate()
    except ValueError as exc:
        parser.error(str(exc))
    setup_logging(config.log_level, "launcher")
    sys.exit(Launcher(config).run())


def plan_layout(config: EngineConfig) -> SlotLayout:
    """Slot capacities from the engine limits and the model's maximum length.

    Raises ``ValueError`` for a model that cannot be resolved, and ``UnsupportedModel`` (a
    ``ValueError`` too) for one cbpipe cannot serve, before any child starts.
    """
    source = resolve_model(config.model.model)
    max_model_len = check_config(source.config, config.model.max_model_len)
    block_size = config.cache.block_size
    limits = SlotLimits(
        max_tokens=config.scheduler.max_batch_tokens,
        max_seqs=config.scheduler.max_num_seqs,
        max_blocks_per_seq=-(-max_model_len // block_size),
    )
    # One slot per step in flight (the scheduler writes a slot only once its last step is
    # back), and two at least: the layout double-buffers.
    return SlotLayout.build(limits, num_slots=max(2, config.scheduler.max_in_flight))


class Launcher:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.stop_requested = False

    def run(self) -> int:
        """Serve until a signal (exit 0) or a child's death (exit 1)."""
        try:
            layout = plan_layout(self.config)
        except ValueError as exc:
            print(f"cbpipe-launch: {exc}", file=sys.stderr)
            return 2
        run_dir = tempfile.mkdtemp(prefix="cbpipe-")
        segment = create_segment(new_segment_name(), layout.segment_nbytes)
        children: dict[str, mp.process.BaseProcess] = {}
        try:
            spec = RunSpec(
                self.config,
                EngineAddresses.in_directory(run_dir, self.config.address),
                segment.name,
                layout.limits,
                layout.num_slots,
                launcher_pid=os.getpid(),
                run_dir=run_dir,
            )
            self._install_signal_handlers()
            children = self._start_children(spec)
            if self.stop_requested:
                return 0
            print(
                f"cbpipe ready address={spec.addresses.client} "
                f"scheduler={children['scheduler'].pid} worker={children['worker'].pid}",
                flush=True,
            )
            return self._watch(children)
        except LaunchError as exc:
            print(f"cbpipe-launch: {exc}", file=sys.stderr)
            return 1
        finally:
            _stop(children)
            remove_segment(segment)
            shutil.rmtree(run_dir, ignore_errors=True)

    def _install_signal_handlers(self) -> None:
        def request_stop(signum: int, frame: FrameType | None) -> None:
            self.stop_requested = True

        signal.signal(signal.SIGTERM, request_stop)
        signal.signal(signal.SIGINT, request_stop)

    def _start_children(self, spec: RunSpec) -> dict[str, mp.process.BaseProcess]:
        from cbpipe.scheduler.process import scheduler_main
        from cbpipe.worker.process import worker_main

        context = mp.get_context("spawn")
        children, pipes = {}, {}
        for name, target in (("worker", worker_main), ("scheduler", scheduler_main)):
            receiver, sender = context.Pipe(duplex=False)
            process = context.Process(target=_child, args=(target, spec, sender), name=name)
            process.start()
            sender.close()
            children[name], pipes[name] = process, receiver
        deadline = time.monotonic() + spec.config.ready_timeout_s
        waiting = dict(pipes)
        while waiting and not self.stop_requested:
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"{', '.join(waiting)} not ready within {spec.config.ready_timeout_s:.0f} s"
                )
            for conn in mp.connection.wait(list(waiting.values()), timeout=0.2):
                name = next(n for n, c in waiting.items() if c is conn)
                status, detail = _read_status(conn)
                if status != "ready":
                    raise LaunchError(f"the {name} failed to start:\n{detail}")
                log.info("%s ready: %s", name, detail)
                del waiting[name]
        return children

    def _watch(self, children: dict[str, mp.process.BaseProcess]) -> int:
        sentinels = {p.sentinel: name for name, p in children.items()}
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
        log.info("stopping")
        return 0


def _child(target, spec: RunSpec, ready) -> None:  # type: ignore[no-untyped-def]
    # Ctrl-C reaches the whole process group; the launcher alone decides how to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A launcher killed outright stops and cleans up nothing: its children do, on a signal of
    # their own from the kernel (SIGTERM alone could not tell them who must clean up).
    signal.signal(PARENT_DIED, functools.partial(_on_launcher_death, spec))
    end_with_parent(spec.launcher_pid, PARENT_DIED)
    code = 1
    try:
        target(spec, ready)
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


def _on_launcher_death(spec: RunSpec, signum: int, frame: FrameType | None) -> None:
    """Remove what the launcher would have, then stop as if it had asked (SIGTERM).

    Both children do it; whichever comes second finds nothing left. The mappings and the
    connected sockets the processes hold keep working until they exit.
    """
    unlink_segment(spec.segment_name)
    shutil.rmtree(spec.run_dir, ignore_errors=True)
    os.kill(os.getpid(), signal.SIGTERM)


def _read_status(conn: mp.connection.Connection) -> tuple[str, str]:
    try:
        return conn.recv()
    except EOFError:
        return "failed", "the process exited before reporting"


def _stop(children: dict[str, mp.process.BaseProcess]) -> None:
    """Scheduler first: it tells the worker to shut down; then whatever is left."""
    scheduler, worker = children.get("scheduler"), children.get("worker")
    if scheduler is not None and scheduler.is_alive():
        scheduler.terminate()
        scheduler.join(STOP_TIMEOUT_S)
    if worker is not None and worker.is_alive():
        worker.join(WORKER_GRACE_S)
        if worker.is_alive():
            worker.terminate()
            worker.join(STOP_TIMEOUT_S)
    for process in children.values():
        if process.is_alive():
            process.kill()
            process.join()


if __name__ == "__main__":
    main()
