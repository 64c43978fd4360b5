"""An in-process Backend over the reference model, with switchable flaws, to
prove that ``check_backend`` passes a correct adapter and fails broken ones."""

from __future__ import annotations

from collections.abc import AsyncIterator

import trio
import trio.lowlevel

from backends.base import BackendInfo, Event, GenerateRequest, Health, Usage
from backends.errors import ContextLengthExceeded, ModelNotFound

from .reference_model import Sampling, generate, tokenize

BACKEND_FLAWS = frozenset({
    "two_finals", "no_usage", "usage_off", "raw_error", "wedge_on_cancel", "seed_ignored",
    "resume_drift", "stop_no_straddle", "max_tokens_off_by_one",
})


class ReferenceBackend:
    def __init__(self, flaws: frozenset[str] = frozenset(), *, max_context: int = 512) -> None:
        self.flaws, self.max_context = frozenset(flaws), max_context
        self.slots = trio.Semaphore(4)  # "wedge_on_cancel" leaks one per abandoned stream
        self.closed = 0

    def info(self) -> BackendInfo:
        return BackendInfo(name="reference", models=("ref-model",), max_context=self.max_context,
                           token_ids=True, seeds=True)

    async def health(self) -> Health:
        return Health(ok=True)

    async def aclose(self) -> None:
        self.closed += 1

    async def stream(self, request: GenerateRequest) -> AsyncIterator[Event]:
        prompt = self._prompt(request)
        temperature = 1.0 if request.temperature is None else request.temperature  # OpenAI default
        sampling = Sampling(max_tokens=request.max_tokens or 16, temperature=temperature,
                            seed=request.seed, stop=list(request.stop), ignore_eos=request.ignore_eos)
        gen = generate(prompt, sampling, self.flaws & {"seed_ignored", "resume_drift",
                                                        "stop_no_straddle", "max_tokens_off_by_one"})
        if "wedge_on_cancel" in self.flaws:
            await self.slots.acquire()  # released only when the stream completes
        else:
            await trio.lowlevel.checkpoint()
        for i, (token, piece) in enumerate(zip(gen.ids[:-1], gen.pieces[:-1], strict=True)):
            await trio.lowlevel.checkpoint()
            yield Event(token_ids=[token], text=piece, prompt_token_ids=prompt if i == 0 else None)
            if "two_finals" in self.flaws and i == 0:
                yield Event(finish_reason="stop", usage=Usage(len(prompt), 1))
        done = len(gen.ids) + (1 if "usage_off" in self.flaws else 0)
        usage = None if "no_usage" in self.flaws else Usage(len(prompt), done)
        tail_ids, tail_text = gen.ids[-1:], "".join(gen.pieces[-1:])
        first = prompt if len(gen.ids) <= 1 else None
        if "wedge_on_cancel" in self.flaws:
            self.slots.release()
        yield Event(token_ids=tail_ids, text=tail_text, finish_reason=gen.finish,  # type: ignore[arg-type]
                    usage=usage, prompt_token_ids=first)

    def _prompt(self, request: GenerateRequest) -> list[int]:
        if request.model not in (None, "ref-model"):
            if "raw_error" in self.flaws:
                raise KeyError(request.model)
            raise ModelNotFound(f"no model {request.model!r}")
        if request.prompt_token_ids is not None:
            ids = list(request.prompt_token_ids)
        elif request.messages is not None:
            ids = tokenize("".join(f"<{m.role}>{m.content}" for m in request.messages))
        else:
            ids = tokenize(request.prompt or "")
        if len(ids) + 1 > self.max_context:
            raise ContextLengthExceeded(f"{len(ids)} prompt tokens exceed {self.max_context}")
        return ids
