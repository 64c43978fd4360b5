"""Results of a conformance run: the table people read and the JSON CI keeps."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import msgspec

__all__ = ["CheckResult", "ConformanceFailure", "Report"]

Outcome = Literal["pass", "fail", "skip"]


class CheckResult(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    category: str
    outcome: Outcome
    reason: str = ""
    seconds: float = 0.0


class ConformanceFailure(AssertionError):
    """Raised by :meth:`Report.raise_for_failures`; lists every failed check."""


class Report(msgspec.Struct, kw_only=True):
    target: str
    capabilities: dict[str, bool] = {}
    results: list[CheckResult] = []

    @property
    def ok(self) -> bool:
        """True when nothing failed (skips do not count against the target)."""
        return not self.failed

    @property
    def failed(self) -> list[CheckResult]:
        return [r for r in self.results if r.outcome == "fail"]

    def outcome(self, name: str) -> Outcome:
        for result in self.results:
            if result.name == name:
                return result.outcome
        raise KeyError(f"no conformance check named {name!r} in this report")

    def counts(self) -> dict[str, int]:
        counts = {"pass": 0, "fail": 0, "skip": 0}
        for result in self.results:
            counts[result.outcome] += 1
        return counts

    def format_table(self) -> str:
        rows = [(r.outcome.upper(), r.name, f"{r.seconds:.2f}s", r.reason) for r in self.results]
        width = max((len(r[1]) for r in rows), default=5)
        lines = [f"conformance of {self.target}"]
        if self.capabilities:
            caps = ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in self.capabilities.items())
            lines.append(f"capabilities: {caps}")
        lines.append(f"{'RESULT':<6}  {'CHECK':<{width}}  {'TIME':>7}  REASON")
        lines += [f"{o:<6}  {n:<{width}}  {t:>7}  {why}" for o, n, t, why in rows]
        c = self.counts()
        lines.append(f"{c['pass']} passed, {c['fail']} failed, {c['skip']} skipped")
        return "\n".join(lines)

    def to_json(self) -> bytes:
        summary = {"ok": self.ok, **self.counts()}
        return msgspec.json.format(
            msgspec.json.encode({"summary": summary, **msgspec.to_builtins(self)}), indent=2
        )

    def write_json(self, path: str | Path) -> None:
        Path(path).write_bytes(self.to_json() + b"\n")

    def raise_for_failures(self) -> None:
        if not self.ok:
            lines = [f"{r.name}: {r.reason}" for r in self.failed]
            raise ConformanceFailure(f"{len(lines)} conformance check(s) failed:\n" + "\n".join(lines))
