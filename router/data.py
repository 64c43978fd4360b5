"""The data directory and what lives in it: the job store (SQLite), the
uploaded and written files, and the services and routes over them.

::

    --data-dir DIR  >  HEADRACE_DATA_DIR  >  [jobs] data_dir  >  [jobs] path's directory
                    >  $XDG_DATA_HOME/headrace  >  ~/.local/share/headrace
    DIR/headrace.db      jobs, batch items, batches, files, idempotency keys
    DIR/files/<id>.jsonl uploaded batch input, batch output and error files

The command line and the environment variable are applied by
``headrace serve`` (router/server.py) into ``[jobs] data_dir``; the
:class:`~router.app.Router` reads only its config.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

import msgspec

from backends.base import Backend
from frontend.context import Gate
from frontend.server import Handler
from router.batches import BatchesAPI, BatchRunner
from router.config import JobsConfig
from router.files import FilesAPI
from router.idempotency import Idempotency
from router.jobs import JobRunner, JobsAPI
from router.store import JobStore
from router.stores import open_stores

__all__ = ["DataServices", "default_data_dir", "open_data", "resolve_data_dir", "with_data_dir"]

ENV = "HEADRACE_DATA_DIR"


def default_data_dir(env: Mapping[str, str] = os.environ) -> Path:
    """The per-user default: ``$XDG_DATA_HOME/headrace``, else ``~/.local/share/headrace``."""
    base = env.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "headrace"


def with_data_dir(config: JobsConfig, flag: str | None, env: Mapping[str, str] = os.environ) -> JobsConfig:
    """``[jobs]`` with ``--data-dir`` (first) or ``HEADRACE_DATA_DIR`` applied: either turns jobs on."""
    chosen = flag or env.get(ENV) or None
    return config if chosen is None else msgspec.structs.replace(config, data_dir=chosen)


def resolve_data_dir(config: JobsConfig) -> tuple[Path, Path] | None:
    """``(data dir, database file)`` when jobs are on (``enabled``,
    ``data_dir`` or ``path`` set), else None; creates the directories."""
    if not (config.enabled or config.data_dir or config.path or config.store == "postgres"):
        return None
    if config.data_dir is not None:
        data_dir = Path(config.data_dir).expanduser()
    elif config.path is not None:
        data_dir = Path(config.path).expanduser().parent
    else:
        data_dir = default_data_dir()
    db = Path(config.path).expanduser() if config.path is not None else data_dir / "headrace.db"
    (data_dir / "files").mkdir(parents=True, exist_ok=True)
    db.parent.mkdir(parents=True, exist_ok=True)
    return data_dir, db


class DataServices(msgspec.Struct, kw_only=True):
    data_dir: Path
    store: JobStore
    jobs: JobRunner
    batches: BatchRunner
    idempotency: Idempotency
    routes: dict[tuple[str, str], Handler]


def open_data(config: JobsConfig, backend: Backend, gate: Gate, *, ready: Callable[[], bool], max_line_bytes: int) -> DataServices | None:
    """The store, runners and routes of the data directory, or None when jobs are off."""
    located = resolve_data_dir(config)
    if located is None:
        return None
    data_dir, db = located
    store, batch_store = open_stores(config, db)  # [jobs] store: SQLite (db) or PostgreSQL (router/stores.py)
    jobs = JobRunner(store, backend, config, gate=gate, ready=ready)
    batches = BatchRunner(batch_store, backend, data_dir / "files", config, max_line_bytes=max_line_bytes, jobs=jobs)
    idem = Idempotency(store)
    batch_routes = {k: idem.wrap(h) if k[0] == "POST" else h for k, h in BatchesAPI(batch_store, batches, config).routes().items()}
    routes = {
        **JobsAPI(store, jobs, backend, idem).routes(),
        **FilesAPI(batch_store, data_dir / "files", config, idem, batches.partial).routes(),
        **batch_routes,
    }
    return DataServices(data_dir=data_dir, store=store, jobs=jobs, batches=batches, idempotency=idem, routes=routes)
