"""The loop-lag monitor: the largest lateness over its window, forgotten
after it; installed while it runs and only then."""

from __future__ import annotations

import trio
import trio.testing

from frontend import loop_lag


def test_recent_is_the_largest_lateness_within_the_window() -> None:
    lag = loop_lag.LoopLag(interval=0.05, window=5.0)
    assert lag.recent(0.0) == 0.0
    lag.note(1.0, 0.2)
    lag.note(2.0, 0.7)
    lag.note(3.0, 0.1)
    assert lag.recent(3.0) == 0.7
    assert lag.recent(7.5) == 0.1  # the 0.7 at t=2 is past the window
    assert lag.recent(9.0) == 0.0


async def test_the_running_monitor_is_current_and_notes_late_wakeups(autojump_clock: trio.testing.MockClock) -> None:
    lag = loop_lag.LoopLag(interval=0.05)
    assert loop_lag.current() == 0.0
    async with trio.open_nursery() as nursery:
        await nursery.start(lag.run)
        assert loop_lag._current is lag
        await trio.sleep(0.2)
        lag.note(trio.current_time(), 0.3)  # as if the loop had been blocked
        assert loop_lag.current() == 0.3
        nursery.cancel_scope.cancel()
    assert loop_lag._current is None and loop_lag.current() == 0.0
