"""frontend/lean_h2.py over real sockets on loopback: what it does that
hypercorn's H2Protocol did not (or did by patches), and where the two could
differ. tests/hardening runs the whole battery against it too
(tests/hardening/conftest.py)."""

from __future__ import annotations

from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import httpx
import pytest
import trio

from frontend import lean_h2, server, serving
from frontend.server import BODY_WRITER, ON_DISCONNECT
from frontend.serving import Limits, ServeOptions, serve
from tests.hardening.harness import RawH2, body_of, of

Scope = dict[str, Any]


def _http(app: Any) -> Any:
    """``app`` for http scopes; lifespan events acknowledged."""

    async def served(scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": message["type"] + ".complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        await app(scope, receive, send)

    return served


async def _start(nursery: trio.Nursery, app: Any, **options: Any) -> int:
    url = await nursery.start(serve, _http(app), ServeOptions(graceful_timeout=2.0, h2_ingress="lean", **options))
    return int(url.rsplit(":", 1)[1])


async def _read_body(receive: Any) -> bytes:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body", False):
            return body


async def _wide_open_request(port: int) -> RawH2:
    """A client whose windows are so large that it never sends a
    WINDOW_UPDATE (the stream's too: its SETTINGS acknowledged first), with
    ``GET /`` sent on stream 1."""
    client = await RawH2.open(port, window=2**31 - 1)
    client.conn.increment_flow_control_window(2**31 - 1 - 65535)
    await client.flush()
    await client.read_until(lambda ev: bool(of(ev, h2.events.SettingsAcknowledged)), 5)
    client.request(1, "/")
    await client.flush()
    return client


def _client(port: int) -> httpx.AsyncClient:
    return httpx.AsyncClient(http1=False, http2=True, base_url=f"http://127.0.0.1:{port}", timeout=10)


@pytest.mark.parametrize("ingress", ["lean", "hypercorn"])
async def test_the_switch_picks_the_protocol_of_cleartext_h2(nursery: trio.Nursery, ingress: str) -> None:
    writers: list[object] = []

    async def app(scope: Scope, receive: Any, send: Any) -> None:
        writers.append(scope["extensions"].get(BODY_WRITER))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    url = await nursery.start(serve, _http(app), ServeOptions(h2_ingress=ingress))
    async with httpx.AsyncClient(http1=False, http2=True, base_url=url, timeout=10) as client:
        assert (await client.get("/")).text == "ok"
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:  # HTTP/1.1: hypercorn's, either way
        assert (await client.get("/")).text == "ok"
    kinds = [type(w) for w in writers]
    assert kinds == [lean_h2._BodyWriter if ingress == "lean" else serving._BodyWriter, type(None)]


def test_an_unknown_ingress_is_refused() -> None:
    with pytest.raises(ValueError, match="h2_ingress"):
        ServeOptions(h2_ingress="nginx")


async def _length_app(scope: Scope, receive: Any, send: Any) -> None:
    """Answers the length of the body it read."""
    body = await _read_body(receive)
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"%d" % len(body)})


async def test_a_body_past_the_windows_is_credited_as_the_app_reads_it(nursery: trio.Nursery) -> None:
    # 300 KB against windows of 64 KiB: only credit given as the app reads lets it through.
    port = await _start(nursery, _length_app)
    async with _client(port) as client:
        with trio.fail_after(10):
            for _ in range(2):
                assert (await client.post("/", content=b"y" * 300_000)).text == "300000"


async def test_bodies_the_app_never_reads_are_credited_when_their_streams_close(nursery: trio.Nursery) -> None:
    # Three 60 KB bodies refused unread on one connection: without credit for
    # them, the connection's 64 KiB window would stall the second.
    async def app(scope: Scope, receive: Any, send: Any) -> None:
        if scope["path"] == "/refuse":
            await trio.sleep(0.2)  # the body arrives meanwhile, and is never read
            await send({"type": "http.response.start", "status": 413, "headers": [(b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return
        await _length_app(scope, receive, send)

    port = await _start(nursery, app)
    async with _client(port) as client:
        with trio.fail_after(10):
            for _ in range(3):
                assert (await client.post("/refuse", content=b"z" * 60_000)).status_code == 413
            assert (await client.post("/", content=b"z" * 60_000)).text == "60000"


async def _parts_app(scope: Scope, receive: Any, send: Any) -> None:
    await _read_body(receive)
    await send({"type": "http.response.start", "status": 200, "headers": []})
    for i in range(5):
        await send({"type": "http.response.body", "body": b"part%d;" % i, "more_body": True})
        await trio.sleep(0.02)
    await send({"type": "http.response.body", "body": b"end"})


def _ended(sid: int) -> Any:
    return lambda events: any(e.stream_id == sid for e in of(events, h2.events.StreamEnded))


async def test_past_keep_alive_max_requests_the_goaway_waits_for_the_streams_in_flight(nursery: trio.Nursery) -> None:
    # A GOAWAY under a live stream fails it in h2-based clients (this one
    # included: h2 closes its state machine); new streams are refused meanwhile.
    port = await _start(nursery, _parts_app, keep_alive_max_requests=1)
    client = await RawH2.open(port)
    client.request(1, "/")
    await client.flush()
    await client.read_until(lambda ev: bool(of(ev, h2.events.DataReceived)), 10)
    client.request(3, "/")
    await client.flush()
    events = await client.read_until(lambda ev: bool(of(ev, h2.events.ConnectionTerminated)), 10)
    assert body_of(events, 1) == b"part0;part1;part2;part3;part4;end"
    (refused,) = of(events, h2.events.StreamReset)
    assert (refused.stream_id, refused.error_code) == (3, h2.errors.ErrorCodes.REFUSED_STREAM)
    (goaway,) = of(events, h2.events.ConnectionTerminated)
    assert goaway.error_code == h2.errors.ErrorCodes.NO_ERROR
    kinds = [type(e) for e in events]
    assert kinds.index(h2.events.StreamEnded) < kinds.index(h2.events.ConnectionTerminated)
    await client.aclose()


async def test_a_tiny_window_gets_every_part_in_order(nursery: trio.Nursery) -> None:
    # 8-byte windows, 100-byte parts: each part waits in its stream's buffer
    # and is framed as the client's WINDOW_UPDATEs come, from the reader's task.
    parts = [bytes([65 + i]) * 100 for i in range(5)]

    async def app(scope: Scope, receive: Any, send: Any) -> None:
        await _read_body(receive)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for part in parts:
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b"end"})

    port = await _start(nursery, app)
    client = await RawH2.open(port, window=8)
    for sid in (1, 3, 5):
        client.request(sid, "/")
    await client.flush()
    events = await client.read_until(lambda ev: all(_ended(s)(ev) for s in (1, 3, 5)), 10)
    for sid in (1, 3, 5):
        assert body_of(events, sid) == b"".join(parts) + b"end"
    await client.aclose()


async def test_requests_whose_bodies_came_with_their_headers_find_them_on_their_first_turn(nursery: trio.Nursery) -> None:
    """Eight requests, each HEADERS then DATA with END_STREAM, in one write:
    each app task's first turn finds its whole body ready (what
    frontend/server.py's ``_read_body`` takes without a cancel scope or a
    wait), as the reader handles a request's body and end before it gives
    the others a turn (after the request's headers, the new task ran first
    in about half the turns: one of eight requests at least)."""
    firsts: list[dict[str, Any] | None] = []

    async def app(scope: Scope, receive: Any, send: Any) -> None:
        first = server._queued(receive)()  # taken: read the rest only where it was not all
        firsts.append(first)
        if first is None or first["more_body"]:
            await _read_body(receive)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    port = await _start(nursery, app)
    client = await RawH2.open(port)
    sids = range(1, 17, 2)
    for sid in sids:
        client.request(sid, "/", b"body of %02d" % sid)
    await client.flush()
    events = await client.read_until(lambda ev: all(_ended(s)(ev) for s in sids), 10)
    assert [body_of(events, sid) for sid in sids] == [b"ok"] * 8
    assert sorted(firsts, key=str) == [{"type": "http.request", "body": b"body of %02d" % sid, "more_body": False} for sid in sids]
    await client.aclose()


async def _hooked_head(scope: Scope, receive: Any, send: Any, disconnected: trio.Event) -> None:
    """``disconnected`` set by the stream's disconnect hook; the body read, the head sent."""
    scope["extensions"][ON_DISCONNECT].then(disconnected.set)
    await _read_body(receive)
    await send({"type": "http.response.start", "status": 200, "headers": []})


async def test_a_client_that_credits_nothing_has_its_stream_given_up(nursery: trio.Nursery) -> None:
    disconnected = trio.Event()

    async def app(scope: Scope, receive: Any, send: Any) -> None:
        await _hooked_head(scope, receive, send, disconnected)
        while not disconnected.is_set():
            await send({"type": "http.response.body", "body": b"x" * 1000, "more_body": True})

    port = await _start(nursery, app, limits=Limits(write_stall_timeout=0.5))
    client = await RawH2.open(port, window=0)
    client.request(1, "/")
    await client.flush()
    events = await client.read_until(lambda ev: bool(of(ev, h2.events.StreamReset)), 10)
    (reset,) = of(events, h2.events.StreamReset)
    assert reset.error_code == h2.errors.ErrorCodes.CANCEL
    with trio.fail_after(5):
        await disconnected.wait()
    await client.aclose()


async def test_a_reset_by_the_client_calls_the_disconnect_hook(nursery: trio.Nursery) -> None:
    disconnected = trio.Event()

    async def app(scope: Scope, receive: Any, send: Any) -> None:
        await _hooked_head(scope, receive, send, disconnected)
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        await trio.sleep_forever()

    port = await _start(nursery, app)
    client = await RawH2.open(port)
    client.request(1, "/")
    await client.flush()
    await client.read_until(lambda ev: bool(of(ev, h2.events.DataReceived)), 10)
    client.conn.reset_stream(1, h2.errors.ErrorCodes.CANCEL)
    await client.flush()
    with trio.fail_after(5):
        await disconnected.wait()
    await client.aclose()


async def test_app_errors_give_a_500_before_the_head_and_a_reset_after_it(nursery: trio.Nursery) -> None:
    async def app(scope: Scope, receive: Any, send: Any) -> None:
        await _read_body(receive)
        if scope["path"] == "/early":
            raise RuntimeError("before the head")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"half", "more_body": True})
        raise RuntimeError("mid-body")

    port = await _start(nursery, app)
    client = await RawH2.open(port)
    client.request(1, "/early")
    client.request(3, "/late")
    await client.flush()
    events = await client.read_until(lambda ev: _ended(1)(ev) and bool(of(ev, h2.events.StreamReset)), 10)
    statuses = {e.stream_id: dict(e.headers)[b":status"] for e in of(events, h2.events.ResponseReceived)}
    assert statuses == {1: b"500", 3: b"200"}
    (reset,) = of(events, h2.events.StreamReset)
    assert (reset.stream_id, reset.error_code) == (3, h2.errors.ErrorCodes.INTERNAL_ERROR)
    assert body_of(events, 3) == b"half"  # what the app handed over went first
    await client.aclose()


async def test_what_an_app_sent_before_it_failed_goes_before_the_reset(nursery: trio.Nursery) -> None:
    """Parts held behind a write in flight (the socket took part of the
    first, the flush task writes the rest) are not the client's to lose
    when the app then fails: they go out, then the reset. Over TLS every
    part after the first waits so (tests/backends/test_openai_http.py's
    cut mid-stream over TLS)."""
    big = bytes(range(256)) * 4096  # 1 MiB: more than the socket takes at once

    async def app(scope: Scope, receive: Any, send: Any) -> None:
        await _read_body(receive)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": big, "more_body": True})
        await send({"type": "http.response.body", "body": b"tail", "more_body": True})
        raise RuntimeError("mid-body")

    port = await _start(nursery, app, limits=Limits(stream_buffer_bytes=4 << 20, connection_buffer_bytes=8 << 20))
    client = await _wide_open_request(port)
    events = await client.read_until(lambda ev: bool(of(ev, h2.events.StreamReset)), 10)
    (reset,) = of(events, h2.events.StreamReset)
    assert (reset.stream_id, reset.error_code) == (1, h2.errors.ErrorCodes.INTERNAL_ERROR)
    assert body_of(events, 1) == big + b"tail"
    await client.aclose()


async def test_connect_is_refused(nursery: trio.Nursery) -> None:
    called = []

    async def app(scope: Scope, receive: Any, send: Any) -> None:
        called.append(scope)

    port = await _start(nursery, app)
    client = await RawH2.open(port)
    client.conn.send_headers(1, [(":method", "CONNECT"), (":authority", "example.com:443")])
    await client.flush()
    events = await client.read_until(_ended(1), 10)
    (response,) = of(events, h2.events.ResponseReceived)
    assert dict(response.headers)[b":status"] == b"405"
    assert called == []
    await client.aclose()


async def test_draining_says_goaway_after_the_last_stream_has_ended(nursery: trio.Nursery) -> None:
    shutdown = trio.Event()
    url = await nursery.start(lambda task_status: serve(
        _http(_parts_app), ServeOptions(graceful_timeout=5.0, h2_ingress="lean"), shutdown=shutdown, task_status=task_status))
    client = await RawH2.open(int(url.rsplit(":", 1)[1]))
    client.request(1, "/")
    await client.flush()
    await client.read_until(lambda ev: bool(of(ev, h2.events.DataReceived)), 10)
    shutdown.set()
    events = await client.read_until(lambda ev: bool(of(ev, h2.events.ConnectionTerminated)), 10)
    assert body_of(events, 1) == b"part0;part1;part2;part3;part4;end"
    kinds = [type(e) for e in events]
    assert kinds.index(h2.events.StreamEnded) < kinds.index(h2.events.ConnectionTerminated)
    await client.aclose()


async def test_the_body_writer_sends_parts_between_the_first_and_the_last(nursery: trio.Nursery) -> None:
    taken: list[bool] = []

    async def app(scope: Scope, receive: Any, send: Any) -> None:
        writer = scope["extensions"][BODY_WRITER]
        await _read_body(receive)
        taken.append(writer(b"early"))  # no head yet: refused
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
        for part in (b"b", b"c"):
            if not writer(part):
                taken.append(False)
                await send({"type": "http.response.body", "body": part, "more_body": True})
            else:
                taken.append(True)
        await send({"type": "http.response.body", "body": b"d"})
        taken.append(writer(b"late"))  # ended: refused

    port = await _start(nursery, app)
    async with _client(port) as client:
        assert (await client.get("/")).text == "abcd"
    assert taken == [False, True, True, False]


async def test_an_h2c_upgrade_is_served_on_the_lean_protocol(nursery: trio.Nursery) -> None:
    seen: list[tuple[str, str, type]] = []

    async def app(scope: Scope, receive: Any, send: Any) -> None:
        seen.append((scope["http_version"], scope["path"], type(scope["extensions"].get(BODY_WRITER))))
        await _read_body(receive)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"upgraded"})

    port = await _start(nursery, app)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    settings = conn.initiate_upgrade_connection()
    sock = await trio.open_tcp_stream("127.0.0.1", port)
    await sock.send_all(b"GET /up HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
                        b"HTTP2-Settings: " + settings + b"\r\n\r\n")
    data = b""
    with trio.fail_after(10):
        while b"\r\n\r\n" not in data:
            data += await sock.receive_some(65536)
        head, _, rest = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 101")
        await sock.send_all(conn.data_to_send())  # the client's preface
        events = conn.receive_data(rest) if rest else []
        while not any(isinstance(e, h2.events.StreamEnded) for e in events):
            events += conn.receive_data(await sock.receive_some(65536))
    assert body_of(events, 1) == b"upgraded"
    assert seen == [("2", "/up", lean_h2._BodyWriter)]
    await sock.aclose()


async def test_an_access_log_line_for_each_request(nursery: trio.Nursery, capsys: pytest.CaptureFixture[str]) -> None:
    async def app(scope: Scope, receive: Any, send: Any) -> None:
        await _read_body(receive)
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    port = await _start(nursery, app, access_log=True)
    async with _client(port) as client:
        assert (await client.get("/logged")).status_code == 201
    out = ""
    with trio.fail_after(5):
        while "/logged" not in out:
            await trio.sleep(0.01)
            out += capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if "/logged" in x]
    assert '"GET /logged 2" 201 ' in line


async def test_parts_left_unframed_at_the_output_bound_go_on_without_another_event(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Windows so large that the client never sends a WINDOW_UPDATE, and an
    # output bound (a frame) that the socket always takes at once: a 1 MB
    # part must not wait for an event that never comes.
    monkeypatch.setattr(lean_h2, "OUT_HIGH", 1)
    async def app(scope: Scope, receive: Any, send: Any) -> None:
        await _read_body(receive)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"w" * 1_000_000, "more_body": True})
        await send({"type": "http.response.body", "body": b"end"})

    port = await _start(nursery, app)
    client = await _wide_open_request(port)
    events = await client.read_until(_ended(1), 10)
    assert body_of(events, 1) == b"w" * 1_000_000 + b"end"
    await client.aclose()
