"""OpenAIHTTPBackend against the mock server on loopback, over HTTP/1.1,
HTTP/2 (prior knowledge) and TLS (ALPN): streaming, resume, every error
translation, and cancellation reaching the server."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import aclosing

import msgspec
import pytest
import trio

from backends.base import ChatMessage, Event, GenerateRequest
from backends.errors import (
    BackendProtocolError,
    BackendStalled,
    BackendTimeout,
    BackendUnavailable,
    BadRequest,
    ContextLengthExceeded,
    ModelNotFound,
    StreamBroken,
    UpstreamError,
    UpstreamRateLimited,
)
from backends.mock import MockBackend, MockConfig, parse_fault
from backends.openai_http import OpenAIHTTPBackend
from frontend import loop_lag
from tests.backends.conftest import (
    Served,
    TLSFiles,
    collect,
    collect_until_error,
    eventually,
    ids_of,
    serve_mock,
    text_of,
)

PROTOCOLS = ["h1", "h2", "tls"]


async def _backend(
    nursery: trio.Nursery,
    protocol: str,
    tls_files: TLSFiles,
    *faults: str,
    config: MockConfig | None = None,
    **kw: object,
) -> tuple[Served, OpenAIHTTPBackend]:
    certs = tls_files if protocol == "tls" else None
    served = await serve_mock(nursery, config, [parse_fault(f) for f in faults], certs=certs)
    client = OpenAIHTTPBackend(
        served.url,
        http="1.1" if protocol == "h1" else "2",
        verify=tls_files.client_context if certs else True,
        **kw,  # type: ignore[arg-type]
    )
    return served, client


# The wait for a response's head in the tests of mid-stream silences: the
# stall timeout (0.3 s) was also the opening's, and a connection on a loaded
# 2-core CI box once took longer than that to answer (BackendTimeout, not
# the stall under test).
OPENING = 10.0


@pytest.fixture
async def closing() -> AsyncIterator[list[OpenAIHTTPBackend]]:
    backends: list[OpenAIHTTPBackend] = []
    yield backends
    for b in backends:
        await b.aclose()


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_streams_text_and_token_ids_identical_to_in_process(
    nursery: trio.Nursery, tls_files: TLSFiles, closing: list[OpenAIHTTPBackend], protocol: str
) -> None:
    served, client = await _backend(nursery, protocol, tls_files)
    closing.append(client)
    request = GenerateRequest(prompt="hello there", max_tokens=8, seed=42, logprobs=2)
    remote = await collect(client, request)
    local = await collect(MockBackend(), request)
    assert ids_of(remote) == ids_of(local) and text_of(remote) == text_of(local)
    assert remote[0].prompt_token_ids == local[0].prompt_token_ids and remote[0].seed == 42
    assert remote[-1].finish_reason == "length" and remote[-1].usage == local[-1].usage
    assert [lp.token_id for e in remote for lp in e.logprobs or []] == ids_of(local)
    assert client.info().token_ids
    assert served.backend.statistics().completed == 1


async def test_chat_goes_to_chat_completions_and_matches_the_template(
    nursery: trio.Nursery, tls_files: TLSFiles, closing: list[OpenAIHTTPBackend]
) -> None:
    _, client = await _backend(nursery, "h2", tls_files)
    closing.append(client)
    request = GenerateRequest(
        messages=[ChatMessage(role="user", content="hi")], max_tokens=4, seed=1, stop=["zzz"]
    )
    remote = await collect(client, request)
    assert ids_of(remote) == ids_of(await collect(MockBackend(), request))
    assert remote[-1].finish_reason == "length"


async def test_resume_after_a_cut_on_another_server_reproduces_the_uninterrupted_stream(
    nursery: trio.Nursery, tls_files: TLSFiles, closing: list[OpenAIHTTPBackend]
) -> None:
    _, broken = await _backend(nursery, "h2", tls_files, "cut-after=4")
    _, healthy = await _backend(nursery, "h2", tls_files)
    closing += [broken, healthy]
    request = GenerateRequest(prompt="long story", max_tokens=10, seed=5)
    head, exc = await collect_until_error(broken, request)
    assert isinstance(exc, StreamBroken) and len(ids_of(head)) == 4
    prompt = head[0].prompt_token_ids
    assert prompt is not None
    resumed = GenerateRequest(prompt_token_ids=prompt + ids_of(head), max_tokens=6, seed=5)
    tail = await collect(healthy, resumed)
    whole = await collect(healthy, request)
    assert ids_of(head) + ids_of(tail) == ids_of(whole)
    assert text_of(head) + text_of(tail) == text_of(whole)


def _resumed(request: GenerateRequest, first: list[Event], k: int) -> GenerateRequest:
    """The router's continuation after ``k`` relayed tokens (router.migration.resume_request)."""
    prompt = first[0].prompt_token_ids
    assert prompt is not None and request.max_tokens is not None
    return msgspec.structs.replace(
        request, prompt=None, prompt_token_ids=prompt + ids_of(first)[:k], resumed_tokens=k,
        max_tokens=request.max_tokens - k, seed=first[0].seed,
    )


@pytest.mark.parametrize("protocol", ["h1", "h2"])
@pytest.mark.parametrize("shape", ["plain", "stop", "stop+logprobs"])
async def test_a_resumed_request_continues_the_uninterrupted_stream_exactly_over_http(
    nursery: trio.Nursery, tls_files: TLSFiles, closing: list[OpenAIHTTPBackend],
    protocol: str, shape: str,
) -> None:
    """``resumed_tokens`` goes over the wire and the mock server honours it on
    each of its paths (the fast path's burst, its step loop for stop strings,
    the frontend for logprobs): from token k on, the events are the
    uninterrupted run's, held-back stop text and usage included."""
    _, client = await _backend(nursery, protocol, tls_files)
    closing.append(client)
    request = GenerateRequest(prompt="long story", max_tokens=10, seed=5)
    words = [e.text for e in await collect(client, request)]
    if shape != "plain":  # one stop held back at 2, one straddling 5|6
        stop = [words[2] + "\u2603", words[5][-2:] + words[6][:2]]
        request = msgspec.structs.replace(request, stop=stop, logprobs=2 if "logprobs" in shape else None)
    full = await collect(client, request)
    for k in range(1, len(ids_of(full))):
        tail = await collect(client, _resumed(request, full, k))
        assert tail[0].prompt_token_ids == full[0].prompt_token_ids and tail[0].seed == 5
        tail[0].prompt_token_ids = tail[0].seed = None
        # ``more_ready`` says how the bytes came in reads, not what the stream says.
        assert _content(tail) == _content(full[k:]), k


def _content(events: list[Event]) -> list[Event]:
    return [msgspec.structs.replace(e, more_ready=False) for e in events]


async def test_refused_port_is_backend_unavailable(closing: list[OpenAIHTTPBackend]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = OpenAIHTTPBackend(f"http://127.0.0.1:{port}", connect_timeout=2)
    closing.append(client)
    with pytest.raises(BackendUnavailable):
        await collect(client, GenerateRequest(prompt="a"))
    health = await client.health()
    assert not health.ok and "unreachable" in health.detail


@pytest.mark.parametrize(
    ("fault", "error", "retry_after"),
    [
        ("429:retry-after=3", UpstreamRateLimited, 3.0),
        ("status=503", BackendUnavailable, None),
        ("status=500", UpstreamError, None),
    ],
)
async def test_status_codes_translate_with_retry_after(
    nursery: trio.Nursery,
    tls_files: TLSFiles,
    closing: list[OpenAIHTTPBackend],
    fault: str,
    error: type[Exception],
    retry_after: float | None,
) -> None:
    _, client = await _backend(nursery, "h2", tls_files, fault)
    closing.append(client)
    events, exc = await collect_until_error(client, GenerateRequest(prompt="a"))
    assert events == [] and type(exc) is error
    assert exc.retry_after == retry_after  # type: ignore[attr-defined]


async def test_client_errors_carry_the_servers_message(
    nursery: trio.Nursery, tls_files: TLSFiles, closing: list[OpenAIHTTPBackend]
) -> None:
    _, client = await _backend(nursery, "h1", tls_files, config=MockConfig(max_context=32))
    closing.append(client)
    with pytest.raises(ModelNotFound, match="nope"):
        await collect(client, GenerateRequest(prompt="a", model="nope"))
    with pytest.raises(ContextLengthExceeded, match="32"):
        await collect(client, GenerateRequest(prompt="a" * 30, max_tokens=8))
    with pytest.raises(BadRequest, match="max_tokens"):
        await collect(client, GenerateRequest(prompt="a", max_tokens=0))


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_cut_mid_stream_is_stream_broken_after_exactly_n_tokens(
    nursery: trio.Nursery, tls_files: TLSFiles, closing: list[OpenAIHTTPBackend], protocol: str
) -> None:
    _, client = await _backend(nursery, protocol, tls_files, "cut-after=3")
    closing.append(client)
    events, exc = await collect_until_error(client, GenerateRequest(prompt="a", max_tokens=10))
    assert isinstance(exc, StreamBroken) and len(ids_of(events)) == 3


async def test_stall_is_backend_timeout_after_stall_timeout(
    nursery: trio.Nursery, tls_files: TLSFiles, closing: list[OpenAIHTTPBackend]
) -> None:
    served, client = await _backend(nursery, "h2", tls_files, "stall-after=2", stall_timeout=0.3, first_token_timeout=OPENING)
    closing.append(client)
    start = trio.current_time()
    events, exc = await collect_until_error(client, GenerateRequest(prompt="a", max_tokens=500))
    assert isinstance(exc, BackendTimeout) and len(events) == 2
    assert 0.3 <= trio.current_time() - start < 2.0
    # The backend was blocked behind the stall; the RST_STREAM we sent frees it.
    await eventually(lambda: served.backend.statistics().cancelled == 1, 0.5)


async def test_a_stall_verdict_waits_once_more_for_the_routers_own_loop_lag(
    nursery: trio.Nursery, tls_files: TLSFiles, closing: list[OpenAIHTTPBackend]
) -> None:
    """A router whose loop ran 0.4 s late may have read the backend late:
    the 0.3 s stall verdict waits once more, min(lag, 0.3) s, before it is
    given (frontend/loop_lag.py); a loop on time gives it at 0.3 s."""
    _, client = await _backend(nursery, "h2", tls_files, "stall-after=2", stall_timeout=0.3, first_token_timeout=OPENING)
    closing.append(client)
    lag = loop_lag.LoopLag()
    lag.note(trio.current_time(), 0.4)
    loop_lag.install(lag)
    try:
        start = trio.current_time()
        events, exc = await collect_until_error(client, GenerateRequest(prompt="a", max_tokens=500))
    finally:
        loop_lag.install(None)
    assert isinstance(exc, BackendStalled) and len(events) == 2
    assert trio.current_time() - start >= 0.6 and "for 0.6s" in str(exc)


async def test_malformed_chunk_is_backend_protocol_error(
    nursery: trio.Nursery, tls_files: TLSFiles, closing: list[OpenAIHTTPBackend]
) -> None:
    _, client = await _backend(nursery, "h2", tls_files, "malformed-after=2")
    closing.append(client)
    events, exc = await collect_until_error(client, GenerateRequest(prompt="a", max_tokens=10))
    assert isinstance(exc, BackendProtocolError) and len(events) == 2


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_stream_with_its_final_event_and_usage_but_no_done_is_a_complete_answer(
    nursery: trio.Nursery, tls_files: TLSFiles, closing: list[OpenAIHTTPBackend], protocol: str
) -> None:
    _, client = await _backend(nursery, protocol, tls_files, "no-done")
    closing.append(client)
    request = GenerateRequest(prompt="a", max_tokens=4, seed=2)
    events = await collect(client, request)
    local = await collect(MockBackend(), request)
    assert ids_of(events) == ids_of(local) and text_of(events) == text_of(local)
    assert events[-1].finish_reason == "length" and events[-1].usage == local[-1].usage
    assert client.statistics().completed == 1 and client.statistics().failed == 0


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_stream_that_ends_before_its_final_event_is_stream_broken(
    nursery: trio.Nursery, tls_files: TLSFiles, closing: list[OpenAIHTTPBackend], protocol: str
) -> None:
    """The server ends the body cleanly, but the finish chunk never came: the
    last token (which was in it) is not delivered, so a resume regenerates it."""
    _, client = await _backend(nursery, protocol, tls_files, "no-final")
    closing.append(client)
    request = GenerateRequest(prompt="a", max_tokens=4, seed=2)
    events, exc = await collect_until_error(client, request)
    local = await collect(MockBackend(), request)
    assert isinstance(exc, StreamBroken) and "final event" in str(exc)
    assert ids_of(events) == ids_of(local)[:-1] and all(e.finish_reason is None for e in events)


def _data(obj: object) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


def _choice(text: str, token: int, finish: str | None = None) -> dict[str, object]:
    return {"choices": [{"index": 0, "text": text, "token_ids": [token], "finish_reason": finish}]}


@pytest.mark.parametrize("usage", [True, False], ids=["usage", "no-usage"])
@pytest.mark.parametrize("ending", ["eof", "reset", "abort", "stall"])
async def test_a_stream_without_done_is_complete_only_once_finish_and_usage_both_came(
    nursery: trio.Nursery, usage: bool, ending: str
) -> None:
    """After the finish chunk and the usage chunk, however the stream ends
    (end of stream, RST_STREAM, TCP reset, silence past the stall timeout) the
    answer is complete; without the usage chunk it is broken (or timed out)."""
    from tests.backends.test_h2client import ScriptedServer, ServerConn

    async def handler(conn: ServerConn, sid: int, _: dict[bytes, bytes]) -> None:
        await conn.respond(sid, headers=[(b"content-type", b"text/event-stream")])
        await conn.send(sid, _data({**_choice(" a", 300), "prompt_token_ids": [1, 2]}))
        await conn.send(sid, _data(_choice(" b", 301, "stop")))
        if usage:
            await conn.send(sid, _data({"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 2}}))
        if ending == "eof":
            await conn.send(sid, b"", end=True)
        elif ending == "reset":
            conn.h2.reset_stream(sid, error_code=2)
            await conn.flush()
        elif ending == "abort":
            conn.abort()
        else:
            await trio.sleep_forever()

    server = await ScriptedServer(handler).start(nursery)
    client = OpenAIHTTPBackend(f"http://127.0.0.1:{server.port}", http="2", stall_timeout=0.3, first_token_timeout=OPENING)
    try:
        if usage:
            events = await collect(client, GenerateRequest(prompt="x", max_tokens=2))
            assert [(e.text, e.token_ids, e.finish_reason) for e in events] == [
                (" a", [300], None), (" b", [301], "stop")
            ]
            assert events[0].prompt_token_ids == [1, 2]
            assert events[-1].usage is not None and events[-1].usage.completion_tokens == 2
        else:
            events, exc = await collect_until_error(client, GenerateRequest(prompt="x", max_tokens=2))
            assert type(exc) is (BackendStalled if ending == "stall" else StreamBroken), exc
            assert [e.text for e in events] == [" a"]
    finally:
        await client.aclose()


@pytest.mark.parametrize(
    ("error", "before", "want"),
    [
        ({"message": "boom", "type": "upstream_error", "code": "stream_broken"}, False, StreamBroken),
        ({"message": "bad", "type": "server_error", "code": "backend_protocol_error"}, False, StreamBroken),
        ({"message": "boom", "type": "server_error"}, True, UpstreamError),
        ({"message": "full", "type": "server_error", "code": "backend_unavailable"}, True, BackendUnavailable),
    ],
)
async def test_an_in_band_error_after_the_first_event_is_stream_broken(
    nursery: trio.Nursery, error: dict[str, str], before: bool, want: type[Exception]
) -> None:
    """Mid-stream, whatever the error says, the tokens so far are valid and
    the stream is migratable; before the first event it is an ordinary
    upstream error (retried elsewhere)."""
    from tests.backends.test_h2client import ScriptedServer, ServerConn

    async def handler(conn: ServerConn, sid: int, _: dict[bytes, bytes]) -> None:
        await conn.respond(sid, headers=[(b"content-type", b"text/event-stream")])
        if not before:
            await conn.send(sid, _data(_choice(" a", 300)))
        await conn.send(sid, _data({"error": error}), end=True)

    server = await ScriptedServer(handler).start(nursery)
    client = OpenAIHTTPBackend(f"http://127.0.0.1:{server.port}", http="2")
    try:
        events, exc = await collect_until_error(client, GenerateRequest(prompt="x"))
        assert type(exc) is want and len(events) == (0 if before else 1)
    finally:
        await client.aclose()


@pytest.mark.parametrize(
    ("config", "faults", "want"),
    [
        (MockConfig(faults=[parse_fault("cut-after=2")]), (), StreamBroken),  # in-band error
        (MockConfig(faults=[parse_fault("malformed-after=2")]), (), StreamBroken),  # in-band error
        (None, ("cut-after=2",), StreamBroken),  # the transport breaks
        (None, ("no-final",), StreamBroken),
        (None, ("malformed-after=2",), BackendProtocolError),
        (None, ("stall-after=2",), BackendStalled),
    ],
)
async def test_every_mid_stream_failure_is_an_upstream_error_the_router_can_name(
    nursery: trio.Nursery, tls_files: TLSFiles, closing: list[OpenAIHTTPBackend],
    config: MockConfig | None, faults: tuple[str, ...], want: type[Exception],
) -> None:
    _, client = await _backend(nursery, "h2", tls_files, *faults, config=config, stall_timeout=0.3, first_token_timeout=OPENING)
    closing.append(client)
    events, exc = await collect_until_error(client, GenerateRequest(prompt="a", max_tokens=6))
    assert type(exc) is want and isinstance(exc, UpstreamError) and len(ids_of(events)) >= 2
    stats = client.statistics()  # the adapter's own tally: failed, not completed nor left in flight
    assert (stats.started, stats.failed, stats.completed, stats.cancelled, stats.in_flight) == (1, 1, 0, 0, 0)


@pytest.mark.parametrize(
    ("config", "token_ids", "want"),
    [
        (MockConfig(), "auto", (True, True)),
        (MockConfig(), False, (False, False)),  # never asks for ids: no resume by them
        (MockConfig(token_ids=False), "auto", (False, False)),
        (MockConfig(faults=[parse_fault("diverge")]), "auto", (True, False)),
    ],
)
async def test_refresh_reads_token_ids_and_exact_resume_from_the_model_list(
    nursery: trio.Nursery, tls_files: TLSFiles, closing: list[OpenAIHTTPBackend],
    config: MockConfig, token_ids: object, want: tuple[bool, bool],
) -> None:
    _, client = await _backend(nursery, "h2", tls_files, config=config, token_ids=token_ids)
    closing.append(client)
    assert not client.info().exact_resume  # nothing known before the model list
    info = await client.refresh()
    assert (info.token_ids, info.exact_resume) == want


@pytest.mark.parametrize(
    ("entries", "want"),
    [
        ([{"exact_resume": True}, {"exact_resume": True}], {"exact_resume": True}),
        ([{"exact_resume": True}, {"exact_resume": False}], {"exact_resume": False}),
        ([{"exact_resume": True}, {}], {"exact_resume": True}),
        ([{"exact_resume": "yes", "token_ids": 1}], {}),
        ([{"token_ids": False, "block_size": 16}], {"token_ids": False, "block_size": 16}),
    ],
)
def test_engine_fields_take_exact_resume_only_as_a_bool_every_entry_agrees_on(
    entries: list[dict[str, object]], want: dict[str, object]
) -> None:
    from backends.openai_wire import engine_fields

    assert engine_fields(entries) == want


async def test_a_server_without_token_ids_streams_text_and_usage_and_says_so(
    nursery: trio.Nursery, tls_files: TLSFiles, closing: list[OpenAIHTTPBackend]
) -> None:
    _, client = await _backend(nursery, "h2", tls_files, config=MockConfig(token_ids=False))
    closing.append(client)
    request = GenerateRequest(prompt="hello", max_tokens=5, seed=3, logprobs=1)
    events = await collect(client, request)  # asks for ids ("auto"), gets none
    local = await collect(MockBackend(), request)
    assert ids_of(events) == [] and text_of(events) == text_of(local)
    assert events[0].prompt_token_ids is None and events[0].seed is None
    assert events[-1].usage == local[-1].usage and not client.info().token_ids


async def test_a_diverging_server_answers_identical_requests_differently(
    nursery: trio.Nursery, tls_files: TLSFiles, closing: list[OpenAIHTTPBackend]
) -> None:
    config = MockConfig(faults=[parse_fault("diverge")], token_ids=False)
    _, client = await _backend(nursery, "h1", tls_files, config=config)
    closing.append(client)
    request = GenerateRequest(prompt="same", max_tokens=6, seed=4)
    texts = {text_of(await collect(client, request)) for _ in range(3)}
    assert len(texts) == 3


def test_resumed_tokens_are_forwarded_with_a_token_id_prompt_only() -> None:
    client = OpenAIHTTPBackend("http://127.0.0.1:9", http="2")
    path, body = client._payload(
        GenerateRequest(prompt_token_ids=[1, 2, 3], resumed_tokens=2, max_tokens=4)
    )
    assert path == "/v1/completions" and (body["prompt"], body["resumed_tokens"]) == ([1, 2, 3], 2)
    assert "resumed_tokens" not in client._payload(GenerateRequest(prompt_token_ids=[1]))[1]
    with pytest.raises(BadRequest, match="resumed_tokens"):
        client.stream(GenerateRequest(prompt="text", resumed_tokens=1))
    chat = [ChatMessage(role="user", content="x")]
    with pytest.raises(BadRequest, match="resumed_tokens"):
        client.stream(GenerateRequest(messages=chat, resumed_tokens=1))


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_cancelling_the_consumer_reaches_the_server_within_100ms(
    nursery: trio.Nursery, tls_files: TLSFiles, closing: list[OpenAIHTTPBackend], protocol: str
) -> None:
    served, client = await _backend(
        nursery, protocol, tls_files, config=MockConfig(tpot_s=0.02, max_tokens=1000)
    )
    closing.append(client)
    with trio.move_on_after(0.2):
        async with aclosing(client.stream(GenerateRequest(prompt="a", max_tokens=1000))) as events:
            async for _ in events:
                pass
    assert served.backend.statistics().in_flight == 1 or served.backend.statistics().cancelled == 1
    await eventually(lambda: served.backend.statistics().cancelled == 1, 0.1)
    assert served.backend.statistics().in_flight == 0
    # The pooled connection still works afterwards (HTTP/2: the reset freed the stream only).
    assert len(ids_of(await collect(client, GenerateRequest(prompt="b", max_tokens=3)))) == 3
    assert client.statistics().cancelled == 1 and client.statistics().completed == 1


async def test_many_cancelled_h2_streams_do_not_exhaust_the_connection_window(
    nursery: trio.Nursery, tls_files: TLSFiles, closing: list[OpenAIHTTPBackend]
) -> None:
    """Without RST_STREAM the server keeps sending into a stream nobody reads,
    which eats the connection's flow-control window until every stream on it
    stalls."""
    served, client = await _backend(
        nursery, "h2", tls_files, config=MockConfig(max_tokens=4000), stall_timeout=2
    )
    closing.append(client)
    for _ in range(8):
        async with aclosing(
            client.stream(GenerateRequest(prompt="a", max_tokens=4000, logprobs=5))
        ) as events:
            async for _ in events:
                break
    events = await collect(client, GenerateRequest(prompt="a", max_tokens=2000, logprobs=5))
    assert len(events) == 2000
    assert served.backend.statistics().cancelled == 8


async def test_health_and_refresh_read_the_server(
    nursery: trio.Nursery, tls_files: TLSFiles, closing: list[OpenAIHTTPBackend]
) -> None:
    _, client = await _backend(nursery, "h2", tls_files, config=MockConfig(models=("m1", "m2")))
    closing.append(client)
    assert client.info().models == ()
    assert (await client.health()).ok
    info = await client.refresh()
    assert info.models == ("m1", "m2") and client.info() == info
    events = await collect(
        client, GenerateRequest(prompt="a", max_tokens=1)
    )  # model defaults to m1
    assert len(events) == 1


async def test_text_only_mode_does_not_ask_for_ids(
    nursery: trio.Nursery, tls_files: TLSFiles, closing: list[OpenAIHTTPBackend]
) -> None:
    _, client = await _backend(nursery, "h1", tls_files, token_ids=False)
    closing.append(client)
    events = await collect(client, GenerateRequest(prompt="hello", max_tokens=5, seed=3))
    local = await collect(MockBackend(), GenerateRequest(prompt="hello", max_tokens=5, seed=3))
    assert ids_of(events) == [] and text_of(events) == text_of(local)
    assert events[-1].finish_reason == "length" and events[-1].usage is not None
    assert events[-1].usage.completion_tokens == 5 and not client.info().token_ids


def test_bad_base_url_is_rejected_at_construction() -> None:
    with pytest.raises(ValueError, match="base_url"):
        OpenAIHTTPBackend("ftp://example.com")


async def test_probes_have_their_own_connection_so_full_streams_never_fail_them(
    nursery: trio.Nursery,
) -> None:
    """Issue 12, bug 5: with every stream slot of the pool taken (here 4 per
    connection, one connection), a health probe still answers at once."""
    from hypercorn.config import Config as HypercornConfig

    from backends.mock_server import build_app
    from frontend.serving import ServeOptions, serve

    class FourStreams(ServeOptions):
        def hypercorn_config(self) -> HypercornConfig:
            config = super().hypercorn_config()
            config.h2_max_concurrent_streams = 4
            return config

    app = build_app(MockBackend(MockConfig(tpot_s=0.05, max_tokens=1000)))
    url = await nursery.start(serve, app, FourStreams(graceful_timeout=0.1))
    client = OpenAIHTTPBackend(url, http="2", max_connections=1, connect_timeout=0.5, health_timeout=1)
    try:
        held: list[object] = []
        async with trio.open_nursery() as streams:
            started = trio.Semaphore(0)

            async def hold() -> None:
                async with aclosing(client.stream(GenerateRequest(prompt="a", max_tokens=1000))) as events:  # type: ignore[type-var]
                    async for event in events:
                        held.append(event)
                        started.release()
                        await trio.sleep_forever()

            for _ in range(4):
                streams.start_soon(hold)
            for _ in range(4):
                await started.acquire()
            # Every slot of the one stream connection is taken: a fifth stream waits...
            with trio.move_on_after(0.3) as waited:
                await collect(client, GenerateRequest(prompt="b", max_tokens=1))
            assert waited.cancelled_caught
            # ...but the probe does not.
            start = trio.current_time()
            health = await client.health()
            assert health.ok, health.detail
            assert trio.current_time() - start < 0.5
            streams.cancel_scope.cancel()
    finally:
        await client.aclose()


async def test_a_goaway_never_fails_a_request(nursery: trio.Nursery) -> None:
    """Issue 12, bug 1: a backend that closes a connection (GOAWAY, as
    hypercorn did after 1,000 requests) must not fail a request: streams up to
    last_stream_id finish on the old connection, and the one it refused is
    sent again at once on a new connection, before any byte reached the client."""
    from tests.backends.test_h2client import ScriptedServer, ServerConn

    sse = [(b"content-type", b"text/event-stream")]
    three, finish = trio.Event(), trio.Event()

    def chunk(text: str, final: bool = False) -> bytes:
        choice = {"index": 0, "text": text, "token_ids": [1], "finish_reason": "stop" if final else None}
        body = b"data: " + msgspec.json.encode({"choices": [choice]}) + b"\n\n"
        return body + (b"data: [DONE]\n\n" if final else b"")

    async def handler(conn: ServerConn, sid: int, _: dict[bytes, bytes]) -> None:
        if conn is server.conns[0] and sid == 5:
            three.set()
            return  # above the GOAWAY's last stream id: never processed
        await conn.respond(sid, headers=sse)
        await conn.send(sid, chunk(" a"))
        if conn is server.conns[0]:
            await finish.wait()
        await conn.send(sid, chunk(" b", final=True), end=True)

    server = await ScriptedServer(handler).start(nursery)
    client = OpenAIHTTPBackend(f"http://127.0.0.1:{server.port}", http="2")
    texts: list[str] = []

    async def one() -> None:
        texts.append(text_of(await collect(client, GenerateRequest(prompt="x", max_tokens=2))))

    try:
        with trio.fail_after(5):
            async with trio.open_nursery() as inner:
                for n in (1, 2, 3):
                    inner.start_soon(one)
                    await eventually(lambda n=n: server.requests == n, 2)  # type: ignore[misc]
                await three.wait()
                await server.conns[0].goaway(3)
                await eventually(lambda: len(texts) == 1, 2)  # the refused one, resent
                assert len(server.conns) == 2
                finish.set()
        assert texts == [" a b"] * 3
    finally:
        await client.aclose()


def test_the_engine_priority_goes_upstream_in_the_backends_order_or_not_at_all() -> None:
    """headrace runs higher first; vLLM's priority scheduling lower first;
    and vLLM's default FCFS refuses any non-zero priority with a 400, so a
    plain OpenAI backend built from config gets none."""
    req = GenerateRequest(prompt="x", priority=1)
    sent = {order: OpenAIHTTPBackend("http://127.0.0.1:9", priority=order)._payload(req)[1].get("priority")
            for order in ("higher_first", "lower_first", "off")}  # fmt: skip
    assert sent == {"higher_first": 1, "lower_first": -1, "off": None}
    assert "priority" not in OpenAIHTTPBackend("http://127.0.0.1:9")._payload(GenerateRequest(prompt="x"))[1]
    from router.config import BackendSpec
    from router.factory import build_backend

    def built(**spec: object) -> object:
        return build_backend(BackendSpec(url="http://127.0.0.1:9", **spec), "b").priority  # type: ignore[arg-type, attr-defined]

    assert built() == "off" and built(kind="engine") == "higher_first"
    assert built(options={"priority": "lower_first"}) == "lower_first"
