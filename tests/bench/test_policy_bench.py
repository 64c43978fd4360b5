"""``headrace bench policies``: a whole run in a tiny configuration, both
ways of handing views to the picks."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from bench.cli import main as bench_main
from bench.policy_bench import _Actors


@pytest.mark.parametrize("fresh", [False, True], ids=["actors", "fresh-views"])
def test_a_tiny_run_times_every_policy_and_writes_the_json(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           fresh: bool) -> None:
    out = tmp_path / "policies.json"
    args = ["policies", "--backends", "8", "--blocks", "4096", "--blocks-per-prefix", "32", "--prompt-blocks", "32",
            "--requests", "300", "--policy", "kv_aware", "--policy", "least_loaded", "--json", str(out)]
    assert bench_main(args + (["--fresh-views"] if fresh else [])) == 0
    printed = capsys.readouterr().out
    assert "CPU:" in printed and ("fresh views" if fresh else "views kept by actors") in printed
    doc = json.loads(out.read_text())
    assert doc["args"]["fresh_views"] is fresh and doc["cpu"]["model"]
    rows = {r["policy"]: r for r in doc["rows"]}
    assert set(rows) == {"kv_aware", "least_loaded"}
    assert rows["kv_aware"]["indexed_blocks"] > 0
    for r in rows.values():
        assert 0 < r["pick"]["p50_us"] <= r["pick"]["p99_us"] <= r["pick"]["max_us"]
        assert r["pick_and_dispatch"]["p50_us"] >= r["pick"]["p50_us"] * 0.5


def test_actors_rebuild_only_the_views_whose_count_changed() -> None:
    flights = [0, 3, 0, 5]
    actors = _Actors(4, flights, None)
    before = list(actors.views)
    actors.step("gpu-2", random.Random(1))
    changed = [i for i in range(4) if actors.views[i] is not before[i]]
    assert 2 in changed and 1 <= len(changed) <= 2
    assert [v.in_flight for v in actors.views] == flights and sum(flights) == 8  # one dispatched, one completed
