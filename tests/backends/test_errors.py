"""``drop_tracebacks``: an exception kept after it was handled leaves no reference
cycle through its traceback, nor through those of what it chains."""

from __future__ import annotations

import gc
import weakref

from backends.errors import StreamBroken, drop_tracebacks


class State:
    """What a request's frames hold: freed or not is what the test reads."""


def _failing(state: State, keep: list[BaseException]) -> None:
    try:
        try:
            raise ConnectionResetError("peer reset")
        except ConnectionResetError as low:
            raise StreamBroken("backend stream broke") from low
    except StreamBroken as exc:
        keep.append(exc)  # kept after the block, as a migration keeps it
        kept = exc  # and by this frame, which its traceback holds: the cycle
        assert kept is exc and state is not None


def test_a_kept_exception_and_the_state_its_frames_held_are_freed_once_handled() -> None:
    def run(forget: bool) -> tuple[weakref.ref[State], list[BaseException]]:
        state, keep = State(), []
        ref = weakref.ref(state)
        _failing(state, keep)
        del state
        if forget:
            drop_tracebacks(keep[0])
        return ref, keep

    gc.collect()
    gc.disable()
    try:
        ref, keep = run(forget=False)
        assert ref() is not None  # held by a frame of the kept error's traceback
        ref, keep = run(forget=True)
        assert ref() is None
        error = keep[0]
        assert error.__traceback__ is None and error.__cause__ is not None and error.__cause__.__traceback__ is None
        assert str(error) == "backend stream broke"  # the message, type and chain stay
    finally:
        gc.enable()


def test_a_chain_with_a_loop_in_it_ends() -> None:
    a, b = ValueError("a"), KeyError("b")
    a.__context__, b.__context__ = b, a
    drop_tracebacks(a)  # returns: each exception visited once
    assert a.__context__ is b
