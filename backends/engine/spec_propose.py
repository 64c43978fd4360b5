"""Proposers for speculative decoding: guess the next few tokens cheaply.

Prompt lookup (n-gram matching, TGI/vLLM "ngram"): find the most recent earlier
occurrence of the sequence's last ``n`` tokens (``n`` from ``max_n`` down to
``min_n``, the longest match wins) and propose the tokens that followed it. It
costs no model call and shines on summarisation, code edits, RAG and any output
that quotes its prompt or repeats itself.

:func:`ngram_propose` is the stateless definition (a backwards scan, O(L·n) per
call). :class:`NgramProposer` gives the same answers from an incremental index per
sequence (n-gram -> where its most recent continuation starts), so a step costs
O(new tokens · max_n) rather than a rescan of a long context. Both only ever read
tokens that are committed (drafts are appended after proposing).

The draft-model proposer lives in :mod:`backends.engine.speculative` since it needs
a runner; it proposes through the same interface.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

__all__ = ["NgramProposer", "ngram_propose"]


def _check_n(min_n: int, max_n: int) -> None:
    if not 1 <= min_n <= max_n:
        raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")


def ngram_propose(tokens: Seq[int], k: int, *, min_n: int = 1, max_n: int = 4) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the
    longest suffix n-gram (``max_n >= n >= min_n``) of ``tokens``; [] if none."""
    _check_n(min_n, max_n)
    size = len(tokens)
    if k <= 0:
        return []
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = list(tokens[size - n :])
        # occurrences starting at j, ending before the suffix's own last token
        for j in range(size - n - 1, -1, -1):
            if tokens[j + n - 1] == suffix[-1] and list(tokens[j : j + n]) == suffix:
                return list(tokens[j + n : j + n + k])
    return []


class _Index:
    """n-gram tuple -> start of the continuation after its most recent occurrence,
    for every n-gram of ``tokens[:num_indexed]`` that has a following token."""

    __slots__ = ("num_indexed", "table")

    def __init__(self) -> None:
        self.table: dict[tuple[int, ...], int] = {}
        self.num_indexed = 0  # tokens seen; n-grams ending at e <= num_indexed - 1 indexed


class NgramProposer:
    """Prompt lookup with a per-sequence incremental index. Call :meth:`forget`
    when a sequence ends."""

    def __init__(self, *, min_n: int = 1, max_n: int = 4) -> None:
        _check_n(min_n, max_n)
        self.min_n = min_n
        self.max_n = max_n
        self._index: dict[str, _Index] = {}

    def propose(self, seq_id: str, tokens: Seq[int], k: int) -> list[int]:
        """Same answer as ``ngram_propose(tokens, k, min_n=..., max_n=...)``.
        ``tokens`` must only grow between calls for one ``seq_id`` (a shorter
        list rebuilds the index)."""
        if k <= 0:
            return []
        index = self._catch_up(seq_id, tokens)
        size = len(tokens)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            start = index.table.get(tuple(tokens[size - n :]))
            if start is not None:
                return list(tokens[start : start + k])
        return []

    def _catch_up(self, seq_id: str, tokens: Seq[int]) -> _Index:
        index = self._index.get(seq_id)
        if index is None or index.num_indexed > len(tokens):
            index = self._index[seq_id] = _Index()
        table, max_n = index.table, self.max_n
        # n-grams ending at e (exclusive) for e in (old last, new last]; the
        # continuation of an n-gram ending at e starts at e
        for e in range(max(index.num_indexed, 1), len(tokens)):
            for n in range(1, min(max_n, e) + 1):
                table[tuple(tokens[e - n : e])] = e
        index.num_indexed = max(index.num_indexed, len(tokens))
        return index

    def forget(self, seq_id: str) -> None:
        self._index.pop(seq_id, None)

    @property
    def num_tracked(self) -> int:
        return len(self._index)
