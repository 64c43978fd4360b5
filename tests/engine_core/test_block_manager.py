"""The block manager: paged allocation, prefix cache, LRU eviction, KV events."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

import backends.engine.block_manager as bm_mod
from backends.engine.block_manager import BlockManager, hash_block
from backends.engine.sequence import SamplingParams, Sequence

P = SamplingParams(seed=0)


def seq(sid: str, tokens: list[int]) -> Sequence:
    return Sequence(sid, tokens, P)


def compute(bm: BlockManager, s: Sequence, n: int, hits: list[int] | None = None) -> None:
    """Allocate and 'compute' n more tokens of s, as scheduler + runner + commit do."""
    assert bm.allocate(s, n, hits)
    s.num_computed_tokens += n
    bm.register_computed(s)


def test_blocks_cover_exactly_the_computed_tokens() -> None:
    bm = BlockManager(10, 4)
    s = seq("a", list(range(9)))
    compute(bm, s, 9)
    assert len(s.block_table) == 3 and len(set(s.block_table)) == 3
    assert bm.num_free_blocks == 7
    bm.free(s)
    assert bm.num_free_blocks == 10 and s.block_table == [] and s.num_computed_tokens == 0


def test_allocation_fails_without_changing_anything() -> None:
    bm = BlockManager(2, 4)
    s = seq("a", list(range(12)))
    assert not bm.allocate(s, 12)
    assert s.block_table == [] and bm.num_free_blocks == 2


def test_prefix_hit_shares_full_blocks_and_always_leaves_the_last_token() -> None:
    bm = BlockManager(10, 4)
    a = seq("a", list(range(8)))
    compute(bm, a, 8)
    b = seq("b", list(range(8)))  # identical prompt: only 1 block may hit (last token computed)
    hits = bm.lookup(b)
    assert hits == a.block_table[:1]
    compute(bm, b, 4, hits)
    assert b.num_computed_tokens == 8 and b.block_table[0] == a.block_table[0]
    assert bm.ref_count(a.block_table[0]) == 2
    c = seq("c", [*range(8), 99])  # longer prompt: both blocks hit
    assert bm.lookup(c) == a.block_table[:2]


def test_different_prefix_with_same_block_tokens_does_not_hit() -> None:
    bm = BlockManager(10, 4)
    a = seq("a", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    compute(bm, a, 9)
    b = seq("b", [9, 9, 9, 9, 5, 6, 7, 8, 0])  # second block equal, first differs
    assert bm.lookup(b) == []


def test_hash_collision_is_never_served(monkeypatch) -> None:
    monkeypatch.setattr(bm_mod, "hash_block", lambda parent, toks: 42)
    bm = BlockManager(10, 4)
    a = seq("a", [1, 2, 3, 4, 0])
    compute(bm, a, 5)
    b = seq("b", [5, 6, 7, 8, 0])  # same (fake) hash, different tokens
    assert bm.lookup(b) == []


def test_freed_blocks_stay_cached_and_are_evicted_lru_tail_first() -> None:
    bm = BlockManager(4, 2, record_events=True)
    a = seq("a", [1, 2, 3, 4, 5])
    compute(bm, a, 5)  # blocks: [1,2] [3,4] [5] -> two registered
    table = list(a.block_table)
    bm.free(a)
    assert bm.statistics().num_cached == 2 and bm.num_free_blocks == 4
    # A hit on the freed blocks revives them.
    again = seq("a2", [1, 2, 3, 4, 9])
    assert bm.lookup(again) == table[:2]
    # Taking 3 new blocks: the never-cached block goes first, then the LRU
    # head, which is the tail block [3,4] of the freed sequence.
    other = seq("o", [7, 7, 7, 7, 7, 7])
    compute(bm, other, 6)
    assert table[2] in other.block_table  # the uncached partial block
    assert table[1] in other.block_table and table[0] not in other.block_table
    removed = [e for e in bm.drain_events() if e.kind == "removed"]
    assert [e.block_hashes for e in removed] == [(hash_block(hash_block(None, (1, 2)), (3, 4)),)]
    assert bm.lookup(seq("a3", [1, 2, 3, 4, 9])) == table[:1]


def test_kv_events_carry_chained_hashes_and_increasing_sequence_numbers() -> None:
    bm = BlockManager(8, 2, record_events=True)
    a = seq("a", [1, 2, 3, 4, 5])
    compute(bm, a, 3)
    compute(bm, a, 2)
    events = bm.drain_events()
    h1 = hash_block(None, (1, 2))
    h2 = hash_block(h1, (3, 4))
    assert [(e.kind, e.block_hashes, e.parent_hash) for e in events] == [
        ("stored", (h1,), None),
        ("stored", (h2,), h1),
    ]
    assert [e.seq for e in events] == [1, 2]
    assert bm.drain_events() == []


def test_events_are_not_recorded_unless_asked() -> None:
    bm = BlockManager(8, 2)
    compute(bm, seq("a", [1, 2, 3]), 3)
    assert bm.drain_events() == []


def test_prefix_caching_off_never_hits() -> None:
    bm = BlockManager(8, 2, enable_prefix_caching=False)
    compute(bm, seq("a", [1, 2, 3, 4, 5]), 5)
    assert bm.lookup(seq("b", [1, 2, 3, 4, 5])) == []
    assert bm.statistics().num_cached == 0


def test_truncate_releases_blocks_past_the_end_and_never_writes_a_shared_block() -> None:
    bm = BlockManager(8, 2)
    a = seq("a", [1, 2, 3, 4, 5, 6, 7])
    compute(bm, a, 7)  # 4 blocks, 3 registered
    bm.truncate(a, 5)  # cut inside registered block [5, 6]
    assert a.token_ids == [1, 2, 3, 4, 5]
    assert len(a.block_table) == 2 and a.num_computed_tokens == 4
    b = seq("b", [1, 2, 3, 4, 5, 6])
    compute(bm, b, 6)
    bm.truncate(b, 5)  # b's block [5,6] was not registered (a's copy was): keep it
    assert len(b.block_table) == 3 and b.num_computed_tokens == 5


def test_statistics_report_usage_and_hit_rate() -> None:
    bm = BlockManager(8, 2)
    compute(bm, seq("a", [1, 2, 3, 4, 5]), 5)
    b = seq("b", [1, 2, 3, 4, 6])
    compute(bm, b, 1, bm.lookup(b))
    st_ = bm.statistics()
    assert st_.num_used == 4 and st_.num_free == 4 and st_.usage == 0.5
    assert st_.prefix_query_tokens == 10 and st_.prefix_hit_tokens == 4
    assert st_.prefix_hit_rate == 0.4


# -- property test --------------------------------------------------------------

ops = st.lists(
    st.one_of(
        st.tuples(st.just("new"), st.lists(st.integers(0, 3), min_size=1, max_size=12)),
        st.tuples(st.just("grow"), st.integers(0, 7), st.integers(1, 6)),
        st.tuples(st.just("free"), st.integers(0, 7)),
        st.tuples(st.just("truncate"), st.integers(0, 7), st.integers(0, 6)),
    ),
    max_size=40,
)


def check_invariants(bm: BlockManager, live: list[Sequence]) -> None:
    refs: dict[int, int] = {}
    for s in live:
        assert len(s.block_table) == -(-s.num_computed_tokens // bm.block_size)
        for b in s.block_table:
            refs[b] = refs.get(b, 0) + 1
        for i in range(s.num_computed_tokens // bm.block_size):
            toks = bm.cached_tokens(s.block_table[i])
            if toks is not None:  # registered: must be exactly these tokens
                assert list(toks) == s.token_ids[i * bm.block_size : (i + 1) * bm.block_size]
                assert bm.block_hash_of(s.block_table[i]) == s.block_hashes[i]
    for b in range(bm.num_blocks):
        assert bm.ref_count(b) == refs.get(b, 0) >= 0
    assert bm.num_free_blocks == bm.num_blocks - len(refs)


@settings(max_examples=200, deadline=None)
@given(ops=ops, num_blocks=st.integers(1, 12), block_size=st.integers(1, 4), caching=st.booleans())
def test_random_operations_never_leak_or_corrupt(ops, num_blocks, block_size, caching) -> None:
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
    live: list[Sequence] = []
    for op in ops:
        if op[0] == "new":
            s = seq(str(len(live)), op[1])
            hits = bm.lookup(s)
            n = len(s.token_ids) - len(hits) * block_size
            if bm.allocate(s, n, hits):
                s.num_computed_tokens += n
                bm.register_computed(s)
                live.append(s)
        elif live and op[0] == "grow":
            s = live[op[1] % len(live)]
            s.token_ids.extend([op[2] % 4] * op[2])
            n = len(s.token_ids) - s.num_computed_tokens
            if bm.allocate(s, n):
                s.num_computed_tokens += n
                bm.register_computed(s)
            else:
                del s.token_ids[s.num_computed_tokens :]
        elif live and op[0] == "free":
            bm.free(live.pop(op[1] % len(live)))
        elif live and op[0] == "truncate":
            s = live[op[1] % len(live)]
            bm.truncate(s, max(1, len(s.token_ids) - op[2]))
        check_invariants(bm, live)
    for s in live:
        bm.free(s)
    check_invariants(bm, [])
    assert bm.num_free_blocks == num_blocks


def test_hashing_happens_once_per_full_block_not_per_step(monkeypatch) -> None:
    calls = []

    def counting(parent, toks):
        calls.append(toks)
        return hash_block(parent, toks)

    monkeypatch.setattr(bm_mod, "hash_block", counting)
    bm = BlockManager(64, 4)
    s = seq("a", [1, 2, 3])
    compute(bm, s, 3)
    for t in range(40):  # 40 decode steps
        s.token_ids.append(t)
        compute(bm, s, 1)
    assert len(calls) == 43 // 4  # one hash per block that filled
