"""Slow readers: a client that stops taking its output, by HTTP/2 flow
control (a zero window) or at the TCP level (it never reads the socket),
holds a bounded amount of the router's memory, and after
``write_stall_timeout`` its streams are reset and their backend requests
cancelled; a neighbour on another connection sees no error.

Sized for two shared cores: 8 streams of 4 KB tokens at 500 tokens/s each
(16 MB/s offered, so an unbounded buffer shows at once), a 10 s stall
timeout instead of 30 s; and the issue's 100 streams on one zero-window
connection with 1 KB tokens, where what the router may legitimately hold
per stream (its upstream HTTP/2 window, 256 KiB, plus the stream's share of
the connection's unsent output) must keep the whole attack under 64 MiB: at
the old 1 MiB upstream window it passed 120 MiB and still grew."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import h2.errors
import h2.events
import trio

from tests.hardening.harness import (
    ATTACK_PROMPT,
    RawH2,
    RouterProcess,
    completion,
    of,
    p99,
    start_mocks,
    start_router,
)
from tests.hardening.procs import MockProcess, start_mock_processes, start_neighbour_process

STALL = 10.0
MOCK: dict[str, Any] = {"vocab": ("x" * 4000,), "tpot_s": 0.002, "max_tokens": 1_000_000, "max_context": 2_000_000}
MANY: dict[str, Any] = {**MOCK, "vocab": ("x" * 1000,), "tpot_s": 0.005}


async def _generating(mocks: list[MockProcess], seconds: float) -> int:
    before = sum([(await m.counts())["events"] for m in mocks])
    await trio.sleep(seconds)
    return sum([(await m.counts())["events"] for m in mocks]) - before


async def _cancelled(mocks: list[MockProcess]) -> int:
    return sum([(await m.counts())["cancelled"] for m in mocks])


def _mib(reports: tuple[dict[str, Any], ...], key: str) -> str:
    return " -> ".join("?" if r[key] is None else f"{r[key] / 2**20:.0f}" for r in reports)


async def _attack(nursery: trio.Nursery, tmp: Path, *, window: int | None, read: bool,
                  streams: int = 8, mock: dict[str, Any] = MOCK, settings: dict[str, Any] | None = None, stall: float = STALL) -> None:  # fmt: skip
    # The mocks and the neighbour run in processes of their own, as a fleet's
    # backends and clients do: in this one, the mocks' generating for the
    # attacker would hold up the neighbour's client in the same event loop.
    mocks = await start_mock_processes(nursery, **mock)
    router: RouterProcess = await start_router(nursery, tmp, [m.url for m in mocks], {"server.write_stall_timeout": stall, **(settings or {})})
    neighbour = await start_neighbour_process(nursery, router.url, tmp)
    await trio.sleep(1.5)
    rss0, fds0, cpu0 = router.usage()
    mem0 = await router.memory()

    attacker = await RawH2.open(router.port, window=window)
    started, attack_at = trio.current_time(), time.monotonic()
    for i in range(streams):
        attacker.request(1 + 2 * i, body=completion(1_000_000, prompt=ATTACK_PROMPT))
    await attacker.flush()
    if read:  # headers come back; no DATA can (window 0), nothing is acknowledged
        nursery.start_soon(lambda: attacker.read(60, ack=False))
    # The backends fill what the router will hold (its upstream client's
    # windows included), then stop: wait for that plateau, then watch it.
    plateau = None
    with trio.move_on_after(stall - 2):
        while await _generating(mocks, 0.5) > streams:
            pass
        plateau = trio.current_time() - started
    rss1, _, _ = router.usage()
    plateau_at = time.monotonic()
    generated = await _generating(mocks, 2.0)
    rss2, fds2, _ = router.usage()
    steady_until = time.monotonic()
    cancelled_after = None
    with trio.move_on_after(stall + 4 + streams / 25 - (trio.current_time() - started)):
        while await _cancelled(mocks) < streams:
            await trio.sleep(0.1)
        cancelled_after = trio.current_time() - started
    rss3, fds3, cpu3 = router.usage()
    mem3 = await router.memory()
    await neighbour.finish()
    await attacker.aclose()
    # What the router held for the attacker goes back to the OS (frontend/heap.py
    # trims glibc's heap every 2 s where 8 MiB of it are free and 2 MiB more
    # were freed since its last trim).
    with trio.move_on_after(6):
        while (rss4 := router.usage()[0]) > rss0 + 16:
            await trio.sleep(0.25)
    await trio.sleep(0.5)
    _, fds4, _ = router.usage()
    mem4 = await router.memory()
    before, steady = p99(neighbour.latencies(until=attack_at)), p99(neighbour.latencies(plateau_at, steady_until))
    during, filling = p99(neighbour.latencies(since=attack_at)), p99(neighbour.latencies(attack_at, plateau_at))
    print(
        f"\n{streams} streams: plateau after {plateau} s, all {streams} backend requests cancelled after {cancelled_after} s;"
        f" RSS {rss0:.0f} -> {rss1:.0f} -> {rss2:.0f} (2 s later) -> {rss3:.0f} -> {rss4:.0f} MiB (closed);"
        f" fds {fds0} -> {fds2} -> {fds3} -> {fds4};"
        f" router CPU {cpu3 - cpu0:.1f} s; backend events in those 2 s: {generated};"
        f" neighbour {len(neighbour.runs)} requests, {len(neighbour.errors())} errors,"
        f" p99 {before * 1000:.0f} ms before, {filling * 1000:.0f} ms while the windows fill, {steady * 1000:.0f} ms on the plateau,"
        f" {during * 1000:.0f} ms over the attack;"
        f" heap in use / free {_mib((mem0, mem3, mem4), 'heap_in_use_bytes')} / {_mib((mem0, mem3, mem4), 'heap_free_bytes')} MiB,"
        f" trims {mem4['trims']} ({mem4['trimmed_bytes'] / 2**20:.0f} MiB)"
    )
    assert plateau is not None, "the backends never stopped generating"
    assert cancelled_after is not None, "the stalled streams' backend requests were not cancelled"
    assert rss2 - rss1 < 4, "the router's memory kept growing while the client read nothing"
    assert generated <= streams, "the backends kept generating for a client that reads nothing"
    assert rss3 - rss0 < 64
    if mem0["heap_in_use_bytes"] is not None:  # glibc: what the router still holds, trimmed or not
        assert mem4["heap_in_use_bytes"] - mem0["heap_in_use_bytes"] < 4 << 20, "the router kept the attack's buffers"
    assert rss4 - rss0 <= 16, "the router's memory did not return to the OS after the attack"
    assert not neighbour.errors()
    assert fds4 <= fds0 + 2
    if read:
        resets = of(attacker.events, h2.events.StreamReset)
        assert {e.stream_id for e in resets} == {1 + 2 * i for i in range(streams)}
        assert {e.error_code for e in resets} == {h2.errors.ErrorCodes.CANCEL}


async def test_a_zero_window_client_holds_bounded_memory_and_its_streams_are_reset(nursery: trio.Nursery, tmp_path: Path) -> None:
    """SETTINGS_INITIAL_WINDOW_SIZE=0 and 32 streams: hypercorn 0.18 buffered
    the whole generation (unbounded); now each stream holds at most its
    buffer, the backends stop, and after the stall timeout every stream gets
    RST_STREAM(CANCEL) and its backend request is cancelled."""
    await _attack(nursery, tmp_path, window=0, read=True)


async def test_a_client_that_stops_reading_the_socket_is_cut_off(nursery: trio.Nursery, tmp_path: Path) -> None:
    """Normal windows, but the client never reads the socket: the router's
    write blocks; after the stall timeout its streams are reset, their
    backend requests cancelled and the connection closed."""
    await _attack(nursery, tmp_path, window=None, read=False)


async def test_a_hundred_zero_window_streams_hold_under_64_mib(nursery: trio.Nursery, tmp_path: Path) -> None:
    """The issue's size: one connection, SETTINGS_INITIAL_WINDOW_SIZE=0, 100
    streams. The router stops reading each upstream stream once its HTTP/2
    window (256 KiB) and the client's unsent-output bounds are full, so its
    memory stays under 64 MiB above baseline and flat; the backends stop;
    every stream is reset and cancelled at the stall timeout.

    Filling 100 upstream windows offers the router some 20,000 events/s, far
    over what one router process relays on two shared cores; so lagging, it
    would take its own delay for backends gone silent (the stall watchdog's
    1 s floor) and migrate the streams. The watchdog is set past the test
    here: what is measured is the memory the router holds."""
    await _attack(nursery, tmp_path, window=0, read=True, streams=100, mock=MANY, settings={"migration.stall_timeout": 30}, stall=20)


async def test_an_http1_client_that_stops_reading_is_cut_off(nursery: trio.Nursery, tmp_path: Path) -> None:
    """HTTP/1.1, where there is no flow control but TCP's: a streamed
    completion whose client never reads the socket. The router's write
    blocks; after the stall timeout the connection is closed and the
    backend request cancelled; memory stays bounded meanwhile."""
    stall = 5.0
    urls, mocks = await start_mocks(nursery, **MOCK)
    router: RouterProcess = await start_router(nursery, tmp_path, urls, {"server.write_stall_timeout": stall})
    rss0, fds0, _ = router.usage()
    sock = trio.socket.socket()
    sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVBUF, 4096)  # a small window: the router blocks soon
    await sock.connect(("127.0.0.1", router.port))
    stream = trio.SocketStream(sock)
    body = completion(1_000_000, prompt=ATTACK_PROMPT)
    await stream.send_all(b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\n"
                          b"content-length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
    started = trio.current_time()
    with trio.fail_after(stall + 10):
        while sum(m.statistics().cancelled for m in mocks) < 1:
            await trio.sleep(0.1)
    cancelled_after = trio.current_time() - started
    rss1, fds1, _ = router.usage()
    await stream.aclose()
    await trio.sleep(0.5)
    _, fds2, _ = router.usage()
    print(f"\nHTTP/1.1 client that reads nothing: backend request cancelled after {cancelled_after:.1f} s;"
          f" RSS {rss0:.0f} -> {rss1:.0f} MiB; fds {fds0} -> {fds1} -> {fds2}")  # fmt: skip
    assert rss1 - rss0 < 64
    assert fds2 <= fds0 + 2
