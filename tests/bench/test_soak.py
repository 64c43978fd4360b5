"""bench/soak.py: a short soak on the real bed (two mock processes and a
router process) finishes with every target met and says so in its JSON;
the router log's access statuses and tracebacks are read as they are."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import soak

LOG = """\
headrace listening on http://127.0.0.1:9410
[2026-12-05 05:07:43 +0000] [1] [INFO] 127.0.0.1:39630 - - [05/Dec/2026:05:07:43 +0000] "POST /v1/completions 2" 200 - "-" "h2load"
[2026-12-05 05:07:43 +0000] [1] [INFO] 127.0.0.1:39631 - - [05/Dec/2026:05:07:43 +0000] "POST /v1/completions 1.1" 200 - "-" "-"
[2026-12-05 05:07:43 +0000] [1] [INFO] 127.0.0.1:39632 - - [05/Dec/2026:05:07:43 +0000] "POST /v1/completions 2" - - "-" "h2load"
[2026-12-05 05:07:44 +0000] [1] [INFO] 127.0.0.1:39633 - - [05/Dec/2026:05:07:44 +0000] "GET /health 1.1" 503 - "-" "-"
Traceback (most recent call last):
  File "x.py", line 1, in <module>
"""


def test_the_access_statuses_and_tracebacks_of_a_router_log() -> None:
    statuses, tracebacks = soak.access_statuses(LOG)
    assert statuses == {"200": 2, "-": 1, "503": 1} and tracebacks == 1
    doc = {"closed_loop": [{"errors": {}}], "open_loop": {"runs": [{"errors": {}}]},
           "router_log": {"statuses": dict(statuses), "tracebacks": 0}}
    assert soak.verdict(doc)["router log: only 200s, no traceback"] is False  # the 503
    doc["router_log"]["statuses"] = {"200": 2, "-": 1}  # a client that left is not the router's error
    assert all(soak.verdict(doc).values())


def test_a_short_soak_meets_every_target_and_writes_the_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "soak.json"
    code = soak.main(["--duration", "1.5", "--open-duration", "1", "--fractions", "0.3", "--client", "python",
                      "--concurrency", "4", "--json", str(out)])  # fmt: skip
    doc = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert [r["http"] for r in doc["closed_loop"]] == ["2", "1.1"]
    assert all(r["ok"] > 0 and not r["errors"] for r in doc["closed_loop"])
    [run] = doc["open_loop"]["runs"]
    assert run["fraction"] == 0.3 and run["counts"]["ok"] > 0 and not run["errors"]
    answered = sum(r["ok"] for r in doc["closed_loop"]) + run["counts"]["ok"]
    assert doc["router_log"]["statuses"].get("200", 0) >= answered and doc["router_log"]["tracebacks"] == 0
    assert all(doc["targets"].values()) and "targets: closed loop: every answer complete, 200: yes" in printed


def test_bad_arguments_are_refused() -> None:
    assert soak.main(["--fractions", "1.5"]) == 2
