"""``python -m bench.task_steps``: how many Trio task steps the router takes
from a request's arrival to its first response byte.

Under load each step that waits on another (a task started, a channel read,
a socket read) waits for the scheduler's next batch, behind every other
runnable task: the TTFT the router adds at a given rate is about the steps
on that path times the batch time. This counts them, unloaded, so a change
to the request path can be judged by the steps it adds or removes; the wall
time beside the count is not the point (it includes the mock).

The router runs in this process (an instrument sees its tasks' steps), in
front of one ``headrace mock`` process (``--tpot-ms 0``) over HTTP/2 (the
router's real upstream client); the client is a raw h2 connection in this
process's main task, whose own steps are not counted. Prints a table and
writes JSON (``--json``)::

    python -m bench.task_steps                   # 20 requests, after 3 to warm up
    python -m bench.task_steps --rounds 50 --json bench/results/issue12/task_steps.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.events
import msgspec
import trio

from backends.openai_http import OpenAIHTTPBackend
from bench.procs import cpu_info, start_server
from bench.report import write_json
from router.app import NamedBackend, Router
from router.config import decode_config
from router.server import options_for, run_router

__all__ = ["StepCounter", "main", "measure"]

REPO = Path(__file__).resolve().parents[1]


class StepCounter(trio.abc.Instrument):
    """The names of the tasks that take a step while it is on, in order."""

    def __init__(self, skip: trio.lowlevel.Task) -> None:
        self.skip = skip
        self.on = False
        self.steps: list[str] = []

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if self.on and task is not self.skip:
            self.steps.append(task.name.split(" at ")[0])


async def _first_byte(sock: trio.SocketStream, conn: h2.connection.H2Connection, body: bytes) -> bool:
    """Send one request, read until its first DATA frame; whether it also ended."""
    sid = conn.get_next_available_stream_id()
    conn.send_headers(sid, [(":method", "POST"), (":path", "/v1/completions"), (":scheme", "http"),
                            (":authority", "127.0.0.1"), ("content-type", "application/json"),
                            ("content-length", str(len(body)))])  # fmt: skip
    conn.send_data(sid, body, end_stream=True)
    await sock.send_all(conn.data_to_send())
    first = ended = False
    while not first:
        data = await sock.receive_some(65536)
        if not data:
            raise RuntimeError("the router closed the connection")
        for event in conn.receive_data(data):
            if isinstance(event, h2.events.DataReceived):
                conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                first = True
            elif isinstance(event, h2.events.StreamReset):
                raise RuntimeError(f"the router reset the stream ({event.error_code})")
            ended = ended or isinstance(event, h2.events.StreamEnded)
        await sock.send_all(conn.data_to_send())
    return ended


async def _rest(sock: trio.SocketStream, conn: h2.connection.H2Connection, ended: bool) -> None:
    """Read until the stream ends, so the next round starts idle."""
    while not ended:
        for event in conn.receive_data(await sock.receive_some(65536)):
            if isinstance(event, h2.events.DataReceived):
                conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            ended = ended or isinstance(event, h2.events.StreamEnded)
        await sock.send_all(conn.data_to_send())


async def measure(backend_url: str, rounds: int, warmup: int, max_tokens: int) -> dict[str, Any]:
    """Rounds of one streamed completion through a router in this process in
    front of ``backend_url``: the router's task steps and the wall time to
    the first DATA frame of each."""
    router = Router(decode_config({}), [NamedBackend("mock", OpenAIHTTPBackend(backend_url, name="mock"))])
    config = decode_config({"server": {"port": 0}})
    body = msgspec.json.encode({"model": "mock", "prompt": "hello world", "max_tokens": max_tokens, "stream": True})
    counts: list[int] = []
    walls: list[float] = []
    last: list[str] = []
    async with trio.open_nursery() as nursery:
        url: str = await nursery.start(lambda task_status: run_router(router, options_for(config), shutdown=trio.Event(),
                                                                      task_status=task_status))  # fmt: skip
        with trio.fail_after(30):
            while not any(a.state.serving for a in router.actors):  # noqa: ASYNC110 (polls the actors)
                await trio.sleep(0.05)
        sock = await trio.open_tcp_stream("127.0.0.1", int(url.rsplit(":", 1)[1]))
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        await sock.send_all(conn.data_to_send())
        counter = StepCounter(trio.lowlevel.current_task())
        trio.lowlevel.add_instrument(counter)
        try:
            for i in range(warmup + rounds):
                await trio.sleep(0.05)  # idle: nothing of the last round still runs
                counter.steps.clear()
                counter.on = True
                start = time.perf_counter()
                with trio.fail_after(10):
                    ended = await _first_byte(sock, conn, body)
                wall = time.perf_counter() - start
                counter.on = False
                if i >= warmup:
                    counts.append(len(counter.steps))
                    walls.append(wall)
                    last = list(counter.steps)
                with trio.fail_after(10):
                    await _rest(sock, conn, ended)
        finally:
            trio.lowlevel.remove_instrument(counter)
            await sock.aclose()
            nursery.cancel_scope.cancel()
    return {
        "rounds": rounds,
        "steps": counts,
        "steps_median": statistics.median(counts),
        "steps_min": min(counts),
        "wall_ms_median": 1000 * statistics.median(walls),
        "last_round_by_task": dict(Counter(last).most_common()),
        "last_round_steps": last,  # in order
    }


def format_report(doc: dict[str, Any]) -> str:
    lines = [f"CPU: {doc['cpu']['model']} ({doc['cpu']['cores']} cores)",
             f"router in front of one headrace mock (--tpot-ms 0, {doc['max_tokens']} tokens), h2c, one request at a time",
             "",
             f"router task steps to the first byte: median {doc['steps_median']:g}, min {doc['steps_min']} "
             f"({doc['rounds']} requests; wall median {doc['wall_ms_median']:.2f} ms, the mock included)",
             "the last request's steps by task:"]  # fmt: skip
    lines += [f"  {n:3d}  {name}" for name, n in doc["last_round_by_task"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.task_steps", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=3)
    p.add_argument("--json", dest="json_path", type=Path, help="JSON report path")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0:
        p.error("--rounds >= 1, --warmup >= 0")
    doc = trio.run(_run, args)
    doc |= {"kind": "task_steps", "cpu": cpu_info(), "max_tokens": args.max_tokens}
    print(format_report(doc))
    if args.json_path is not None:
        print(f"wrote {write_json(args.json_path, doc)}")
    return 0


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    """:func:`measure` in front of a ``headrace mock`` process started (and
    stopped) here, once it says it listens."""
    argv = [sys.executable, "-m", "router.cli", "mock", "--port", "0", "--tpot-ms", "0", "--max-tokens", str(args.max_tokens)]
    with tempfile.TemporaryDirectory(prefix="headrace-task-steps-") as logdir:
        mock = await start_server("mock", argv, Path(logdir), cwd=REPO)
        try:
            return await measure(mock.url, args.rounds, args.warmup, args.max_tokens)
        finally:
            with trio.CancelScope(shield=True):
                await mock.stop(grace=2.0)


if __name__ == "__main__":
    sys.exit(main())
