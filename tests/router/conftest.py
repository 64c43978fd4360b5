"""Fixtures for the router's tests: a real PostgreSQL server (tests/pgserver.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.pgserver import PGServer, running_server


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
