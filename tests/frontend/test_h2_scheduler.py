"""The round-robin stream scheduler that replaces hypercorn's priority tree:
each stream with data gets one turn in order, blocked and removed streams
none, and every call fails (or not) as ``priority.PriorityTree`` does, so
hypercorn's handlers see the same exceptions; hypercorn calls only what it
provides, and its H2 connections use it."""

from __future__ import annotations

import inspect
import re

import priority
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from frontend import serving  # installs the patch
from frontend.h2_scheduler import RoundRobinStreams

OPS = st.lists(
    st.tuples(st.sampled_from(["insert", "block", "unblock", "remove", "reprioritize", "next"]), st.integers(0, 6)),
    max_size=60,
)


def apply(target: object, op: str, sid: int) -> object:
    """The op's result, or the class of what it raised."""
    try:
        if op == "next":
            return next(target)  # type: ignore[call-overload]
        if op == "insert":
            return target.insert_stream(sid)  # type: ignore[attr-defined]
        if op == "remove":
            return target.remove_stream(sid)  # type: ignore[attr-defined]
        if op == "reprioritize":
            return target.reprioritize(sid, weight=32)  # type: ignore[attr-defined]
        return getattr(target, op)(sid)
    except priority.PriorityError as exc:
        return type(exc)


@settings(max_examples=300)
@given(OPS)
def test_every_call_fails_as_the_priority_tree_does_and_next_gives_a_stream_with_data(ops: list[tuple[str, int]]) -> None:
    ours, tree = RoundRobinStreams(), priority.PriorityTree()
    active: set[int] = set()
    for op, sid in ops:
        mine, theirs = apply(ours, op, sid), apply(tree, op, sid)
        if op == "next":
            # which stream goes next may differ (weights), whether one can may not
            assert (mine is priority.DeadlockError) == (theirs is priority.DeadlockError)
            assert mine is priority.DeadlockError or mine in active
        else:
            assert mine == theirs, (op, sid)
            if mine is None:
                if op in ("insert", "unblock"):
                    active.add(sid)
                elif op in ("block", "remove"):
                    active.discard(sid)


def test_streams_with_data_take_turns_and_a_blocked_one_waits() -> None:
    s = RoundRobinStreams()
    for sid in (1, 3, 5, 7):
        s.insert_stream(sid)
    assert [next(s) for _ in range(8)] == [1, 3, 5, 7, 1, 3, 5, 7]
    s.block(3)
    s.unblock(5)  # already has data: keeps its place
    assert [next(s) for _ in range(6)] == [1, 5, 7, 1, 5, 7]
    s.unblock(3)  # back at the end of the turn
    assert [next(s) for _ in range(4)] == [1, 5, 7, 3]
    for sid in (1, 5, 7):
        s.remove_stream(sid)
    s.block(3)
    with pytest.raises(priority.DeadlockError):
        next(s)


def test_a_thousand_idle_streams_cost_nothing_per_turn() -> None:
    """What the tree popped and pushed back per frame, the scheduler never looks at."""
    s = RoundRobinStreams()
    for sid in range(1, 2002, 2):
        s.insert_stream(sid)
        s.block(sid)
    s.unblock(2001)
    assert {next(s) for _ in range(100)} == {2001}
    assert len(s._active) == 1


def test_hypercorn_calls_only_what_the_scheduler_provides_and_its_connections_use_it() -> None:
    from hypercorn.protocol import h2 as hypercorn_h2

    called = set(re.findall(r"self\.priority\.(\w+)", inspect.getsource(hypercorn_h2)))
    called |= set(re.findall(r"self\.priority\.(\w+)", inspect.getsource(serving)))
    assert called and all(callable(getattr(RoundRobinStreams, name, None)) for name in called), called
    assert "next(self.priority)" in inspect.getsource(hypercorn_h2)
    caught = set(re.findall(r"priority\.(\w+Error)", inspect.getsource(hypercorn_h2)))
    assert caught <= {"DeadlockError", "MissingStreamError", "DuplicateStreamError"}, caught
    assert "self.priority = priority.PriorityTree()" in inspect.getsource(hypercorn_h2)
    # serving's __init__, which swaps the tree for the scheduler, is in the chain of wrappers
    chain, init = [], hypercorn_h2.H2Protocol.__init__
    while init is not None:
        chain.append(init.__qualname__)
        cells = [c.cell_contents for c in init.__closure__ or () if callable(c.cell_contents)]
        init = next((c for c in cells if getattr(c, "__name__", "") == "__init__"), None)
    assert "_schedule_streams_round_robin.<locals>.__init__" in chain, chain
