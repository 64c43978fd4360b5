"""The engine loop: requests in, a few tokens per request per step out.

``step()`` is the whole loop (nano-vllm's shape)::

    schedule --> runner.execute --> sample --> commit --> stop checks --> outputs

The engine owns the scheduler (and through it the block manager) and decides
when a sequence stops on token ids: EOS (unless ``ignore_eos``), ``stop_token_ids``,
``max_tokens``, the context length. Stop *strings* need text, so the caller that
detokenizes handles them (:class:`backends.engine.stop.StopMatcher`): on a match
it ends its stream with ``finish_reason="stop"`` and calls :meth:`LLMEngine.abort`
to free the sequence.

The runner is anything with ``execute(scheduled) -> Tensor[num_sampled, V]``
and ``num_kv_blocks`` (plus optional ``max_model_len`` and ``vocab_size``);
tests use a fake whose logits are a pure function of the tokens so far.

A resumed request (stream migration, ``resumed_tokens=k``) is a sequence whose
prompt is the original prompt P plus the k tokens it already produced elsewhere:
its ``num_prompt_tokens`` is ``len(P)`` and its limits are the whole generation's
(``max_tokens + k``, ``min_tokens + k``), so penalties, ``min_tokens``, the stop
checks and ``usage`` see those k tokens as output, exactly as the unbroken run did.

A step that raises (a device out of memory, a kernel error) fails only the
sequences it scheduled: they are aborted, their blocks freed, and
:class:`StepFailed` names them; every other request carries on.

Not thread-safe: one caller drives ``add_request`` / ``abort`` / ``step``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence as Seq
from typing import Any, Protocol

import msgspec
import torch

from backends.base import FinishReason, Logprob, Usage
from backends.engine.accounting import StepMeter
from backends.engine.block_manager import BlockManager
from backends.engine.config import EngineConfig
from backends.engine.sampling import sample
from backends.engine.scheduler import (
    ScheduledSeq,
    Scheduler,
    SchedulerOutput,
    SchedulerStatistics,
)
from backends.engine.sequence import SamplingParams, SeqEvent, Sequence
from backends.errors import BadRequest, ContextLengthExceeded

__all__ = ["EngineStatistics", "LLMEngine", "Runner", "StepFailed", "StepOutput"]


class Runner(Protocol):
    num_kv_blocks: int

    def execute(self, scheduled: Seq[ScheduledSeq]) -> torch.Tensor: ...


class StepOutput(msgspec.Struct, kw_only=True):
    """What one step produced for one request. ``new_token_ids`` includes a
    stop/EOS token that ended the sequence."""

    request_id: str
    new_token_ids: list[int]
    logprobs: list[Logprob] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    usage: Usage | None = None  # on the finished output
    seed: int = 0  # the seed in use (drawn when the request had none)


class StepFailed(Exception):
    """A step raised ``cause``; the sequences it scheduled (``request_ids``) were
    aborted and their blocks freed. The engine is consistent and can step on."""

    def __init__(self, request_ids: list[str], cause: Exception) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.request_ids = request_ids
        self.cause = cause


class EngineStatistics(msgspec.Struct, frozen=True, kw_only=True):
    num_running: int
    num_waiting: int
    num_requests_added: int
    num_requests_finished: int
    num_tokens_generated: int
    num_steps: int
    num_preemptions: int
    kv_usage: float
    prefix_hit_rate: float
    mean_batch_size: float
    last_batch_size: int
    scheduler: SchedulerStatistics


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        runner: Any,
        tokenizer: Any = None,
        *,
        eos_token_ids: Seq[int] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        if eos_token_ids is None:
            eos_token_ids = getattr(tokenizer, "eos_token_ids", ())
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids)
        self.block_size = getattr(runner, "block_size", config.block_size)
        self.num_kv_blocks: int = runner.num_kv_blocks
        model_len = getattr(runner, "max_model_len", None)
        if model_len is None:
            model_len = config.max_model_len or self.num_kv_blocks * self.block_size
        self.max_model_len: int = config.resolve_max_model_len(model_len)
        self.vocab_size: int | None = getattr(runner, "vocab_size", None)
        self.block_manager = BlockManager(
            self.num_kv_blocks,
            self.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            record_events=config.enable_kv_events,
        )
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
        )
        self._rng = rng or random.Random()
        self._pending: list[StepOutput] = []  # abort outputs, delivered by the next step()
        self._added = 0
        self._finished = 0
        self._generated = 0
        # GPU-seconds per tenant: each step's time split by tokens computed (accounting.py)
        self.meter = StepMeter()

    # -- requests -------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        params: SamplingParams,
        priority: int = 0,
        *,
        resumed_tokens: int = 0,
        tenant: str = "default",
    ) -> Sequence:
        """Queue a request; it joins the batch at the next step. Raises
        :class:`BadRequest` / :class:`ContextLengthExceeded` for bad input.

        ``resumed_tokens=k``: the last k of ``prompt_token_ids`` are the
        generation's own earlier output and ``params`` carries what remains of
        its ``max_tokens`` / ``min_tokens``; the sequence continues the unbroken
        generation (module docstring)."""
        if self.scheduler.get(request_id) is not None:
            raise BadRequest(f"request id {request_id!r} is already running", param="request_id")
        prompt = list(prompt_token_ids)
        if not 0 <= resumed_tokens < len(prompt):
            raise BadRequest(
                f"resumed_tokens must be in [0, {len(prompt)}) (it leaves at least one "
                f"prompt token), got {resumed_tokens}",
                param="resumed_tokens",
            )
        self._check_prompt(prompt, params.max_tokens)
        if params.seed is None:
            params = msgspec.structs.replace(params, seed=self._rng.getrandbits(63))
        if resumed_tokens:  # the whole generation's limits, counted from the original prompt
            params = msgspec.structs.replace(
                params,
                max_tokens=params.max_tokens + resumed_tokens,
                min_tokens=params.min_tokens + resumed_tokens,
            )
        seq = Sequence(
            request_id, prompt, params, priority=priority, num_resumed=resumed_tokens
        )
        self.scheduler.add(seq)
        self.meter.admit(request_id, tenant)
        self._added += 1
        return seq

    def _check_prompt(self, prompt: list[int], max_tokens: int) -> None:
        if not prompt:
            raise BadRequest("the prompt must have at least one token", param="prompt")
        v = self.vocab_size
        if v is not None and any(not 0 <= t < v for t in prompt):
            raise BadRequest(f"prompt token ids must be in [0, {v})", param="prompt_token_ids")
        total = len(prompt) + max_tokens
        if total > self.max_model_len:
            raise ContextLengthExceeded(
                f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the "
                f"context length {self.max_model_len}",
                param="max_tokens",
            )
        if -(-total // self.block_size) > self.num_kv_blocks:
            raise ContextLengthExceeded(
                f"prompt + max_tokens ({total} tokens) exceeds the KV cache "
                f"({self.num_kv_blocks * self.block_size} tokens)",
                param="max_tokens",
            )

    def abort(self, request_id: str) -> bool:
        """Stop a request now (its blocks are freed at once); the next ``step()``
        returns its final output. False if it is unknown or already finished."""
        seq = self._discard(request_id)
        if seq is None:
            return False
        self._pending.append(self._settle(self._output(seq, [], None)))
        return True

    def _discard(self, request_id: str) -> Sequence | None:
        """Finish a request as aborted and free its blocks, with no output (the
        hook speculative decoding extends to drop its per-request state)."""
        seq = self.scheduler.abort(request_id)
        if seq is not None:
            self._finished += 1
        return seq

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    # -- the loop -------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """One step's outputs. Raises :class:`StepFailed` when running the plan
        raised: the sequences it scheduled are gone (aborted, blocks freed),
        whatever it had half done to them (KV written, counters advanced,
        drafts appended), and the abort outputs due are kept for the next step."""
        outputs, self._pending = self._pending, []
        started = time.perf_counter()  # the step's wall time, scheduling included (a plan with work only)
        plan = self.scheduler.schedule()
        if plan.is_empty:  # e.g. the last request aborted (a stop string): idle now
            if not self.scheduler.has_unfinished():
                self._release_idle_kv()
            return outputs
        due = len(outputs)
        try:
            self._run(plan, outputs)
        except Exception as exc:
            self._charge(plan, started)
            self._pending = outputs[:due] + self._pending
            raise StepFailed(self._fail(plan), exc) from exc
        self._charge(plan, started)
        for out in outputs[due:]:
            if out.finished:
                self._settle(out)
        if not self.scheduler.has_unfinished():
            self._release_idle_kv()
        return outputs

    def _kv_runners(self) -> list[Any]:
        """The runners holding a KV cache over this engine's block ids."""
        return [self.runner]

    def _release_idle_kv(self) -> None:
        """Idle: keep the KV cache resident up to the runners' ``kv_idle_blocks`` (the
        prefix cache's blocks past it evicted), the rest handed back (release_kv).
        Nothing to do while the cache is within it, or for a runner that cannot."""
        runners = self._kv_runners()
        keep = min(getattr(r, "kv_idle_blocks", self.num_kv_blocks) for r in runners)
        if keep >= self.num_kv_blocks or all(getattr(r, "kv_ready", 0) <= keep for r in runners):
            return
        mark = max(keep, self.block_manager.trim(keep))
        for r in runners:
            r.release_kv(mark)

    def _charge(self, plan: SchedulerOutput, started: float) -> None:
        """The step's wall time to its sequences, by the tokens each computed (a failed step's too)."""
        self.meter.charge(time.perf_counter() - started, [(s.seq.seq_id, s.num_new_tokens) for s in plan.scheduled])

    def _settle(self, out: StepOutput) -> StepOutput:
        """A finished output carries its sequence's GPU-seconds in its usage."""
        seconds = self.meter.release(out.request_id)
        if out.usage is not None:
            out.usage.gpu_seconds = seconds
        return out

    def _fail(self, plan: SchedulerOutput) -> list[str]:
        """Drop every sequence ``plan`` scheduled (those that finished during the
        step are gone already); their ids, in batch order."""
        ids = [s.seq.seq_id for s in plan.scheduled]
        for seq_id in ids:
            self._discard(seq_id)
            self.meter.release(seq_id)
        return ids

    def _run(self, plan: SchedulerOutput, outputs: list[StepOutput]) -> None:
        """Execute a non-empty plan, commit it and append the outputs (the hook
        speculative decoding overrides)."""
        logits = self.runner.execute(plan.scheduled)  # [num_sampled, V]
        seqs = [s.seq for s in plan.scheduled if s.needs_sampling]
        results = sample(logits, seqs, self.eos_token_ids)
        self.scheduler.commit(plan, [t for t, _ in results])
        for seq, (token, lp) in zip(seqs, results, strict=True):
            outputs.append(self._after_token(seq, token, lp))

    def _after_token(self, seq: Sequence, token: int, lp: Logprob | None) -> StepOutput:
        self._generated += 1
        self.meter.generated(seq.seq_id)
        event = self._stop_event(seq, token)
        if event is not None:
            self.scheduler.finish(seq, event)
            self._finished += 1
        return self._output(seq, [token], None if lp is None else [lp])

    def _stop_event(self, seq: Sequence, token: int) -> SeqEvent | None:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return SeqEvent.STOP
        if seq.num_output_tokens >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return SeqEvent.LENGTH
        return None

    def _output(self, seq: Sequence, tokens: list[int], lps: list[Logprob] | None) -> StepOutput:
        reason = seq.status.finish_reason
        usage = None
        if reason is not None:
            usage = Usage(
                prompt_tokens=seq.num_prompt_tokens,
                completion_tokens=seq.num_output_tokens,  # a resumed request's earlier ones too
                cached_tokens=seq.num_cached_tokens,
            )
        return StepOutput(
            request_id=seq.seq_id,
            new_token_ids=tokens,
            logprobs=lps,
            finished=reason is not None,
            finish_reason=reason,  # type: ignore[arg-type]
            usage=usage,
            seed=seq.params.seed or 0,
        )

    # -- introspection --------------------------------------------------------

    def drain_kv_events(self) -> list[Any]:
        return self.block_manager.drain_events()

    def statistics(self) -> EngineStatistics:
        s = self.scheduler.statistics()
        return EngineStatistics(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            num_requests_added=self._added,
            num_requests_finished=self._finished,
            num_tokens_generated=self._generated,
            num_steps=s.num_steps,
            num_preemptions=s.num_preemptions,
            kv_usage=s.kv.usage,
            prefix_hit_rate=s.kv.prefix_hit_rate,
            mean_batch_size=s.mean_batch_size,
            last_batch_size=s.last_batch_size,
            scheduler=s,
        )
