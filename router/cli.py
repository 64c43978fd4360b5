"""``headrace`` command line: one entry point, a subcommand per component.

Each subcommand lives with its component and exposes ``main(argv) -> int``;
this module only dispatches, importing lazily so ``headrace mock`` never pays
for importing torch, and holds the one logging setup the subcommands share
(:func:`configure_logging`).
"""

from __future__ import annotations

import importlib
import logging
import sys

__all__ = ["QUIET_LOGGERS", "configure_logging", "main"]

# Libraries that log every request at INFO (httpx: each upstream request and
# health probe): noise for operators and a cost on the hot path.
QUIET_LOGGERS = ("httpx", "httpcore")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("router.server", "the edge router"),
    "mock": ("backends.mock_server", "a deterministic OpenAI-compatible mock backend"),
    "engine": ("backends.engine.server", "the built-in torch engine as a server"),
    "bench": ("bench.cli", "open-loop load generator and benchmarks"),
    "conformance": ("conformance.cli", "check a backend or router against the API contract"),
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


def configure_logging(level: str | int = "INFO") -> None:
    """Log to stderr at ``level``, with chatty libraries held at WARNING."""
    logging.basicConfig(level=level, format=LOG_FORMAT, stream=sys.stderr)
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
    module = importlib.import_module(SUBCOMMANDS[name][0])
    result: int = module.main(rest)
    return result


if __name__ == "__main__":
    sys.exit(main())
