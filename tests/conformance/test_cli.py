"""``headrace conformance``: table, JSON report and exit status."""

from __future__ import annotations

import json
from pathlib import Path

import trio

from conformance.cli import main

from .reference_server import ReferenceServer
from .serving import serving


async def test_exit_status_is_zero_when_nothing_fails_and_json_is_written(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    async with serving(ReferenceServer()) as url:
        rc = await trio.to_thread.run_sync(main, ["--target", url, "--only", "api,errors",
                                                  "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["summary"]["ok"] is True and doc["summary"]["fail"] == 0
    assert {r["name"] for r in doc["results"]} >= {"api.models", "errors.unknown_model"}


async def test_exit_status_is_one_when_a_check_fails() -> None:
    async with serving(ReferenceServer(frozenset({"no_done"}))) as url:
        rc = await trio.to_thread.run_sync(main, ["--target", url, "--only", "api.chat.stream",
                                                  "--http", "2"])
    assert rc == 1


def test_exit_status_is_two_when_the_target_is_unreachable(capsys: object) -> None:
    assert main(["--target", "http://127.0.0.1:9", "--timeout", "5"]) == 2
