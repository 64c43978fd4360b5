"""Continuous batching: which sequences compute which tokens this step.

Torch-free on purpose, so Hypothesis can drive it with a fake model.

A step is a list of :class:`ScheduledSeq`: "compute the KV of
``seq.token_ids[seq.num_computed_tokens : seq.num_computed_tokens + num_new_tokens]``".
One step, as the engine drives it::

    schedule()  running first (decode tokens and prefill chunks in flight), in
                (priority desc, arrival) order, each within the token budget;
                when blocks run out the running sequence with the lowest
                priority, most recent arrival, is preempted (blocks freed,
                num_computed_tokens reset, back to the waiting queue, which is
                also ordered by (priority desc, arrival), so it goes first);
                then, if nobody was preempted, waiting sequences are admitted
                (prefix-cache hits first, the rest chunked by the budget);
                a prompt's prefill of lower priority than the first waiting
                request goes after the admissions, with the budget left (a
                resumed or interactive request waits one step, not a whole
                long prompt).
    runner      computes the KV and the logits of sequences that need sampling
    commit()    advances num_computed_tokens, registers full blocks in the
                prefix cache, appends each sampled token
    finish()    the engine's stop decision; frees the blocks at once

Requests join at step boundaries; a long prompt is prefilled a budget-sized
chunk at a time after the decodes, so it never stalls them. Per step the work
is O(running + admitted), never O(total tokens).

Not thread-safe: call from one thread, between model steps.
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import msgspec

from backends.engine.block_manager import BlockManager, BlockManagerStatistics
from backends.engine.sequence import SeqEvent, Sequence

__all__ = ["ScheduledSeq", "Scheduler", "SchedulerOutput", "SchedulerStatistics"]

# A waiting sequence waits for a running one's prefill when at least this
# many of its next blocks are in it (32 tokens at 16 a block, SGLang's
# in-batch prefix threshold); a shorter overlap is cheaper to compute again.
_SHARE_MIN_BLOCKS = 2


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    """Compute KV for ``num_new_tokens`` tokens of ``seq`` starting at
    ``seq.num_computed_tokens`` (the sequence is not advanced until commit)."""

    seq: Sequence
    num_new_tokens: int
    start: int = -1  # absolute position of the first token; defaults to seq.num_computed_tokens

    def __post_init__(self) -> None:
        if self.start < 0:
            object.__setattr__(self, "start", self.seq.num_computed_tokens)

    @property
    def end(self) -> int:
        """One past the absolute position of the last token computed this step."""
        return self.start + self.num_new_tokens

    @property
    def needs_sampling(self) -> bool:
        """True when this step reaches the end of the sequence's tokens, so the
        logits at its last position pick the next token (a mid-prompt prefill
        chunk samples nothing)."""
        return self.start + self.num_new_tokens == len(self.seq.token_ids)


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


def _order(seq: Sequence) -> tuple[int, int]:
    """Queue order: higher priority first, then older first."""
    return (-seq.priority, seq.arrival)


class SchedulerStatistics(msgspec.Struct, frozen=True, kw_only=True):
    num_running: int
    num_waiting: int
    num_preemptions: int
    num_steps: int
    last_batch_size: int  # sequences in the last step
    last_num_batched_tokens: int
    mean_batch_size: float
    kv: BlockManagerStatistics
    num_prefix_waits: int = 0  # admissions passed over to share a running prefill's blocks


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int = 32,
        max_num_batched_tokens: int = 512,
        share_inflight_prefixes: bool = True,
    ) -> None:
        if max_num_seqs <= 0 or max_num_batched_tokens <= 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be > 0")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # A waiting sequence whose next uncached blocks a running one is
        # computing waits for them instead of computing them again (see
        # _admit_waiting).
        self.share_inflight_prefixes = share_inflight_prefixes
        self._deferrals = 0
        self.waiting: list[Sequence] = []  # sorted by _order
        self.running: list[Sequence] = []  # sorted by _order; victims come from the tail
        self._seqs: dict[str, Sequence] = {}
        self._next_arrival = 0
        self._preemptions = 0
        self._steps = 0
        self._seqs_scheduled = 0
        self._last = (0, 0)

    # -- requests in and out --------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a new WAITING sequence; it can join at the next step."""
        if seq.seq_id in self._seqs:
            raise ValueError(f"sequence {seq.seq_id!r} is already scheduled")
        seq.arrival = self._next_arrival
        self._next_arrival += 1
        self._seqs[seq.seq_id] = seq
        insort(self.waiting, seq, key=_order)

    def get(self, seq_id: str) -> Sequence | None:
        return self._seqs.get(seq_id)

    def abort(self, seq_id: str) -> Sequence | None:
        """Finish ``seq_id`` as aborted and free its blocks now; ``None`` if unknown."""
        seq = self._seqs.get(seq_id)
        if seq is not None:
            self._remove(seq, SeqEvent.ABORT)
        return seq

    def finish(self, seq: Sequence, event: SeqEvent) -> None:
        """End a running sequence (``SeqEvent.STOP`` or ``SeqEvent.LENGTH``), freeing its blocks."""
        if event not in (SeqEvent.STOP, SeqEvent.LENGTH):
            raise ValueError(f"finish takes STOP or LENGTH, not {event.name}")
        self._remove(seq, event)

    def _remove(self, seq: Sequence, event: SeqEvent) -> None:
        queue = self.running if seq in self.running else self.waiting
        seq.transition(event)  # raises before any change on a bad move
        queue.remove(seq)
        del self._seqs[seq.seq_id]
        self.block_manager.free(seq)

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    @property
    def num_unfinished(self) -> int:
        return len(self._seqs)

    # -- one step -------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        deferred: list[Sequence] = []
        budget = self._schedule_running(out, self.max_num_batched_tokens, deferred)
        if not out.preempted:
            budget = self._admit_waiting(out, budget)
        budget = self._schedule_deferred(out, budget, deferred)
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        self._steps += 1
        self._seqs_scheduled += len(out.scheduled)
        self._last = (len(out.scheduled), out.num_batched_tokens)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int, deferred: list[Sequence]) -> int:
        """Running sequences in order, within the budget. A prompt's prefill
        of lower priority than the first waiting request is put in
        ``deferred`` instead (when there is room to admit): that request is
        admitted first and the prefill takes what budget is left, so a
        higher-priority request (a resumed stream, an interactive one) waits
        at most one step of a long lower-priority prompt, not all of it.
        Decodes are never deferred."""
        running, bm, i = self.running, self.block_manager, 0
        urgent = self.waiting[0].priority if self.waiting and len(running) < self.max_num_seqs else None
        while i < len(running) and budget > 0:
            seq = running[i]
            if urgent is not None and seq.priority < urgent and seq.num_computed_tokens < seq.num_prompt_tokens:
                deferred.append(seq)
                i += 1
                continue
            n = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            while not bm.allocate(seq, n):
                victim = running.pop()  # lowest priority, most recent: never one already scheduled
                self._preempt(victim, out)
                if victim is seq:
                    return budget
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1
        return budget

    def _schedule_deferred(self, out: SchedulerOutput, budget: int, deferred: list[Sequence]) -> int:
        """The prefills :meth:`_schedule_running` put off, in order, with the
        budget admission left; without preempting anyone (a victim could be
        scheduled already): one that finds no blocks waits for the next step.
        (None of them was preempted this step: victims come from the running
        list's tail, and :meth:`_schedule_running` stops at the one it is on.)"""
        bm = self.block_manager
        for seq in deferred:
            if budget <= 0:
                break
            n = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            if not bm.allocate(seq, n):
                break
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        return budget

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.block_manager.free(seq)
        seq.transition(SeqEvent.PREEMPT)
        seq.num_preemptions += 1
        self._preemptions += 1
        insort(self.waiting, seq, key=_order)
        out.preempted.append(seq)

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        """Admit waiting sequences in order while the budget, the blocks and
        max_num_seqs allow. With ``share_inflight_prefixes``, a sequence
        whose next ``_SHARE_MIN_BLOCKS`` or more uncached blocks are being
        prefilled by a running sequence (the same prompt prefix, sent
        moments apart: a shared system prompt in a burst) is passed over
        this step: those blocks are in its prefix cache once that prefill
        registers them, one step or a few later, so it computes only the
        rest instead of the whole prefix twice (SGLang's in-batch prefix
        sharing does the same). The ones behind it go ahead."""
        bm, waiting = self.block_manager, self.waiting
        inflight: set[int] | None = None  # hashes running prefills will register, built on first need
        share = self.shares_prefixes
        i = 0
        while i < len(waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = waiting[i]
            hits = bm.lookup(seq)
            if share and len(seq.block_hashes) - len(hits) >= _SHARE_MIN_BLOCKS:
                if inflight is None:
                    inflight = self._inflight_blocks()
                k = len(hits)
                if all(h in inflight for h in seq.block_hashes[k : k + _SHARE_MIN_BLOCKS]):
                    self._deferrals += 1
                    i += 1
                    continue
            uncached = len(seq.token_ids) - len(hits) * bm.block_size
            n = min(uncached, budget)
            if not bm.allocate(seq, n, hits):
                break  # admission never preempts; the head waits for blocks
            waiting.pop(i)
            if seq.num_preemptions == 0:  # of the original prompt (a resumed one's output is not)
                seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
            seq.transition(SeqEvent.SCHEDULE)
            insort(self.running, seq, key=_order)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            if inflight is not None:
                inflight.update(seq.block_hashes[seq.num_registered_blocks :])
        return budget

    @property
    def shares_prefixes(self) -> bool:
        """Whether a request queued behind a running prefill of its prefix finds that prefix cached."""
        return self.share_inflight_prefixes and self.block_manager.enable_prefix_caching

    def _inflight_blocks(self) -> set[int]:
        """Hashes of the full prompt blocks running sequences have not registered yet."""
        out: set[int] = set()
        for r in self.running:
            if r.num_registered_blocks < len(r.block_hashes):
                out.update(r.block_hashes[r.num_registered_blocks :])
        return out

    def commit(self, out: SchedulerOutput, sampled_token_ids: Seq[int]) -> None:
        """Record that ``out`` was computed: advance each sequence, register its
        newly full blocks, append the sampled tokens (one per sequence that
        needed sampling, in order). Sequences finished meanwhile are skipped."""
        if len(sampled_token_ids) != out.num_sampled:
            raise ValueError(
                f"{len(sampled_token_ids)} sampled tokens for {out.num_sampled} sequences"
            )
        tokens = iter(sampled_token_ids)
        bm = self.block_manager
        for s in out.scheduled:
            seq = s.seq
            token = next(tokens) if s.needs_sampling else None
            if seq.is_finished:
                continue
            seq.num_computed_tokens = s.end
            bm.register_computed(seq)
            if token is not None:
                seq.token_ids.append(token)

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        """Drop ``seq``'s tokens past ``num_tokens`` (rejected speculative drafts)
        and the blocks that held only them."""
        if num_tokens < seq.num_prompt_tokens or num_tokens > len(seq.token_ids):
            raise ValueError("rollback must keep the prompt and not grow the sequence")
        self.block_manager.truncate(seq, num_tokens)

    # -- statistics -----------------------------------------------------------

    def statistics(self) -> SchedulerStatistics:
        return SchedulerStatistics(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_preemptions=self._preemptions,
            num_steps=self._steps,
            last_batch_size=self._last[0],
            last_num_batched_tokens=self._last[1],
            mean_batch_size=self._seqs_scheduled / self._steps if self._steps else 0.0,
            kv=self.block_manager.statistics(),
            num_prefix_waits=self._deferrals,
        )
