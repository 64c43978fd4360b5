"""``headrace`` command line: one entry point, a subcommand per component.

Each subcommand lives with its component and exposes ``main(argv) -> int``;
this module only dispatches, importing lazily so ``headrace mock`` never pays
for importing torch.
"""

from __future__ import annotations

import importlib
import sys

__all__ = ["main"]

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


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in {"-h", "--help"}:
        print(_usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"headrace: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    result: int = module.main(rest)
    return result


if __name__ == "__main__":
    sys.exit(main())
