"""Conformance suites for OpenAI-compatible targets and Backend adapters.

``check_http(url, ...)`` runs the HTTP suite against a server (vLLM, SGLang,
llama.cpp, TGI, the built-in engine, the router); ``check_backend(make_backend)``
runs the in-process suite against a :class:`backends.base.Backend`. Both return
a :class:`Report` (``report.ok``, ``report.format_table()``, ``report.to_json()``,
``report.raise_for_failures()``). ``headrace conformance`` is the CLI.
"""

from __future__ import annotations

from .backend import check_backend
from .http_suite import check_http, http_checks
from .registry import Check, CheckFailed, CheckSkipped, Registry
from .report import CheckResult, ConformanceFailure, Report

__all__ = [
    "Check",
    "CheckFailed",
    "CheckResult",
    "CheckSkipped",
    "ConformanceFailure",
    "Registry",
    "Report",
    "check_backend",
    "check_http",
    "http_checks",
]
