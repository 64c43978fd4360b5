"""The order in which an HTTP/2 connection's streams get to send: round robin
over the streams that have data, O(1) per frame.

hypercorn 0.18 asks ``priority.PriorityTree`` for the next stream before each
DATA frame. That tree keeps every open stream in a heap and pops the idle
ones (blocked: nothing buffered, or no window) until it finds one with data,
then pushes them all back: O(k log k) per frame with k idle streams. A
router holds many idle streams per connection (requests waiting in the
admission queue, streams between tokens), and with ~200 of them the tree
took 28% of the router's CPU under ``headrace bench overload`` (py-spy).

RFC 9113 deprecates RFC 7540's priority tree (clients' PRIORITY frames are
advisory and most send none), so this scheduler ignores weights and
dependencies: every stream with data gets one frame in turn, which is also
what keeps one busy stream from starving the others. It keeps the
PriorityTree methods and exceptions hypercorn uses, so it drops in as
``H2Protocol.priority`` (frontend/serving.py).
"""

from __future__ import annotations

from collections import OrderedDict

from priority.priority import (
    DeadlockError,
    DuplicateStreamError,
    MissingStreamError,
    PseudoStreamError,
)

__all__ = ["RoundRobinStreams"]


class RoundRobinStreams:
    """Streams known (blocked or not) and, in turn order, those with data."""

    __slots__ = ("_active", "_known")

    def __init__(self) -> None:
        self._known: set[int] = set()
        self._active: OrderedDict[int, None] = OrderedDict()

    def insert_stream(
        self, stream_id: int, depends_on: int | None = None, weight: int = 16, exclusive: bool = False
    ) -> None:
        """A new stream, with data to send until :meth:`block` (as the tree)."""
        if stream_id == 0 or stream_id in self._known:  # 0: the tree's root
            raise DuplicateStreamError(f"Stream {stream_id} already in tree")
        self._known.add(stream_id)
        self._active[stream_id] = None

    def reprioritize(
        self, stream_id: int, depends_on: int | None = None, weight: int = 16, exclusive: bool = False
    ) -> None:
        """Priority signals are advisory (RFC 9113 5.3): known, then ignored."""
        if stream_id == 0:
            raise PseudoStreamError("Cannot reprioritize stream 0")
        if stream_id not in self._known:
            raise MissingStreamError(f"Stream {stream_id} not in tree")

    def remove_stream(self, stream_id: int) -> None:
        if stream_id == 0:
            raise PseudoStreamError("Cannot remove stream 0")
        try:
            self._known.remove(stream_id)
        except KeyError:
            raise MissingStreamError(f"Stream {stream_id} not in tree") from None
        self._active.pop(stream_id, None)

    def block(self, stream_id: int) -> None:
        """Nothing to send for now (no data, or no window)."""
        if stream_id == 0:
            raise PseudoStreamError("Cannot block stream 0")
        if stream_id not in self._known:
            raise MissingStreamError(f"Stream {stream_id} not in tree")
        self._active.pop(stream_id, None)

    def idle(self) -> bool:
        """No stream waits for its turn: the send task has nothing to do."""
        return not self._active

    def unblock(self, stream_id: int) -> None:
        """Data to send: the stream joins the turn at the back (or keeps its place)."""
        if stream_id == 0:
            raise PseudoStreamError("Cannot unblock stream 0")
        if stream_id not in self._known:
            raise MissingStreamError(f"Stream {stream_id} not in tree")
        self._active.setdefault(stream_id, None)

    def __iter__(self) -> RoundRobinStreams:
        return self

    def __next__(self) -> int:
        """The stream whose turn it is; it goes to the back of the turn."""
        try:
            stream_id = next(iter(self._active))
        except StopIteration:
            raise DeadlockError("No unblocked streams to schedule.") from None
        self._active.move_to_end(stream_id)
        return stream_id
