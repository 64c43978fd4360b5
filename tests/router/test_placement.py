"""Cost-aware placement: the sans-I/O rule, and through the real router over
loopback: batch items go to the backend tagged preemptible, interactive
traffic stays off it, and when it is preempted (its server stopped mid-batch)
the items finish on the other backend, each once; and items sharing a
prompt prefix grouped on one backend under prefix routing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import msgspec
import trio
from hypothesis import given
from hypothesis import strategies as st

from backends.mock import MockConfig
from backends.openai_http import OpenAIHTTPBackend
from policies.placement import Placement
from router.app import NamedBackend, Router, placement_of
from router.config import decode_config
from tests.backends.conftest import Served, serve_mock
from tests.router.test_batches import jsonl, line, start_batch, wait_batch
from tests.router.test_integration import serve_router


class B(msgspec.Struct, frozen=True):
    name: str


@given(st.lists(st.sampled_from("abcd"), unique=True), st.integers(-1, 1), st.booleans())
def test_placement_narrows_by_class_and_tags_but_never_to_nothing(names: list[str], priority: int, avoids: bool) -> None:
    candidates = [B(n) for n in names]
    kept = Placement({"a", "b"}, interactive_avoids=avoids).filter(candidates, priority)
    assert set(kept) <= set(candidates) and (bool(kept) == bool(candidates))
    cheap = [c for c in candidates if c.name in "ab"]
    if priority < 0:
        assert list(kept) == (cheap or candidates)
    elif avoids:
        assert list(kept) == ([c for c in candidates if c.name not in "ab"] or candidates)
    else:
        assert list(kept) == candidates


def test_placement_is_on_only_with_tagged_backends() -> None:
    plain = decode_config({"backends": [{"kind": "mock", "name": "x"}]})
    assert placement_of(plain) is None
    tagged = decode_config({"backends": [{"kind": "mock", "name": "x", "pool": "batch"}, {"kind": "mock", "name": "y"},
                                         {"kind": "mock", "name": "z", "preemptible": True}],
                            "routing": {"interactive_avoids_preemptible": True}})  # fmt: skip
    placement = placement_of(tagged)
    assert placement is not None and placement.tagged == {"x", "z"} and placement.interactive_avoids


async def test_batch_items_run_on_the_preemptible_backend_and_finish_elsewhere_once_it_is_preempted(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    mock = MockConfig(name="m", models=("mock",), tpot_s=0.02)
    spot_scope = trio.CancelScope()

    async def run_spot(*, task_status: trio.TaskStatus[Served]) -> None:
        with spot_scope:
            async with trio.open_nursery() as inner:
                task_status.started(await serve_mock(inner, mock))
                await trio.sleep_forever()

    spot: Served = await nursery.start(run_spot)
    steady = await serve_mock(nursery, mock)
    config = decode_config({
        "backends": [{"kind": "mock", "name": "spot", "preemptible": True}, {"kind": "mock", "name": "steady"}],
        "routing": {"interactive_avoids_preemptible": True},
        "health": {"interval": 30},
        "jobs": {"path": str(tmp_path / "jobs.db"), "poll_interval": 0.05, "retry_delay": 0.0, "lease": 0.3,
                 "per_tenant": 4, "max_attempts": 5},
    })  # fmt: skip
    backends = [NamedBackend("spot", OpenAIHTTPBackend(spot.url, name="spot")),
                NamedBackend("steady", OpenAIHTTPBackend(steady.url, name="steady"))]  # fmt: skip
    router = Router(config, backends)
    url = await serve_router(nursery, router)
    rows = [line(f"r-{i}", f"q {i}", max_tokens=8) for i in range(40)]
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        batch = await start_batch(client, jsonl(rows))
        interactive = 0
        with trio.fail_after(10):
            while spot.backend.statistics().completed < 8:
                chat: dict[str, Any] = {"messages": [{"role": "user", "content": "now"}], "max_tokens": 2}
                assert (await client.post("/v1/chat/completions", json=chat)).status_code == 200
                interactive += 1
        with trio.fail_after(5):  # the mock counts an answer complete once its send returns,
            while steady.backend.statistics().completed < interactive:  # which may be after the client has it
                await trio.sleep(0.01)
        assert interactive >= 1 and steady.backend.statistics().started == interactive  # only interactive there
        spot_scope.cancel()  # preempted: its server and connections go away mid-batch
        done = await wait_batch(client, batch["id"], "completed", within=20)
        output = (await client.get(f"/v1/files/{done['output_file_id']}/content")).content.splitlines()
    assert done["request_counts"] == {"total": 40, "completed": 40, "failed": 0}
    assert [json.loads(x)["custom_id"] for x in output] == [f"r-{i}" for i in range(40)]  # each once
    assert steady.backend.statistics().completed - interactive >= 1  # the rest finished on the steady backend


async def test_batch_items_sharing_a_prompt_prefix_land_on_one_backend_under_prefix_routing(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """7 items open with one long system prompt, 13 with another; with
    ``prefix_hash`` each group goes to one backend (round robin would split
    them 10 and 10)."""
    mock = MockConfig(name="m", models=("mock",))
    served = [await serve_mock(nursery, mock) for _ in range(2)]
    config = decode_config({
        "backends": [{"kind": "mock", "name": "a"}, {"kind": "mock", "name": "b"}],
        "routing": {"policy": "prefix_hash"},
        "health": {"interval": 30},
        "jobs": {"path": str(tmp_path / "jobs.db"), "poll_interval": 0.05, "per_tenant": 1},
    })  # fmt: skip
    router = Router(config, [NamedBackend(n, OpenAIHTTPBackend(s.url, name=n)) for n, s in zip("ab", served, strict=True)])
    url = await serve_router(nursery, router)
    first, second = "You are a careful legal assistant. " * 12, "You translate product manuals into French. " * 12
    rows = [line(f"a-{i}", first + f"case {i}") for i in range(7)] + [line(f"b-{i}", second + f"page {i}") for i in range(13)]
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        batch = await start_batch(client, jsonl(rows))
        done = await wait_batch(client, batch["id"], "completed", within=20)
    assert done["request_counts"]["completed"] == 20
    counts = sorted(s.backend.statistics().completed for s in served)
    assert counts in ([7, 13], [0, 20]), counts


async def test_a_batchs_items_stay_on_one_backend_under_round_robin(nursery: trio.Nursery, tmp_path: Path) -> None:
    """Round robin spreads requests; a batch's items carry the batch id as
    their affinity key (router/dispatch.py), so its 12 items, one at a time
    (per_tenant = 1), all go to one backend, where their shared prefix is
    cached; a second batch gets a home of its own, by round robin."""
    mock = MockConfig(name="m", models=("mock",))
    served = [await serve_mock(nursery, mock) for _ in range(2)]
    config = decode_config({
        "backends": [{"kind": "mock", "name": "a"}, {"kind": "mock", "name": "b"}],
        "health": {"interval": 30},
        "jobs": {"path": str(tmp_path / "jobs.db"), "poll_interval": 0.05, "per_tenant": 1},
        "routing": {"policy": "round_robin"},
    })  # fmt: skip
    router = Router(config, [NamedBackend(n, OpenAIHTTPBackend(s.url, name=n)) for n, s in zip("ab", served, strict=True)])
    url = await serve_router(nursery, router)
    prefix = "You are a careful legal assistant. " * 12
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        for n in (12, 2):
            batch = await start_batch(client, jsonl([line(f"r-{i}", prefix + f"case {i}") for i in range(n)]))
            done = await wait_batch(client, batch["id"], "completed", within=20)
            assert done["request_counts"]["completed"] == n
            counts = sorted(s.backend.statistics().completed for s in served)
            if n == 12:
                assert counts == [0, 12], counts
    assert counts in ([2, 12], [0, 14]), counts
