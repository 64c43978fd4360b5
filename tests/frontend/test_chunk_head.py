"""A streamed chunk is its call's head, encoded once, then its choice: the
same bytes as encoding the whole envelope per chunk, whatever the kind,
the text (escapes, non-ASCII), the ids, and when the answering model
changes between chunks. A streamed choice keeps the text's length, not the
text: the logprobs' text offsets come out the same."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from backends.base import BackendInfo, Event, Logprob, Usage
from frontend.call import _Choice, _Streamed, prepare_call, sse
from frontend.context import RequestContext
from frontend.wire import chunk_choice


class _Models:
    def info(self) -> BackendInfo:
        return BackendInfo(name="b", models=("m", 'm"2\u00e9'))


events = st.builds(
    Event,
    text=st.text(max_size=12),
    token_ids=st.lists(st.integers(0, 2**31), max_size=3),
    finish_reason=st.sampled_from([None, "stop", "length"]),
    seed=st.one_of(st.none(), st.integers(0, 2**31)),
    model=st.one_of(st.none(), st.sampled_from(["m", "m2"])),
    usage=st.one_of(st.none(), st.builds(Usage, st.integers(0, 9), st.integers(0, 9))),
    logprobs=st.one_of(st.none(), st.lists(st.builds(Logprob, token_id=st.integers(0, 99), logprob=st.just(-0.5),
                                                     token=st.text(max_size=3)), min_size=1, max_size=2)),
)


@settings(max_examples=150, deadline=None)
@given(kind=st.sampled_from(["chat", "completion"]), ids=st.booleans(), batch=st.lists(events, min_size=1, max_size=6),
       switch=st.integers(0, 6), index=st.integers(0, 12))
def test_a_chunk_is_the_whole_envelope_encoded(kind: str, ids: bool, batch: list[Event], switch: int, index: int) -> None:
    body = {"model": "m", "stream": True, "return_token_ids": ids}
    body.update({"messages": [{"role": "user", "content": "x"}]} if kind == "chat" else {"prompt": "x"})
    call = prepare_call(kind, json.dumps(body).encode(), _Models(), RequestContext(request_id="r"))  # type: ignore[arg-type]
    mine, theirs = _Streamed(), _Choice()
    for n, event in enumerate(batch):
        if n == switch:
            call.model = 'm"2\u00e9'  # a fallback model answered: the head follows
        got = call._chunk(index, event, mine)
        first = theirs.events == 0
        offset = len(theirs.text)
        theirs.add(event)
        choice = chunk_choice(call.kind, index, event, token_ids=call.token_ids, first=first, text_offset=offset)
        assert got == sse(call._envelope([choice], None))
        assert json.loads(got[6:])["model"] == call.model
        assert mine.text_length == len(theirs.text) and mine.events == theirs.events
        assert (mine.model, mine.finish_reason, mine.usage) == (theirs.model, theirs.finish_reason, theirs.usage)
