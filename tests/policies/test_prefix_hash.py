"""prefix_hash: same prefix, same backend, in every process; bounded loads; ~1/n keys move."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.base import BackendView, RouteRequest
from policies.prefix_hash import PrefixHash, capacity, mix, request_key
from policies.registry import PolicyError, create_policy


def backends(n: int, loads: dict[str, int] | None = None, weights: dict[str, float] | None = None) -> list[BackendView]:
    loads, weights = loads or {}, weights or {}
    return [BackendView(name=f"b{i}", in_flight=loads.get(f"b{i}", 0), weight=weights.get(f"b{i}", 1.0)) for i in range(n)]


def req(*hashes: int, block_size: int = 16) -> RouteRequest:
    return RouteRequest(block_hashes=hashes, block_size=block_size, prompt_tokens=len(hashes) * block_size)


def test_requests_sharing_their_first_blocks_share_a_backend() -> None:
    policy = PrefixHash()
    cands = backends(8)
    # 16 blocks of 16 tokens = the 256-token key; what follows differs.
    shared = tuple(range(1000, 1016))
    picks = {policy.pick(cands, req(*shared, 5000 + i), 0.0) for i in range(20)}
    assert len(picks) == 1
    others = {policy.pick(cands, req(*range(i * 100, i * 100 + 16)), 0.0) for i in range(1, 40)}
    assert len(others) > 4  # different prefixes spread


def test_the_key_is_the_chained_hash_at_prefix_tokens_or_the_last_full_block() -> None:
    assert request_key(req(*range(1, 40)), 256) == mix(16)  # block 16 of 16 tokens names the first 256 tokens
    assert request_key(req(7, 8, 9), 256) == mix(9)  # shorter: the last full block
    assert request_key(req(7, 8, 9, block_size=0), 32) == mix(8)  # text blocks count as 16 tokens
    short = RouteRequest(prefix="hi")
    assert request_key(short, 256) == request_key(RouteRequest(prefix="hi"), 256) != request_key(RouteRequest(prefix="ho"), 256)


def test_two_processes_place_every_key_on_the_same_backend() -> None:
    """No per-process hash seed anywhere: a fresh interpreter (with another
    PYTHONHASHSEED) computes the same placements, text keys included."""
    code = (
        "from policies.prefix_hash import PrefixHash\n"
        "from policies.base import BackendView, RouteRequest\n"
        "p = PrefixHash(); c = [BackendView(name=f'gpu-{i}') for i in range(5)]\n"
        "print([p.pick(c, RouteRequest(prefix=f'system prompt {k}'), 0.0) for k in range(50)]"
        " + [p.pick(c, RouteRequest(block_hashes=(k,), block_size=16), 0.0) for k in range(50)])\n"
    )
    outs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60,
                       env={"PYTHONHASHSEED": seed, "PATH": ""}).stdout
        for seed in ("1", "2")
    }
    assert len(outs) == 1 and "gpu-" in outs.pop()


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 8),
    weights=st.lists(st.sampled_from([0.5, 1.0, 2.0, 3.0]), min_size=8, max_size=8),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 10**6)), min_size=1, max_size=200),
    load_factor=st.sampled_from([1.0, 1.1, 1.25, 2.0]),
)
def test_no_pick_ever_exceeds_its_bounded_load_cap(n: int, weights: list[float], ops: list[tuple[bool, int]], load_factor: float) -> None:
    """Arrivals (with arbitrary keys) and completions in any order: every
    backend chosen was under ceil(load_factor x (m + 1) x w / W) before the pick."""
    policy = PrefixHash(PrefixHash.Options(load_factor=load_factor))
    load = {f"b{i}": 0 for i in range(n)}
    w = {f"b{i}": weights[i] for i in range(n)}
    for arrive, key in ops:
        if arrive or not any(load.values()):
            cands = [BackendView(name=name, in_flight=load[name], weight=w[name]) for name in load]
            cap = capacity(cands, load_factor)
            name = policy.pick(cands, req(key), 0.0)
            assert name is not None and load[name] < cap[name]
            assert load[name] + 1 <= math.ceil(load_factor * (sum(load.values()) + 1) * w[name] / sum(w.values()))
            load[name] += 1
        else:
            busy = sorted(b for b, v in load.items() if v)
            load[busy[key % len(busy)]] -= 1


@settings(max_examples=25, deadline=None)
@given(n=st.integers(2, 12), salt=st.integers(0, 1000))
def test_a_backend_leaving_moves_only_its_keys_and_joining_takes_about_one_nth(n: int, salt: int) -> None:
    keys = [req(salt * 10_000 + k) for k in range(2000)]
    policy = PrefixHash()
    before = [policy.pick(backends(n), k, 0.0) for k in keys]
    # Leave: b0 goes; nobody else's keys move.
    left = [policy.pick(backends(n)[1:], k, 0.0) for k in keys]
    assert all(a == b for a, b in zip(before, left, strict=True) if a != "b0")
    # Join: b{n} arrives; the keys that move all go to it, about 1/(n+1) of them.
    fresh = PrefixHash()
    joined = [fresh.pick(backends(n + 1), k, 0.0) for k in keys]
    moved = [b for a, b in zip(before, joined, strict=True) if a != b]
    assert set(moved) <= {f"b{n}"}
    assert abs(len(moved) / len(keys) - 1 / (n + 1)) < 0.5 / (n + 1)


def test_weights_give_proportional_shares_of_the_keys() -> None:
    policy = PrefixHash()
    cands = backends(3, weights={"b0": 2.0})
    picks = [policy.pick(cands, req(k), 0.0) for k in range(6000)]
    share = picks.count("b0") / len(picks)
    assert 0.42 < share < 0.58  # 2 / (2 + 1 + 1)


def test_an_overloaded_home_spills_clockwise_and_ordered_puts_full_backends_last() -> None:
    policy = PrefixHash()
    cands = backends(4)
    home = policy.pick(cands, req(42), 0.0)
    loaded = backends(4, loads={home: 10})
    spill = policy.pick(loaded, req(42), 0.0)
    assert spill != home
    assert policy.ordered(loaded, req(42))[-1] == home


def test_bad_options_are_policy_errors_naming_the_option() -> None:
    with pytest.raises(PolicyError, match="load_factor"):
        create_policy("prefix_hash", options={"load_factor": 0.5})
    with pytest.raises(PolicyError, match="nope"):
        create_policy("prefix_hash", options={"nope": 1})


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 12), st.lists(st.integers(0, (1 << 63) - 1), min_size=1, max_size=20), st.integers(1, 10))
def test_leading_is_the_start_of_the_walk_and_follows_the_ring_when_it_changes(n: int, keys: list[int], limit: int) -> None:
    """``leading`` (kept per starting point) names what ``walk`` yields first,
    before and after a backend joins the ring."""
    policy = PrefixHash()
    ring = policy.ring
    ring.update(backends(n))
    for key in keys + keys:  # the second time from what it kept
        assert ring.leading(key, limit) == tuple(ring.walk(key, limit))
    ring.update([*backends(n), BackendView(name="joined")])
    for key in keys:
        assert ring.leading(key, limit) == tuple(ring.walk(key, limit))
        assert len(ring.leading(key, limit)) == min(limit, n + 1)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 70), st.lists(st.integers(0, (1 << 63) - 1), min_size=1, max_size=30), st.integers(1, 9))
def test_the_bucketed_start_is_the_bisection_and_prepare_knows_what_walk_says(n: int, keys: list[int], limit: int) -> None:
    """A key's starting point, found within its bucket of the ring, is where a
    bisection of all the points puts it (keys at the ends of the range too);
    ``prepare`` fills ``leading`` with what ``walk`` yields, in a few calls."""
    import bisect

    ring = PrefixHash().ring
    ring.update(backends(n))
    points = ring._points
    for key in [*keys, 0, (1 << 63) - 1, *points[:3], points[-1]]:
        assert ring._start(key) == bisect.bisect_left(points, key)
    calls = 0
    while len(ring._leading.get(limit, {})) <= len(points):
        ring.prepare(limit, 64)
        calls += 1
        assert calls <= len(points) // 64 + 2
    ring.prepare(limit, 64)  # a full ring: nothing left to do
    for start, names in ring._leading[limit].items():
        assert names == tuple(ring._walk_from(start, limit))
    for key in keys:
        assert ring.leading(key, limit) == tuple(ring.walk(key, limit))
