"""How the scheduler's loop takes client messages between steps (``loop.take_messages``)."""

from cbpipe.scheduler.loop import take_messages


class Burst:
    """``count`` messages waiting, each taking ``cost`` units of a fake clock to receive."""

    def __init__(self, count: int, cost: int) -> None:
        self.left, self.cost, self.now = count, cost, 0

    def receive(self) -> None:
        self.left -= 1
        self.now += self.cost

    def take(self, **kwargs: int) -> int:
        return take_messages(lambda: self.left > 0, self.receive, clock=lambda: self.now, **kwargs)


def test_a_burst_is_taken_a_slice_at_a_time() -> None:
    """So that steps leave and results are applied between the slices of a flood of submits:
    taken whole, a burst kept the device idle until its last submit was in (PERFORMANCE.md)."""
    burst = Burst(256, cost=1)  # whole units: no rounding at the slice's end
    assert burst.take(slice_s=20) == 20
    assert burst.take(slice_s=20) == 20  # the next poll goes on where this one stopped
    assert burst.left == 216


def test_the_count_limit_and_an_empty_socket_end_a_poll_too() -> None:
    assert Burst(2000, cost=0).take(slice_s=20, limit=1024) == 1024
    assert Burst(3, cost=0).take(slice_s=20) == 3
    assert Burst(0, cost=0).take() == 0


def test_one_message_at_least_however_long_it_takes() -> None:
    assert Burst(3, cost=100).take(slice_s=20) == 1
