"""``python -m bench.engine_paths``: one real ``headrace engine`` run (on the tiny
random model), through the whole harness (start, idle RSS, the bench, RSS, stop, table, JSON)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from bench import engine_paths
from tests.engine import tiny

pytestmark = pytest.mark.slow


def test_one_path_from_one_checkout_gives_tok_s_and_rss(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """On the tiny random model: what is checked is the bench's plumbing (a
    path's flags and env reach the engine, its tok/s and RSS the table and
    the JSON), which the default model's ~10 s load adds nothing to."""
    model = tiny.write_gguf(tiny.hf_model(), tmp_path / "tiny.gguf")
    rc = engine_paths.main(["--checkout", "here=.", "--path", "float32", "--concurrency", "1",
                            "--duration", "0.25", "--warmup", "0", "--max-tokens", "4", "--settle", "0.5",
                            "--model", str(model), "--results-dir", str(tmp_path)])  # fmt: skip
    assert rc == 0
    summary = json.loads((tmp_path / "engine_paths.json").read_text())
    assert summary["kind"] == "engine_paths" and summary["cpu"]["model"]
    assert summary["commits"]["here"].split("+")[0] == subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    (row,) = summary["rows"]
    assert (row["checkout"], row["path"]) == ("here", "float32")
    assert row["tok_s"]["1"] > 0
    assert 50e6 < row["idle_rss"] <= row["loaded_rss"] * 1.5
    per_run = json.loads(Path(row["json"]).read_text())
    assert per_run["kind"] == "engine" and "--dtype float32" in per_run["server"]
    table = capsys.readouterr().out
    assert "float32" in table and "idle RSS" in table


def test_paths_that_need_a_flag_are_left_out_for_a_checkout_without_it() -> None:
    needing = [p for p in engine_paths.PATHS if p.needs]
    assert needing and all("--no-batch-invariant" in p.flags for p in needing)
    assert engine_paths._has_flag(engine_paths.sys.executable, Path("."), "--no-batch-invariant")
    assert not engine_paths._has_flag(engine_paths.sys.executable, Path("."), "--no-such-flag")
