"""Proposers for speculative decoding: guess the next few tokens cheaply.

Prompt lookup (n-gram matching, TGI/vLLM "ngram"): find the most recent earlier
occurrence of the sequence's last ``n`` tokens (``n`` from ``max_n`` down to
``min_n``, the longest match wins) and propose the tokens that followed it. It
costs no model call and shines on summarisation, code edits, RAG and any output
that quotes its prompt or repeats itself. The proposal comes with the length of
the match, extended backwards past ``n`` (up to :data:`MAX_MATCH`): how much
context agrees is what predicts acceptance (spec_policy.MatchAcceptance).

:func:`ngram_lookup` is the stateless definition (a backwards scan, O(L·n) per
call). :class:`NgramProposer` gives the same answers from an incremental index per
sequence (n-gram -> where its most recent continuation starts), so a step costs
O(new tokens · max_n) rather than a rescan of a long context. Both only ever read
tokens that are committed (drafts are appended after proposing).

A draft model (:class:`DraftProposer`) is any cheaper model with the target's
vocabulary that a runner can drive: a quantised copy, or the target's first layers
with its head (:func:`layer_skip_model`, weights shared). It keeps its own paged KV
tensor indexed by the *target's* block tables (same block ids, its own layers), so
it needs no allocator of its own; per sequence it remembers how many positions its
KV covers and catches up (prompt, accepted tokens) in the first of its ``k`` passes.
Its KV in blocks shared through the prefix cache may have been written by a
sequence that never drafted: that only lowers acceptance, never correctness,
because verification is exact.

How many of the proposed tokens to verify is spec_policy's call (a measured cost
model and per-match-length acceptance estimates).

Draft sampling, per request: greedy requests draft the argmax; sampled requests
either draw with the *target's* noise for (seed, position) ("match" mode: the
proposal is a deterministic function of the prefix, so verification can use the
match rule and the output is bit-identical to plain decoding), or draw from the
draft distribution ``q`` with independent keyed noise ("rejection" mode: the
engine verifies with Leviathan/Chen rejection sampling and needs ``q``).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from backends.engine.model import Transformer
from backends.engine.sampling import sample
from backends.engine.scheduler import ScheduledSeq
from backends.engine.sequence import Sequence
from backends.engine.spec_verify import DRAFT_STREAM, keyed_gumbel, processed_logits

__all__ = [
    "MAX_MATCH",
    "DraftProposal",
    "DraftProposer",
    "Lookup",
    "NgramProposer",
    "TokenProposer",
    "layer_skip_model",
    "ngram_lookup",
    "ngram_propose",
]


class Lookup(NamedTuple):
    """A model-free proposal: the draft ``tokens`` and the length of the suffix
    match they continue (how much context agrees: the acceptance predictor)."""

    tokens: list[int]
    match: int


class TokenProposer(Protocol):
    """A model-free proposer (the n-gram one; tests plug in an oracle): up to
    ``k`` guesses after ``tokens`` (committed tokens only)."""

    def lookup(self, seq_id: str, tokens: Seq[int], k: int) -> Lookup: ...

    def forget(self, seq_id: str) -> None: ...


# A match is measured up to this many tokens (longer ones are all "very sure").
MAX_MATCH = 32


def _check_n(min_n: int, max_n: int) -> None:
    if not 1 <= min_n <= max_n:
        raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")


def ngram_lookup(tokens: Seq[int], k: int, *, min_n: int = 1, max_n: int = 8) -> Lookup:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the
    longest suffix n-gram (``max_n >= n >= min_n``) of ``tokens``, and how many
    tokens before that occurrence agree with the suffix (at least ``n``, at most
    :data:`MAX_MATCH`); ``([], 0)`` if there is no match."""
    _check_n(min_n, max_n)
    size = len(tokens)
    if k <= 0:
        return Lookup([], 0)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = list(tokens[size - n :])
        # occurrences starting at j, ending before the suffix's own last token
        for j in range(size - n - 1, -1, -1):
            if tokens[j + n - 1] == suffix[-1] and list(tokens[j : j + n]) == suffix:
                return Lookup(list(tokens[j + n : j + n + k]), _extend(tokens, j + n, n))
    return Lookup([], 0)


def ngram_propose(tokens: Seq[int], k: int, *, min_n: int = 1, max_n: int = 8) -> list[int]:
    """The tokens of :func:`ngram_lookup`."""
    return ngram_lookup(tokens, k, min_n=min_n, max_n=max_n).tokens


def _extend(tokens: Seq[int], end: int, n: int) -> int:
    """Length of the common suffix of ``tokens[:end]`` and ``tokens``, known to be
    at least ``n``, counted up to :data:`MAX_MATCH`."""
    size, m = len(tokens), n
    while m < MAX_MATCH and end - m - 1 >= 0 and tokens[end - m - 1] == tokens[size - m - 1]:
        m += 1
    return m


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

    def __init__(self, *, min_n: int = 1, max_n: int = 8) -> None:
        _check_n(min_n, max_n)
        self.min_n = min_n
        self.max_n = max_n
        self._index: dict[str, _Index] = {}

    def lookup(self, seq_id: str, tokens: Seq[int], k: int) -> Lookup:
        """Same answer as ``ngram_lookup(tokens, k, min_n=..., max_n=...)``.
        ``tokens`` must only grow between calls for one ``seq_id`` (a shorter
        list rebuilds the index)."""
        if k <= 0:
            return Lookup([], 0)
        index = self._catch_up(seq_id, tokens)
        size = len(tokens)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            start = index.table.get(tuple(tokens[size - n :]))
            if start is not None:
                return Lookup(list(tokens[start : start + k]), _extend(tokens, start, n))
        return Lookup([], 0)

    def propose(self, seq_id: str, tokens: Seq[int], k: int) -> list[int]:
        """The tokens of :meth:`lookup`."""
        return self.lookup(seq_id, tokens, k).tokens

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


# -- draft model ----------------------------------------------------------------


def layer_skip_model(target: Transformer, num_layers: int) -> Transformer:
    """A draft that is ``target``'s first ``num_layers`` layers plus its final norm
    and head, sharing their weights (no copy)."""
    if not 1 <= num_layers <= target.args.n_layers:
        raise ValueError(f"num_layers must be in [1, {target.args.n_layers}], got {num_layers}")
    draft = Transformer.__new__(Transformer)
    nn.Module.__init__(draft)
    draft.args = replace(target.args, n_layers=num_layers)
    draft.tok_embeddings = target.tok_embeddings
    draft.layers = nn.ModuleList(list(target.layers)[:num_layers])
    draft.norm = target.norm
    draft.output = target.output
    draft.rope = target.rope
    return draft


@dataclass
class DraftProposal:
    """Per sequence: the drafted tokens and, for rejection-mode rows, the draft
    distributions they were drawn from (``q``: ``[len(tokens), V]``, else None)."""

    tokens: list[list[int]] = field(default_factory=list)
    probs: list[torch.Tensor | None] = field(default_factory=list)


class DraftProposer:
    """Drafts ``k`` tokens per sequence with a draft runner in ``k`` batched passes.
    ``runner``: ``execute(scheduled, logits_per_seq=None) -> Tensor[N, V]``, built
    with the target's ``num_kv_blocks`` and ``block_size``."""

    def __init__(self, runner: Any, *, rejection: bool = False) -> None:
        self.runner = runner
        self.rejection = rejection
        self._kv: dict[str, tuple[int, int]] = {}  # seq_id -> (num_preemptions, draft KV length)

    def propose(
        self, seqs: Seq[Sequence], ks: Seq[int], eos_token_ids: Seq[int] = ()
    ) -> DraftProposal:
        """Draft ``ks[i]`` tokens after ``seqs[i]``'s tokens. Blocks for
        ``len(token_ids) + ks[i] - 1`` positions must already be allocated.
        ``token_ids`` is left as it was."""
        out = DraftProposal(tokens=[[] for _ in seqs], probs=[None for _ in seqs])
        lengths = [len(s.token_ids) for s in seqs]
        q_rows: list[list[torch.Tensor]] = [[] for _ in seqs]
        try:
            for step in range(max(ks, default=0)):
                active = [i for i, k in enumerate(ks) if k > step]
                self._one_pass([seqs[i] for i in active], active, step, out, q_rows, eos_token_ids)
        finally:
            for seq, n in zip(seqs, lengths, strict=True):
                del seq.token_ids[n:]
        for i, rows in enumerate(q_rows):
            if rows:
                out.probs[i] = torch.stack(rows)
        for seq, n, k in zip(seqs, lengths, ks, strict=True):
            if k > 0:
                self._kv[seq.seq_id] = (seq.num_preemptions, n + k - 1)
        return out

    def _one_pass(
        self,
        seqs: list[Sequence],
        index: list[int],
        step: int,
        out: DraftProposal,
        q_rows: list[list[torch.Tensor]],
        eos: Seq[int],
    ) -> None:
        items = [self._item(s, step) for s in seqs]
        logits = self.runner.execute(items)  # [len(seqs), V]
        positions = [len(s.token_ids) for s in seqs]
        tokens = [t for t, _ in sample(logits, seqs, eos, positions)]  # coupled: target's noise
        if self.rejection:
            tokens = self._draw_from_q(logits, seqs, positions, tokens, index, q_rows, eos)
        for seq, i, t in zip(seqs, index, tokens, strict=True):
            out.tokens[i].append(t)
            seq.token_ids.append(t)

    def _item(self, seq: Sequence, step: int) -> ScheduledSeq:
        end = len(seq.token_ids)
        if step > 0:
            return ScheduledSeq(seq, 1, start=end - 1)
        start = self.kv_length(seq)
        start = min(start, end - 1)
        return ScheduledSeq(seq, end - start, start=start)

    def _draw_from_q(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        positions: list[int],
        tokens: list[int],
        index: list[int],
        q_rows: list[list[torch.Tensor]],
        eos: Seq[int],
    ) -> list[int]:
        """Sampled rows draw from q with the draft stream's noise; greedy rows keep argmax."""
        rows = [j for j, s in enumerate(seqs) if not s.params.greedy]
        if not rows:
            return tokens
        sub = [seqs[j] for j in rows]
        pos = [positions[j] for j in rows]
        y = processed_logits(logits[rows], sub, eos, pos)  # [R, V]
        q = y.softmax(dim=-1)
        keys = [(s.params.seed or 0, p) for s, p in zip(sub, pos, strict=True)]
        drawn = (y + keyed_gumbel(keys, y.shape[1], DRAFT_STREAM).to(y.device)).argmax(dim=-1)
        tokens = list(tokens)
        for r, j in enumerate(rows):
            tokens[j] = int(drawn[r])
            q_rows[index[j]].append(q[r].float().cpu())
        return tokens

    def kv_length(self, seq: Sequence) -> int:
        """Positions of ``seq`` whose draft KV is valid (0 after a preemption)."""
        state = self._kv.get(seq.seq_id)
        if state is None or state[0] != seq.num_preemptions:
            return 0
        return state[1]

    def accepted(self, seq: Sequence, num_tokens: int) -> None:
        """After verification: the sequence now has ``num_tokens`` tokens; draft KV
        past the last accepted draft is stale."""
        state = self._kv.get(seq.seq_id)
        if state is not None:
            self._kv[seq.seq_id] = (state[0], min(state[1], num_tokens - 1))

    def forget(self, seq_id: str) -> None:
        self._kv.pop(seq_id, None)
