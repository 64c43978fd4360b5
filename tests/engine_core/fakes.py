"""Fakes for the engine core: a paged "KV cache" of token ids and a model.

``FakeKV`` stores, per cache slot, the token whose KV would live there, exactly
as the real runner addresses its tensors (``slot = block_table[pos // bs] * bs +
pos % bs``). A step writes the new tokens, then reads every position back
through the block table: if the block manager handed out a wrong prefix hit,
overwrote a shared block or lost a block, the tokens read back differ from the
sequence's tokens and the fake raises. ``FakeRunner`` then turns the tokens read
back into logits that are a pure function of them, so outputs are comparable
across batching, caching and preemption.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from backends.engine.scheduler import ScheduledSeq


class KVCorruption(AssertionError):
    pass


class FakeKV:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.slots = [-1] * (num_blocks * block_size)

    def _slot(self, table: list[int], pos: int) -> int:
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def run(self, s: ScheduledSeq) -> list[int]:
        """Write the step's tokens, read the whole context back; returns it."""
        seq = s.seq
        table = seq.block_table
        if len(table) * self.block_size < s.end:
            raise KVCorruption(f"{seq.seq_id}: {len(table)} blocks for {s.end} tokens")
        for pos in range(s.start, s.end):
            self.slots[self._slot(table, pos)] = seq.token_ids[pos]
        context = [self.slots[self._slot(table, pos)] for pos in range(s.end)]
        if context != seq.token_ids[: s.end]:
            raise KVCorruption(f"{seq.seq_id}: cache holds the wrong tokens")
        return context


def fake_logits(context: Seq[int], vocab_size: int) -> torch.Tensor:
    """Deterministic logits ``[V]`` from the tokens so far (and their count)."""
    key = hash((len(context), tuple(context[-4:]))) & ((1 << 62) - 1)
    gen = torch.Generator().manual_seed(key)
    return torch.randn(vocab_size, generator=gen) * 3.0


class FakeRunner:
    """Implements the runner interface the engine calls."""

    def __init__(self, num_kv_blocks: int, block_size: int = 4, vocab_size: int = 64) -> None:
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.max_model_len = 4096
        self.kv = FakeKV(num_kv_blocks, block_size)
        self.steps: list[list[tuple[str, int, int]]] = []  # (seq_id, start, n) per step

    def execute(self, scheduled: Seq[ScheduledSeq]) -> torch.Tensor:
        self.steps.append([(s.seq.seq_id, s.start, s.num_new_tokens) for s in scheduled])
        rows = []
        for s in scheduled:
            context = self.kv.run(s)
            if s.needs_sampling:
                rows.append(fake_logits(context, self.vocab_size))
        if not rows:
            return torch.empty(0, self.vocab_size)
        return torch.stack(rows)  # [num_sampled, V]
