"""``headrace bench policies``: what one routing decision costs.

Builds the state a large fleet gives a policy (``--backends`` engines whose
KV indexes hold ``--blocks`` distinct block hashes in all, each a chain of
``--blocks-per-prefix`` blocks replicated on a few backends), then times
``pick`` on requests of ``--prompt-blocks`` blocks, half of them sharing an
indexed prefix and half cold, with the feedback the router delivers between
picks (``on_dispatch``, ``on_first_token``, ``on_complete``) on a virtual
clock of ``--rate`` requests per second (so the policy's record of recent
prefills holds what that rate leaves in it). The views are what the
router's actors hand a pick: the same view object again for a backend
whose view did not change, and a new one for the two whose in-flight count
each pick changes (its own dispatch, +1, and a completion somewhere, -1);
``--fresh-views`` builds all 64 anew each pick with every count drifting
(what the router did before its actors kept their views).
The decision is ``pick`` + ``on_dispatch`` (what the request waits for);
``on_first_token`` + ``on_complete`` run later, off the request's path, and
are timed apart. The cyclic collector is frozen after indexing, as
``headrace serve`` freezes its startup heap. Prints p50/p99/max per policy
and writes JSON (with the CPU it ran on).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.procs import cpu_info
from bench.progress import ProgressBar
from bench.report import write_json
from policies.base import BackendView, RouteRequest
from policies.registry import create_policy

__all__ = ["main"]


@dataclass(frozen=True)
class _Ev:
    seq: int
    kind: str
    block_hashes: tuple[int, ...]


def _fill(policy: Any, backends: int, blocks: int, per_prefix: int, rng: random.Random, bar: ProgressBar) -> list[tuple[int, ...]]:
    """Index ``blocks`` hashes as prefixes of ``per_prefix`` blocks, each on 1-3 backends."""
    prefixes: list[tuple[int, ...]] = []
    seqs = dict.fromkeys(range(backends), 0)
    on_kv = getattr(policy, "on_kv_events", None)
    total = blocks // per_prefix
    for i in range(total):
        if i % 256 == 0:
            bar.update(i / total, f"{i * per_prefix:,} blocks", time.monotonic())
        chain = tuple(rng.getrandbits(63) for _ in range(per_prefix))
        prefixes.append(chain)
        if on_kv is not None:
            for b in rng.sample(range(backends), rng.randint(1, 3)):
                seqs[b] += 1
                on_kv(_NAMES[b], [_Ev(seqs[b], "stored", chain)], 0.0)
    return prefixes


_NAMES = [f"gpu-{b}" for b in range(4096)]  # a backend's name is one string object (its actor's), as in the router


def _view(b: int, flights: list[int], cache_blocks: int | None) -> BackendView:
    return BackendView(name=_NAMES[b], in_flight=flights[b], kv_events=True, block_size=16, cache_blocks=cache_blocks)


def _views(backends: int, flights: list[int], rng: random.Random, cache_blocks: int | None) -> list[BackendView]:
    """Fresh views, every in-flight count drifting by one (``--fresh-views``)."""
    for b in range(backends):
        flights[b] = max(0, min(16, flights[b] + rng.choice((-1, 0, 0, 1))))
    return [_view(b, flights, cache_blocks) for b in range(backends)]


class _Actors:
    """Views as the router's actors keep them: a backend's view is rebuilt
    only when its count changes (the pick's dispatch, a completion)."""

    def __init__(self, backends: int, flights: list[int], cache_blocks: int | None) -> None:
        self.flights, self.cache_blocks = flights, cache_blocks
        self.views = [_view(b, flights, cache_blocks) for b in range(backends)]

    def step(self, picked: str | None, rng: random.Random) -> None:
        """The pick's dispatch (+1 there) and one completion (-1 on a backend
        drawn by its in-flight count): a steady state."""
        changed = set()
        if picked is not None:
            b = _NAMES.index(picked)
            self.flights[b] += 1
            changed.add(b)
        if any(self.flights):  # each stream as likely to end as any other: more end where more run
            b = rng.choices(range(len(self.flights)), weights=self.flights)[0]
            self.flights[b] -= 1
            changed.add(b)
        for b in changed:
            self.views[b] = _view(b, self.flights, self.cache_blocks)


def _time(policy: Any, backends: int, requests: list[RouteRequest], rate: float, rng: random.Random,
          t0: float = 0.0, cpu_clock: bool = False, cache_blocks: int | None = None,
          fresh_views: bool = True) -> tuple[list[float], list[float], list[float]]:
    """Microseconds of each ``pick``, of each ``pick`` + ``on_dispatch`` (the
    decision as the router makes it), and of the later feedback
    (``on_first_token`` + ``on_complete``)."""
    on_dispatch = getattr(policy, "on_dispatch", None)
    on_first = getattr(policy, "on_first_token", None)
    on_complete = getattr(policy, "on_complete", None)
    picks: list[float] = []
    decisions: list[float] = []
    feedback: list[float] = []
    clock = time.thread_time_ns if cpu_clock else time.perf_counter_ns
    flights = [rng.randint(0, 8) for _ in range(backends)]
    actors = None if fresh_views else _Actors(backends, flights, cache_blocks)
    for i, request in enumerate(requests):
        views = _views(backends, flights, rng, cache_blocks) if actors is None else list(actors.views)
        now = t0 + i / rate
        start = clock()
        name = policy.pick(views, request, now)
        picked = clock()
        if on_dispatch is not None and name is not None:
            on_dispatch(name, request, now)
        done = clock()
        picks.append((picked - start) / 1000.0)
        decisions.append((done - start) / 1000.0)
        if name is not None and (on_first is not None or on_complete is not None):
            start = clock()
            if on_first is not None:
                on_first(name, request, now)
            if on_complete is not None:
                on_complete(name, request, now, ok=True, cached_tokens=None)
            feedback.append((clock() - start) / 1000.0)
        if actors is not None:
            actors.step(name, rng)
    return picks, decisions, feedback


def _row(name: str, took: list[float]) -> dict[str, Any]:
    took = sorted(took) or [0.0]
    return {"p50_us": statistics.median(took), "p99_us": took[int(0.99 * (len(took) - 1))], "max_us": took[-1]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="headrace bench policies", description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", action="append", help="policy to time (repeatable; default: all cache-aware and the rest)")
    parser.add_argument("--backends", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=1_000_000, help="distinct block hashes indexed")
    parser.add_argument("--blocks-per-prefix", type=int, default=128)
    parser.add_argument("--prompt-blocks", type=int, default=128, help="blocks per request (128 x 16 = 2k tokens)")
    parser.add_argument("--cache-blocks", type=int, default=None,
                        help="each backend's KV capacity in blocks, as /v1/models gives it (default: its share "
                             "of the indexed blocks, each on 2 backends on average; 0: unknown, no cache model)")
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--rate", type=float, default=1000.0, help="requests per second of virtual time")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: this thread's CPU time (what a decision costs, without the time "
                             "other processes take the core away on a shared box)")
    parser.add_argument("--fresh-views", action="store_true",
                        help="build every view anew each pick, every in-flight count drifting (the router before "
                             "its actors kept their views)")
    parser.add_argument("--json", default="bench/results/issue13/policy_bench.json")
    args = parser.parse_args(argv)
    names = args.policy or ["kv_aware", "prefix_hash", "power_of_two", "least_loaded", "round_robin"]
    if args.cache_blocks is None:
        args.cache_blocks = 2 * args.blocks // args.backends
    cache_blocks = args.cache_blocks or None
    rng = random.Random(0)
    rows = []
    for name in names:
        policy = create_policy(name, options={"max_blocks": args.blocks} if name == "kv_aware" else None)
        bar = ProgressBar(f"{name}: indexing")
        prefixes = _fill(policy, args.backends, args.blocks, args.blocks_per_prefix, rng, bar)
        bar.close(f"{len(prefixes) * args.blocks_per_prefix:,} blocks; timing picks")
        requests = []
        for i in range(args.requests):
            if i % 2 and prefixes:
                chain = rng.choice(prefixes)[: args.prompt_blocks]
            else:
                chain = tuple(rng.getrandbits(63) for _ in range(args.prompt_blocks))
            requests.append(RouteRequest(request_id=str(i), block_hashes=chain, block_size=16,
                                         prompt_tokens=16 * len(chain)))
        gc.collect()
        gc.freeze()
        _time(policy, args.backends, requests[:1000], args.rate, rng, cache_blocks=cache_blocks,
              fresh_views=args.fresh_views)  # warm up
        picks, decisions, feedback = _time(policy, args.backends, requests, args.rate, rng, t0=1000 / args.rate,
                                            cpu_clock=args.clock == "cpu", cache_blocks=cache_blocks,
                                            fresh_views=args.fresh_views)
        gc.unfreeze()
        rows.append({"policy": name, "indexed_blocks": len(getattr(policy, "index", ())),
                     "pick": _row(name, picks), "pick_and_dispatch": _row(name, decisions),
                     "feedback": _row(name, feedback)})
    cpu = cpu_info()
    print(f"CPU: {cpu['model']} ({cpu['cores']} cores; {', '.join(cpu['features'])})")  # type: ignore[arg-type]
    print(f"{args.backends} backends, {args.blocks:,} blocks indexed, {args.prompt_blocks} blocks per request, "
          f"capacity {f'{cache_blocks:,} blocks each' if cache_blocks else 'unknown'}, {args.clock} clock, "
          f"{'fresh views' if args.fresh_views else 'views kept by actors'}")
    print(f"{'policy':<14} {'pick p50':>9} {'p99':>7} {'max':>8}   {'+dispatch p50':>13} {'p99':>7} {'max':>8}"
          f"   {'feedback p50':>12} {'p99':>7}  (us)")
    for r in rows:
        p, d, f = r["pick"], r["pick_and_dispatch"], r["feedback"]
        print(f"{r['policy']:<14} {p['p50_us']:>9.1f} {p['p99_us']:>7.1f} {p['max_us']:>8.1f}   "
              f"{d['p50_us']:>13.1f} {d['p99_us']:>7.1f} {d['max_us']:>8.1f}   {f['p50_us']:>12.1f} {f['p99_us']:>7.1f}")
    document = {"cpu": {k: v for k, v in cpu.items() if k != "flags"}, "args": vars(args), "rows": rows}
    path = write_json(Path(args.json), document)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
