"""Hostile HTTP/2 clients against frontend.serving (in-process, real
sockets on loopback): floods from a client that never reads, Rapid Reset,
streams over the advertised limit, malformed header blocks."""

from __future__ import annotations

import time
from typing import Any

import h2.errors
import h2.events
import h2.settings
import pytest
import trio
from hyperframe.frame import DataFrame, PingFrame, RstStreamFrame, SettingsFrame

from frontend.serving import Limits, ServeOptions, serve
from tests.hardening.harness import RawH2, of


class App:
    """``/slow``: 20 chunks 50 ms apart; anything else: ``ok``. Reads the
    body first; counts requests and the most in flight at once."""

    def __init__(self) -> None:
        self.started = self.in_flight = self.peak = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": message["type"] + ".complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        self.started += 1
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            while (await receive()).get("more_body", False):
                pass
            await send({"type": "http.response.start", "status": 200, "headers": []})
            if scope["path"] == "/slow":
                for _ in range(20):
                    await send({"type": "http.response.body", "body": b"x", "more_body": True})
                    await trio.sleep(0.05)
            await send({"type": "http.response.body", "body": b"ok"})
        finally:
            self.in_flight -= 1


async def start(nursery: trio.Nursery, app: App | None = None, **limits: Any) -> tuple[int, App]:
    app = app or App()
    url = await nursery.start(serve, app, ServeOptions(graceful_timeout=0.1, limits=Limits(**limits)))
    return int(url.rsplit(":", 1)[1]), app


async def _flood(port: int, frame: bytes, *, open_stream: bool = False) -> tuple[float, int]:
    """Write ``frame`` over and over, never reading; (seconds, frames) until
    the server cut the connection. Fails after 10 s."""
    client = await RawH2.open(port)
    if open_stream:
        client.conn.send_headers(1, client.headers("/", b"x"))  # a body that never comes
        await client.flush()
    batch = frame * (65536 // len(frame))
    sent, start = 0, trio.current_time()
    with trio.fail_after(10):
        try:
            while True:
                await client.sock.send_all(batch)
                sent += len(batch) // len(frame)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
    await client.aclose()
    return trio.current_time() - start, sent


@pytest.mark.parametrize(
    ("name", "frame", "open_stream"),
    [
        ("PING", PingFrame(0, opaque_data=b"\0" * 8).serialize(), False),
        ("SETTINGS", SettingsFrame(0).serialize(), False),
        ("empty DATA", DataFrame(1, data=b"").serialize(), True),
    ],
    ids=["PING", "SETTINGS", "empty-DATA"],
)
async def test_a_control_frame_flood_from_a_client_that_never_reads_is_cut_off(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture, name: str, frame: bytes, open_stream: bool
) -> None:
    """hypercorn 0.18 answered every PING and SETTINGS (and took 2 million
    empty DATA frames, 26 s of CPU); unread answers then blocked its writes,
    and the connection stayed open for ever. Now the control-frame budget
    (1,000 at once, 100/s) closes it with GOAWAY(ENHANCE_YOUR_CALM)."""
    port, _ = await start(nursery)
    cpu = time.process_time()
    seconds, frames = await _flood(port, frame, open_stream=open_stream)
    cpu = time.process_time() - cpu
    print(f"\n{name} flood: cut off after {seconds:.2f} s, {frames} frames written, {cpu:.2f} s CPU (client and server)")
    assert seconds < 10 and cpu < 5
    assert "ENHANCE_YOUR_CALM" in caplog.text and "control frames over 1000" in caplog.text


async def test_rapid_reset_gets_goaway_long_before_2000_streams(nursery: trio.Nursery, caplog: pytest.LogCaptureFixture) -> None:
    """10,000 HEADERS+RST_STREAM pairs as fast as the socket takes them:
    GOAWAY(ENHANCE_YOUR_CALM) after the reset budget (100 at once); the app
    never runs more than the advertised 100 streams at once."""
    port, app = await start(nursery)
    client = await RawH2.open(port)
    headers = client.headers("/slow")
    sent = 0
    with trio.fail_after(10):
        try:
            for batch in range(100):
                for i in range(100):
                    sid = 1 + 2 * (batch * 100 + i)
                    client.conn.send_headers(sid, headers, end_stream=True)
                    client.conn.reset_stream(sid)
                await client.flush()
                sent += 100
                await client.read(0, ack=False)
                if of(client.events, h2.events.ConnectionTerminated) or client.closed:
                    break
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        await client.read(1)
    goaway = of(client.events, h2.events.ConnectionTerminated)
    assert goaway and goaway[0].error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
    processed = (goaway[0].last_stream_id + 1) // 2
    print(f"\nRapid Reset: {sent} streams written, GOAWAY after stream {processed};"
          f" app started {app.started}, at most {app.peak} at once")
    assert processed < 2000
    assert app.peak <= 100
    assert "stream resets over 100" in caplog.text
    with trio.fail_after(2):
        while app.in_flight:  # every reset stream's app is cancelled
            await trio.sleep(0.01)


async def test_a_stream_over_the_advertised_limit_is_refused_not_the_connection(nursery: trio.Nursery) -> None:
    """The router advertises 100 concurrent streams; the 101st opened at once
    gets RST_STREAM(REFUSED_STREAM) (safe to retry) and the first 100 finish
    on the same connection. h2 raised TooManyStreamsError: GOAWAY, all lost."""
    port, _ = await start(nursery)
    client = await RawH2.open(port)
    for i in range(101):  # all before reading the server's SETTINGS: h2 then lets the client send them
        client.request(1 + 2 * i, "/slow")
    await client.flush()
    done = lambda events: len(of(events, h2.events.StreamEnded)) + len(of(events, h2.events.StreamReset)) >= 101  # noqa: E731
    events = await client.read_until(done, 10)
    advertised = [e.changed_settings[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS].new_value
                  for e in of(events, h2.events.RemoteSettingsChanged)
                  if h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS in e.changed_settings]  # fmt: skip
    assert advertised == [100]
    resets = of(events, h2.events.StreamReset)
    assert [(e.stream_id, e.error_code) for e in resets] == [(201, h2.errors.ErrorCodes.REFUSED_STREAM)]
    assert len(of(events, h2.events.StreamEnded)) == 100
    assert not of(events, h2.events.ConnectionTerminated)
    client.request(203, "/")  # and the connection still serves
    await client.flush()
    await client.read_until(lambda events: any(isinstance(e, h2.events.StreamEnded) and e.stream_id == 203 for e in events), 5)


@pytest.mark.parametrize(
    "bad",
    [("Upper-Case", "x"), ("connection", "keep-alive"), ("transfer-encoding", "chunked"), ("content-length", "nope")],
)
async def test_a_malformed_header_resets_that_stream_only(nursery: trio.Nursery, bad: tuple[str, str]) -> None:
    """RST_STREAM(PROTOCOL_ERROR) on the malformed stream; a stream in
    flight on the same connection finishes; no GOAWAY."""
    port, app = await start(nursery)
    client = await RawH2.open(port, validate=False)
    client.request(1, "/slow")
    await client.flush()
    await trio.sleep(0.1)
    client.conn.send_headers(3, [*client.headers("/"), bad], end_stream=True)
    await client.flush()
    events = await client.read_until(lambda events: any(isinstance(e, h2.events.StreamEnded) and e.stream_id == 1 for e in events), 5)
    assert [(e.stream_id, e.error_code) for e in of(events, h2.events.StreamReset)] == [(3, h2.errors.ErrorCodes.PROTOCOL_ERROR)]
    assert not of(events, h2.events.ConnectionTerminated)
    assert app.started == 1
    client.request(5, "/")
    await client.flush()
    await client.read_until(lambda events: any(isinstance(e, h2.events.StreamEnded) and e.stream_id == 5 for e in events), 5)


async def test_data_on_a_refused_stream_is_dropped_and_credited(nursery: trio.Nursery) -> None:
    """A refused stream's body still arrives; it is dropped, its flow control
    credited, and the connection goes on."""
    port, _ = await start(nursery, max_concurrent_streams=1)
    client = await RawH2.open(port)
    client.request(1, "/slow")
    client.conn.send_headers(3, client.headers("/", b"y" * 70000))
    await client.flush()
    await client.read_until(lambda events: bool(of(events, h2.events.StreamReset)), 5)
    raw = DataFrame(3, data=b"y" * 16384).serialize() + RstStreamFrame(3).serialize()
    await client.sock.send_all(raw)
    events = await client.read_until(lambda events: any(isinstance(e, h2.events.StreamEnded) and e.stream_id == 1 for e in events), 5)
    assert not of(events, h2.events.ConnectionTerminated)



async def test_cancelling_streams_that_ran_a_while_is_not_rapid_reset(nursery: trio.Nursery) -> None:
    """A router cancels upstream streams as its own clients leave: 150
    streams reset after they ran past premature_reset (here 0.2 s) do not
    spend the reset budget, and the connection goes on."""
    port, _ = await start(nursery, premature_reset=0.2)
    client = await RawH2.open(port)
    for batch in range(2):
        sids = [1 + 2 * (batch * 75 + i) for i in range(75)]
        for sid in sids:
            client.request(sid, "/slow")
        await client.flush()
        await client.read(0.4)
        for sid in sids:
            client.conn.reset_stream(sid)
        await client.flush()
    client.request(301, "/")
    await client.flush()
    events = await client.read_until(lambda events: any(isinstance(e, h2.events.StreamEnded) and e.stream_id == 301 for e in events), 5)
    assert not of(events, h2.events.ConnectionTerminated)
