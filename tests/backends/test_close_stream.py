"""close_stream: a stream is closed however its consumer ends, its
cleanup allowed to wait even under cancellation; a finished one is left be."""

from __future__ import annotations

from collections.abc import AsyncIterator

import trio
import trio.testing

from backends.base import close_stream


async def test_a_suspended_generators_cleanup_runs_and_may_wait_though_its_consumer_is_cancelled() -> None:
    cleaned: list[str] = []

    async def events() -> AsyncIterator[int]:
        try:
            yield 1
            yield 2
        finally:
            await trio.sleep(0.01)  # e.g. telling the backend (RST_STREAM)
            cleaned.append("done")

    it = events()
    with trio.CancelScope() as scope:
        assert await it.__anext__() == 1
        scope.cancel()
        await close_stream(it)
    assert cleaned == ["done"]
    assert it.ag_frame is None  # closed


async def test_a_finished_generator_and_other_iterators() -> None:
    async def one() -> AsyncIterator[int]:
        yield 1

    done = one()
    assert [x async for x in done] == [1]
    with trio.testing.assert_no_checkpoints():
        await close_stream(done)  # nothing left to close: no await at all

    class Closable:
        closed = 0

        async def aclose(self) -> None:
            await trio.lowlevel.checkpoint()
            self.closed += 1

    c = Closable()
    with trio.CancelScope() as scope:
        scope.cancel()
        await close_stream(c)  # not a generator: closed, shielded
    assert c.closed == 1
    await close_stream(iter([1, 2]))  # nothing to close
