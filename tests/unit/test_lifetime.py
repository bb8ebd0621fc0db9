import subprocess
import sys
import time

import pytest

from cbpipe.lifetime import process_age_s

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_process_age_counts_from_the_process_start() -> None:
    """A child that sleeps before asking is at least that old, and not much older."""
    code = (
        "import time; time.sleep(0.5)\n"
        "from cbpipe.lifetime import process_age_s; print(process_age_s())"
    )
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    lifetime = time.monotonic() - started
    age = float(out.stdout)
    assert 0.5 <= age <= lifetime + 0.05  # clock ticks are 10 ms


def test_process_age_grows() -> None:
    first = process_age_s()
    time.sleep(0.05)
    second = process_age_s()
    assert first is not None and second is not None
    assert second - first >= 0.04
