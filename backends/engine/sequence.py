"""One request inside the engine: its tokens, its KV bookkeeping, its lifecycle.

The scheduler's whole view of a request is two numbers (vLLM v1's lesson):
``len(token_ids)`` (prompt + generated) and ``num_computed_tokens`` (tokens
whose KV is already in the cache). Chunked prefill, prefix-cache hits (start
with ``num_computed_tokens`` at the hit length), preemption by recompute (reset
it to 0) and speculative rollback (decrease it) are all moves of that counter.

The lifecycle is a transition table, like h11's ``_state.py``::

    WAITING --schedule--> RUNNING --preempt--> WAITING
       |                     |
       +--abort--> FINISHED_ABORTED <--abort--+
                             +--stop--> FINISHED_STOPPED
                             +--length--> FINISHED_LENGTH

An unknown ``(state, event)`` pair raises :class:`InvalidTransition`: a bug,
never a silent no-op.
"""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec

from backends.base import SAMPLING_FIELDS, GenerateRequest
from backends.engine.config import SamplingDefaults
from backends.errors import BadRequest

__all__ = [
    "InvalidTransition",
    "SamplingParams",
    "SeqEvent",
    "SeqStatus",
    "Sequence",
]


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI finish reason of a finished state, ``None`` otherwise."""
        return _FINISH_REASON.get(self)


class SeqEvent(enum.Enum):
    SCHEDULE = "schedule"
    PREEMPT = "preempt"
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


_FINISHED = frozenset(
    {SeqStatus.FINISHED_STOPPED, SeqStatus.FINISHED_LENGTH, SeqStatus.FINISHED_ABORTED}
)
_FINISH_REASON = {
    SeqStatus.FINISHED_STOPPED: "stop",
    SeqStatus.FINISHED_LENGTH: "length",
    SeqStatus.FINISHED_ABORTED: "abort",
}

TRANSITIONS: dict[tuple[SeqStatus, SeqEvent], SeqStatus] = {
    (SeqStatus.WAITING, SeqEvent.SCHEDULE): SeqStatus.RUNNING,
    (SeqStatus.WAITING, SeqEvent.ABORT): SeqStatus.FINISHED_ABORTED,
    (SeqStatus.RUNNING, SeqEvent.PREEMPT): SeqStatus.WAITING,
    (SeqStatus.RUNNING, SeqEvent.STOP): SeqStatus.FINISHED_STOPPED,
    (SeqStatus.RUNNING, SeqEvent.LENGTH): SeqStatus.FINISHED_LENGTH,
    (SeqStatus.RUNNING, SeqEvent.ABORT): SeqStatus.FINISHED_ABORTED,
}


class InvalidTransition(RuntimeError):
    """A sequence was asked to make a move its lifecycle does not allow (a bug)."""


NonNeg = Annotated[int, msgspec.Meta(ge=0)]


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How to pick each next token. ``seed`` is ``None`` only until the engine
    draws one at ``add_request``; from then on every sequence has one, so its
    noise is a pure function of (seed, position)."""

    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: NonNeg = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; n: the chosen token plus n alternatives

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @classmethod
    def from_request(
        cls,
        req: GenerateRequest,
        *,
        default_max_tokens: int,
        defaults: SamplingDefaults | None = None,
    ) -> SamplingParams:
        """The sampling part of a validated request (seed may still be ``None``).
        A sampling field the request leaves unset (``None``) takes ``defaults``
        (the model's recommended sampling), else OpenAI's default."""
        d = defaults or SamplingDefaults()
        # Every sampling field the engine implements, by name (declared once
        # in backends.base.Sampling): the request's value; if unset, the
        # model's default; if none, ours (OpenAI's, the field defaults here).
        values: dict[str, object] = {}
        for field in msgspec.structs.fields(cls):
            if field.name not in _REQUEST_FIELDS:
                continue
            value = getattr(req, field.name)
            if value is None:
                value = getattr(d, field.name, None)
            if value is not None:
                values[field.name] = tuple(value) if isinstance(value, list) else value
        if req.max_tokens is None:
            values["max_tokens"] = default_max_tokens
        return cls(**values)  # type: ignore[arg-type]


_REQUEST_FIELDS = frozenset(f.name for f in SAMPLING_FIELDS)
_MAX_LOGPROBS = 20


def _validate(p: SamplingParams) -> None:
    checks: list[tuple[bool, str, str]] = [
        (p.temperature >= 0.0, "temperature", "must be >= 0"),
        (0.0 < p.top_p <= 1.0, "top_p", "must be in (0, 1]"),
        (p.top_k >= 0, "top_k", "must be >= 0 (0: off)"),
        (0.0 <= p.min_p <= 1.0, "min_p", "must be in [0, 1]"),
        (p.repetition_penalty > 0.0, "repetition_penalty", "must be > 0"),
        (-2.0 <= p.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]"),
        (-2.0 <= p.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]"),
        (p.max_tokens >= 1, "max_tokens", "must be >= 1"),
        (p.min_tokens <= p.max_tokens, "min_tokens", "must be <= max_tokens"),
        (all(t >= 0 for t in p.stop_token_ids), "stop_token_ids", "must be >= 0"),
        (
            p.logprobs is None or 0 <= p.logprobs <= _MAX_LOGPROBS,
            "logprobs",
            f"must be in [0, {_MAX_LOGPROBS}]",
        ),
    ]
    for ok, name, why in checks:
        if not ok:
            raise BadRequest(f"{name} {why}, got {getattr(p, name)!r}", param=name)


class Sequence:
    """A request's mutable engine state. Only the scheduler (and the block
    manager it drives) mutates ``num_computed_tokens``, ``block_table`` and
    ``status``; the engine appends sampled tokens through the scheduler."""

    __slots__ = (
        "arrival",
        "block_hashes",
        "block_table",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "num_registered_blocks",
        "params",
        "priority",
        "seq_id",
        "status",
        "token_ids",
    )

    def __init__(
        self,
        seq_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        arrival: int = 0,
        num_resumed: int = 0,
    ) -> None:
        """``num_resumed``: the last tokens of ``prompt_token_ids`` that are this
        generation's own earlier output (a resumed stream): they count as output,
        so ``num_prompt_tokens`` is the original prompt's length."""
        if not prompt_token_ids:
            raise BadRequest("the prompt must have at least one token", param="prompt")
        if not 0 <= num_resumed < len(prompt_token_ids):
            raise BadRequest(
                "resumed_tokens must leave at least one prompt token", param="resumed_tokens"
            )
        self.seq_id = seq_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids) - num_resumed
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = 0  # of the prompt, served by the prefix cache (last admission)
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of full blocks of token_ids (lazy)
        self.num_registered_blocks = 0  # leading blocks already offered to the prefix cache
        self.num_preemptions = 0
        self.priority = priority  # higher runs first
        self.arrival = arrival  # admission order: lower is older
        self.status = SeqStatus.WAITING
        self.params = params

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id!r}, status={self.status.name}, tokens={len(self.token_ids)}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def is_finished(self) -> bool:
        return self.status in _FINISHED

    def transition(self, event: SeqEvent) -> SeqStatus:
        """Apply ``event``; raise :class:`InvalidTransition` if the table has no such move."""
        try:
            self.status = TRANSITIONS[(self.status, event)]
        except KeyError:
            raise InvalidTransition(
                f"sequence {self.seq_id!r}: no transition from {self.status.name} on {event.name}"
            ) from None
        return self.status
