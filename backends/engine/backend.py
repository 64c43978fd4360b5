"""The built-in engine as an in-process :class:`~backends.base.Backend`.

One actor owns the :class:`LLMEngine`: the engine loop task. Request streams never
touch the engine; they queue commands (add, abort) and read their outputs from a
per-request memory channel::

    stream()  --add/abort-->  _commands  --+
                                           v
    engine loop:  apply commands -> trio.to_thread(engine.step) -> route StepOutputs
                                                                  -> per-request channel
    stream()  <--StepOutput-- channel: detokenize, stop strings -> Event

The model step runs in a worker thread, so the event loop keeps serving HTTP while
the CPU multiplies matrices. Commands are applied only between steps (the engine is
not thread-safe), so a cancelled consumer's sequence is aborted and its blocks freed
within one step. Stop strings need text, so they are matched here (the engine only
knows token ids); a match ends the stream and aborts the sequence.

A resumed request (``resumed_tokens=k``: the prompt ends with k tokens this
generation already produced and relayed, on another engine) continues the unbroken
run exactly: the engine counts those k as output (penalties, ``min_tokens``, limits,
``usage``), and here they are replayed through the detokenizer, the stop matcher and
the logprob offsets without being emitted, so whatever the unbroken run held back at
token k (half a UTF-8 character, the start of a stop string) is held back again::

    prompt_token_ids = P + E, resumed_tokens = len(E)
        replay E:  detokenize -> stop matcher -> offsets      (nothing emitted)
        then:      new tokens -> the same, emitted             (events name P, not P + E)

A failed step (an out-of-memory or kernel error) breaks only the streams whose
sequences it scheduled, with :class:`StreamBroken` (the router migrates them); the
engine freed their blocks and serves the rest.
"""

from __future__ import annotations

import codecs
import collections
import itertools
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import msgspec
import trio

from backends.base import (
    BackendInfo,
    Event,
    GenerateRequest,
    Health,
    KVEvent,
    Logprob,
    TopLogprob,
    Usage,
)
from backends.engine.config import EngineConfig
from backends.engine.dense import drop_dense, ensure_dense
from backends.engine.engine import LLMEngine, StepFailed, StepOutput
from backends.engine.generation_config import ResolvedSampling, resolve_sampling_defaults
from backends.engine.loader import LoadedModel, load_model
from backends.engine.quant import attach_q4
from backends.engine.runner import (
    TORCH_DTYPES,
    ModelRunner,
    kv_bytes_per_block,
    resolve_device,
)
from backends.engine.sequence import SamplingParams, Sequence
from backends.engine.speculative import SpecConfig, make_engine
from backends.engine.stop import StopMatcher
from backends.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from backends.engine.tp_comm import RankFailure
from backends.errors import (
    BackendUnavailable,
    BadRequest,
    ContextLengthExceeded,
    HeadraceError,
    StreamBroken,
)
from frontend.heap import release_free_heap

__all__ = ["BackendStatistics", "EngineBackend", "build_engine", "open_engine_backend"]

log = logging.getLogger(__name__)

_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_KV_EVENT_HISTORY = 10_000


def build_engine(
    config: EngineConfig, loaded: LoadedModel | None = None, spec: SpecConfig | None = None
) -> tuple[LLMEngine, Tokenizer, str]:
    """Load the model (unless given), size the KV cache, wire runner and engine
    (speculative when ``spec`` asks for it); blocking: seconds."""
    device = resolve_device(config.device)
    dtype = TORCH_DTYPES[config.dtype]
    if loaded is None:
        loaded = load_model(config.model, dtype=dtype, device=device)
    max_len = config.resolve_max_model_len(loaded.args.max_seq_len)
    per_block = kv_bytes_per_block(loaded.args, config.block_size, dtype)
    num_blocks = config.resolve_num_kv_blocks(per_block, max_len, device.type)
    runner = ModelRunner(
        loaded.model, num_blocks, config.block_size, device=device, dtype=dtype,
        batch_invariant=config.batch_invariant,
        kv_idle_blocks=config.resolve_kv_idle_blocks(per_block, num_blocks),
    )
    if config.packed_weights and loaded.q4:
        ensure_dense(runner.model)  # an earlier engine over this model may have dropped them
        attach_q4(runner.model, loaded.q4)
        plan = runner.model.native_plan()  # compile and lay out the native kernels now
        if plan is not None and config.batch_invariant and runner.device.type == "cpu":
            # every step runs natively: the layers' dense copies are never read (dense.py)
            drop_dense(runner.model, loaded.path)
            plan.rewatch()
    engine = make_engine(config, runner, loaded.tokenizer, spec)
    release_free_heap()  # the loader's float32 staging tensors, freed in heap-sized pieces
    log.info("engine %s: %s", loaded.name, runner.memory().line())
    return engine, loaded.tokenizer, loaded.name


def _advance(
    detok: IncrementalDetokenizer, stops: StopMatcher, new_ids: list[int]
) -> tuple[list[int], str, bool]:
    """Detokenize ``new_ids`` one at a time (a speculative step brings several)
    so that a stop string ends the event at the token that completed it: the
    event's ids then match its text, which a resume relies on."""
    text = ""
    for i, token in enumerate(new_ids):
        piece, stopped = stops.feed(detok.push([token]))
        text += piece
        if stopped:
            return list(new_ids[: i + 1]), text, True
    return list(new_ids), text, False


class _TextOffsets:
    """Names a request's logprob records (the sampler knows ids only): each
    token's text and bytes, and where it starts in the output text, counted in
    whole characters of the bytes before it (special tokens add none, as the
    detokenizer skips them). The same for a stream and a whole answer, however
    the detokenizer holds back a character split across tokens."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.piece = tokenizer.token_piece
        self.special = set(tokenizer.backend.get_added_tokens_decoder())
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.chars = 0

    def label(self, lp: Logprob) -> Logprob:
        text, raw = self.piece(lp.token_id)
        offset = self._count(lp.token_id, raw)
        top = [TopLogprob(t.token_id, t.logprob, *self.piece(t.token_id)) for t in lp.top]
        return Logprob(lp.token_id, lp.logprob, text, top, raw, offset)

    def skip(self, token_id: int) -> None:
        """Count a token that is not labelled (a resumed request's earlier output)."""
        self._count(token_id, self.piece(token_id)[1])

    def _count(self, token_id: int, raw: bytes) -> int:
        """Where the token starts; then move past it."""
        offset = self.chars
        if token_id not in self.special:
            self.chars += len(self.decoder.decode(raw))
        return offset


class _OutputText:
    """A request's output as text: detokenizer, stop matcher and logprob offsets,
    fed together one token at a time. ``replay`` feeds a resumed request's
    earlier output without emitting it, leaving all three as the unbroken run
    left them at that token."""

    def __init__(self, tokenizer: Tokenizer, prompt: list[int], request: GenerateRequest) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, prompt)
        self.stops = StopMatcher(request.stop)
        self.offsets = _TextOffsets(tokenizer) if request.logprobs is not None else None

    def replay(self, earlier: list[int]) -> bool:
        """Feed ``earlier`` and drop its text; True if it completed a stop string."""
        _, _, stopped = _advance(self.detok, self.stops, earlier)
        if self.offsets is not None:
            for token in earlier:
                self.offsets.skip(token)
        return stopped

    def advance(self, out: StepOutput) -> tuple[list[int], str, list[Logprob] | None, bool]:
        """The ids, text and logprobs ``out`` brings to the stream, and whether
        a stop string ended it (the ids then end at the token that completed it)."""
        ids, text, stopped = _advance(self.detok, self.stops, out.new_token_ids)
        if out.finished and not stopped:
            tail, stopped = self.stops.feed(self.detok.flush())
            text += tail + ("" if stopped else self.stops.flush())
        logprobs = out.logprobs
        if out.logprobs and self.offsets is not None:
            logprobs = [self.offsets.label(lp) for lp in out.logprobs[: len(ids)]]
        return ids, text, logprobs, stopped


class BackendStatistics(msgspec.Struct, frozen=True, kw_only=True):
    num_active_streams: int
    num_steps: int
    num_step_errors: int
    tokens_per_second: float  # generated tokens over the last ~10 s
    batch_size_histogram: dict[int, int]  # upper bucket bound -> steps
    last_kv_event_seq: int


@dataclass
class _Request:
    prompt: list[int]
    params: SamplingParams
    priority: int
    outputs: trio.MemorySendChannel[StepOutput | HeadraceError]
    resumed: int = 0  # the last tokens of ``prompt`` that are earlier output
    seq: Sequence | None = None
    tenant: str = "default"  # whose GPU time its steps are (the engine's accounting)


@dataclass
class _Rate:
    """Generated tokens per second over a sliding window of step timestamps."""

    window: float = 10.0
    points: collections.deque[tuple[float, int]] = field(default_factory=collections.deque)

    def add(self, now: float, tokens: int) -> None:
        self.points.append((now, tokens))
        while self.points and self.points[0][0] < now - self.window:
            self.points.popleft()

    def rate(self, now: float) -> float:
        recent = [n for t, n in self.points if t >= now - self.window]
        return sum(recent) / self.window


class EngineBackend:
    """Serve an :class:`LLMEngine` in-process. Start :meth:`run` in a nursery (or use
    :func:`open_engine_backend`) before streaming."""

    def __init__(
        self,
        engine: LLMEngine,
        tokenizer: Tokenizer,
        *,
        model_name: str,
        max_queued_requests: int = 1024,
        max_failed_steps: int = 3,
        run_step: Callable[[Callable[[], list[StepOutput]]], Awaitable[list[StepOutput]]] | None = None,
    ) -> None:
        """``run_step(fn)`` runs a model step off the event loop: a worker
        thread by default, the main thread under ``headrace engine``
        (:mod:`backends.engine.host`)."""
        self.engine = engine
        self._run_step = run_step if run_step is not None else trio.to_thread.run_sync
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.sampling: ResolvedSampling = resolve_sampling_defaults(
            engine.config, getattr(tokenizer, "recommended_sampling", None), model_name
        )
        if self.sampling.source:
            log.info(
                "%s: sampling defaults for unset request fields %s (from %s)",
                model_name,
                self.sampling.payload(),
                self.sampling.source,
            )
        self.max_queued_requests = max_queued_requests
        self._requests: dict[str, _Request] = {}
        self._commands: collections.deque[tuple[str, str]] = collections.deque()  # (op, request_id)
        self._wakeup = trio.Event()
        self._running = False
        self._stepping = False  # a step is running in the worker thread: queue commands
        self._closed = False
        self._fatal: str | None = None
        self._steps = 0
        self._step_errors = 0
        # Steps failed in a row: a wedged device (a lost CUDA context, a
        # failing driver) fails every step; after max_failed_steps the engine
        # gives up (stopped is set) so its supervisor restarts the process.
        self.max_failed_steps = max_failed_steps
        self._failed_in_a_row = 0
        self.stopped = trio.Event()
        self._rate = _Rate()
        self._histogram = dict.fromkeys(_BATCH_BUCKETS, 0)
        self._kv_events: collections.deque[KVEvent] = collections.deque(maxlen=_KV_EVENT_HISTORY)
        self._kv_changed = trio.Event()

    # ---- Backend protocol ----------------------------------------------------------

    def info(self) -> BackendInfo:
        return BackendInfo(
            name="engine",
            models=(self.model_name,),
            max_context=self.engine.max_model_len,
            token_ids=True,
            kv_events=self.engine.config.enable_kv_events,
            seeds=True,
            block_size=self.engine.block_size,
            kv_capacity_blocks=self.engine.block_manager.num_blocks,
            prefix_sharing=self.engine.scheduler.shares_prefixes,
            exact_resume=bool(getattr(self.engine.runner, "batch_invariant", False)),
        )

    @property
    def fatal(self) -> str | None:
        """Why the engine gave up (None while it serves)."""
        return self._fatal

    async def health(self) -> Health:
        if self._fatal is not None:
            return Health(ok=False, detail=self._fatal)
        failure = getattr(self.engine.runner, "failure", None)  # a tensor-parallel rank died
        if failure:
            return Health(ok=False, detail=failure)
        if not self._running:
            return Health(ok=False, detail="engine loop not running")
        return Health(ok=True)

    async def aclose(self) -> None:
        self._closed = True
        self._wakeup.set()

    async def stream(self, request: GenerateRequest) -> AsyncIterator[Event]:
        """Generate for ``request``; closing or cancelling the iterator aborts it."""
        prompt = self.prompt_ids(request)
        k = _resumed_tokens(request, prompt)
        original = prompt[: len(prompt) - k]
        text = _OutputText(self.tokenizer, original, request)
        stopped = text.replay(prompt[len(original) :])
        used_up = request.max_tokens is None and k >= self.engine.config.default_max_tokens
        if stopped or used_up:  # the earlier output already ended the generation
            yield Event(
                prompt_token_ids=original,
                seed=request.seed,
                finish_reason="stop" if stopped else "length",
                usage=Usage(prompt_tokens=len(original), completion_tokens=k),
            )
            return
        params = self._params(request, len(prompt), k)
        rid = f"{request.request_id or 'req'}-{uuid.uuid4().hex[:8]}"
        send, recv = trio.open_memory_channel[StepOutput | HeadraceError](params.max_tokens + 2)
        self._submit(rid, _Request(prompt, params, request.priority, send, resumed=k, tenant=request.tenant))
        try:
            async for event in self._events(rid, original, text, k, recv):
                yield event
        finally:
            self._abort(rid)

    # ---- request side ----------------------------------------------------------------

    def prompt_ids(self, request: GenerateRequest) -> list[int]:
        """Token ids of the request's input: ids, messages (chat template) or text."""
        tok = self.tokenizer
        if request.prompt_token_ids is not None:
            tok.check_ids(request.prompt_token_ids)
            return list(request.prompt_token_ids)
        if request.messages is not None:
            messages = [msgspec.structs.asdict(m) for m in request.messages]
            text = tok.apply_chat_template(messages, add_generation_prompt=True)
            return tok.encode(text, add_special_tokens=False)
        return tok.encode(request.prompt or "")

    def _params(self, request: GenerateRequest, n_prompt: int, resumed: int = 0) -> SamplingParams:
        """The request's sampling; a resumed request's limits are what remains of
        them, its default ``max_tokens`` what the unbroken run's default left."""
        room = self.engine.max_model_len - n_prompt
        if room < 1:
            raise ContextLengthExceeded(
                f"the prompt has {n_prompt} tokens; this model's context is {self.engine.max_model_len}",
                param="prompt",
            )
        default = min(self.engine.config.default_max_tokens - resumed, room)
        params = SamplingParams.from_request(
            request, default_max_tokens=default, defaults=self.sampling.defaults
        )
        stop_ids = set(params.stop_token_ids)
        if any(not 0 <= t < self.tokenizer.vocab_size for t in stop_ids):
            raise BadRequest("stop_token_ids must be in the vocabulary", param="stop_token_ids")
        return params

    def _submit(self, rid: str, req: _Request) -> None:
        if self._closed or self._fatal is not None:
            raise BackendUnavailable(self._fatal or "engine is shutting down", retry_after=1.0)
        if not self._running:
            raise BackendUnavailable("engine loop not running", retry_after=1.0)
        if len(self._requests) >= self.max_queued_requests:
            raise BackendUnavailable("engine queue is full", retry_after=1.0)
        if not self._stepping:  # the engine is ours right now: errors reach the caller directly
            req.seq = self._add(rid, req)
            self._requests[rid] = req
        else:
            self._requests[rid] = req
            self._commands.append(("add", rid))
        self._wakeup.set()

    def _abort(self, rid: str) -> None:
        if self._requests.pop(rid, None) is None:
            return
        if self._stepping:  # applied as soon as the step in flight returns
            self._commands.append(("abort", rid))
        else:
            self.engine.abort(rid)
        self._wakeup.set()

    def _add(self, rid: str, req: _Request) -> Sequence:
        return self.engine.add_request(
            rid, req.prompt, req.params, req.priority, resumed_tokens=req.resumed, tenant=req.tenant
        )

    async def _events(
        self,
        rid: str,
        prompt: list[int],
        output: _OutputText,
        emitted: int,
        recv: trio.MemoryReceiveChannel[StepOutput | HeadraceError],
    ) -> AsyncIterator[Event]:
        """Events from the engine's outputs. ``prompt`` is the original prompt
        and ``emitted`` the tokens already out (a resumed request's earlier ones)."""
        first = True
        async with recv:
            async for out in recv:
                if isinstance(out, HeadraceError):
                    raise out
                ids, text, logprobs, stopped = output.advance(out)
                emitted += len(ids)
                event = Event(token_ids=ids, text=text, logprobs=logprobs)
                if first:
                    event.prompt_token_ids, event.seed, first = prompt, out.seed, False
                if stopped or out.finished:
                    event.finish_reason = "stop" if stopped else out.finish_reason
                    usage = out.usage if out.usage is not None and len(ids) == len(out.new_token_ids) else None
                    event.usage = self._usage(rid, prompt, emitted, usage)
                    yield event
                    return
                yield event
        raise StreamBroken("engine stopped before the generation finished")

    def _usage(self, rid: str, prompt: list[int], emitted: int, usage: Usage | None) -> Usage:
        if usage is not None:
            return usage
        req = self._requests.get(rid)
        cached = req.seq.num_cached_tokens if req is not None and req.seq is not None else 0
        return Usage(prompt_tokens=len(prompt), completion_tokens=emitted, cached_tokens=cached)

    # ---- the engine loop (the actor) -------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The engine loop. Returns after :meth:`aclose`; cancel it to stop at once."""
        self._running = True
        task_status.started()
        try:
            while not self._closed:
                self._apply_commands()
                if not self.engine.has_unfinished():
                    await self._wakeup.wait()
                    self._wakeup = trio.Event()
                    continue
                await self._step()
        finally:
            self._running = False
            for req in self._requests.values():
                req.outputs.close()

    def _apply_commands(self) -> None:
        while self._commands:
            op, rid = self._commands.popleft()
            if op == "abort":
                self.engine.abort(rid)
                continue
            req = self._requests.get(rid)
            if req is None:  # cancelled before it was added
                continue
            try:
                req.seq = self._add(rid, req)
            except HeadraceError as exc:
                self._deliver(rid, req, exc)

    async def _step(self) -> None:
        self._stepping = True
        try:
            outputs = await self._run_step(self.engine.step)
        except StepFailed as exc:
            if isinstance(exc.cause, RankFailure):
                self._stop(exc.cause)
            else:
                self._fail_step(exc)
            return
        except RankFailure as exc:
            self._stop(exc)
            return
        except Exception as exc:  # outside any batch (a scheduler bug): fail everything, keep serving
            log.exception("engine step failed")
            self._step_errors += 1
            self._fail_all(f"engine step failed: {type(exc).__name__}: {exc}")
            return
        finally:
            self._stepping = False
        self._steps += 1
        self._failed_in_a_row = 0
        self._record(outputs)
        for out in outputs:
            req = self._requests.get(out.request_id)
            if req is not None:
                self._deliver(out.request_id, req, out)
        events = self.engine.drain_kv_events()
        if events:
            self._kv_events.extend(events)
            self._kv_changed.set()
            self._kv_changed = trio.Event()

    def _deliver(self, rid: str, req: _Request, item: StepOutput | HeadraceError) -> None:
        """Hand an output to its consumer. A consumer that already left (it
        saw a stop string, or was cancelled, and closed its channel before its
        abort was applied) is not an engine error: abort the request."""
        try:
            req.outputs.send_nowait(item)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self._abort(rid)

    def _stop(self, exc: RankFailure) -> None:
        """A tensor-parallel rank died: this engine is done."""
        self._give_up(exc.message)

    def _give_up(self, detail: str) -> None:
        """This engine cannot serve any more: fail everything, refuse new work,
        report unhealthy, and set :attr:`stopped` (the server then exits, and
        the replica's supervisor starts a fresh process)."""
        log.error("engine stopped: %s", detail)
        self._fatal = detail
        self._fail_all(detail)
        self._closed = True
        self.stopped.set()

    def _fail_step(self, exc: StepFailed) -> None:
        """A torch/runtime failure (out of memory, a kernel error) in one step:
        break the streams it touched (the engine dropped their sequences and
        freed their blocks); every other request carries on."""
        log.error(
            "engine step failed for %d requests", len(exc.request_ids), exc_info=exc.cause
        )
        self._step_errors += 1
        for rid in exc.request_ids:
            req = self._requests.get(rid)
            if req is not None:
                self._deliver(rid, req, StreamBroken(f"engine step failed: {exc}"))
        self._failed_in_a_row += 1
        if self._failed_in_a_row >= self.max_failed_steps:
            self._give_up(f"{self._failed_in_a_row} engine steps in a row failed (the last: {exc})")

    def _fail_all(self, detail: str) -> None:
        for rid, req in list(self._requests.items()):
            self.engine.abort(rid)
            self._deliver(rid, req, StreamBroken(detail))

    def _record(self, outputs: list[StepOutput]) -> None:
        tokens = sum(len(o.new_token_ids) for o in outputs)
        self._rate.add(trio.current_time(), tokens)
        batch = self.engine.statistics().last_batch_size
        bucket = next((b for b in _BATCH_BUCKETS if batch <= b), _BATCH_BUCKETS[-1])
        self._histogram[bucket] += 1

    # ---- KV events ------------------------------------------------------------------------

    async def kv_events(self, since: int = -1) -> AsyncIterator[KVEvent]:
        """KV events with ``seq > since``, then new ones as they happen (forever).
        Events older than the last 10,000 are gone; a subscriber that fell that far
        behind sees a gap in ``seq`` and should resynchronise."""
        last = since
        while True:
            changed = self._kv_changed
            kept = self._kv_events
            if kept and kept[-1].seq > last:
                # Sequence numbers are consecutive, so skip straight to the resume point;
                # snapshot, since the deque grows while we are suspended in yield.
                start = max(0, last + 1 - kept[0].seq)
                for event in list(itertools.islice(kept, start, None)):
                    if event.seq > last:
                        last = event.seq
                        yield event
            await changed.wait()

    # ---- statistics -------------------------------------------------------------------------

    def statistics(self) -> BackendStatistics:
        return BackendStatistics(
            num_active_streams=len(self._requests),
            num_steps=self._steps,
            num_step_errors=self._step_errors,
            tokens_per_second=self._rate.rate(trio.current_time()),
            batch_size_histogram=dict(self._histogram),
            last_kv_event_seq=self._kv_events[-1].seq if self._kv_events else -1,
        )


def _resumed_tokens(request: GenerateRequest, prompt: list[int]) -> int:
    """``request.resumed_tokens``, checked: token-id input, at least one prompt token left."""
    k = request.resumed_tokens
    if k == 0:
        return 0
    if k < 0 or request.prompt_token_ids is None or k >= len(prompt):
        raise BadRequest(
            "resumed_tokens must be >= 0, with prompt token ids of which it leaves at "
            f"least one (got {k} of {len(prompt)})",
            param="resumed_tokens",
        )
    return k


@asynccontextmanager
async def open_engine_backend(
    engine: LLMEngine, tokenizer: Tokenizer, *, model_name: str, max_queued_requests: int = 1024
) -> AsyncIterator[EngineBackend]:
    """An :class:`EngineBackend` with its loop running; the loop stops on exit."""
    backend = EngineBackend(
        engine, tokenizer, model_name=model_name, max_queued_requests=max_queued_requests
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(backend.run)
        try:
            yield backend
        finally:
            await backend.aclose()
            nursery.cancel_scope.cancel()
