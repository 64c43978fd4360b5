"""``headrace serve``: parse flags, load the config, run the router.

Startup prints ``headrace listening on <url>`` (tests started with
``--port 0`` read the port from it), then ``headrace admin on <url>``: the
admin listener, which alone serves ``/metrics`` and ``/admin/*`` (with
``/health`` and ``/ready``), on ``[server] admin_host`` (127.0.0.1) and
``admin_port`` (the main port + 1; a free port when the main one is 0). A
non-loopback admin host needs ``[auth] admin_sha256`` and, when the main
listener has TLS, serves TLS with the same certificate. With workers, SIGHUP
to the supervisor is passed on to each worker. SIGTERM or SIGINT
starts a graceful drain: the listeners close at once, streams in flight run
on for up to ``--drain-timeout`` seconds, then everything is cancelled and
the backend clients are closed. With TLS, SIGHUP re-reads the certificate
files: new connections get the new certificate, open ones keep theirs;
without TLS it is logged and ignored (never the default action, exit). A bad
config exits with status 2 and one clear line.

``--workers N`` (``[server] workers``; default one per core) runs N router
processes on the port under a supervisor (router/workers.py); ``--workers 1``
is one process, as before. A worker is this same command, started by the
supervisor with the hidden ``--worker-config`` and ``--worker-index``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import ipaddress
import logging
import os
import shlex
import signal
import ssl
import sys
import time
from functools import partial
from pathlib import Path

import msgspec
import trio

from frontend.serving import (
    Limits,
    ServeOptions,
    os_error_in,
    reload_on_sighup,
    reserve_port,
    serve,
    wait_for_signal,
)
from frontend.tls import server_context
from policies.base import RoutingPolicy
from policies.registry import PolicyError, create_policy
from router.admin_fanout import PEERS_ENV, FanOut, publish_peer
from router.app import OPS_PATHS, Router
from router.config import (
    BackendSpec,
    ConfigError,
    EngineSpec,
    RouterConfig,
    apply_settings,
    decode_config,
    load_config,
    with_overrides,
)
from router.data import with_data_dir
from router.engines import EngineManager, default_engines
from router.factory import build_backends
from router.workers import WorkerFailed, serve_workers, watch_parent

__all__ = ["admin_options_for", "main", "options_for", "parse_args", "run_router", "worker_count"]

log = logging.getLogger("headrace")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="headrace serve", description="Run the headrace edge router.")
    p.add_argument("--config", help="TOML configuration file")
    p.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to listen on; 0 picks a free one (default 8000)")
    p.add_argument("--backend", action="append", metavar="URL", help="an OpenAI-compatible backend; repeat for more (replaces [[backends]])")
    p.add_argument("--policy", help="routing policy name (default kv_aware: prefix- and KV-cache-aware)")
    p.add_argument("--certfile", help="TLS certificate (PEM); serves HTTP/2 over TLS with ALPN")
    p.add_argument("--keyfile", help="TLS private key (PEM)")
    p.add_argument("--drain-timeout", type=float, help="seconds streams may run on after SIGTERM (default 30)")
    p.add_argument("--data-dir", help="jobs, files and batches live here (also HEADRACE_DATA_DIR, [jobs] data_dir)")
    p.add_argument("--workers", type=int, help="router processes sharing the port (SO_REUSEPORT); default one per core")
    p.add_argument(
        "--engine-args",
        default="",
        help="extra arguments for the local engine replicas started when no backend is configured, e.g. '--dtype bfloat16'",
    )
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument("--log-format", choices=["text", "json"], help="json: one JSON object per log line, and a line per request ([logging] format)")
    p.add_argument(
        "--set", dest="settings", action="append", default=[], metavar="SECTION.FIELD=VALUE",
        help="override any config field, e.g. --set routing.max_attempts=5 --set 'backends.0.options.http=\"1.1\"' (repeatable; applied last)",
    )
    # Set by the worker supervisor only: the whole config, and this worker's number.
    p.add_argument("--worker-config", help=argparse.SUPPRESS)
    p.add_argument("--worker-index", type=int, default=0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    config = load_config(args.config)
    config = with_overrides(
        config,
        host=args.host,
        port=args.port,
        certfile=args.certfile,
        keyfile=args.keyfile,
        drain_timeout=args.drain_timeout,
        workers=args.workers,
    )
    if args.backend:
        backends = tuple(BackendSpec(url=url, kind="openai", name=f"backend-{i}") for i, url in enumerate(args.backend))
        config = with_overrides(config, backends=backends)
    if args.policy:
        config = with_overrides(config, policy=args.policy)
    # --data-dir, else HEADRACE_DATA_DIR, over [jobs] data_dir: either turns jobs, files and batches on.
    config = msgspec.structs.replace(config, jobs=with_data_dir(config.jobs, args.data_dir))
    if args.log_format:
        config = msgspec.structs.replace(config, logging=msgspec.structs.replace(config.logging, format=args.log_format))
    return apply_settings(config, args.settings)


def worker_config(path: str) -> RouterConfig:
    """The config the supervisor wrote for its workers (JSON)."""
    try:
        with open(path, "rb") as f:
            return decode_config(msgspec.json.decode(f.read()))
    except (OSError, msgspec.DecodeError) as exc:
        raise ConfigError(f"cannot read worker config {path}: {exc}") from None


def worker_count(config: RouterConfig) -> int:
    """``[server] workers``, or one per core."""
    return config.server.workers or os.cpu_count() or 1


def _limits(config: RouterConfig) -> Limits:
    s = config.server
    return Limits(
        max_concurrent_streams=s.max_concurrent_streams,
        stream_buffer_bytes=s.stream_buffer_bytes,
        connection_buffer_bytes=s.connection_buffer_bytes,
        write_stall_timeout=s.write_stall_timeout,
        reset_burst=s.reset_burst,
        reset_rate=s.reset_rate,
        max_connections=s.max_connections,
        max_connections_per_client=s.max_connections_per_client,
        reserved_connections=s.reserved_connections,
        reserved_paths=OPS_PATHS,
    )


def options_for(config: RouterConfig, *, reuse_port: bool = False) -> ServeOptions:
    """The main listener."""
    s = config.server
    return ServeOptions(
        s.host,
        s.port,
        certfile=s.certfile,
        keyfile=s.keyfile,
        graceful_timeout=s.drain_timeout,
        keep_alive_timeout=s.keep_alive_timeout,
        keep_alive_max_requests=s.keep_alive_max_requests,
        access_log=s.access_log,
        reuse_port=reuse_port,
        limits=_limits(config),
        h2_ingress=s.h2_ingress,
    )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def admin_port(config: RouterConfig) -> int:
    """``[server] admin_port``, or the main port + 1 (0, a free port, when the main port is 0)."""
    s = config.server
    port = s.admin_port if s.admin_port is not None else (s.port + 1 if s.port else 0)
    if port > 65535:
        raise ConfigError(f"server.admin_port: the main port + 1 is {port}; set server.admin_port")
    if port and port == s.port and (s.admin_host == s.host or s.host in ("0.0.0.0", "::")):
        raise ConfigError("server.admin_port: the admin listener needs a port of its own")
    return port


def admin_options_for(config: RouterConfig, *, reuse_port: bool = False) -> ServeOptions:
    """The admin listener (/metrics, /admin/*): loopback unless the config
    has an admin key; TLS like the main listener's when it is not loopback."""
    s = config.server
    loopback = is_loopback(s.admin_host)
    if not loopback and config.auth.admin_sha256 is None:
        raise ConfigError(
            f"server.admin_host {s.admin_host!r} is not a loopback address: set auth.admin_sha256 "
            "(the admin key's SHA-256: printf %s KEY | sha256sum) or keep the admin listener on 127.0.0.1"
        )
    return ServeOptions(
        s.admin_host,
        admin_port(config),
        certfile=None if loopback else s.certfile,
        keyfile=None if loopback else s.keyfile,
        graceful_timeout=s.drain_timeout,
        keep_alive_timeout=s.keep_alive_timeout,
        access_log=s.access_log,
        reuse_port=reuse_port,
        limits=dataclasses.replace(_limits(config), reserved_connections=0),
    )


async def run_router(
    router: Router,
    options: ServeOptions,
    *,
    shutdown: trio.Event,
    admin: ServeOptions | None = None,
    admin_app: FanOut | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the actors and serve HTTP until ``shutdown`` is set and the drain
    is over; ``task_status.started`` gets the main listener's URL. With
    ``admin``, the main listener serves ``router.public`` and the admin one
    ``router.admin`` (its URL in ``router.admin_url``); without, one
    listener serves every route."""
    async with trio.open_nursery() as nursery:
        await nursery.start(router.run)
        nursery.start_soon(router.metrics.run_mirror)  # returns at once unless several workers share metrics
        async with trio.open_nursery() as http:
            if admin is not None:
                app = admin_app if admin_app is not None else router.admin
                router.admin_url = await http.start(partial(serve, app, admin, shutdown=shutdown))
            url = await http.start(partial(serve, router.public if admin is not None else router, options, shutdown=shutdown))
            task_status.started(url)
        nursery.cancel_scope.cancel()


async def _serve_until_signal(
    config: RouterConfig, policy: RoutingPolicy, engine_args: list[str], *, worker: int | None = None
) -> None:
    """One router process: on its own, or as worker ``worker`` of a supervisor."""
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait_for_signal, shutdown)
        if worker is not None:
            nursery.start_soon(watch_parent, shutdown)
        engines = None
        if config.engines or not config.backends:  # [[engines]], or nothing: local replicas (router/engines.py)
            engines = EngineManager(config.engines or default_engines(), engine_args)
            specs = await engines.start(nursery)
            config = msgspec.structs.replace(config, backends=(*config.backends, *specs), engines=())
        router = Router(config, build_backends(config), policy=policy)
        if engines is not None:
            engines.attach(router)  # warm replicas drained; /admin/engines
        if worker is not None:
            router.metrics.set_worker(worker)
        options = options_for(config, reuse_port=worker is not None)
        admin = admin_options_for(config, reuse_port=worker is not None)
        nursery.start_soon(reload_on_sighup, options, admin)  # also without TLS: SIGHUP must not kill
        peers = os.environ.get(PEERS_ENV)
        fanout = FanOut(router.admin, Path(peers), worker) if worker is not None and peers else None
        async with trio.open_nursery() as inner:
            url = await inner.start(partial(run_router, router, options, shutdown=shutdown, admin=admin, admin_app=fanout))
            if fanout is not None:  # this worker's own admin port, for the others to pass changes on to
                private = ServeOptions("127.0.0.1", 0, graceful_timeout=admin.graceful_timeout,
                                       keep_alive_timeout=admin.keep_alive_timeout, limits=admin.limits)  # fmt: skip
                publish_peer(fanout.peers, fanout.index, await inner.start(partial(serve, router.admin, private, shutdown=shutdown)))
            freeze_startup_heap()
            print(f"headrace listening on {url}", flush=True)
            if worker is None:  # the supervisor prints the workers' shared one
                print(f"headrace admin on {router.admin_url}", flush=True)
        nursery.cancel_scope.cancel()
    log.info("headrace stopped")


# (young, middle, oldest): CPython's are (700, 10, 10). See freeze_startup_heap.
SERVING_GC_THRESHOLDS = (10_000, 10, 10)


def freeze_startup_heap() -> None:
    """Move everything alive once serving starts (modules, config, actors:
    the bulk of the heap) out of the cyclic collector's reach.

    A full collection walks every tracked object, and in ``headrace bench
    overload`` the router's took 44-106 ms, three times in 35 s, each a
    pause for every request (the refusals' p99 followed them). What is
    frozen is never freed, so collect first, once.

    Then the youngest generation is collected after 10,000 net allocations
    of tracked objects instead of CPython's 700 (:data:`SERVING_GC_THRESHOLDS`).
    Requests in flight keep thousands of young objects alive (32 streams:
    ~7,000), so at 700 the collector ran every few requests and walked them
    each time: under h2load -c 32 against two mocks, 2,093 young, 190 middle
    and 17 full collections in 10 s took 0.58 s, 5.8% of the router's CPU
    (gc callbacks timed); at 10,000, one young collection in those 10 s.
    Most of what a request allocates is freed by its reference count and
    never reaches the threshold; cyclic garbage waits longer, bounded by
    the threshold (tests/router/test_config.py compares the dead cycles
    waiting with CPython's). That needs the hot paths to make none: before
    broken streams and closed connections stopped leaving cycles
    (backends.errors.drop_tracebacks, frontend/hardening.py's _dismantle), this
    threshold took ``headrace bench chaos``'s idle RSS growth from +16% to
    +34%; with them, +3.4% at 10,000 and +3.8% at 700.

    The oldest generation's threshold stays CPython's. Raising it (700, 3,
    300, to spare the full collections a router's requests in flight
    trigger by their promotions) made the refusals no faster on a quiet box
    (probe p99 5.6-6.8 ms with CPython's, 6.0-8.8 with those) and let the
    cycles of requests that outlive the young collections pile up in the
    oldest generation: in ``headrace bench chaos`` the router's idle RSS
    went 73 -> 125 MiB (+71%) against 73 -> 87 MiB (+18%) with CPython's."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*SERVING_GC_THRESHOLDS)


async def _supervise_until_signal(config: RouterConfig, workers: int, engine_args: list[str], log_level: str) -> int:
    """Several router processes (router/workers.py); the exit status."""
    shutdown = trio.Event()
    status = 0
    try:
        # The admin port, held here (SO_REUSEPORT, not listening) so that every
        # worker binds the same one, as they do the main port.
        s = config.server
        with reserve_port(s.admin_host, admin_port(config)) as held:
            config = with_overrides(config, admin_port=held.getsockname()[1])
            async with trio.open_nursery() as nursery:
                nursery.start_soon(wait_for_signal, shutdown)
                nursery.start_soon(_forward_sighup_to_workers)
                start_backends = partial(start_replicas, engine_args=engine_args, engines=config.engines)
                config = msgspec.structs.replace(config, engines=())  # started here, not by each worker

                async def run_workers(task_status: trio.TaskStatus[str]) -> None:
                    await serve_workers(config, workers, start_backends=start_backends, shutdown=shutdown,
                                        log_level=log_level, task_status=task_status)  # fmt: skip
                    nursery.cancel_scope.cancel()  # the workers are done: so are the signal receivers

                url = await nursery.start(run_workers)
                print(f"headrace listening on {url}", flush=True)
                host = f"[{s.admin_host}]" if ":" in s.admin_host else s.admin_host
                scheme = "https" if admin_options_for(config).certfile is not None else "http"
                print(f"headrace admin on {scheme}://{host}:{config.server.admin_port}", flush=True)
                log.info("%d router workers serving %s", workers, url)
    except* (WorkerFailed, OSError) as group:  # OSError: the port is taken
        for exc in group.exceptions:
            log.error("headrace serve: %s", exc)
        status = 1
    log.info("headrace stopped")
    return status


async def _forward_sighup_to_workers() -> None:
    """SIGHUP to the supervisor: every worker re-reads its certificate (the
    workers run in sessions of their own, so they do not get it otherwise;
    engine replicas, which do not reload, are left alone)."""
    with trio.open_signal_receiver(signal.SIGHUP) as signals:
        async for _ in signals:
            for pid in _worker_pids():
                try:
                    os.kill(pid, signal.SIGHUP)
                except ProcessLookupError:
                    pass


def _worker_pids() -> list[int]:
    """This process's children started with ``--worker-config`` (from /proc)."""
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == me and b"\0--worker-config\0" in cmdline:
            found.append(int(entry))
    return found


async def start_replicas(nursery: trio.Nursery, engine_args: list[str], engines: tuple[EngineSpec, ...] = ()) -> list[BackendSpec]:
    """Start the replicas that serve of each ``[[engines]]`` entry (none: the
    default two) in ``nursery``, which owns their processes; their specs once
    all serve. For ``--workers N``: no warm pool (router/engines.py)."""
    if any(spec.warm for spec in engines):
        log.warning("[[engines]] warm pools and /admin/engines need --workers 1; starting the serving replicas only")
    return await EngineManager(engines or default_engines(), engine_args).start(nursery, serving_only=True)


def _check_certificate(certfile: str, keyfile: str) -> None:
    try:
        server_context(certfile, keyfile)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"server.certfile/keyfile: cannot load {certfile} with {keyfile}: {exc}") from None


def main(argv: list[str]) -> int:
    try:
        args = parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else 2
    # Imported here: router/__init__ imports this module, and importing
    # router.cli with it would make ``python -m router.cli`` warn.
    from router.cli import configure_logging

    configure_logging(args.log_level)
    try:
        config = worker_config(args.worker_config) if args.worker_config else config_from_args(args)
        policy = create_policy(config.routing.policy, options=config.routing.options)
        build_backends(config)  # validate adapter settings before anything starts
        admin_options_for(config)  # the admin listener's address and key
        if config.engines and config.backends and worker_count(config) > 1:
            raise ConfigError("engines: with [[backends]] too, [[engines]] needs --workers 1 (workers start replicas only when no backend is configured)")
        if config.server.certfile is not None and config.server.keyfile is not None:
            _check_certificate(config.server.certfile, config.server.keyfile)
    except (ConfigError, PolicyError) as exc:
        print(f"headrace serve: {exc}", file=sys.stderr)
        return 2
    if config.logging.format == "json":
        configure_logging(args.log_level, "json")  # [logging] format, known once the config is read
    engine_args = shlex.split(args.engine_args)
    if not args.worker_config and (config.engines or not config.backends):
        try:  # the replicas' models exist and fit in the memory left (router/engines.py)
            EngineManager(config.engines or default_engines(), engine_args).check_placement(time.monotonic(), serving_only=worker_count(config) > 1)
        except ConfigError as exc:
            print(f"headrace serve: {exc}", file=sys.stderr)
            return 2
    if args.worker_config:
        trio.run(partial(_serve_until_signal, config, policy, [], worker=args.worker_index))
        return 0
    workers = worker_count(config)
    if workers == 1:
        return _serve_one(config, policy, engine_args)
    status: int = trio.run(_supervise_until_signal, config, workers, engine_args, args.log_level)
    return status


def _serve_one(config: RouterConfig, policy: RoutingPolicy, engine_args: list[str]) -> int:
    """The router in this process (one worker): 1, logged in a line as the
    supervisor of several logs it, when a port is taken (the main
    listener's, or the admin one's, by default the main + 1), not a
    traceback."""
    try:
        trio.run(_serve_until_signal, config, policy, engine_args)
    except (OSError, BaseExceptionGroup) as exc:
        error = os_error_in(exc)
        if error is None:
            raise
        s = config.server
        log.error("headrace serve: %s (the listener on %s:%d, or the admin one on %s:%d: [server] admin_port)",
                  error, s.host, s.port, s.admin_host, admin_port(config))  # fmt: skip
        return 1
    return 0
