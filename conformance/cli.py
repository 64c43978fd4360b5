"""``headrace conformance``: check a backend or the router over HTTP.

Exit status: 0 when no check failed (skips are fine), 1 when one did, 2 when
the target could not be probed at all or the arguments are wrong.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial

import httpx
import trio

from .http_suite import check_http, http_checks
from .runner import DEFAULT_TIMEOUT
from .target import CAPABILITIES, ProbeError

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="headrace conformance", description=__doc__.split("\n")[0])
    p.add_argument("--target", required=False, help="base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--api-key", help="sent as Authorization: Bearer KEY")
    p.add_argument("--model", help="model to use (default: the first of /v1/models)")
    p.add_argument("--only", help="comma-separated check names, prefixes or wildcards")
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    p.add_argument("--http", choices=("auto", "2", "1.1"), default="auto",
                   help="auto: HTTP/2 where TLS ALPN offers it; 2: HTTP/2 prior knowledge")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds per check")
    p.add_argument("--concurrency", type=int, default=8, help="parallel streams in load checks")
    p.add_argument("--burst", type=int, default=32, help="requests in the overload burst")
    p.add_argument("--grace", type=float, default=5.0,
                   help="seconds before capacity held by dropped streams counts as leaked")
    p.add_argument("--max-context", type=int, help="context length, when /v1/models omits it")
    p.add_argument("--without", action="append", default=[], choices=CAPABILITIES,
                   help="a capability the target does not honour (repeatable)")
    p.add_argument("--list", action="store_true", help="list the checks and exit")
    return p


def main(argv: list[str]) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.list:
        for check in http_checks():
            needs = f" [needs {', '.join(sorted(check.requires))}]" if check.requires else ""
            print(f"{check.name:<30} {check.doc}{needs}")
        return 0
    if not args.target:
        parser.error("--target is required")
    for name in ("concurrency", "burst", "timeout"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name} must be positive")
    run = partial(
        check_http, args.target, api_key=args.api_key, model=args.model, only=args.only,
        http=args.http, check_timeout=args.timeout, concurrency=args.concurrency, burst=args.burst,
        without=args.without, max_context=args.max_context, grace=args.grace,
    )
    try:
        report = trio.run(run)
    except (ProbeError, httpx.HTTPError, OSError) as exc:
        print(f"headrace conformance: cannot probe {args.target}: {exc}", file=sys.stderr)
        return 2
    print(report.format_table())
    if args.json:
        report.write_json(args.json)
    return 0 if report.ok else 1
