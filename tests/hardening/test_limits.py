"""frontend/limits.py (budgets, the connection ledger) and frontend/hardening.py's
bounded stream buffer (under trio's MockClock)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from frontend.hardening import MIN_SHARE, StreamBuffer, WriteStalled, _Unsent
from frontend.limits import Budget, ConnectionLedger, Limits


def test_a_budget_allows_its_burst_at_once_then_its_rate() -> None:
    budget = Budget(100, 33)
    assert all(budget.spend(0.0) for _ in range(100))
    assert not budget.spend(0.0)
    assert not budget.spend(0.0, 1)  # still in debt
    fresh = Budget(100, 33)
    # 33 a second, sustained for a minute, never runs out; 34 does, within the minute
    assert all(fresh.spend(t / 33) for t in range(33 * 60))
    faster = Budget(100, 33)
    assert not all(faster.spend(t / 36) for t in range(36 * 60))


def test_the_ledger_caps_per_address_then_in_total_and_keeps_a_reserve() -> None:
    ledger = ConnectionLedger(total=4, per_client=2, reserved=1)
    a = [("10.0.0.1", p) for p in range(3)]
    b = [("10.0.0.2", p) for p in range(3)]
    c = ("10.0.0.3", 1)
    assert [ledger.admit(x) for x in (a[0], a[1], a[2])] == ["normal", "normal", "refused"]
    assert [ledger.admit(x) for x in (b[0], b[1], c)] == ["normal", "reserve", "refused"]
    assert ledger.is_reserve(b[1]) and not ledger.is_reserve(b[0])
    ledger.release(a[0])
    assert ledger.admit(c) == "reserve"
    ledger.release(b[1])
    stats = ledger.statistics()
    assert (stats.open, stats.reserve, stats.refused_total, stats.refused_per_client, stats.clients) == (3, 1, 1, 1, 3)


def test_the_default_connection_cap_is_three_quarters_of_the_fd_limit() -> None:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert Limits().connection_cap() == max(16, soft * 3 // 4)
    assert Limits(max_connections=7).connection_cap() == 7


def _buffer(limit: int = 10, stall: float = 30.0, unsent: _Unsent | None = None) -> StreamBuffer:
    buffer = StreamBuffer()
    buffer.attach(unsent or _Unsent(1 << 30), Limits(stream_buffer_bytes=limit, write_stall_timeout=stall))
    return buffer


async def test_a_pop_of_nothing_does_not_release_a_writer_over_its_limit(autojump_clock: trio.testing.MockClock) -> None:
    """hypercorn's buffer released its writer on any pop under low water,
    0 bytes (a zero window) included, so the writer never waited."""
    buffer = _buffer(limit=10)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(buffer.push, b"x" * 10)
        await trio.testing.wait_all_tasks_blocked()
        assert await buffer.pop(0) == b""
        await trio.testing.wait_all_tasks_blocked()
        assert nursery.child_tasks  # still waiting
        assert await buffer.pop(4) == b"xxxx"
    assert bytes(buffer.buffer) == b"x" * 6


async def test_a_writer_blocked_for_the_stall_timeout_raises(autojump_clock: trio.testing.MockClock) -> None:
    buffer = _buffer(limit=10, stall=30.0)
    start = trio.current_time()
    with pytest.raises(WriteStalled):
        await buffer.push(b"x" * 20)
    assert trio.current_time() - start == pytest.approx(30.0)


async def test_room_made_by_other_streams_does_not_restart_the_stall_clock(autojump_clock: trio.testing.MockClock) -> None:
    """Two streams share 2 x MIN_SHARE: over its share at t=0, released at
    t=20 when the other stream closes (its share doubles), over it again:
    it stalls at t=30, since none of its own bytes were ever taken."""
    unsent = _Unsent(2 * MIN_SHARE)
    stuck, other = _buffer(limit=1 << 20, stall=30.0, unsent=unsent), _buffer(limit=1 << 20, unsent=unsent)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stuck.push, b"x" * (MIN_SHARE + 1))
        await trio.sleep(20)
        await other.close()
    assert trio.current_time() == pytest.approx(20)
    with pytest.raises(WriteStalled):
        await stuck.push(b"x" * MIN_SHARE)  # over its doubled share
    assert trio.current_time() == pytest.approx(30)


async def test_stalled_streams_hold_their_shares_and_never_hold_up_a_flowing_one(autojump_clock: trio.testing.MockClock) -> None:
    """HTTP/2 lets a client stall some streams by flow control while others
    flow (the router does, upstream, for a slow client of its own). Three
    streams nobody reads have written far past the connection's budget and
    wait; a fourth whose output is taken as it comes writes 1 MiB without
    ever waiting on them. (A connection-wide limit made it wait the whole
    stall timeout.)"""
    unsent = _Unsent(4 * MIN_SHARE)
    stalled = [_buffer(limit=1 << 20, unsent=unsent) for _ in range(3)]
    flowing = _buffer(limit=1 << 20, unsent=unsent)
    async with trio.open_nursery() as nursery:
        for buffer in stalled:
            nursery.start_soon(buffer.push, b"s" * (1 << 20))
        await trio.testing.wait_all_tasks_blocked()
        assert unsent.bytes == 3 << 20  # over the budget: each waits on its share
        sent = 0
        for _ in range(128):
            with trio.fail_after(1):
                await flowing.push(b"f" * 8192)
            sent += len(await flowing.pop(1 << 20))
        assert sent == 1 << 20 and trio.current_time() == 0
        assert len(nursery.child_tasks) == 3  # still waiting
        nursery.cancel_scope.cancel()


def test_a_connection_holds_at_most_max_of_its_budget_and_streams_times_min_share() -> None:
    unsent = _Unsent(1 << 20)
    for streams, share in ((1, 1 << 20), (16, 1 << 16), (64, MIN_SHARE), (100, MIN_SHARE)):
        unsent.streams = streams
        assert unsent.share == share


async def test_closing_a_buffer_releases_its_writer_and_its_share(autojump_clock: trio.testing.MockClock) -> None:
    unsent = _Unsent(1 << 20)
    buffer = _buffer(limit=4, unsent=unsent)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(buffer.push, b"x" * 8)
        await trio.testing.wait_all_tasks_blocked()
        await buffer.close()
    assert unsent.bytes == 0 and buffer.complete
