"""A refusal-latency probe in its own process (``python -m bench.refusal_probe``).

A load generator that keeps hundreds of streams open in one Python process
measures its own event-loop lag as much as the router: a refusal's bytes
wait behind every other stream's chunks before the client reads them. This
probe has nothing else to do. It sends requests the router should refuse at
arrival (by default ``X-Priority: batch`` with a 50 ms ``X-Deadline-Ms``,
which an overloaded fleet sheds), Poisson at ``--rate`` for ``--duration``
seconds on one HTTP/2 connection opened beforehand, and times each from
just before its HEADERS go out to its last byte. Prints one JSON document
on stdout: each answer's status, code, milliseconds and start (``at``:
``time.perf_counter()``, CLOCK_MONOTONIC on Linux, the same clock in
every process, so a trace of the router lines up with it). With
``--router-pid``, each answer also says how long, while it was out, this
probe's thread and the router's main thread waited for a CPU
(``/proc/.../schedstat``'s run-queue delay): on a box where the bed shares
two cores, that separates a router that was slow from one (or a client)
that was not running.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from typing import Any

import msgspec
import trio

from backends.h2client import H2Pool

__all__ = ["main", "probe"]


def run_queue_wait(pid: int | None) -> float:
    """Seconds a thread has waited for a CPU since it started (the run-queue
    delay in ``/proc/<pid>/task/<pid>/schedstat``; this thread's for None; 0 when unreadable)."""
    path = "/proc/thread-self/schedstat" if pid is None else f"/proc/{pid}/task/{pid}/schedstat"
    try:
        with open(path, "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


async def probe(url: str, *, key: str, rate: float, duration: float, deadline_ms: int, seed: int = 0,
                router_pid: int | None = None) -> list[dict[str, Any]]:  # fmt: skip
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body = msgspec.json.encode({"model": "m", "prompt": "probe", "max_tokens": 4, "stream": True})
    headers = [("authorization", f"Bearer {key}"), ("content-type", "application/json"),
               ("x-priority", "batch"), ("x-deadline-ms", str(deadline_ms))]  # fmt: skip
    rng = random.Random(seed)
    answers: list[dict[str, Any]] = []
    async with H2Pool(host, int(port)) as pool:
        await pool.request("GET", "/health")  # the connection is open before the first probe

        async def one() -> None:
            waits = (run_queue_wait(None), run_queue_wait(router_pid)) if router_pid else None
            began = time.perf_counter()
            with trio.move_on_after(30):
                async with pool.stream("POST", "/v1/completions", headers=headers, body=body) as resp:
                    data = b"".join([chunk async for chunk in resp])
                    ms = (time.perf_counter() - began) * 1000
                    code = None
                    if resp.status != 200:
                        try:
                            code = msgspec.json.decode(data)["error"]["code"]
                        except (msgspec.DecodeError, KeyError, TypeError):
                            code = f"http_{resp.status}"
                    answer = {"status": resp.status, "code": code, "ms": round(ms, 3), "at": began}
                    if waits is not None:
                        answer["probe_wait_ms"] = round((run_queue_wait(None) - waits[0]) * 1000, 3)
                        answer["router_wait_ms"] = round((run_queue_wait(router_pid) - waits[1]) * 1000, 3)
                    answers.append(answer)

        async with trio.open_nursery() as nursery:
            end = trio.current_time() + duration
            while trio.current_time() < end:
                nursery.start_soon(one)
                await trio.sleep(rng.expovariate(rate))
    return answers


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.refusal_probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True)
    p.add_argument("--key", required=True, help="the probing tenant's API key")
    p.add_argument("--rate", type=float, default=5.0, help="probes per second (Poisson)")
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--deadline-ms", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--router-pid", type=int, help="also note the router's main thread's run-queue wait per answer")
    p.add_argument("--cpus", help="run on these CPUs only (comma-separated)")
    args = p.parse_args(argv)
    if args.cpus:
        os.sched_setaffinity(0, [int(c) for c in args.cpus.split(",")])
    answers = trio.run(lambda: probe(args.url, key=args.key, rate=args.rate, duration=args.duration,
                                     deadline_ms=args.deadline_ms, seed=args.seed, router_pid=args.router_pid))  # fmt: skip
    sys.stdout.buffer.write(msgspec.json.encode({"answers": answers}) + b"\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
