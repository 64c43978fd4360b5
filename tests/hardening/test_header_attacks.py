"""Header-block attacks on a real ``headrace serve``: a CONTINUATION flood (a
header block that never ends), oversized header blocks (a list over the
advertised 64 KiB) and an HPACK bomb (one 4 KB header in the dynamic table,
referenced 16,000 times by one byte each: 64 MB decoded from 16 KB sent).
Each is rejected (GOAWAY, connection closed) after a bounded amount of work:
under 1 s of the router's CPU for the whole attack (user + system, read by
psutil from /proc: CPU time, not wall-clock time, so load on the box does not
change it much); the router stays up and a neighbour gets no error."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import h2.events
import hpack
import pytest
import trio
from hyperframe.frame import ContinuationFrame, HeadersFrame

from tests.hardening.harness import Neighbour, RawH2, RouterProcess, of, start_mocks, start_router

pytestmark = pytest.mark.timeout(180)
CONNECTIONS = 20  # attack connections, one after another
FRAME = 16384  # the default SETTINGS_MAX_FRAME_SIZE


def _pseudo(encoder: hpack.Encoder) -> bytes:
    return encoder.encode([(":method", "POST"), (":path", "/v1/completions"), (":scheme", "http"), (":authority", "router")])


def continuation_flood() -> list[bytes]:
    """HEADERS without END_HEADERS, then CONTINUATION frames that never end it."""
    frames = [HeadersFrame(1, data=_pseudo(hpack.Encoder())).serialize()]
    return frames + [ContinuationFrame(1, data=b"\x00" * FRAME).serialize()] * 200


def oversized_block() -> list[bytes]:
    """One complete header block of 100 distinct 1 KB headers (100 KB > 64 KiB)."""
    encoder = hpack.Encoder()
    block = _pseudo(encoder) + encoder.encode([(f"x-pad-{i}", "v" * 1000) for i in range(100)], huffman=False)
    return _split(block)


def hpack_bomb() -> list[bytes]:
    """A 4,000-byte header added to the dynamic table (index 62), then 16,000
    one-byte references to it (0x80 | 62)."""
    encoder = hpack.Encoder()
    block = _pseudo(encoder) + encoder.encode([("x-bomb", "b" * 4000)], huffman=False) + b"\xbe" * 16000
    return _split(block)


def _split(block: bytes) -> list[bytes]:
    """``block`` as HEADERS + CONTINUATION frames, END_HEADERS on the last."""
    chunks = [block[i:i + FRAME] for i in range(0, len(block), FRAME)]
    frames = []
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        frame = HeadersFrame(1, data=chunk) if i == 0 else ContinuationFrame(1, data=chunk)
        if i == 0:
            frame.flags.add("END_STREAM")
        if last:
            frame.flags.add("END_HEADERS")
        frames.append(frame.serialize())
    return frames


async def _one(port: int, frames: list[bytes]) -> bool:
    """Send ``frames`` on a fresh connection; whether the router answered
    GOAWAY or closed it (within 5 s)."""
    client = await RawH2.open(port)
    try:
        for frame in frames:
            await client.sock.send_all(frame)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass  # cut off mid-attack
    await client.read(5)
    await client.aclose()
    return client.closed or bool(of(client.events, h2.events.ConnectionTerminated))


@pytest.mark.parametrize("attack", [continuation_flood, oversized_block, hpack_bomb], ids=lambda f: f.__name__)
async def test_a_header_block_attack_is_rejected_with_under_a_second_of_cpu(
    nursery: trio.Nursery, tmp_path: Path, attack: Callable[[], list[bytes]]
) -> None:
    urls, mocks = await start_mocks(nursery)
    router: RouterProcess = await start_router(nursery, tmp_path, urls)
    neighbour = Neighbour(router.url)
    stop = trio.Event()
    nursery.start_soon(neighbour.run, stop)
    await trio.sleep(1)
    baseline = len(neighbour.latencies)
    rss0, fds0, cpu0 = router.usage()
    frames = attack()
    rejected = [await _one(router.port, frames) for _ in range(CONNECTIONS)]
    rss1, fds1, cpu1 = router.usage()
    await trio.sleep(0.5)
    stop.set()
    _, fds2, _ = router.usage()
    sent = sum(map(len, frames))
    during = Neighbour(router.url, latencies=neighbour.latencies[baseline:])
    print(f"\n{attack.__name__}: {CONNECTIONS} connections x {sent // 1024} KiB, {sum(rejected)} rejected;"
          f" router CPU {cpu1 - cpu0:.2f} s, RSS {rss0:.0f} -> {rss1:.0f} MiB, fds {fds0} -> {fds1} -> {fds2};"
          f" neighbour {len(neighbour.latencies)} requests, {len(neighbour.errors)} errors,"
          f" p99 {Neighbour(router.url, latencies=neighbour.latencies[:baseline]).p99() * 1000:.0f} ms before,"
          f" {during.p99() * 1000:.0f} ms during")  # fmt: skip
    assert all(rejected)
    assert cpu1 - cpu0 < 1.0
    assert router.process.returncode is None
    assert not neighbour.errors
    assert rss1 - rss0 < 64
    assert fds2 <= fds0 + 2
    assert not any(m.events for m in mocks)  # no attack stream reached a backend
