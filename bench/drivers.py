"""Closed-loop load drivers for ``headrace bench router``: wrk (HTTP/1.1) and
h2load (h2c) when installed, else the project's own Python client.

A Python client streaming 20 chunks per request costs the client about as
much CPU as the server it measures, and on a two-core machine it competes
with it: wrk and h2load (``apt-get install wrk nghttp2-client``) cost a few
microseconds a request, so req/s measures the server. Each driver runs
``concurrency`` connections back to back for ``duration`` seconds and returns
how many requests completed and how many failed, by kind. wrk checks each
body for ``data: [DONE]`` and no in-band error (a Lua ``response`` hook);
h2load only counts statuses, so an in-band error is invisible to it.
"""

from __future__ import annotations

import re
import resource
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import msgspec
import trio

from backends.errors import ClientError
from backends.h2client import H2Pool
from bench.client import RequestResult, RequestSpec, build_body, send_request
from bench.connect import make_client, make_pool
from bench.engine_bench import run_closed_loop
from bench.progress import ProgressBar, run_progress

__all__ = ["native_available", "run_driver"]

_WRK_SCRIPT = """
local body = io.open("%s", "r"); wrk.body = body:read("*a"); body:close()
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
bad = 0
local threads = {}
function setup(thread) table.insert(threads, thread) end
function response(status, headers, text)
  if status == 200 and (not text:find("data: [DONE]", 1, true) or text:find('{"error"', 1, true)) then
    bad = bad + 1
  end
end
function done(summary, latency, requests)
  local n = 0
  for _, t in ipairs(threads) do n = n + t:get("bad") end
  io.write(string.format("incomplete: %%d\\n", n))
end
"""


def native_available() -> bool:
    return shutil.which("wrk") is not None and shutil.which("h2load") is not None


def _int(pattern: str, text: str) -> int:
    found = re.search(pattern, text)
    return int(found.group(1)) if found else 0


def parse_wrk(text: str) -> dict[str, Any]:
    total = _int(r"(\d+) requests in", text)
    errors: Counter[str] = Counter()
    errors["http_non_2xx"] = _int(r"Non-2xx or 3xx responses: (\d+)", text)
    errors["incomplete"] = _int(r"incomplete: (\d+)", text)
    for kind in ("connect", "read", "write", "timeout"):
        errors[f"socket_{kind}"] = _int(rf"{kind} (\d+)", text) if "Socket errors" in text else 0
    bad = errors["http_non_2xx"] + errors["incomplete"]
    return {"requests": total, "ok": max(0, total - bad), "errors": +errors}


def parse_h2load(text: str) -> dict[str, Any]:
    succeeded = _int(r"(\d+) succeeded", text)
    errors: Counter[str] = Counter()
    errors["failed"] = _int(r"(\d+) failed", text)
    errors["errored"] = _int(r"(\d+) errored", text)
    errors["timeout"] = _int(r"(\d+) timeout", text)
    non2xx = sum(_int(rf"(\d+) {c}xx", text) for c in (3, 4, 5))
    errors["http_non_2xx"] = non2xx
    return {"requests": succeeded + errors["failed"], "ok": max(0, succeeded - non2xx),
            "errors": +errors}


async def _run_tool(argv: list[str], duration: float, label: str) -> str:
    progress = ProgressBar(label)
    start = trio.current_time()

    def status(now: float) -> tuple[float, str]:
        return min(1.0, (now - start) / duration), f"{now - start:5.1f}s"

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_progress, progress, status)
        done = await trio.run_process(argv, capture_stdout=True, capture_stderr=True,
                                      check=False)
        nursery.cancel_scope.cancel()
    progress.close(f"{trio.current_time() - start:5.1f}s")
    out = (done.stdout + done.stderr).decode(errors="replace")
    if done.returncode != 0 and "requests" not in out:
        raise RuntimeError(f"{argv[0]} failed ({done.returncode}): {out[-500:]}")
    return out


async def _native(url: str, http: str, body_file: Path, concurrency: int, duration: float,
                  label: str) -> dict[str, Any]:
    target = url.rstrip("/") + "/v1/completions"
    if http == "1.1":
        script = body_file.with_suffix(".lua")
        script.write_text(_WRK_SCRIPT % body_file)
        argv = ["wrk", "-t1", f"-c{concurrency}", f"-d{max(1, round(duration))}s",
                "--timeout", "30s", "-s", str(script), target]
        return {"client": "wrk", **parse_wrk(await _run_tool(argv, duration, label))}
    argv = ["h2load", "-t1", "-c", str(concurrency), "-m", "1", "-D", str(max(1, round(duration))),
            "-d", str(body_file), "-H", "content-type: application/json", target]
    return {"client": "h2load", **parse_h2load(await _run_tool(argv, duration, label))}


def closed_client(url: str, http: str, concurrency: int, timeout: float) -> httpx.AsyncClient | H2Pool:
    """A closed loop's Python client: the lean one (backends.h2client) over
    h2c, httpx over HTTP/1.1; ``concurrency`` connections."""
    if http == "2":
        return make_pool(url, max_connections=concurrency, api_key=None, timeout=timeout)
    return make_client(url, "1.1", max_connections=concurrency, api_key=None, timeout=timeout)


async def _python(url: str, http: str, spec: RequestSpec, prompt: str, concurrency: int,
                  duration: float, label: str) -> dict[str, Any]:
    """httpx over HTTP/1.1; the lean client (backends.h2client) over h2c."""
    client = closed_client(url, http, concurrency, spec.timeout)
    async with client:
        async def send(index: int, _: str, planned: float, run_start: float) -> RequestResult:
            return await send_request(client, spec, prompt, index=index, start=planned,
                                      run_start=run_start)

        _, results = await run_closed_loop(concurrency, duration, send,
                                           progress=ProgressBar(label))
    errors = Counter(r.error for r in results if r.error)
    return {"client": "python", "requests": len(results),
            "ok": sum(r.ok for r in results), "errors": dict(errors)}


def check_client(choice: str) -> None:
    """Refuse ``--client native`` where wrk or h2load is missing."""
    if choice == "native" and not native_available():
        raise ClientError("--client native needs wrk and h2load (apt-get install wrk nghttp2-client)")


def write_body(path: Path, spec: RequestSpec, prompt: str) -> None:
    """The request body the native tools send, a few hundred bytes (written before a run)."""
    path.write_bytes(msgspec.json.encode(build_body(spec, prompt)))


async def run_closed(url: str, http: str, *, client: str, spec: RequestSpec, prompt: str, body_file: Path,
                     concurrency: int, duration: float, label: str) -> dict[str, Any]:
    """:func:`run_driver` with ``prompt``'s request body written to
    ``body_file`` (what the native tools send) and the client ``client``
    names: native, python, or auto (native when installed)."""
    write_body(body_file, spec, prompt)
    kind = "native" if client == "native" or (client == "auto" and native_available()) else "python"
    return await run_driver(kind, url, http, spec=spec, prompt=prompt, body_file=body_file,
                            concurrency=concurrency, duration=duration, label=label)


async def run_driver(kind: str, url: str, http: str, *, spec: RequestSpec, prompt: str,
                     body_file: Path, concurrency: int, duration: float,
                     label: str) -> dict[str, Any]:
    """One closed-loop run; adds the wall time and the client's own CPU seconds."""
    before = _client_cpu(kind)
    start = time.monotonic()
    if kind == "native":
        out = await _native(url, http, body_file, concurrency, duration, label)
    else:
        out = await _python(url, http, spec, prompt, concurrency, duration, label)
    out["wall_s"] = time.monotonic() - start
    out["client_cpu_s"] = _client_cpu(kind) - before
    out["errors"] = dict(sorted(out["errors"].items()))
    return out


def _client_cpu(kind: str) -> float:
    """Native tools: CPU of our reaped children (only the tool is reaped during
    a run); the Python client: this process."""
    who = resource.RUSAGE_CHILDREN if kind == "native" else resource.RUSAGE_SELF
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime

