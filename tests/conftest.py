"""Suite-wide fixtures.

Torch runs on one thread in tests: the models are tiny, CI has two cores,
and tests often run a server process beside the test process; on shared
cores torch's default thread count was measured up to 8x slower.

The project's packages are byte-compiled once per session: tests start
hundreds of ``router``, ``mock`` and ``engine`` processes, and where
``PYTHONDONTWRITEBYTECODE`` is set none of them writes its ``__pycache__``,
so each compiled every module it imports again (~0.5 s of a router's
1.2 s start on the 2-core box). Sources newer than their ``.pyc`` are
compiled again, so an edit never runs stale code.

``HEADRACE_H2_INGRESS=hypercorn`` (or ``lean``, the default): every server a test starts in its own process
(``frontend.serving.ServeOptions`` without ``h2_ingress``), and the router
processes tests/hardening's harness starts, serve cleartext HTTP/2 on
frontend/lean_h2.py."""

from __future__ import annotations

import compileall
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from frontend import serving

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


@pytest.fixture(autouse=True)
def h2_ingress(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str | None:
    """The HTTP/2 ingress of the test's servers: its parameter where a
    conftest parametrizes it (tests/hardening/conftest.py), else
    ``HEADRACE_H2_INGRESS``, else the default."""
    ingress = getattr(request, "param", None) or os.environ.get("HEADRACE_H2_INGRESS")
    if ingress:
        monkeypatch.setattr(serving, "DEFAULT_H2_INGRESS", ingress)
        monkeypatch.setenv("HEADRACE_H2_INGRESS", ingress)  # for the processes a test starts
    return ingress
