"""The KV event feed: the HTTP adapter streams an engine's ``/v1/kv_events``;
a backend actor with a KV sink subscribes beside its prober, delivers batches,
resumes with ``since`` after a cut, resubscribes from -1 after a gap, resets
the sink once per burst of garbage (one log line) and when the backend goes
down or closes; and it counts the prompt tokens still waiting for prefill.

Real engine servers (the real EngineBackend over the fake runner) on
127.0.0.1:0; a TCP proxy cuts streams; a raw socket server sends garbage."""

from __future__ import annotations

import json
import logging
import re
import ssl
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

import msgspec
import pytest
import trio
import trio.testing

from backends.base import BackendInfo, ChatMessage, Event, GenerateRequest, KVEvent
from backends.engine.backend import EngineBackend
from backends.engine.server import run_server
from backends.errors import BackendProtocolError, BackendUnavailable, StreamBroken
from backends.openai_http import OpenAIHTTPBackend
from backends.openai_wire import KVEventParser
from frontend.serving import ServeOptions
from policies.base import KVEventView
from router.actors import BackendActor
from router.health import HealthState
from router.prefix_keys import PrefixKeys, load_tokenizer
from tests.router.fakes import FakeBackend
from tests.router.test_prefix_keys import BLOCK, fake_engine_backend, write_tokenizer_gguf

pytestmark = pytest.mark.timeout(60)


class RecordingSink:
    """A KVEventSink that records; ``gap_at``: report a gap (once) on that seq."""

    def __init__(self, gap_at: int | None = None, *, explode: bool = False) -> None:
        self.seqs: list[int] = []
        self.batches: list[int] = []
        self.since: list[int] = []
        self.resets = 0
        self.gaps = 0
        self.last = -1
        self.gap_at = gap_at
        self.explode = explode

    def kv_since(self, backend: str) -> int:
        self.since.append(self.last)
        return self.last

    def on_kv_events(self, backend: str, events: Sequence[KVEventView], now: float) -> bool:
        if self.explode:
            raise RuntimeError("sink bug")
        if self.gap_at is not None and any(e.seq >= self.gap_at for e in events):
            self.gap_at, self.last, self.seqs = None, -1, []  # drops the backend's entries
            self.gaps += 1
            return False
        self.batches.append(len(events))
        self.seqs += [e.seq for e in events]
        self.last = events[-1].seq
        return True

    def on_kv_reset(self, backend: str) -> None:
        self.resets += 1
        self.last = -1


async def wait_for(condition: Callable[[], object]) -> None:
    with trio.fail_after(10):
        while not condition():
            await trio.sleep(0.01)


# ---------------------------------------------------------------- a real engine server


@pytest.fixture(scope="module")
def tok_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer_gguf(tmp_path_factory.mktemp("kvtok") / "tiny-tok.gguf")


@pytest.fixture
async def engine(tok_gguf: Path) -> AsyncIterator[tuple[str, EngineBackend]]:
    backend = fake_engine_backend(load_tokenizer(str(tok_gguf)), model=str(tok_gguf))
    async with trio.open_nursery() as nursery:
        url = await nursery.start(run_server, backend, ServeOptions("127.0.0.1", 0, graceful_timeout=0.5))
        yield url, backend
        nursery.cancel_scope.cancel()


async def generate(backend: EngineBackend, text: str) -> None:
    request = GenerateRequest(messages=[ChatMessage(role="user", content=text)], max_tokens=2, temperature=0.0)
    async for _ in backend.stream(request):
        pass


class Proxy:
    """A TCP proxy to ``port`` that records what clients send and can cut
    every connection at once."""

    def __init__(self, port: int) -> None:
        self.upstream = port
        self.port = 0
        self.sent = b""
        self._streams: list[trio.SocketStream] = []

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started()
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, client: trio.SocketStream) -> None:
        upstream = await trio.open_tcp_stream("127.0.0.1", self.upstream)
        self._streams += [client, upstream]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._pipe, client, upstream, True)
            nursery.start_soon(self._pipe, upstream, client, False)

    async def _pipe(self, src: trio.SocketStream, dst: trio.SocketStream, record: bool) -> None:
        try:
            async for data in src:
                if record:
                    self.sent += data
                await dst.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await dst.aclose()

    async def cut(self) -> None:
        streams, self._streams = self._streams, []
        for stream in streams:
            await stream.aclose()

    def kv_since(self) -> list[int]:
        return [int(m) for m in re.findall(rb"GET /v1/kv_events\?since=(-?\d+)", self.sent)]


async def test_the_engine_lists_its_kv_fields_and_the_adapter_reads_them(
    engine: tuple[str, EngineBackend], tok_gguf: Path
) -> None:
    """/v1/models says block_size, kv_events and the tokenizer file; a router
    that learns from it computes the engine's own block hashes."""
    url, backend = engine
    adapter = OpenAIHTTPBackend(url, http="1.1")
    try:
        info = await adapter.refresh()
        assert (info.block_size, info.kv_events, info.tokenizer) == (BLOCK, True, str(tok_gguf))
        keys = PrefixKeys()
        await keys.learn(adapter, info)
        request = GenerateRequest(model="tiny", messages=[ChatMessage(role="user", content="the water " * 5)])
        got = keys.keys(request)
        assert got.source == "tokens" and got.block_size == BLOCK
        ids = backend.prompt_ids(request)
        assert got.prompt_tokens == len(ids) and len(got.block_hashes) == len(ids) // BLOCK
    finally:
        await adapter.aclose()


async def test_the_adapter_streams_kv_events_and_resumes_after_since(engine: tuple[str, EngineBackend]) -> None:
    url, backend = engine
    for text in ("the water in the well " * 3, "another one, in winter " * 3, "and a third " * 4):
        await generate(backend, text)
    adapter = OpenAIHTTPBackend(url, http="1.1")
    try:
        seen: list[KVEvent] = []
        with trio.fail_after(10):
            async for event in adapter.kv_events(-1):
                seen.append(event)
                if event.seq == backend.statistics().last_kv_event_seq:
                    break
        assert [e.seq for e in seen] == list(range(1, len(seen) + 1)) and len(seen) >= 3  # seqs from 1
        assert any(e.kind == "stored" and e.block_hashes for e in seen)
        with trio.fail_after(10):
            async for event in adapter.kv_events(seen[1].seq):
                assert event == seen[2]
                break
    finally:
        await adapter.aclose()


async def test_a_refused_kv_stream_is_backend_unavailable() -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    await listeners[0].aclose()  # nothing listens there now
    adapter = OpenAIHTTPBackend(f"http://127.0.0.1:{port}", http="1.1", connect_timeout=2.0)
    with pytest.raises(BackendUnavailable):
        async for _ in adapter.kv_events(-1):
            pass
    await adapter.aclose()


async def test_resubscribing_builds_no_new_tls_context(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every attempt used to build an httpx client with a fresh SSLContext,
    loading the CA bundle with the event loop held (25-35 ms each), at each
    reconnect to a restarted backend: now one context serves every attempt."""
    loads: list[object] = []
    real = ssl.SSLContext.load_verify_locations

    def counted(self: ssl.SSLContext, *args: object, **kwargs: object) -> None:
        loads.append(args or kwargs)
        real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ssl.SSLContext, "load_verify_locations", counted)
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    await listeners[0].aclose()  # refused: each attempt fails at once
    adapter = OpenAIHTTPBackend(f"http://127.0.0.1:{port}", http="1.1", connect_timeout=2.0)
    before = len(loads)  # the request pool's own context, built once
    for _ in range(5):
        with pytest.raises(BackendUnavailable):
            async for _ in adapter.kv_events(-1):
                pass
    assert len(loads) - before <= 1
    await adapter.aclose()


def test_the_kv_sse_parser_reads_split_chunks_and_refuses_what_is_not_the_engines() -> None:
    good = b": kv events\n\nid: 0\ndata: {\"seq\":0,\"kind\":\"stored\",\"block_hashes\":[5]}\n\r\nid: 1\r\ndata: {\"seq\":1,\"kind\":\"cleared\"}\r\n\r\n"
    parser = KVEventParser()
    events = [e for i in range(len(good)) for e in parser.feed(good[i : i + 1])]
    assert events == [KVEvent(seq=0, kind="stored", block_hashes=(5,)), KVEvent(seq=1, kind="cleared")]
    for bad in (b"data: {not json\n\n", b"id: 7\ndata: {\"seq\":8,\"kind\":\"stored\"}\n\n",
                b"data: {\"seq\":0,\"kind\":\"weird\"}\n\n", b"hello there\n", b"\xff\xfe x\n\n",
                b"data: " + b"x" * (2 << 20)):  # fmt: skip
        taken: list[KVEvent] = []
        with pytest.raises(BackendProtocolError):
            taken += KVEventParser().feed(good + bad)
        assert taken == events  # what came before the bad line is still delivered


async def test_an_actor_feeds_the_sink_and_resumes_with_since_after_the_stream_is_cut(
    engine: tuple[str, EngineBackend],
) -> None:
    url, backend = engine
    async with trio.open_nursery() as nursery:
        proxy = Proxy(int(url.rsplit(":", 1)[1]))
        await nursery.start(proxy.run)
        sink = RecordingSink()
        adapter = OpenAIHTTPBackend(f"http://127.0.0.1:{proxy.port}", http="1.1")
        actor = BackendActor("e", adapter, probe_interval=0.2, kv_sink=sink, kv_backoff=0.05)
        await nursery.start(actor.run)
        assert actor.view().kv_events and actor.view().block_size == BLOCK
        assert actor.view().cache_blocks == backend.engine.block_manager.num_blocks  # its LRU's size, from /v1/models
        await generate(backend, "first conversation about the water " * 2)
        await wait_for(lambda: sink.seqs and sink.seqs[-1] == backend.statistics().last_kv_event_seq)
        before = len(sink.seqs)
        await proxy.cut()
        await generate(backend, "second conversation, about the winter " * 2)
        await wait_for(lambda: sink.seqs[-1] == backend.statistics().last_kv_event_seq)
        assert sink.seqs == list(range(1, len(sink.seqs) + 1)) and len(sink.seqs) > before  # no loss, no repeat
        assert proxy.kv_since() == [-1, before]
        assert sink.resets == 0 and actor.statistics().kv_errors == 1
        await actor.aclose()
        assert sink.resets == 1  # closing drops what the sink holds of this backend
        nursery.cancel_scope.cancel()


async def test_a_gap_resubscribes_from_minus_one_and_replays_what_the_engine_keeps(tok_gguf: Path) -> None:
    """In-process engine: the sink reports a gap at seq 2 and forgets; the
    actor asks kv_since again (-1) and gets the engine's kept events from the first."""
    backend = fake_engine_backend(load_tokenizer(str(tok_gguf)))
    sink = RecordingSink(gap_at=2)
    async with trio.open_nursery() as nursery:
        await nursery.start(backend.run)
        actor = BackendActor("e", backend, probe_interval=0.2, kv_sink=sink)
        await nursery.start(actor.run)
        for text in ("the water in the well " * 3, "another one, in winter " * 3, "and a third " * 4):
            await generate(backend, text)
        last = backend.statistics().last_kv_event_seq
        assert last >= 3
        await wait_for(lambda: sink.seqs and sink.seqs[-1] == last)
        assert sink.since[:2] == [-1, -1]
        assert sink.gaps == 1 and sink.seqs == list(range(1, last + 1))  # replayed from the first kept
        await actor.aclose()
        await backend.aclose()
        nursery.cancel_scope.cancel()


# ---------------------------------------------------------------- garbage


async def garbage_server(*, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """HTTP/1.1 on a raw socket: healthy, lists a KV-event backend, and answers
    /v1/kv_events with garbage."""
    models = json.dumps({"object": "list", "data": [{"id": "g", "kv_events": True, "block_size": 4}]}).encode()

    async def handle(stream: trio.SocketStream) -> None:
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = await stream.receive_some(65536)
            if not chunk:
                return
            head += chunk
        path = head.split(b" ", 2)[1]
        if path.startswith(b"/v1/kv_events"):
            await stream.send_all(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
                b": hello\n\n\x00\x01 definitely not SSE {{{\n\n"
            )
        else:
            body = models if path == b"/v1/models" else b'{"status": "ok"}'
            await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n"
                                  b"content-length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
        await stream.aclose()

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(handle, listeners)


async def test_garbage_resets_the_sink_once_and_logs_one_line_per_burst(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="router.actors")
    async with trio.open_nursery() as nursery:
        port = await nursery.start(garbage_server)
        sink = RecordingSink()
        adapter = OpenAIHTTPBackend(f"http://127.0.0.1:{port}", http="1.1")
        actor = BackendActor("g", adapter, probe_interval=0.05, kv_sink=sink, kv_backoff=0.01, kv_backoff_max=0.02)
        await nursery.start(actor.run)
        await wait_for(lambda: actor.statistics().kv_errors >= 4)
        assert sink.resets == 1 and len(caplog.records) == 1  # one burst: no good batch between
        assert "garbled" in caplog.records[0].getMessage()
        assert actor.state is HealthState.UP and actor.statistics().probes > 1
        await actor.aclose()
        nursery.cancel_scope.cancel()


class KVFake(FakeBackend):
    """A FakeBackend that publishes KV events from a list; ``cut`` breaks the
    open stream, ``garbage`` makes every stream fail as garbled."""

    def __init__(self) -> None:
        super().__init__("kv")
        self.log: list[KVEvent] = []
        self.subscriptions: list[int] = []
        self.open = 0
        self.garbage = False
        self._changed = trio.Event()
        self._cut = False
        self.epoch = "run-1"

    def info(self) -> BackendInfo:
        return BackendInfo(name=self.name, models=self.models, kv_events=True, block_size=4, kv_epoch=self.epoch)

    def restart(self) -> None:
        """A new run: the event numbers start again, the old stream stays quiet."""
        self.epoch = "run-2"
        self.log = []
        self.publish(2)

    def publish(self, n: int) -> None:
        for _ in range(n):
            self.log.append(KVEvent(seq=len(self.log), kind="stored", block_hashes=(len(self.log),)))
        self._changed.set()
        self._changed = trio.Event()

    def cut(self) -> None:
        self._cut = True
        self.publish(0)

    async def kv_events(self, since: int = -1) -> AsyncIterator[KVEvent]:
        self.subscriptions.append(since)
        self.open += 1
        last = since
        try:
            while True:
                if self.garbage:
                    raise BackendProtocolError("garbage")
                if self._cut:
                    self._cut = False
                    raise StreamBroken("cut")
                changed = self._changed
                for event in self.log[last + 1 :]:
                    last = event.seq
                    yield event
                await changed.wait()
        finally:
            self.open -= 1


@pytest.fixture
def clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


async def test_events_ready_together_go_to_the_sink_in_batches_of_at_most_256(clock: trio.testing.MockClock) -> None:
    fake = KVFake()
    fake.publish(600)
    sink = RecordingSink()
    actor = BackendActor("kv", fake, kv_sink=sink)
    async with trio.open_nursery() as nursery:
        await nursery.start(actor.run)
        await trio.sleep(0.1)
        assert sink.batches == [256, 256, 88] and sink.seqs == list(range(600))
        fake.publish(3)
        await trio.sleep(0.1)
        assert sink.batches[-1] == 3
        nursery.cancel_scope.cancel()


async def test_down_resets_the_sink_and_up_resubscribes_from_kv_since(clock: trio.testing.MockClock) -> None:
    fake = KVFake()
    fake.publish(5)
    sink = RecordingSink()
    actor = BackendActor("kv", fake, probe_interval=1.0, kv_sink=sink)
    async with trio.open_nursery() as nursery:
        await nursery.start(actor.run)
        await trio.sleep(0.1)
        assert sink.seqs == [0, 1, 2, 3, 4] and fake.open == 1
        fake.healthy = False
        await trio.sleep(1.5)
        assert actor.state is HealthState.DOWN and sink.resets == 1 and fake.open == 0
        fake.healthy = True
        await trio.sleep(1.5)
        assert actor.statistics().state == "up" and fake.subscriptions == [-1, -1] and fake.open == 1
        fake.cut()  # a stream error: back off, resume from the last seq
        await trio.sleep(1.0)
        assert fake.subscriptions == [-1, -1, 4] and sink.resets == 1
        nursery.cancel_scope.cancel()


async def test_a_restart_between_probes_is_seen_by_its_new_epoch_and_resubscribes_from_the_start(
    clock: trio.testing.MockClock,
) -> None:
    """Numbering starts again after a restart, so resuming from the old seq
    would hear nothing new and keep a stale index: the epoch in the backend's
    info changing resets the sink and resubscribes from -1."""
    fake = KVFake()
    fake.publish(5)
    sink = RecordingSink()
    actor = BackendActor("kv", fake, probe_interval=1.0, kv_sink=sink)
    async with trio.open_nursery() as nursery:
        await nursery.start(actor.run)
        await trio.sleep(0.1)
        assert sink.seqs == [0, 1, 2, 3, 4]
        fake.restart()  # never went down: no probe failed
        await trio.sleep(1.5)
        assert actor.state is HealthState.UP and sink.resets == 1
        assert fake.subscriptions == [-1, -1] and sink.seqs == [0, 1, 2, 3, 4, 0, 1]  # then the new run's, from the start
        nursery.cancel_scope.cancel()


def test_the_engine_and_the_mock_name_their_kv_epoch_in_v1_models() -> None:
    from backends.openai_wire import engine_fields

    assert engine_fields([{"id": "m", "kv_epoch": "abc", "kv_events": True}])["kv_epoch"] == "abc"
    assert "kv_epoch" not in engine_fields([{"id": "m", "kv_epoch": 7}])  # wrong type: ignored
    assert engine_fields([{"id": "m", "kv_capacity_blocks": 4096}])["kv_capacity_blocks"] == 4096
    for bad in (0, -3, True, "4096", 1.5):
        assert "kv_capacity_blocks" not in engine_fields([{"id": "m", "kv_capacity_blocks": bad}])


async def test_repeated_garbage_resets_once_logs_once_and_backs_off(
    clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="router.actors")
    fake = KVFake()
    fake.garbage = True
    sink = RecordingSink()
    actor = BackendActor("kv", fake, probe_interval=1.0, kv_sink=sink, kv_backoff=0.1, kv_backoff_max=5.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(actor.run)
        await trio.sleep(30.0)
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert sink.resets == 1 and len(warnings) == 1
        # 0.1 + 0.2 + ... + 3.2, then every 5 s: about a dozen tries in 30 s, not thousands
        assert 8 <= len(fake.subscriptions) <= 14
        assert actor.state is HealthState.UP
        fake.garbage = False
        fake.publish(2)
        await trio.sleep(6.0)
        assert sink.seqs == [0, 1]
        nursery.cancel_scope.cancel()


async def test_a_sink_that_raises_never_stops_the_prober(clock: trio.testing.MockClock) -> None:
    fake = KVFake()
    fake.publish(2)
    sink = RecordingSink(explode=True)
    actor = BackendActor("kv", fake, probe_interval=1.0, kv_sink=sink)
    async with trio.open_nursery() as nursery:
        await nursery.start(actor.run)
        await trio.sleep(10.0)
        assert actor.state is HealthState.UP and fake.probes >= 10 and sink.resets == 1
        assert actor.statistics().restarts == 0
        nursery.cancel_scope.cancel()


async def test_no_subscription_without_a_sink_or_without_kv_events(clock: trio.testing.MockClock) -> None:
    fake = KVFake()
    plain = FakeBackend()
    async with trio.open_nursery() as nursery:
        await nursery.start(BackendActor("kv", fake).run)
        await nursery.start(BackendActor("plain", plain, kv_sink=RecordingSink()).run)
        await trio.sleep(1.0)
        assert fake.subscriptions == []
        nursery.cancel_scope.cancel()


# ---------------------------------------------------------------- pending prefill


async def test_pending_prefill_tokens_rise_until_the_first_event_and_drop_on_any_exit(
    clock: trio.testing.MockClock,
) -> None:
    actor = BackendActor("a", FakeBackend(delay=1.0))
    await actor.probe()
    request = GenerateRequest(prompt="x", max_tokens=3)
    firsts: list[int] = []

    async def consume(tokens: int) -> None:
        async for event in actor.stream(request, prompt_tokens=tokens):
            firsts.append(actor.view().pending_prefill_tokens)
            assert isinstance(event, Event)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(consume, 100)
        nursery.start_soon(consume, 50)
        await trio.sleep(0.5)
        assert actor.view().pending_prefill_tokens == 150
    # The first to get its first event leaves the other's tokens pending; the second none.
    assert firsts[1] == 0 and firsts[0] in (50, 100) and actor.view().pending_prefill_tokens == 0
    with trio.move_on_after(0.5):  # cancelled before its first event
        await consume(70)
    assert actor.view().pending_prefill_tokens == 0
    async for _ in actor.stream(request):  # existing callers: nothing pending
        assert actor.view().pending_prefill_tokens == 0
    assert msgspec.structs.asdict(actor.statistics())["pending_prefill_tokens"] == 0
