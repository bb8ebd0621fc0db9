"""Tests marked ``gpu`` run only where torch sees a CUDA device; elsewhere they are skipped."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from types import FrameType

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(scope="session", autouse=True)
def sigterm_unwinds() -> Iterator[None]:
    """A SIGTERM (from ``timeout`` in scripts/gpu_check.sh) unwinds like Ctrl-C, so the
    engines that the tests started, each in its own session, are stopped rather than left."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    yield
    signal.signal(signal.SIGTERM, previous)
