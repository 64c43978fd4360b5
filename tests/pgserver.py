"""A real PostgreSQL server for tests: ``initdb`` in a temporary directory,
``postgres`` on a free port on 127.0.0.1 (its unix socket in that
directory too), one fresh database per test.

The binaries are looked for in $HEADRACE_PG_BIN, beside ``postgres`` on
PATH, then under /usr/lib/postgresql/*/bin (the Debian package, which
.ci/run installs as root), newest version first. PostgreSQL refuses to run
as root, so as root the server runs as an unprivileged user through
``setpriv``: ``postgres`` (the Debian package's) if it exists, else
``nobody``, else a system user ``headrace-pg`` created with ``useradd``.
Where no binaries are found, or they cannot start, the tests that need the
server skip and say why, unless $HEADRACE_REQUIRE_POSTGRES=1 (set by
.ci/run once it has the binaries), which turns the skip into a failure.

``fsync=off``: the tests kill routers, never the database's host, so
what they check does not depend on the server's own fsyncs.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

SUPERUSER = "headrace"


def pg_bin_dir() -> Path | None:
    candidates = [os.environ.get("HEADRACE_PG_BIN", "")]
    on_path = shutil.which("postgres")
    if on_path:
        candidates.append(str(Path(os.path.realpath(on_path)).parent))
    versions = glob.glob("/usr/lib/postgresql/*/bin")
    candidates += sorted(versions, key=lambda p: int(Path(p).parent.name) if Path(p).parent.name.isdigit() else 0, reverse=True)
    for candidate in filter(None, candidates):
        d = Path(candidate)
        if all(os.access(d / name, os.X_OK) for name in ("initdb", "postgres")):
            return d
    return None


def unprivileged_user() -> pwd.struct_passwd:
    """An unprivileged account to run the server as (we are root)."""
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "headrace-pg"],
                   check=True, capture_output=True)  # fmt: skip
    return pwd.getpwnam("headrace-pg")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def skip_or_fail(reason: str) -> None:
    if os.environ.get("HEADRACE_REQUIRE_POSTGRES") == "1":
        pytest.fail(f"PostgreSQL is required here (HEADRACE_REQUIRE_POSTGRES=1): {reason}")
    pytest.skip(reason)


@dataclass
class PGServer:
    host: str
    port: int
    root: Path

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{SUPERUSER}@{self.host}:{self.port}/{database}"

    def create_database(self) -> str:
        import psycopg

        name = "t_" + secrets.token_hex(6)
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"'.encode())
        return name

    def drop_database(self, name: str) -> None:
        import psycopg

        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'.encode())


@contextlib.contextmanager
def running_server() -> Iterator[PGServer]:
    """Start a server for the block (skipping, saying why, where none can start)."""
    try:
        import psycopg
    except ImportError as exc:  # not installed, or no libpq for its pure-Python build
        skip_or_fail(f"psycopg cannot be imported ({exc}): pip install -e '.[dev]' (and libpq5)")
    bindir = pg_bin_dir()
    if bindir is None:
        skip_or_fail("no PostgreSQL server binaries (initdb, postgres): install the Debian package postgresql "
                     "(.ci/run does, as root), or point HEADRACE_PG_BIN at their directory")  # fmt: skip
    assert bindir is not None
    root = Path(tempfile.mkdtemp(prefix="headrace-pg-"))
    prefix: list[str] = []
    if os.getuid() == 0:
        user = unprivileged_user()
        os.chown(root, user.pw_uid, user.pw_gid)
        prefix = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups", "--"]
    env = {**os.environ, "LC_ALL": "C", "HOME": str(root)}
    data, log = root / "data", root / "server.log"
    proc: subprocess.Popen[bytes] | None = None
    try:
        init = subprocess.run([*prefix, str(bindir / "initdb"), "-D", str(data), "-U", SUPERUSER, "--auth=trust",
                               "-E", "UTF8", "--no-sync", "--no-instructions"],
                              env=env, capture_output=True, cwd=root, check=False)  # fmt: skip
        if init.returncode != 0:
            skip_or_fail(f"initdb failed (exit {init.returncode}): {init.stderr.decode(errors='replace')[-500:]}")
        port = free_port()
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [*prefix, str(bindir / "postgres"), "-D", str(data), "-h", "127.0.0.1", "-p", str(port), "-k", str(root),
                 "-c", "fsync=off", "-c", "shared_buffers=16MB", "-c", "max_connections=60"],
                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=root,
            )  # fmt: skip
        server = PGServer("127.0.0.1", port, root)
        deadline = time.monotonic() + 30
        while True:
            try:
                psycopg.connect(server.url(), connect_timeout=2).close()
                break
            except psycopg.OperationalError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    tail = log.read_bytes().decode(errors="replace")[-800:]
                    skip_or_fail(f"postgres could not start (exit {proc.poll()}): {tail}")
                time.sleep(0.05)
        yield server
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # fast shutdown
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(root, ignore_errors=True)
