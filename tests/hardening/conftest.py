"""The battery's HTTP/2 attacks run against both HTTP/2 ingresses:
frontend/lean_h2.py (``[server] h2_ingress = "lean"``, the default) and
hypercorn's protocol (patched, ``"hypercorn"``). The other modules attack
HTTP/1.1, TLS or the router's own checks, which do not depend on it
(``HEADRACE_H2_INGRESS=hypercorn`` runs them all on hypercorn's)."""

from __future__ import annotations

import pytest

BOTH_INGRESSES = frozenset({
    "test_h2_abuse", "test_h2_protocol", "test_slow_readers", "test_shutdown", "test_connections", "test_limits",
})


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    module = metafunc.module.__name__.rsplit(".", 1)[-1]
    if "http1" in metafunc.function.__name__:
        return  # an HTTP/1.1 client: the same connection either way
    if module in BOTH_INGRESSES and "h2_ingress" in metafunc.fixturenames:
        metafunc.parametrize("h2_ingress", ["hypercorn", "lean"], indirect=True)
