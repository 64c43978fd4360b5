"""``headrace`` command line: one entry point, a subcommand per component.

Each subcommand lives with its component and exposes ``main(argv) -> int``
(or the function a ``module:function`` entry names); this module only
dispatches, importing lazily so ``headrace mock`` never pays for importing
torch, and holds the one logging setup the subcommands share
(:func:`configure_logging`). ``headrace policies`` is small enough to live
here: policies/ stays free of printing, and the registry answers the question.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Iterable
from importlib.metadata import EntryPoint

__all__ = ["QUIET_LOGGERS", "configure_logging", "main", "policies_main"]

# Libraries that log every request at INFO (httpx: each upstream request and
# health probe): noise for operators and a cost on the hot path.
QUIET_LOGGERS = ("httpx", "httpcore")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("router.server", "the edge router"),
    "mock": ("backends.mock_server", "a deterministic OpenAI-compatible mock backend"),
    "engine": ("backends.engine.server", "the built-in torch engine as a server"),
    "bench": ("bench.cli", "open-loop load generator and benchmarks"),
    "simulate": ("sim.cli", "routing policies against modelled backends, in virtual time"),
    "plan": ("sim.plan", "replicas needed for a target p99 (M/M/c, Erlang C; --measure a live backend)"),
    "conformance": ("conformance.cli", "check a backend or router against the API contract"),
    "policies": ("router.cli:policies_main", "list the installed policies by kind, with their packages"),
    "top": ("router.top", "live latency breakdown per backend, from a router's admin listener"),
}


def _usage() -> str:
    lines = ["usage: headrace <command> [options]", "", "commands:"]
    lines += [f"  {name:<12} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "Run `headrace <command> --help` for the options of one command."]
    return "\n".join(lines)


def quiet_libraries() -> None:
    """Only warnings and errors from :data:`QUIET_LOGGERS`, whatever the level."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def configure_logging(level: str | int = "INFO", fmt: str = "text") -> None:
    """Log to stderr at ``level``, with chatty libraries held at WARNING;
    ``fmt="json"``: every line one JSON object (router/logs.py)."""
    logging.basicConfig(level=level, format=LOG_FORMAT, stream=sys.stderr)
    if fmt == "json":
        from router.logs import JsonFormatter

        for handler in logging.getLogger().handlers:
            handler.setFormatter(JsonFormatter())
    quiet_libraries()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in {"-h", "--help"}:
        print(_usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"headrace: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    quiet_libraries()  # also for subcommands that configure no logging of their own
    module_name, _, function = SUBCOMMANDS[name][0].partition(":")
    module = importlib.import_module(module_name)
    result: int = getattr(module, function or "main")(rest)
    return result


def policies_main(argv: list[str], entry_points: Iterable[EntryPoint] | None = None) -> int:
    """``headrace policies``: every kind, then each policy of it with the
    package that provides it (built-ins: headrace) and its factory."""
    from policies.registry import KINDS, PolicyError, group, installed

    parser = argparse.ArgumentParser(prog="headrace policies", description=policies_main.__doc__)
    parser.add_argument("--json", action="store_true", help="one JSON array of {kind, name, package, value, builtin, summary}")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    try:
        rows = installed(entry_points)
    except PolicyError as exc:
        print(f"headrace policies: {exc}", file=sys.stderr)
        return 1
    if args.json:
        import msgspec

        print(msgspec.json.encode(rows).decode())
        return 0
    width = max((len(r.name) for r in rows), default=0)
    pkg_width = max((len(r.package) for r in rows), default=0)
    for kind in KINDS.values():
        print(f"{kind.name}: {kind.summary} [{group(kind.name)}]")
        mine = [r for r in rows if r.kind == kind.name]
        for r in mine:
            print(f"  {r.name:<{width}}  {r.package:<{pkg_width}}  {r.summary or r.value}")
        if not mine:
            print("  (none installed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
