"""Fixtures for the router's tests: a real PostgreSQL server
(tests/pgserver.py), and the job store on SQLite and on PostgreSQL."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from router.store import SQLiteStore
from tests.pgserver import PGServer, running_server

OpenStore = Callable[..., Any]


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PGServer]:
    """One server for the session (initdb takes a second or two), started on first use."""
    with running_server() as server:
        yield server


@pytest.fixture
def pg_url(pg_server: PGServer) -> Iterator[str]:
    """A fresh, empty database on that server, dropped afterwards."""
    name = pg_server.create_database()
    yield pg_server.url(name)
    pg_server.drop_database(name)


@pytest.fixture(params=["sqlite", "postgres"])
def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[OpenStore]:
    """Opens the store under test (``clock``, ``idempotency_ttl``, ``lease``
    as the constructors take them); each call opens the same database again."""
    opened: list[Any] = []
    if request.param == "sqlite":
        def open_(**options: Any) -> Any:
            opened.append(SQLiteStore(tmp_path / "jobs.db", **options))
            return opened[-1]
    else:
        url = request.getfixturevalue("pg_url")
        from router.store_pg import PostgresStore

        def open_(**options: Any) -> Any:
            opened.append(PostgresStore(url, **options))
            return opened[-1]
    yield open_
    for store in opened:
        store.close()
