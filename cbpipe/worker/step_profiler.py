"""torch's profiler around a range of a serving worker's steps: where a step's host time goes.

A launched engine's steps are timed by its trace (the scheduler's step records), which says
how long the worker took to enqueue a step but not on what. ``CBPIPE_PROFILE_STEPS=8-14``
(step numbers as the trace has them) profiles those steps' launches and their device work,
with Python's own calls, and writes into ``CBPIPE_PROFILE_DIR`` (default: the working
directory) a Chrome trace and a table of operators by their own host time. The profiler
slows the host several-fold while it runs; compare shares, not absolute times.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cbpipe import env

log = logging.getLogger(__name__)


@dataclass
class StepProfiler:
    first: int
    last: int
    folder: Path
    _profile: torch.profiler.profile | None = field(default=None, repr=False)
    _done: bool = False

    @classmethod
    def from_env(cls) -> StepProfiler | None:
        span = env.profile_steps()
        if span is None:
            return None
        log.info("profiling steps %d-%d into %s", *span, env.profile_dir())
        return cls(*span, folder=env.profile_dir())

    def before_launch(self, step: int) -> None:
        if self._done or self._profile is not None or not self.first <= step <= self.last:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile = torch.profiler.profile(activities=activities, with_stack=True)
        self._profile.__enter__()

    def after_launch(self, step: int) -> None:
        """Past the range's last step: wait for the device, stop and write the results (the
        worker stalls for the seconds this takes; the trace shows it as one slow step)."""
        if self._profile is None or step < self.last:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        profile, self._profile, self._done = self._profile, None, True
        profile.__exit__(None, None, None)
        start = time.perf_counter()
        self.folder.mkdir(parents=True, exist_ok=True)
        name = f"steps_{self.first}-{self.last}"
        profile.export_chrome_trace(str(self.folder / f"{name}.json.gz"))  # .gz: torch packs it
        table = profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=60)
        (self.folder / f"{name}.txt").write_text(table)
        log.info(
            "profile of steps %d-%d written to %s in %.1f s",
            self.first,
            self.last,
            self.folder,
            time.perf_counter() - start,
        )
