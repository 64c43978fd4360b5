"""bench/task_steps.py counts the router's task steps to a response's first
byte, against a real ``headrace mock`` process over HTTP/2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import task_steps


def test_a_short_run_counts_the_routers_steps_and_writes_the_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "steps.json"
    assert task_steps.main(["--rounds", "3", "--warmup", "1", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["kind"] == "task_steps" and doc["rounds"] == 3 and len(doc["steps"]) == 3
    # a request crosses at least hypercorn's connection task and the app's task (which reads the upstream)
    assert all(n >= 3 for n in doc["steps"]) and doc["steps_min"] == min(doc["steps"])
    tasks = doc["last_round_by_task"]
    assert sum(tasks.values()) == doc["steps"][-1] == len(doc["last_round_steps"])
    # the app's task (frontend/lean_h2.py's, the default ingress) and the connection's
    assert any("LeanH2Protocol._run" in name for name in tasks) and any("_run_handler" in name for name in tasks)
    assert "main" not in " ".join(tasks)  # the client's own steps are not counted
    printed = capsys.readouterr().out
    assert "router task steps to the first byte: median" in printed and f"wrote {out}" in printed


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(SystemExit):
        task_steps.main(["--rounds", "0"])
