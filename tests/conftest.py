"""Suite-wide fixtures.

Torch runs on one thread in tests: the models are tiny, CI has two cores,
and tests often run a server process beside the test process; on shared
cores torch's default thread count was measured up to 8x slower.

The project's packages are byte-compiled once per session: tests start
hundreds of ``router``, ``mock`` and ``engine`` processes, and where
``PYTHONDONTWRITEBYTECODE`` is set none of them writes its ``__pycache__``,
so each compiled every module it imports again (~0.5 s of a router's
1.2 s start on the 2-core box). Sources newer than their ``.pyc`` are
compiled again, so an edit never runs stale code."""

from __future__ import annotations

import compileall
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("frontend", "router", "backends", "policies", "conformance", "bench", "sim", "tests")


def pytest_sessionstart(session: pytest.Session) -> None:
    for name in PACKAGES:
        compileall.compile_dir(ROOT / name, quiet=2)


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
