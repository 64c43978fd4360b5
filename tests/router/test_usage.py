"""The usage ledger (router/usage.py) on both job stores (a real SQLite file,
a real PostgreSQL server): rows per tenant, model and minute, added to by
several routers (one upsert per row), read back by tenant, model and time;
a batch the store refuses is kept and sent with the next."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from backends.base import Usage
from router.metrics import RouterMetrics
from router.store import StoreUnavailable
from router.usage import UsageLedger, UsageRow, UsageStore, open_usage_store
from tests.router.test_jobs_store import OpenStore, WallClock


def ledger(store: object, clock: WallClock) -> UsageLedger:
    ledger = UsageLedger(RouterMetrics(), clock=clock)
    ledger.attach(open_usage_store(store))  # type: ignore[arg-type]
    return ledger


async def test_rows_from_two_routers_add_up_per_tenant_model_and_minute(open_store: OpenStore) -> None:
    clock = WallClock()  # 1000.0: the minute starting at 960
    store = open_store(clock=clock)
    one, two = ledger(store, clock), ledger(open_store(clock=clock), clock)  # two routers, one database
    one.record("alice", "m", Usage(prompt_tokens=10, completion_tokens=5, gpu_seconds=0.25))
    two.record("alice", "m", Usage(prompt_tokens=7, completion_tokens=3, gpu_seconds=0.5))
    two.record("alice", "other-model", Usage(prompt_tokens=1, completion_tokens=1))
    one.record("bob", "m", Usage(prompt_tokens=2, completion_tokens=2, gpu_seconds=0.125))
    await one.flush()
    await two.flush()
    clock.now = 1030.0  # the next minute
    one.record("alice", "m", Usage(prompt_tokens=1, completion_tokens=1, gpu_seconds=1.0))
    await one.flush()
    assert one.store is not None
    rows = await one.store.usage(tenant="alice", model="m", since=0, until=2000, limit=100)
    assert rows == [UsageRow(tenant="alice", model="m", start=960.0, requests=2, prompt_tokens=17, generated_tokens=8, gpu_seconds=0.75),
                    UsageRow(tenant="alice", model="m", start=1020.0, requests=1, prompt_tokens=1, generated_tokens=1, gpu_seconds=1.0)]  # fmt: skip
    everyone = await one.store.usage(tenant=None, model=None, since=960, until=1020, limit=100)
    assert [(r.tenant, r.model, r.requests) for r in everyone] == [("alice", "m", 2), ("alice", "other-model", 1), ("bob", "m", 1)]
    assert await one.store.usage(tenant="carol", model=None, since=0, until=2000, limit=100) == []


class Refusing:
    """A usage store that refuses its first batch (the database was away)."""

    def __init__(self, inner: UsageStore) -> None:
        self.inner, self.refused = inner, 0

    async def add_usage(self, rows: Sequence[UsageRow]) -> None:
        if not self.refused:
            self.refused += 1
            raise StoreUnavailable("the job store is unavailable: OperationalError", retry_after=1.0)
        await self.inner.add_usage(rows)

    async def usage(self, **query: object) -> list[UsageRow]:
        return await self.inner.usage(**query)  # type: ignore[arg-type]


@pytest.mark.parametrize("open_store", ["sqlite"], indirect=True)
async def test_a_batch_the_store_refuses_is_kept_and_sent_with_the_next(open_store: OpenStore) -> None:
    clock = WallClock()
    book = ledger(open_store(clock=clock), clock)
    assert book.store is not None
    refusing = Refusing(book.store)
    book.attach(refusing)
    book.record("alice", "m", Usage(prompt_tokens=3, completion_tokens=4))
    await book.flush()  # refused: kept
    book.record("alice", "m", Usage(prompt_tokens=1, completion_tokens=1))
    await book.flush()
    rows = await refusing.usage(tenant="alice", model=None, since=0, until=2000, limit=10)
    assert [(r.requests, r.prompt_tokens, r.generated_tokens) for r in rows] == [(2, 4, 5)]
