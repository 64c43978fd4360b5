"""The admission stages under fake time (trio's MockClock, autojump): a
request waits for a slot in the queue's order and times out with
queue_timeout; full queues, shedding, class caps and the engine priority."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing

import pytest
import trio
import trio.lowlevel
import trio.testing

from backends.base import Event
from backends.errors import HeadraceError
from frontend.call import Call, prepare_call, watched
from frontend.context import RequestContext
from policies.admission import ErlangShedding
from policies.fairness import FairQueue
from router.admission import Overloaded, Queue, Tenants, _Meter
from router.config import AdmissionConfig, ClassTable, TenantConfig
from tests.router.fakes import FakeBackend

BACKEND = FakeBackend()
TWO_MODELS = FakeBackend(models=("m", "n"))


def call_for(tenant: str, priority: str = "default", prompt: str = "x" * 40) -> tuple[RequestContext, Call]:
    context = RequestContext(request_id="r", tenant=tenant, priority=priority, arrival=trio.current_time())  # type: ignore[arg-type]
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 1}).encode()
    return context, prepare_call("completion", body, BACKEND, context)


def make_queue(capacity: int = 1, *, queue_size: int = 8, timeout: float = 30.0,
               tenants: dict[str, TenantConfig] | None = None) -> Queue:  # fmt: skip
    config = AdmissionConfig(queue_size=ClassTable(interactive=queue_size, default=queue_size, batch=queue_size),
                             queue_timeout=ClassTable(interactive=timeout, default=timeout, batch=timeout))  # fmt: skip
    return Queue(Tenants(tenants or {}), config, ErlangShedding(), lambda: FairQueue(aging=1000), lambda key: capacity)


async def hold(queue: Queue, tenant: str, release: trio.Event, log: list[str], priority: str = "default",
               task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:  # fmt: skip
    context, call = call_for(tenant, priority)
    task_status.started()
    async with queue.admit(context, call):
        log.append(tenant)
        await release.wait()


async def test_a_request_waits_for_a_slot_and_times_out_with_queue_timeout(autojump_clock: trio.testing.MockClock) -> None:
    queue, release, log = make_queue(timeout=30), trio.Event(), []
    async with trio.open_nursery() as nursery:
        await nursery.start(hold, queue, "a", release, log)
        await trio.sleep(0.01)
        start = trio.current_time()
        context, call = call_for("b")
        with pytest.raises(Overloaded) as info:
            async with queue.admit(context, call):
                pass
        assert info.value.code == "queue_timeout" and info.value.status == 503
        assert trio.current_time() - start == pytest.approx(30)
        assert queue.group(()).queue.depth() == 0 and queue.busy == 1
        release.set()
    assert queue.busy == 0


async def test_a_freed_slot_goes_to_the_tenant_with_the_least_service(autojump_clock: trio.testing.MockClock) -> None:
    """``a`` queued three before ``b`` queued one: b goes second, not fourth."""
    queue, log = make_queue(), []
    releases = [trio.Event() for _ in range(5)]
    async with trio.open_nursery() as nursery:
        for i, tenant in enumerate(["a", "a", "a", "a", "b"]):
            await nursery.start(hold, queue, tenant, releases[i], log)
            await trio.sleep(0.01)
        assert log == ["a"] and queue.group(()).queue.depth() == 4
        for r in releases:
            r.set()
            await trio.sleep(0.01)
    assert log == ["a", "b", "a", "a", "a"]


async def test_interactive_goes_before_batch_that_waited_longer(autojump_clock: trio.testing.MockClock) -> None:
    queue, log = make_queue(), []
    releases = [trio.Event() for _ in range(3)]
    async with trio.open_nursery() as nursery:
        await nursery.start(hold, queue, "t", releases[0], log, "default")
        await trio.sleep(0.01)
        await nursery.start(hold, queue, "batchy", releases[1], log, "batch")
        await trio.sleep(1)
        await nursery.start(hold, queue, "urgent", releases[2], log, "interactive")
        await trio.sleep(0.01)
        for r in releases:
            r.set()
            await trio.sleep(0.01)
    assert log == ["t", "urgent", "batchy"]


async def test_a_full_queue_refuses_at_once_with_queue_full(autojump_clock: trio.testing.MockClock) -> None:
    queue, release, log = make_queue(queue_size=1), trio.Event(), []
    async with trio.open_nursery() as nursery:
        await nursery.start(hold, queue, "a", release, log)
        await nursery.start(hold, queue, "b", release, log)
        await trio.sleep(0.01)
        start = trio.current_time()
        context, call = call_for("c")
        with pytest.raises(Overloaded) as info:
            async with queue.admit(context, call):
                pass
        assert info.value.code == "queue_full" and trio.current_time() == start
        assert info.value.retry_after is not None and info.value.retry_after >= 1
        release.set()
    assert log == ["a", "b"]


async def test_a_request_whose_estimated_wait_is_past_its_deadline_is_shed(autojump_clock: trio.testing.MockClock) -> None:
    queue = make_queue()
    queue.group(()).rate.observe(10.0)  # a slot turns over every 10 s
    release, log = trio.Event(), []
    async with trio.open_nursery() as nursery:
        await nursery.start(hold, queue, "a", release, log)
        await trio.sleep(0.01)
        context, call = call_for("b")
        context.deadline = trio.current_time() + 5  # X-Deadline-Ms: 5000
        with pytest.raises(Overloaded) as info:
            async with queue.admit(context, call):
                pass
        assert info.value.code == "shed" and info.value.retry_after == pytest.approx(10)
        release.set()


async def test_no_eligible_backend_is_no_healthy_backend() -> None:
    queue = make_queue(capacity=0)
    context, call = call_for("a")
    with pytest.raises(HeadraceError) as info:
        async with queue.admit(context, call):
            pass
    assert info.value.code == "no_healthy_backend"


async def test_the_class_is_capped_by_the_tenant_and_passed_to_the_engine() -> None:
    queue = make_queue(tenants={"bulk": TenantConfig(max_priority="batch")})
    context, call = call_for("bulk", "interactive")
    async with queue.admit(context, call):
        assert context.priority == "batch"
        assert [s.priority for s in call.subs] == [-1]
    context, call = call_for("other", "interactive")
    async with queue.admit(context, call):
        assert context.priority == "interactive" and call.subs[0].priority == 1


def call_with(tenant: str, body: dict[str, object], priority: str = "default") -> tuple[RequestContext, Call]:
    context = RequestContext(request_id="r", tenant=tenant, priority=priority, arrival=trio.current_time())  # type: ignore[arg-type]
    data = json.dumps({"model": "m", "prompt": "x", "max_tokens": 1, **body}).encode()
    return context, prepare_call("completion", data, BACKEND, context)


@pytest.mark.parametrize(
    ("tenant", "header", "body", "cls", "engine"),
    [
        ("t", "default", "batch", "batch", -1),  # the body's class wins over X-Priority's
        ("t", "batch", "interactive", "interactive", 1),
        ("bulk", "default", "interactive", "batch", -1),  # capped by the tenant
        ("t", "interactive", 5, "interactive", 1),  # an int orders within the class, never above it
        ("t", "default", -3, "default", -3),
        ("bulk", "default", 0, "batch", -1),
    ],
)
async def test_a_body_priority_names_a_class_or_orders_the_engine_within_it(
    tenant: str, header: str, body: object, cls: str, engine: int
) -> None:
    queue = make_queue(tenants={"bulk": TenantConfig(max_priority="batch")})
    context, call = call_with(tenant, {"priority": body}, header)
    async with queue.admit(context, call):
        assert context.priority == cls and [s.priority for s in call.subs] == [engine]


async def test_a_full_model_group_does_not_hold_up_another_groups_requests(autojump_clock: trio.testing.MockClock) -> None:
    config = AdmissionConfig(queue_timeout=ClassTable(interactive=30, default=30, batch=30))
    groups = {"m": ("a",), "n": ("b",)}
    queue = Queue(Tenants({}), config, ErlangShedding(), lambda: FairQueue(aging=1000), lambda key: 1,
                  group=lambda model: groups[model or "m"])  # fmt: skip
    release, log = trio.Event(), []

    async def hold_model(model: str, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        context = RequestContext(request_id="r", tenant="t", arrival=trio.current_time())
        call = prepare_call("completion", json.dumps({"model": model, "prompt": "x"}).encode(), TWO_MODELS, context)
        task_status.started()
        async with queue.admit(context, call):
            log.append(model)
            await release.wait()

    async with trio.open_nursery() as nursery:
        for model in ("m", "m", "n"):
            await nursery.start(hold_model, model)
            await trio.sleep(0.01)
        assert log == ["m", "n"]  # n went at once though m's slot is full and one m waits
        assert queue.group(("a",)).queue.depth() == 1 and queue.group(("b",)).queue.depth() == 0
        stats = queue.statistics()
        assert stats.busy == 2 and stats.queued["default"] == 1 and len(stats.groups) == 2
        release.set()
    assert log == ["m", "n", "m"]


async def test_the_last_free_slot_is_kept_for_a_tenant_under_its_share(autojump_clock: trio.testing.MockClock) -> None:
    """4 slots, a flood that would hold them all and a quiet tenant that asked
    lately: the flood holds 3 (its share is 2, the last free slot is kept),
    and the quiet tenant's next request goes at once; alone, the flood takes all 4."""
    queue, release, log = make_queue(capacity=4), trio.Event(), []
    async with trio.open_nursery() as nursery:
        for _ in range(6):
            await nursery.start(hold, queue, "flood", release, log)
        await trio.sleep(0.01)
        assert log.count("flood") == 4  # alone: every slot
        release.set()
    queue, release, log = make_queue(capacity=4), trio.Event(), []
    quiet = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(hold, queue, "quiet", quiet, log)
        quiet.set()
        await trio.sleep(0.01)  # quiet was served and asked lately
        for _ in range(6):
            await nursery.start(hold, queue, "flood", release, log)
        await trio.sleep(0.01)
        assert log.count("flood") == 3 and queue.busy == 3
        start = trio.current_time()
        await nursery.start(hold, queue, "quiet", release, log)
        await trio.lowlevel.checkpoint()
        assert log[-1] == "quiet" and trio.current_time() == start and queue.busy == 4
        release.set()


async def test_a_request_with_a_deadline_waits_at_most_its_deadline_less_a_slots_hold(
    autojump_clock: trio.testing.MockClock,
) -> None:
    queue, release, log = make_queue(timeout=30), trio.Event(), []
    queue.group(()).rate.observe(2.0)  # a slot is held 2 s
    async with trio.open_nursery() as nursery:
        await nursery.start(hold, queue, "a", release, log)
        context, call = call_for("b")
        context.deadline = trio.current_time() + 5  # X-Deadline-Ms: 5000
        start = trio.current_time()
        with pytest.raises(Overloaded) as info:
            async with queue.admit(context, call):
                pass
        # Its answer would need 2 s more: it gives up after 3, not 5.
        assert info.value.code == "queue_timeout" and trio.current_time() - start == pytest.approx(3)
        release.set()


async def test_capacity_that_appears_without_a_release_is_given_within_a_poll(autojump_clock: trio.testing.MockClock) -> None:
    slots = [0]
    config = AdmissionConfig(queue_timeout=ClassTable(interactive=30, default=30, batch=30))
    queue = Queue(Tenants({}), config, ErlangShedding(), lambda: FairQueue(aging=1000), lambda key: slots[0])
    context, call = call_for("a")
    with pytest.raises(Overloaded):  # no backend at all: refused at once
        async with queue.admit(context, call):
            pass
    slots[0] = 1
    release, log = trio.Event(), []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(queue.run)
        await nursery.start(hold, queue, "a", release, log)
        await nursery.start(hold, queue, "b", release, log)
        await trio.sleep(0.01)
        assert log == ["a"]
        slots[0] = 2  # a backend came up
        start = trio.current_time()
        while log != ["a", "b"]:
            await trio.sleep(0.01)
        assert trio.current_time() - start <= 0.26
        release.set()
        nursery.cancel_scope.cancel()


class _Batches:
    """A backend whose events come in reads: ``reads`` events each, all but
    a read's last marked ``more_ready``, one token each."""

    def __init__(self, reads: list[int]) -> None:
        self.reads = reads

    async def stream(self, request: object) -> AsyncIterator[Event]:
        for size in self.reads:
            for k in range(size):
                yield Event(token_ids=[k], text=" w", more_ready=k < size - 1)


async def test_tokens_are_charged_once_a_read_and_what_a_consumer_left_with() -> None:
    """Metering charges the tokens of one upstream read in one call (a
    charge took a clock read and a policy update per token); every token
    is charged, also when the consumer leaves inside a read."""
    charges: list[int] = []
    metered = lambda: watched(_Batches([3, 1, 4]).stream(None), [_Meter(charges.append)])  # noqa: E731
    assert len([e async for e in metered()]) == 8
    assert charges == [3, 1, 4]
    charges.clear()
    async with aclosing(metered()) as events:
        for _ in range(5):  # the first read, the second, and 1 of the third's 4
            await events.__anext__()
    assert charges == [3, 1, 1]
