"""Rate limits shared through Redis: the I/O around :mod:`policies.shared_limits`.

The decision is the policy's, made inside Redis by its scripts; this module
only carries them. An admission is one round trip; the generated tokens
streams report and the ends of requests are gathered and sent every
``flush_interval`` in one pipelined write, by :class:`RedisLimiter`'s own
task (a supervised service, CONVENTIONS #5)::

    RateLimits.admit ── acquire ── EVALSHA acquire (one round trip) ──> RateDecision
    stream events    ── charge  ─┐
    request end      ── release ─┴─> pending (per subject set) ── run(): every flush_interval
                                         EVALSHA settle, one per subject set, pipelined

The client is a small RESP2 client over trio streams (:class:`RedisPool`)
rather than the ``redis`` package: redis-py's asyncio client does not run
under trio, and its blocking client would cost a thread hop per admission
and could not be cancelled; four commands are needed (AUTH, SELECT,
EVALSHA, EVAL). A script the server does not hold yet (NOSCRIPT: a
restarted or new Redis) is sent once in full with EVAL, which caches it.

Failures (refused, reset, a timeout, an error reply) are
:class:`RedisUnavailable` here and never leave this module: an admission
that cannot reach Redis is admitted or refused by ``fail_open`` and counted;
a batch that cannot be sent is kept and sent with the next one (charges are
merged), so a short outage loses nothing but time. ``rediss://`` (TLS) is
not supported.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from urllib.parse import unquote, urlsplit

import msgspec
import trio

from policies.ratelimit import Limits, RateDecision
from policies.shared_limits import ScriptCall, SharedRateLimitPolicy

__all__ = ["RedisError", "RedisLimiter", "RedisLimiterStatistics", "RedisPool", "RedisUnavailable"]

log = logging.getLogger(__name__)

Reply = bytes | int | str | list["Reply"] | None


class RedisUnavailable(Exception):
    """Redis could not be reached or did not answer in time."""


class RedisError(RedisUnavailable):
    """Redis answered with an error reply (``-ERR ...``)."""


def encode(*args: str | bytes | int) -> bytes:
    """One command in RESP2: an array of bulk strings."""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


class _Connection:
    """One connection: write commands, read their replies in order."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buffer = bytearray()

    async def _line(self) -> bytes:
        while True:
            end = self.buffer.find(b"\r\n")
            if end >= 0:
                line = bytes(self.buffer[:end])
                del self.buffer[: end + 2]
                return line
            await self._fill()

    async def _fill(self) -> None:
        chunk = await self.stream.receive_some(65536)
        if not chunk:
            raise RedisUnavailable("Redis closed the connection")
        self.buffer += chunk

    async def reply(self) -> Reply:
        line = await self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            raise RedisError(rest.decode())
        if kind == b":":
            return int(rest)
        if kind == b"$":
            size = int(rest)
            if size < 0:
                return None
            while len(self.buffer) < size + 2:
                await self._fill()
            data = bytes(self.buffer[:size])
            del self.buffer[: size + 2]
            return data
        if kind == b"*":
            count = int(rest)
            return None if count < 0 else [await self.reply() for _ in range(count)]
        raise RedisUnavailable(f"not a RESP reply: {line[:40]!r}")

    async def execute(self, commands: Sequence[Sequence[str | bytes | int]]) -> list[Reply | RedisError]:
        """Send ``commands`` in one write; their replies (an error reply as a
        :class:`RedisError` in its place, so one bad command spoils no other)."""
        await self.stream.send_all(b"".join(encode(*c) for c in commands))
        replies: list[Reply | RedisError] = []
        for _ in commands:
            try:
                replies.append(await self.reply())
            except RedisError as exc:
                replies.append(exc)
        return replies


class RedisPool:
    """Connections to one Redis (``redis://[user:password@]host[:port][/db]``),
    at most ``size`` open; a connection that failed or was cancelled mid-
    command is closed, never reused (its replies would be out of step)."""

    def __init__(self, url: str, *, size: int = 8, connect_timeout: float = 2.0) -> None:
        parts = urlsplit(url)
        if parts.scheme != "redis":
            raise ValueError(f"a Redis URL is redis://host[:port][/db], not {url!r} (rediss:// is not supported)")
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 6379
        self.user = unquote(parts.username) if parts.username else None
        self.password = unquote(parts.password) if parts.password else None
        self.db = int(parts.path.strip("/") or 0)
        self.connect_timeout = connect_timeout
        self._idle: list[_Connection] = []
        self._slots = trio.Semaphore(size)
        self._known: set[str] = set()  # script shas the server holds (as far as we know)

    async def _connect(self) -> _Connection:
        with trio.move_on_after(self.connect_timeout) as scope:
            stream = await trio.open_tcp_stream(self.host, self.port)
        if scope.cancelled_caught:
            raise RedisUnavailable(f"no connection to Redis at {self.host}:{self.port} within {self.connect_timeout:g} s")
        conn = _Connection(stream)
        setup: list[list[str | bytes | int]] = []
        if self.password is not None:
            setup.append(["AUTH", *([self.user] if self.user else []), self.password])
        if self.db:
            setup.append(["SELECT", self.db])
        for reply in await conn.execute(setup) if setup else ():
            if isinstance(reply, RedisError):
                await stream.aclose()
                raise reply
        return conn

    async def execute(self, commands: Sequence[Sequence[str | bytes | int]]) -> list[Reply | RedisError]:
        async with self._slots:
            conn = self._idle.pop() if self._idle else None
            ok = False
            try:
                if conn is None:
                    conn = await self._connect()
                replies = await conn.execute(commands)
                ok = True
                return replies
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise RedisUnavailable(f"Redis at {self.host}:{self.port}: {exc}") from exc
            finally:
                if conn is not None:
                    if ok:
                        self._idle.append(conn)
                    else:
                        with trio.CancelScope(shield=True):
                            await conn.stream.aclose()

    async def scripts(self, calls: Sequence[ScriptCall]) -> list[Reply | RedisError]:
        """Run the calls, pipelined: EVALSHA, then EVAL for those the server
        did not hold (NOSCRIPT), once."""
        replies = await self.execute([_evalsha(c) for c in calls])
        missing = [i for i, r in enumerate(replies) if isinstance(r, RedisError) and str(r).startswith("NOSCRIPT")]
        if missing:
            again = await self.execute([("EVAL", calls[i].script, len(calls[i].keys), *calls[i].keys, *calls[i].args) for i in missing])
            for i, reply in zip(missing, again, strict=True):
                replies[i] = reply
        return replies

    async def aclose(self) -> None:
        while self._idle:
            with trio.CancelScope(shield=True):
                await self._idle.pop().stream.aclose()


def _evalsha(call: ScriptCall) -> tuple[str | int, ...]:
    return ("EVALSHA", call.sha, len(call.keys), *call.keys, *call.args)


class RedisLimiterStatistics(msgspec.Struct, frozen=True, kw_only=True):
    acquires: int  # admissions decided by Redis
    errors: int  # admissions Redis could not decide (fail_open chose)
    flushes: int  # batches of charges and releases sent
    flush_errors: int  # batches that failed (kept for the next)
    pending: int  # subject sets with charges or releases not sent yet


class _Pending:
    __slots__ = ("holders", "tokens")

    def __init__(self) -> None:
        self.tokens = 0
        self.holders: list[str] = []


class RedisLimiter:
    """A :class:`router.admission.Limiter` whose decisions Redis makes; a
    supervised service (its task sends the batches)."""

    name = "ratelimit:redis"

    def __init__(self, policy: SharedRateLimitPolicy, url: str, *, pool: RedisPool | None = None) -> None:
        self.policy = policy
        self.options = policy.options
        self.pool = pool or RedisPool(url)
        self._limits: dict[str, Limits] = {}  # each subject's limits, as last admitted
        self._pending: dict[tuple[str, ...], _Pending] = {}
        self._counts = dict.fromkeys(("acquires", "errors", "flushes", "flush_errors"), 0)

    async def acquire(self, subjects: Sequence[tuple[str, Limits]], tokens: int, holder: str) -> RateDecision:
        self._limits.update(subjects)
        call = self.policy.acquire_call(subjects, tokens, holder)
        try:
            with trio.fail_after(self.options.timeout):
                (reply,) = await self.pool.scripts([call])
            if isinstance(reply, RedisError):
                raise reply
            if not isinstance(reply, list):
                raise RedisUnavailable(f"the acquire script answered {reply!r}")
            decision = self.policy.acquire_result(subjects, reply)
        except (RedisUnavailable, trio.TooSlowError, ValueError) as exc:
            self._counts["errors"] += 1
            log.warning("shared rate limits: Redis did not decide (%s); %s", exc,
                        "admitting" if self.options.fail_open else "refusing")  # fmt: skip
            return RateDecision(allowed=self.options.fail_open, retry_after=1.0)
        self._counts["acquires"] += 1
        return decision

    def charge(self, subjects: Sequence[str], tokens: int) -> None:
        self._pending_for(subjects).tokens += tokens

    def release(self, subjects: Sequence[str], holder: str) -> None:
        self._pending_for(subjects).holders.append(holder)

    def _pending_for(self, subjects: Sequence[str]) -> _Pending:
        key = tuple(subjects)
        found = self._pending.get(key)
        if found is None:
            self._pending[key] = found = _Pending()
        return found

    async def flush(self) -> None:
        """Send what is pending, one settle script per subject set, pipelined;
        what fails stays pending (merged with what comes meanwhile)."""
        if not self._pending:
            return
        batch, self._pending = self._pending, {}
        keys = list(batch)
        calls = [self.policy.settle_call([(s, self._limits.get(s, Limits())) for s in key], batch[key].tokens, batch[key].holders)
                 for key in keys]  # fmt: skip
        try:
            with trio.fail_after(self.options.timeout * 4):
                replies = await self.pool.scripts(calls)
            failed = [key for key, reply in zip(keys, replies, strict=True) if isinstance(reply, RedisError)]
        except (RedisUnavailable, trio.TooSlowError) as exc:
            log.warning("shared rate limits: a batch of %d did not reach Redis (%s); kept for the next", len(keys), exc)
            failed = keys
        self._counts["flushes"] += 1
        if failed:
            self._counts["flush_errors"] += 1
        for key in failed:
            pending = self._pending_for(key)
            pending.tokens += batch[key].tokens
            pending.holders += batch[key].holders

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            while True:
                await trio.sleep(self.options.flush_interval)
                await self.flush()
        finally:
            with trio.move_on_after(self.options.timeout * 4) as scope:
                scope.shield = True
                await self.flush()  # what the last requests left, before the router goes
                await self.pool.aclose()

    def crashed(self, exc: BaseException) -> None:
        log.error("shared rate limits: the batch sender crashed (%r); restarting it", exc)

    def statistics(self) -> RedisLimiterStatistics:
        return RedisLimiterStatistics(**self._counts, pending=len(self._pending))
