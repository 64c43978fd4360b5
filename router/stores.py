"""The stores ``[jobs] store`` names: SQLite in the data directory (the
default: one host, its router processes sharing the file), or PostgreSQL at
``[jobs] url`` (router/store_pg.py: router replicas on several hosts sharing
one queue). psycopg is imported only for the latter (an optional extra)."""

from __future__ import annotations

from pathlib import Path

from router.batch_store import BatchStore, SQLiteBatchStore
from router.config import ConfigError, JobsConfig
from router.store import JobStore, SQLiteStore

__all__ = ["open_stores"]


def open_stores(config: JobsConfig, db: Path) -> tuple[JobStore, BatchStore]:
    """The job store and the batch store over it (blocking: connects and
    migrates). ``db``: the SQLite file, when that is the store."""
    if config.store == "postgres":
        try:
            from router.batch_store_pg import PostgresBatchStore
            from router.store_pg import PostgresStore
        except ImportError as exc:  # psycopg missing, or no libpq for its pure-Python build
            raise ConfigError(f"jobs: store = \"postgres\" needs psycopg ({exc}): pip install 'headrace[postgres]'") from None
        if config.url is None:
            raise ConfigError('jobs: store = "postgres" needs jobs.url')
        pg = PostgresStore(config.url, idempotency_ttl=config.idempotency_ttl, pool_size=config.pool_size,
                           timeout=config.store_timeout)  # fmt: skip
        return pg, PostgresBatchStore(pg)
    sqlite = SQLiteStore(db, idempotency_ttl=config.idempotency_ttl)
    return sqlite, SQLiteBatchStore(sqlite)
