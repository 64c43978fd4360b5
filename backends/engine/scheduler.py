"""Continuous batching: which sequences compute which tokens this step.

Torch-free on purpose, so Hypothesis can drive it with a fake model.

A step is a list of :class:`ScheduledSeq`: "compute the KV of
``seq.token_ids[seq.num_computed_tokens : seq.num_computed_tokens + num_new_tokens]``".
"""

from __future__ import annotations

from dataclasses import dataclass, field

from backends.engine.sequence import Sequence

__all__ = ["ScheduledSeq", "SchedulerOutput"]


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    """Compute KV for ``num_new_tokens`` tokens of ``seq`` starting at
    ``seq.num_computed_tokens`` (the sequence is not advanced until commit)."""

    seq: Sequence
    num_new_tokens: int

    @property
    def start(self) -> int:
        """Absolute position of the first token computed this step."""
        return self.seq.num_computed_tokens

    @property
    def end(self) -> int:
        """One past the absolute position of the last token computed this step."""
        return self.seq.num_computed_tokens + self.num_new_tokens

    @property
    def needs_sampling(self) -> bool:
        """True when this step reaches the end of the sequence's tokens, so the
        logits at its last position pick the next token (a mid-prompt prefill
        chunk samples nothing)."""
        return self.seq.num_computed_tokens + self.num_new_tokens == len(self.seq.token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    """One step's plan. ``scheduled`` is in batch order; ``preempted`` lost
    their KV this step and went back to the waiting queue."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_sampled(self) -> int:
        """Rows of logits the runner returns: one per sequence that needs sampling."""
        return sum(1 for s in self.scheduled if s.needs_sampling)
