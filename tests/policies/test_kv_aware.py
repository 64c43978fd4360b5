"""kv_aware and its indexes: bounded, gap-safe, and the lowest estimated TTFT wins."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from policies.base import BackendView, RouteRequest
from policies.kv_aware import KVAware
from policies.kv_index import KVIndex, RecentlySent
from policies.registry import create_policy


@dataclass(frozen=True)
class Ev:
    seq: int
    kind: str
    block_hashes: tuple[int, ...] = ()


def stored(seq: int, *hashes: int) -> Ev:
    return Ev(seq, "stored", hashes)


def req(*hashes: int, rid: str = "r", block_size: int = 16) -> RouteRequest:
    return RouteRequest(request_id=rid, block_hashes=hashes, block_size=block_size, prompt_tokens=len(hashes) * block_size)


# ------------------------------------------------------------ KVIndex


def test_match_counts_leading_blocks_per_backend() -> None:
    index = KVIndex()
    assert index.apply("a", [stored(1, 1, 2, 3)])
    assert index.apply("b", [stored(1, 1, 2), stored(2, 9)])
    assert index.match([1, 2, 3, 4], ["a", "b", "c"]) == {"a": 3, "b": 2}
    assert index.match([4, 1], ["a", "b"]) == {}  # only a leading run counts
    assert index.apply("a", [Ev(2, "removed", (2,))])
    assert index.match([1, 2, 3], ["a", "b"]) == {"a": 1, "b": 2}
    assert index.apply("b", [Ev(3, "cleared")])
    assert index.match([1, 2, 3], ["a", "b"]) == {"a": 1}


def test_a_gap_or_a_restart_drops_the_backend_and_asks_for_everything_again() -> None:
    index = KVIndex()
    index.apply("a", [stored(5, 1, 2)])
    index.apply("b", [stored(1, 1)])
    assert index.since("a") == 5
    assert index.apply("a", [stored(7, 3)]) is False  # 6 is missing
    assert index.since("a") == -1 and index.match([1, 2], ["a", "b"]) == {"b": 1}
    assert index.apply("a", [stored(40, 1, 2)])  # resubscribed from the start: any first seq
    assert index.apply("a", [stored(3, 8)]) is False  # seq went back: the engine restarted
    assert index.statistics().gaps == 2


@settings(max_examples=60, deadline=None)
@given(
    bound=st.integers(1, 40),
    batches=st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "c"]),
            st.lists(st.tuples(st.sampled_from(["stored", "removed", "cleared"]), st.lists(st.integers(0, 60), max_size=8)), max_size=5),
            st.integers(0, 2),  # 0: in order; otherwise skip that many seqs (a gap)
        ),
        max_size=30,
    ),
)
def test_the_index_never_exceeds_its_bound_and_a_gap_always_clears_the_backend(bound: int, batches: list) -> None:
    index = KVIndex(max_blocks=bound)
    next_seq = {"a": 1, "b": 1, "c": 1}
    for backend, events, skip in batches:
        seq = next_seq[backend] + skip if index.since(backend) >= 0 else next_seq[backend]
        evs = []
        for kind, hashes in events:
            evs.append(Ev(seq, kind, tuple(hashes)))
            seq += 1
        ok = index.apply(backend, evs)
        next_seq[backend] = seq
        assert len(index) <= bound
        if not ok:
            assert index.since(backend) == -1
            assert index.statistics().backends.get(backend, 0) == 0
            assert index.match(list(range(61)), [backend]) == {}
        # Membership is consistent both ways: what a backend is said to hold
        # is in the index with its bit, and every bit set has its entry.
        for name, held in index._held.items():
            bit = index._slots.bit[name]
            assert all(index._owners.get(h, 0) & bit for h in held)
            assert {h for h, mask in index._owners.items() if mask & bit} == set(held)


@settings(max_examples=60, deadline=None)
@given(
    bound=st.integers(1, 30),
    ops=st.lists(
        st.tuples(st.sampled_from(["stored", "removed", "match", "reset"]), st.sampled_from(["a", "b"]),
                  st.integers(0, 12), st.integers(1, 12)),
        max_size=60,
    ),
)
def test_matches_touch_the_lru_later_but_it_evicts_as_if_at_once(bound: int, ops: list) -> None:
    """A match only notes the blocks it touched (moving them in the LRU is
    left to ``settle``, off the decision's path); the index settles before
    anything that reads or changes the order, so what it holds and evicts is
    what touching at once gives."""
    lazy, eager = KVIndex(max_blocks=bound), KVIndex(max_blocks=bound)
    seqs = {"a": 0, "b": 0}
    for kind, backend, start, length in ops:
        chain = tuple(range(start, start + length))  # chains over shared numbers: prefixes overlap
        if kind == "match":
            assert lazy.match(chain, ["a", "b"]) == eager.match(chain, ["a", "b"])
            eager.settle()
        elif kind == "reset":
            lazy.reset(backend)
            eager.reset(backend)
            seqs[backend] = 0
        else:
            seqs[backend] += 1
            for index in (lazy, eager):
                assert index.apply(backend, [Ev(seqs[backend], kind, chain)])
        assert list(lazy._owners) == list(eager._owners) or lazy._touched  # apart only while touches wait
    lazy.settle()
    assert list(lazy._owners.items()) == list(eager._owners.items())


def test_recently_sent_keeps_a_send_between_ttl_and_ttl_plus_a_generation() -> None:
    recent = RecentlySent(ttl=10.0, generations=4)  # generations 2.5 s wide
    recent.record("a", [1, 2, 3], now=0.0)
    assert recent.match([1, 2, 3], ["a"], now=9.9) == {"a": 3}
    recent.record("a", [1], now=5.0)  # refreshed, in a newer generation
    assert recent.match([1, 2, 3], ["a"], now=12.4) == {"a": 3}  # within ttl + 2.5 of the first send
    assert recent.match([1, 2, 3], ["a"], now=12.5) == {"a": 1}
    assert recent.match([1, 2, 3], ["a"], now=17.4) == {"a": 1}
    assert recent.match([1, 2, 3], ["a"], now=17.5) == {}
    assert len(recent) == 0


def test_a_prompt_whose_first_block_is_held_nowhere_matches_nothing_in_either_record() -> None:
    """The first block decides a cold prompt (one look-up), whatever later
    blocks are held; a first block held only in the older generation of the
    record still matches."""
    index = KVIndex()
    assert index.apply("a", [stored(1, 2, 3)])
    assert index.match([1, 2, 3], ["a", "b"]) == {}
    assert index.match([2, 3], ["a", "b"]) == {"a": 2}
    recent = RecentlySent(ttl=10.0, generations=2)  # generations 5 s wide
    recent.record("a", [1, 2], now=0.0)
    recent.record("b", [7, 8], now=6.0)  # a second generation
    assert recent.match([3, 1, 2], ["a", "b"], now=6.0) == {}
    assert recent.match([1, 2, 9], ["a", "b"], now=6.0) == {"a": 2}
    assert recent.match([7, 8], ["a", "b"], now=14.9) == {"b": 2}
    assert recent.match([1, 2], ["a", "b"], now=15.0) == {}  # the first generation went at ttl + its width


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.integers(1, 30), st.floats(0, 5)), max_size=40), st.integers(1, 50))
def test_recently_sent_stays_within_its_bound(sends: list[tuple[str, int, float]], bound: int) -> None:
    recent = RecentlySent(ttl=3.0, max_entries=bound)
    now = 0.0
    for backend, length, dt in sends:
        now += dt
        recent.record(backend, range(length), now)
        assert len(recent) <= bound + length  # the bound, plus the blocks of the send just recorded


def test_forget_drops_one_backend_only() -> None:
    recent = RecentlySent(ttl=10.0)
    recent.record("a", [1, 2], 0.0)
    recent.record("b", [1, 2], 0.0)
    recent.forget("a")
    assert recent.match([1, 2], ["a", "b"], 1.0) == {"b": 2}


# ------------------------------------------------------------ kv_aware


def test_a_second_request_sharing_a_prefix_goes_where_the_first_was_cached() -> None:
    policy = KVAware()
    cands = [BackendView(name=n, kv_events=True) for n in ("a", "b", "c", "d")]
    # The engine "c" reports it holds the first 20 blocks.
    policy.on_kv_events("c", [stored(1, *range(100, 120))], 0.0)
    assert policy.pick(cands, req(*range(100, 130)), 1.0) == "c"
    assert policy.statistics().hits == 1


def test_backends_without_events_are_credited_with_what_was_sent_to_them() -> None:
    policy = KVAware()
    cands = [BackendView(name=n) for n in ("a", "b", "c")]
    first = req(*range(1, 33), rid="1")
    home = policy.pick(cands, first, 0.0)
    assert home is not None
    policy.on_dispatch(home, first, 0.0)
    policy.on_first_token(home, first, 0.1)
    policy.on_complete(home, first, 0.5, ok=True, cached_tokens=0)
    # A conversation that grew lands on the same backend even when the key would differ.
    assert policy.pick(cands, req(*range(1, 33), *range(900, 940), rid="2"), 1.0) == home


def test_load_outweighs_a_small_hit_but_not_a_large_one() -> None:
    policy = KVAware(KVAware.Options(prefill_s_per_token=1e-3, decode_s_per_seq=0.05, load_factor=100))
    policy.on_kv_events("a", [stored(1, *range(10))], 0.0)  # a holds 10 of 100 blocks
    busy_a = [BackendView(name="a", kv_events=True, in_flight=8), BackendView(name="b", kv_events=True)]
    # a: 1e-3 * 1440 + 0.4 = 1.84 s; b: 1e-3 * 1600 = 1.6 s
    assert policy.pick(busy_a, req(*range(100)), 0.0) == "b"
    policy.on_kv_events("a", [stored(2, *range(10, 90))], 0.0)  # now 90 of 100
    # a: 1e-3 * 160 + 0.4 = 0.56 s; b: 1.6 s
    assert policy.pick(busy_a, req(*range(100)), 0.0) == "a"


@settings(max_examples=80, deadline=None)
@given(
    held=st.lists(st.integers(0, 12), min_size=2, max_size=6),
    loads=st.lists(st.integers(0, 6), min_size=6, max_size=6),
    queued=st.lists(st.integers(0, 400), min_size=6, max_size=6),
    per_token=st.sampled_from([1e-4, 5e-4, 2e-3]),
    per_seq=st.sampled_from([0.0, 1e-3, 2e-2]),
)
def test_kv_aware_picks_the_lowest_estimated_ttft(held: list[int], loads: list[int], queued: list[int], per_token: float, per_seq: float) -> None:
    """Brute force: ttft = per_token x (queued + (prompt - cached) x (1 at home, 2 away))
    + per_seq x in_flight; the pick is an argmin (no cap: load_factor large)."""
    policy = KVAware(KVAware.Options(prefill_s_per_token=per_token, decode_s_per_seq=per_seq, load_factor=1000))
    hashes = tuple(range(500, 512))
    cands = []
    for i, n in enumerate(held):
        name = f"b{i}"
        policy.on_kv_events(name, [stored(1, *hashes[:n])] if n else [stored(1)], 0.0)
        cands.append(BackendView(name=name, kv_events=True, in_flight=loads[i], pending_prefill_tokens=queued[i]))
    request = req(*hashes)
    choice = policy.pick(cands, request, 0.0)

    home = create_policy("prefix_hash", options={"load_factor": 1000}).pick(cands, request, 0.0)

    def ttft(c: BackendView, n: int) -> float:
        away = 1.0 if c.name == home else 2.0  # off_home_penalty 1
        return per_token * (c.pending_prefill_tokens + away * (request.prompt_tokens - 16 * n)) + per_seq * c.in_flight

    costs = {c.name: ttft(c, n) for c, n in zip(cands, held, strict=True)}
    if any(held):
        assert costs[choice] <= min(costs.values()) + 1e-9
    else:  # cold: prefix_hash's placement
        assert choice == create_policy("prefix_hash", options={"load_factor": 1000}).pick(cands, request, 0.0)


def test_queued_prefill_from_feedback_steers_the_next_pick() -> None:
    policy = KVAware(KVAware.Options(load_factor=1000))
    cands = [BackendView(name=n, kv_events=True) for n in ("a", "b")]
    for name in ("a", "b"):
        policy.on_kv_events(name, [stored(1, *range(10))], 0.0)  # both hold the prefix
    big = RouteRequest(request_id="x", block_hashes=tuple(range(10)), block_size=16, prompt_tokens=4000)
    first = policy.pick(cands, big, 0.0)
    assert first is not None
    policy.on_dispatch(first, big, 0.0)
    second = RouteRequest(request_id="y", block_hashes=tuple(range(10)), block_size=16, prompt_tokens=4000)
    # At home: 3840 queued + 3840 = 7680 token-costs; away: 3840 x 2, a tie: home wins.
    assert policy.pick(cands, second, 0.0) == first
    policy.on_dispatch(first, second, 0.0)
    third = RouteRequest(request_id="z", block_hashes=tuple(range(10)), block_size=16, prompt_tokens=4000)
    assert policy.pick(cands, third, 0.0) != first  # now 7680 queued there: away is cheaper
    policy.on_first_token(first, big, 1.0)
    policy.on_complete(first, second, 1.0, ok=True, cached_tokens=160)
    assert policy._queued == {}


def test_a_reset_backend_is_cold_again() -> None:
    policy = KVAware()
    cands = [BackendView(name=n, kv_events=True) for n in ("a", "b", "c")]
    policy.on_kv_events("b", [stored(1, 1, 2, 3)], 0.0)
    assert policy.pick(cands, req(1, 2, 3), 0.0) == "b"
    policy.on_kv_reset("b")
    assert policy.kv_since("b") == -1
    assert policy.cached_tokens(cands, req(1, 2, 3), 100.0) == {}


def test_a_short_shared_head_does_not_pull_a_group_off_its_home_but_most_of_the_prompt_does() -> None:
    """Every group's prompt starts with the same block (a chat template's
    header): greedy TTFT would send every group where that block is; the
    off-home price keeps each group at its ring home until another backend
    holds most of its prompt. (Homes here are prefix_hash's ring order:
    key_load_factor 0.)"""
    policy = KVAware(KVAware.Options(load_factor=1000, key_load_factor=0))
    cands = [BackendView(name=f"b{i}", kv_events=True) for i in range(4)]
    head = 999
    homes = set()
    for g in range(12):
        request = req(head, *range(g * 100, g * 100 + 30), rid=str(g))
        home = create_policy("prefix_hash", options={"load_factor": 1000}).pick(cands, request, 0.0)
        policy.on_kv_events("b0", [stored(g + 1, head)], 0.0) if g == 0 else None
        choice = policy.pick(cands, request, 0.0)
        assert choice == home
        homes.add(choice)
    assert len(homes) > 1  # the groups stay spread over their homes
    away = next(c.name for c in cands if c.name != home)
    policy.on_kv_events(away, [stored(1, head, *range(1100, 1125))], 0.0)  # 26 of 31 blocks
    assert policy.pick(cands, req(head, *range(1100, 1130), rid="x"), 0.0) == away


def test_homes_are_balanced_by_key_so_few_system_prompts_spread_evenly() -> None:
    """16 prefix keys on 8 backends: by the ring alone some backends home 3-4
    and some none; with key-bounded homes each homes exactly 2, and a key
    seen again keeps its home."""
    cands = [BackendView(name=f"backend-{i}", kv_events=True) for i in range(8)]
    policy = KVAware(KVAware.Options(load_factor=1000))
    ring_only = KVAware(KVAware.Options(load_factor=1000, key_load_factor=0))
    requests = [req(*range(g * 1000, g * 1000 + 20), rid=f"g{g}") for g in range(16)]
    homes = {r.request_id: policy.pick(cands, r, float(i)) for i, r in enumerate(requests)}
    counts = Counter(homes.values())
    assert sorted(counts.values()) == [2] * 8
    assert max(Counter(ring_only.pick(cands, r, 0.0) for r in requests).values()) > 2  # what the ring alone gives
    for i, r in enumerate(requests):  # again, later: the same homes
        assert policy.pick(cands, r, 100.0 + i) == homes[r.request_id]


def test_a_key_not_seen_for_its_ttl_frees_its_home() -> None:
    policy = KVAware(KVAware.Options(key_ttl_s=10.0))
    cands = [BackendView(name=n, kv_events=True) for n in ("a", "b")]
    policy.pick(cands, req(1, 2, rid="x"), 0.0)
    assert sum(policy._homed.values()) == 1
    policy.pick(cands, req(7, 8, rid="y"), 11.0)  # x expired first
    assert sum(policy._homed.values()) == 1 and len(policy._keys) == 1


def test_a_busy_holder_keeps_its_conversation_below_the_load_slack_but_not_past_it() -> None:
    """In flight 3, 0, 0, 0: ceil(1.25 x average) is 2, so a strict cap would
    send the request away from the only backend holding its 100 blocks; with
    load_slack 8 the estimate decides (it holds the prompt: it wins); with
    load_slack 0 the cap binds."""
    hashes = tuple(range(100))
    cands = [BackendView(name="a", kv_events=True, in_flight=3)] + [
        BackendView(name=n, kv_events=True) for n in ("b", "c", "d")]
    for slack, expected in ((8, True), (0, False)):
        policy = KVAware(KVAware.Options(load_slack=slack))
        policy.on_kv_events("a", [stored(1, *hashes)], 0.0)
        assert (policy.pick(cands, req(*hashes), 0.0) == "a") is expected


def test_a_new_conversation_skips_a_backend_with_more_than_its_share_of_recent_picks_but_a_later_turn_stays() -> None:
    """One system prompt (blocks 0-9) on a; a has taken every recent pick.
    A new conversation (no earlier prompt's last block in it) goes elsewhere,
    copying the prompt; a later turn of a conversation a served stays on a."""
    cands = [BackendView(name=n, kv_events=True) for n in ("a", "b", "c", "d")]
    policy = KVAware(KVAware.Options(load_factor=1000))
    system = tuple(range(10))
    policy.on_kv_events("a", [stored(1, *system)], 0.0)
    first = req(*system, 100, 101, rid="c0.t0")
    assert policy.pick(cands, first, 0.0) == "a"
    policy.on_first_token("a", first, 0.1)  # conversation c0's first turn was prefilled on a
    later = req(*system, 100, 101, 102, 103, rid="c0.t1")
    for i in range(8):  # its later turns stay on a however many picks a has taken
        assert policy.pick(cands, later, 0.2 + 0.1 * i) == "a"
    assert policy.pick(cands, req(*system, 300, rid="new"), 1.0) != "a"
    off = KVAware(KVAware.Options(load_factor=1000, balance_factor=0))
    off.on_kv_events("a", [stored(1, *system)], 0.0)
    assert all(off.pick(cands, req(*system, 200 + i, rid=f"x{i}"), 0.1 * i) == "a" for i in range(12))


def test_balancing_works_on_a_clock_far_from_zero_and_over_long_gaps() -> None:
    """The router's clock reads thousands of seconds, and hours may pass
    between picks: the decayed counts neither overflow nor stick."""
    cands = [BackendView(name=n, kv_events=True) for n in ("a", "b")]
    policy = KVAware()
    for i, now in enumerate((45_000.0, 45_000.5, 60_000.0, 60_000.1, 1e9, 10.0)):
        assert policy.pick(cands, req(i * 10, i * 10 + 1, rid=str(i)), now) in ("a", "b")


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.floats(0, 3)), min_size=1, max_size=80), st.integers(1, 12))
def test_keys_seen_move_in_their_order_later_but_expire_as_if_at_once(picks: list, max_keys: int) -> None:
    """A pick only notes the prefix keys it saw (the moves in the keys' order
    are replayed from the feedback); expiry replays them first, so the homes
    kept and forgotten are those of moving each at once."""
    options = KVAware.Options(max_keys=max_keys, key_ttl_s=2.0, balance_factor=0)
    lazy, eager = KVAware(options), KVAware(options)
    cands = [BackendView(name=f"b{i}", kv_events=True) for i in range(5)]
    now = 0.0
    for group, step in picks:
        now += step
        request = req(*range(group * 100, group * 100 + 20), rid="r")
        assert lazy.pick(cands, request, now) == eager.pick(cands, request, now)
        eager._settle_keys()
        assert lazy._homed == eager._homed
    lazy._settle_keys()
    assert list(lazy._keys.items()) == list(eager._keys.items())


def test_queued_prefill_counts_what_each_backend_must_compute_not_the_prompts() -> None:
    """What a resume's placement weighs (router/migration.py): a 1040-token
    prompt of which ``a`` holds 1024 queues 16 there, not 1040; none before
    any feedback; gone at the first token."""
    policy = KVAware()
    assert policy.queued_prefill() is None
    policy.on_kv_events("a", [stored(1, *range(64))], 0.0)  # 64 blocks of 16: 1024 tokens
    cands = [BackendView(name="a", kv_events=True), BackendView(name="b", kv_events=True)]
    resume = RouteRequest(request_id="r", block_hashes=tuple(range(65)), block_size=16, prompt_tokens=1040)
    assert policy.pick(cands, resume, 0.0) == "a"
    policy.on_dispatch("a", resume, 0.0)
    cold = RouteRequest(request_id="c", block_hashes=tuple(range(1000, 1065)), block_size=16, prompt_tokens=1040)
    policy.on_dispatch("b", cold, 0.0)
    assert policy.queued_prefill() == {"a": 16, "b": 1040}
    policy.on_first_token("a", resume, 0.1)
    assert policy.queued_prefill() == {"b": 1040}
