"""The routing-policy interface: what a picker sees, what it returns, and what it hears.

A policy is sans-I/O (see CONVENTIONS.md #1): the router hands it frozen
snapshots of the eligible backends and of the request, plus ``now``, and gets a
backend name back. It never awaits, never reads a clock, never touches a
socket, so the same object runs in the router, in the simulator
(``headrace simulate``) and in a unit test.

The one required method is :meth:`RoutingPolicy.pick`. A policy that keeps
state about backends (what they cache, what is on its way to them) also has
some of the *feedback* methods of :class:`RoutingFeedback` and
:class:`KVEventSink`; the router calls each one a policy has and skips the
ones it has not, so the two built-ins without state stay three lines long::

    router                                   policy
    ──────                                   ──────
    candidates, request, now ─────────────> pick() -> name
    stream started on name   ─────────────> on_dispatch(name, request, now)
    first token from name    ─────────────> on_first_token(name, request, now)
    stream ended             ─────────────> on_complete(name, request, now, ok, cached_tokens)
    engine KV events         ─────────────> on_kv_events(name, events, now) -> False on a gap
    (re)subscribing          <───────────── kv_since(name)
    engine restarted / gone  ─────────────> on_kv_reset(name)

Prefix keys: ``RouteRequest.block_hashes`` are the chained hashes of the
request's full KV blocks (``backends.base.hash_block`` over token ids, the
engine's own hashes; or, where the router has no tokenizer for the model,
over fixed-size blocks of the rendered prompt text). Both are stable across
processes, so two routers with the same config compute the same keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol, runtime_checkable

import msgspec

__all__ = [
    "BackendView",
    "KVEventSink",
    "KVEventView",
    "RouteRequest",
    "RoutingFeedback",
    "RoutingPolicy",
]


class BackendView(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of one backend as the router sees it at decision time.

    The router hands a policy the same object again while nothing in it has
    changed (a pick changes one backend's count), so a policy may skip what
    it read from a view it saw last time; it must be as right with new ones."""

    name: str
    in_flight: int = 0  # this router's streams on it (queued at the backend or running)
    healthy: bool = True
    draining: bool = False
    weight: float = 1.0
    models: frozenset[str] = frozenset()
    # Prompt tokens of this router's streams on it that have not had their
    # first token yet: the prefill work queued there (uncached estimate).
    pending_prefill_tokens: int = 0
    kv_events: bool = False  # publishes KV events (its cache is known, not guessed)
    block_size: int | None = None  # its KV block size, when known
    cache_blocks: int | None = None  # KV blocks its prefix cache holds at most, when known
    # A prompt sent while another with the same prefix is still prefilling
    # there finds that prefix cached (it prefills in arrival order and shares
    # what it is computing; vLLM computes it again).
    prefix_sharing: bool = False


class RouteRequest(msgspec.Struct, frozen=True, kw_only=True):
    """What a policy may know about a request (never its full body)."""

    request_id: str = ""
    model: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    prefix: str = ""  # the first characters of the rendered prompt, when there are no block hashes
    tenant: str = "default"
    priority: int = 0
    # Chained hashes of the prompt's full blocks, in order (see the module docstring).
    block_hashes: tuple[int, ...] = ()
    block_size: int = 0  # tokens per block (0: the hashes are of text blocks, or none)
    prompt_tokens: int = 0  # the prompt's length in tokens (estimated when not tokenized)
    affinity: str = ""  # requests with one key stay together (the dispatcher keeps them so; see router/dispatch.py)


class KVEventView(Protocol):
    """One KV event as an engine publishes it (``backends.base.KVEvent``)."""

    @property
    def seq(self) -> int: ...
    @property
    def kind(self) -> Literal["stored", "removed", "cleared"]: ...
    @property
    def block_hashes(self) -> tuple[int, ...]: ...


@runtime_checkable
class RoutingPolicy(Protocol):
    """Pick one of ``candidates`` (already filtered to healthy, non-draining
    backends serving the model) by name, or ``None`` to refuse."""

    def pick(self, candidates: Sequence[BackendView], request: RouteRequest, now: float) -> str | None: ...


class RoutingFeedback(Protocol):
    """Optional: what happened to the requests a policy placed. Each method is
    called only if the policy defines it."""

    def on_dispatch(self, backend: str, request: RouteRequest, now: float) -> None:
        """A stream of ``request`` started on ``backend`` (after :meth:`pick`,
        or on the retry the router chose after a failure)."""

    def on_first_token(self, backend: str, request: RouteRequest, now: float) -> None:
        """``backend`` sent the request's first token: its prefill is done."""

    def on_complete(
        self, backend: str, request: RouteRequest, now: float, *, ok: bool, cached_tokens: int | None
    ) -> None:
        """The stream ended (``ok``: with its final event). ``cached_tokens`` is
        what the backend reported as served from its prefix cache, when it did."""


class KVEventSink(Protocol):
    """Optional: a policy that indexes what engines cache. The backend's actor
    subscribes to its event stream from :meth:`kv_since` and delivers batches;
    a ``False`` from :meth:`on_kv_events` means the policy saw a gap (or a
    restart) and dropped that backend's entries: the actor resubscribes from
    :meth:`kv_since`, which is then -1 (everything the engine still keeps)."""

    def kv_since(self, backend: str) -> int: ...

    def on_kv_events(self, backend: str, events: Sequence[KVEventView], now: float) -> bool: ...

    def on_kv_reset(self, backend: str) -> None: ...
