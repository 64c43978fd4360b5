"""``headrace serve``: parse flags, load the config, run the router.

Startup prints ``headrace listening on <url>`` (tests started with
``--port 0`` read the port from it). SIGTERM or SIGINT starts a graceful
drain: the listener closes at once, streams in flight run on for up to
``--drain-timeout`` seconds, then everything is cancelled and the backend
clients are closed. A bad config exits with status 2 and one clear line.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from functools import partial

import trio

from backends.serving import ServeOptions, serve, wait_for_signal
from policies.base import RoutingPolicy
from policies.registry import PolicyError, create_policy
from router.app import Router
from router.config import BackendSpec, ConfigError, RouterConfig, load_config, with_overrides
from router.factory import DEFAULT_REPLICAS, build_backends, default_backends
from router.replicas import EngineReplica

__all__ = ["main", "options_for", "parse_args", "run_router"]

log = logging.getLogger("headrace")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="headrace serve", description="Run the headrace edge router.")
    p.add_argument("--config", help="TOML configuration file")
    p.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to listen on; 0 picks a free one (default 8000)")
    p.add_argument("--backend", action="append", metavar="URL", help="an OpenAI-compatible backend; repeat for more (replaces [[backends]])")
    p.add_argument("--policy", help="routing policy name (default round_robin)")
    p.add_argument("--certfile", help="TLS certificate (PEM); serves HTTP/2 over TLS with ALPN")
    p.add_argument("--keyfile", help="TLS private key (PEM)")
    p.add_argument("--drain-timeout", type=float, help="seconds streams may run on after SIGTERM (default 30)")
    p.add_argument(
        "--engine-args",
        default="",
        help="extra arguments for the local engine replicas started when no backend is configured, e.g. '--dtype bfloat16'",
    )
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
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
    )
    if args.backend:
        backends = tuple(BackendSpec(url=url, kind="openai", name=f"backend-{i}") for i, url in enumerate(args.backend))
        config = with_overrides(config, backends=backends)
    if args.policy:
        config = with_overrides(config, policy=args.policy)
    return config


def options_for(config: RouterConfig) -> ServeOptions:
    s = config.server
    return ServeOptions(
        s.host, s.port, certfile=s.certfile, keyfile=s.keyfile, graceful_timeout=s.drain_timeout, access_log=s.access_log
    )


async def run_router(
    router: Router,
    options: ServeOptions,
    *,
    shutdown: trio.Event,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the actors and serve HTTP until ``shutdown`` is set and the drain
    is over; ``task_status.started`` gets the bound URL."""
    async with trio.open_nursery() as nursery:
        await nursery.start(router.run)
        async with trio.open_nursery() as http:
            url = await http.start(partial(serve, router, options, shutdown=shutdown))
            task_status.started(url)
        nursery.cancel_scope.cancel()


async def _serve_until_signal(config: RouterConfig, policy: RoutingPolicy, engine_args: list[str]) -> None:
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait_for_signal, shutdown)
        if not config.backends:
            urls = await start_replicas(nursery, engine_args)
            config = with_overrides(config, backends=default_backends(urls))
        router = Router(config, build_backends(config), policy=policy)
        async with trio.open_nursery() as inner:
            url = await inner.start(partial(run_router, router, options_for(config), shutdown=shutdown))
            print(f"headrace listening on {url}", flush=True)
        nursery.cancel_scope.cancel()
    log.info("headrace stopped")


async def start_replicas(nursery: trio.Nursery, engine_args: list[str], n: int = DEFAULT_REPLICAS) -> list[str]:
    """Start ``n`` local engine replicas at once (each in ``nursery``, which
    owns their processes) and return their URLs once all are serving."""
    threads = max(1, (os.cpu_count() or 1) // n)
    replicas = [EngineReplica(f"engine-{i}", ["--threads", str(threads), *engine_args]) for i in range(n)]
    urls = [""] * n
    log.info("starting %d engine replicas on the default model (first start loads the model)", n)

    async def start(i: int) -> None:
        urls[i] = await nursery.start(replicas[i].run)

    async with trio.open_nursery() as starting:
        for i in range(n):
            starting.start_soon(start, i)
    return urls


def main(argv: list[str]) -> int:
    try:
        args = parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else 2
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        config = config_from_args(args)
        policy = create_policy(config.routing.policy)
        build_backends(config)  # validate adapter settings before anything starts
    except (ConfigError, PolicyError) as exc:
        print(f"headrace serve: {exc}", file=sys.stderr)
        return 2
    trio.run(_serve_until_signal, config, policy, shlex.split(args.engine_args))
    return 0
