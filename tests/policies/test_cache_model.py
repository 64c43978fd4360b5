"""The cache model (policies/cache_model.py): an LRU per backend of known
capacity, run ahead of the backend's KV events, that takes away the hits the
prompts sent since will have evicted."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from backends.mock_cache import PrefixCache
from policies.base import BackendView, RouteRequest
from policies.cache_model import CacheModel
from policies.kv_aware import KVAware


@dataclass(frozen=True)
class Ev:
    seq: int
    kind: str
    block_hashes: tuple[int, ...]


def _chain(head: int, length: int, salt: int) -> tuple[int, ...]:
    """A prompt's block hashes: ``head`` shared blocks (a system prompt), then its own
    (as chained hashes are: a hash names its whole prefix, so it sits at one position)."""
    return tuple(range(1, head + 1)) + tuple(10**6 * (salt + 1) + 1000 * head + i for i in range(length - head))


prompts = st.lists(
    st.tuples(st.integers(0, 6), st.integers(1, 12), st.integers(0, 5)).map(lambda t: _chain(min(t[0], t[1]), t[1], t[2])),
    min_size=1, max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(prompts, st.integers(1, 30))
def test_the_model_holds_what_the_mock_cache_holds(sent: list[tuple[int, ...]], capacity: int) -> None:
    """Driven by the same prompts in the same order, the model's held prefix
    of any prompt is the mock cache's (an exact LRU with the head touched
    last, as the model): each lookup is predicted before it is made."""
    cache, model = PrefixCache(capacity, 16), CacheModel()
    assert model.capacity("b", capacity)
    for prompt in sent:
        in_cache = cache.match(prompt, 16 * len(prompt) + 1) // 16  # +1 token: no cap on the last block
        assert model.held("b", prompt, len(prompt)) == in_cache
        model.send("b", prompt)
        cache.store(prompt)
    assert model.blocks("b") == len(cache)


def test_events_add_other_traffic_and_remove_what_the_backend_evicted() -> None:
    model = CacheModel()
    model.capacity("b", 4)
    model.send("b", (1, 2, 3))
    model.send("b", (7, 8))  # 5 blocks in 4: block 3 (the oldest chain's tail) goes
    assert model.held("b", (1, 2, 3), 3) == 2
    model.apply("b", [Ev(1, "removed", (3, 8))])  # 3's removal confirms the model; 8's it did not predict
    assert model.held("b", (1, 2, 3), 3) == 2 and model.held("b", (7, 8), 2) == 1
    # Another router's prompt, seen only in the events, joins the model (and evicts by it: 1, 2, 7 + 20, 21).
    model.apply("b", [Ev(2, "stored", (20, 21))])
    assert model.held("b", (20, 21), 2) == 2 and model.held("b", (1, 2), 2) == 1
    assert model.blocks("b") == 4
    model.apply("b", [Ev(3, "cleared", ())])
    assert model.blocks("b") == 0 and model.held("b", (1, 2), 2) == 0


def test_sends_are_applied_in_order_before_anything_reads_the_backend() -> None:
    """send only queues (the decision's path stays short); the next read of
    that backend, its next events, or a flush apply what is queued, in order."""
    model = CacheModel()
    model.capacity("a", 2)
    model.capacity("b", 2)
    model.send("a", (1, 2))
    model.send("a", (3,))
    model.send("b", (5, 6))
    assert model.evictions == 0  # nothing applied yet
    assert model.held("a", (1, 2), 2) == 1 and model.evictions == 1  # (1, 2) then (3): 2 went
    model.flush()
    assert model.held("b", (5, 6), 2) == 2
    model.send("b", (9,))
    model.apply("b", [Ev(1, "stored", (10,))])  # the send came first: 6 then 5 go
    assert model.held("b", (5, 6), 2) == 0 and model.held("b", (9,), 1) == 1


def test_unknown_capacity_or_past_the_bound_is_not_modelled() -> None:
    model = CacheModel(max_blocks=100)
    assert not model.capacity("a", None)
    assert model.capacity("b", 60)
    assert not model.capacity("c", 60)  # 120 > 100: c's predictions stay the index's
    model.send("c", (1, 2, 3))
    assert model.held("c", (1, 2, 3), 3) == 3 and model.active
    assert model.capacity("b", 30) and model.capacity("c", 60)  # b shrank: room for c
    model.forget("b")
    assert not model.modelled("b") and model.held("b", (5,), 1) == 1


def test_a_model_starts_from_what_the_index_says_and_trims_to_its_capacity() -> None:
    model = CacheModel()
    model.capacity("b", 3, held={10, 11, 12, 13})  # more than fits: one of them is evicted at once
    assert model.blocks("b") == 3 and model.evictions == 1
    model.send("b", (10, 11))
    assert model.held("b", (10, 11), 2) == 2


def _views(names: list[str], capacity: int | None) -> list[BackendView]:
    return [BackendView(name=n, kv_events=True, block_size=16, cache_blocks=capacity) for n in names]


def _request(i: int, hashes: tuple[int, ...]) -> RouteRequest:
    return RouteRequest(request_id=str(i), block_hashes=hashes, block_size=16, prompt_tokens=16 * len(hashes) + 1)


def test_kv_aware_stops_predicting_hits_the_prompts_it_sent_will_evict() -> None:
    """b0's events say it holds prefix P; the policy then sends b0 prompts
    that, in a 10-block cache, evict P before their events arrive. With b0's
    capacity known, P is no longer predicted cached there (the index alone
    still says it is), and a request for P is priced as cold."""
    prefix = tuple(range(1, 9))  # 8 blocks
    for capacity, expected in ((None, 8 * 16), (10, 0)):
        policy = KVAware(KVAware.Options(balance_factor=0.0, key_load_factor=0.0))
        names = ["b0", "b1"]
        policy.on_kv_events("b0", [Ev(1, "stored", prefix)], 0.0)
        assert policy.cached_tokens(_views(names, capacity), _request(0, prefix), 0.0) == {"b0": 128}
        for i in range(1, 3):  # two cold prompts of 8 blocks each, dispatched to b0
            other = tuple(1000 * i + j for j in range(8))
            policy.on_dispatch("b0", _request(i, other), float(i))
        got = policy.cached_tokens(_views(names, capacity), _request(9, prefix), 3.0).get("b0", 0)
        assert got == expected
        assert policy.index.match(prefix, names) == {"b0": 8}  # the events said nothing new
        assert (policy.statistics().model_evictions > 0) == (capacity is not None)


def test_kv_aware_counts_over_and_under_predictions() -> None:
    policy = KVAware()
    views = _views(["b0"], None)
    prefix = tuple(range(1, 5))
    policy.on_kv_events("b0", [Ev(1, "stored", prefix)], 0.0)
    for i, reported in enumerate((64, 0, 64, 64)):  # predicted 64 each time
        request = _request(i, prefix)
        assert policy.pick(views, request, float(i)) == "b0"
        policy.on_dispatch("b0", request, float(i))
        policy.on_complete("b0", request, float(i), ok=True, cached_tokens=reported)
    request = _request(7, ())  # nothing predicted, 48 reported: under
    policy.on_dispatch("b0", request, 5.0)
    policy.on_complete("b0", request, 5.0, ok=True, cached_tokens=48)
    s = policy.statistics()
    assert (s.checked, s.agreed, s.over, s.under) == (5, 3, 1, 1)
