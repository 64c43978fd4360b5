"""``headrace top``: the router's live latency breakdown per backend.

Polls ``GET /admin/breakdown`` on the router's admin listener (router/breakdown.py)
every ``--interval`` seconds and redraws one table: per backend, streams in
flight, requests per second and the error share over the last 10 s, and the
p50/p99 of each phase of the last minute's requests (ms), so a p99 that moved
shows where it moved: the client's upload (ingress), the router's queue,
failed attempts (connect), the backend's prefill, decode, or the relay
(egress). ``--once`` prints the table once and exits (scripts, tests)::

    headrace top --admin http://127.0.0.1:8001
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import httpx

__all__ = ["main", "render"]

CLEAR = "\x1b[H\x1b[2J"


def render(data: dict[str, Any], url: str) -> str:
    """The table for one ``/admin/breakdown`` answer."""
    phases: list[str] = data.get("phases", [])
    head = ["BACKEND", "INFLIGHT", "RPS", "ERR%", "REQS"] + [f"{p.upper()} p50/p99" for p in phases]
    rows = [head]
    for b in data.get("backends", []):
        cells = [b["backend"], str(b["in_flight"]), f"{b['rps']:.1f}", f"{100 * b['error_rate']:.1f}", str(b["requests"])]
        for p in phases:
            q = b["phases"].get(p)
            cells.append(f"{_ms(q['p50'])}/{_ms(q['p99'])}" if q else "-")
        rows.append(cells)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [f"headrace top  {url}  phases over {data.get('window_s', 0):g} s, ms  {time.strftime('%H:%M:%S')}"]
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))) for r in rows]
    if len(rows) == 1:
        lines.append("(no requests yet)")
    return "\n".join(lines)


def _ms(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 1 else f"{value:.2f}"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="headrace top", description="live latency breakdown per backend (GET /admin/breakdown)")
    parser.add_argument("--admin", default="http://127.0.0.1:8001", help="the router's admin URL ('headrace admin on URL'; default %(default)s)")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    parser.add_argument("--once", action="store_true", help="print the table once and exit")
    parser.add_argument("--key-env", default="HEADRACE_ADMIN_KEY", help="environment variable holding the admin key, if the router wants one")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    key = os.environ.get(args.key_env)
    headers = {"authorization": f"Bearer {key}"} if key else {}
    url = args.admin.rstrip("/")
    try:
        return _loop(url, headers, args.interval, args.once)
    except KeyboardInterrupt:
        return 0


def _loop(url: str, headers: dict[str, str], interval: float, once: bool) -> int:
    with httpx.Client(base_url=url, headers=headers, timeout=5) as client:
        while True:
            try:
                r = client.get("/admin/breakdown")
                r.raise_for_status()
                table = render(r.json(), url)
            except (httpx.HTTPError, ValueError) as exc:
                print(f"headrace top: {url}/admin/breakdown: {exc}", file=sys.stderr)
                if once:
                    return 1
                table = ""
            if once:
                print(table)
                return 0
            if table:
                sys.stdout.write(CLEAR + table + "\n")
                sys.stdout.flush()
            time.sleep(interval)
