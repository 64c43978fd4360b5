"""Tensor-parallel processes: rank 0's runner, the worker ranks, and launching them.

The sharding itself (plan, transform) is in tp.py, the collectives in tp_comm.py. Here:

* :class:`TPRunner` is rank 0's runner, with :class:`ModelRunner`'s interface: each
  ``execute`` broadcasts the step's compact description to the workers, then runs rank
  0's shard of the forward. A monitor thread waits on the worker processes' sentinels, so
  a dead worker marks the group failed at once (``failure``, ``check()``), even when idle.
* A worker has no scheduler, sampler or server. It builds the full model, keeps its shard,
  allocates KV for its own KV heads, reports ready through the rendezvous store, and then
  runs every step rank 0 broadcasts (per sequence: start position, new token ids, block
  table; plus the logits rows per sequence), rebuilt into :class:`ScheduledSeq` views for
  the same :class:`ModelRunner`, so the collectives inside its forward pair up with rank
  0's. It exits 0 after rank 0's "stop" and 1 when the group fails (a dead peer closes its
  sockets, a collective misses its deadline): a worker never outlives rank 0 hanging. A
  startup failure is written to the store (``tp/error/<rank>``) for rank 0 to report.
* Workers are started from a ``forkserver`` that has imported torch and this module once,
  so a worker starts in a fraction of a second instead of re-importing torch; ranks of a
  torchrun launch use the standard RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT /
  LOCAL_RANK variables and torchrun's store.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing import connection as mp_connection
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from backends.engine.config import EngineConfig
from backends.engine.model import ModelArgs, Transformer
from backends.engine.runner import TORCH_DTYPES, ModelRunner
from backends.engine.scheduler import ScheduledSeq
from backends.engine.tp import ShardPlan, apply_tp, kv_blocks_for, plan_for, rank_device
from backends.engine.tp_comm import Comm, PrefixStore, RankFailure, TensorParallelError

__all__ = [
    "LoadModel",
    "SeqView",
    "TPLaunch",
    "TPRunner",
    "TPStatistics",
    "TokenWindow",
    "WorkerSpec",
    "decode_step",
    "encode_step",
    "launch_tp",
    "run_spawned",
    "run_torchrun",
    "serve",
    "start_tp",
    "torchrun_env",
    "torchrun_rank0",
]


# ---- rank 0's runner ----------------------------------------------------------------------


class TPStatistics(msgspec.Struct, frozen=True, kw_only=True):
    world_size: int
    num_steps: int
    failed: bool
    failure: str | None
    q_heads_per_rank: tuple[int, ...]
    kv_heads_per_rank: tuple[int, ...]


def encode_step(
    scheduled: Sequence[ScheduledSeq], counts: Sequence[int], block_size: int
) -> tuple[Any, ...]:
    """What the workers need of a step: per sequence the start position, the new token
    ids and the block table up to the last block touched; and the logits counts."""
    items = [
        (
            s.start,
            list(s.seq.token_ids[s.start : s.end]),
            list(s.seq.block_table[: -(-s.end // block_size)]),
        )
        for s in scheduled
    ]
    return ("step", items, list(counts))


class TPRunner:
    """Rank 0's runner with :class:`ModelRunner`'s interface: each ``execute`` first
    broadcasts the step to the workers, then runs this rank's shard of the forward.

    Not re-entrant: one caller drives ``execute`` (like the engine)."""

    def __init__(
        self, local: ModelRunner, comm: Comm, plan: ShardPlan, procs: Sequence[BaseProcess] = ()
    ) -> None:
        self.local, self.comm, self.plan = local, comm, plan
        self.num_kv_blocks = local.num_kv_blocks
        self.block_size = local.block_size
        self.device, self.dtype = local.device, local.dtype
        self.vocab_size = plan.vocab_size
        self.max_model_len = local.max_model_len
        self._procs = list(procs)
        self._sentinels = [p.sentinel for p in self._procs]
        self._lock = threading.Lock()
        self._fail_lock = threading.Lock()
        # Every poll of a worker's exit status goes through this lock: a
        # forkserver child's status is read from its sentinel pipe once, and
        # a second thread polling at the same time reads EOF and records 255
        # over it (CPython's popen_forkserver), so a SIGKILL read as "exited
        # with status 255".
        self._reap_lock = threading.Lock()
        self._failure: str | None = None
        self._steps = 0
        self._closing = False
        self._wake_r, self._wake_w = os.pipe()
        self._monitor: threading.Thread | None = None
        if self._procs:
            self._monitor = threading.Thread(target=self._watch, name="tp-monitor", daemon=True)
            self._monitor.start()

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    @property
    def workers(self) -> tuple[BaseProcess, ...]:
        """The worker processes this rank spawned (empty under torchrun). To
        wait for one to end, wait on its ``sentinel``; its ``join`` or
        ``exitcode`` from another thread races the runner's own (see
        ``_reap_lock``)."""
        return tuple(self._procs)

    def _exit_code(self, proc: BaseProcess, wait: float = 0.0) -> int | None:
        """``proc``'s exit code once it has ended (waiting up to ``wait`` s), else None."""
        with self._reap_lock:
            proc.join(wait)
            return proc.exitcode

    @property
    def failure(self) -> str | None:
        """Why the group is down, or None while it is healthy."""
        return self._failure

    def check(self) -> None:
        """Raise :class:`RankFailure` if a rank has died (health checks call this)."""
        if self._failure is not None:
            raise RankFailure(self._failure)

    def execute(
        self, scheduled: Sequence[ScheduledSeq], logits_per_seq: Sequence[int] | None = None
    ) -> torch.Tensor:
        self.check()
        self._check_workers()
        if not scheduled:
            return self.local.execute(scheduled, logits_per_seq)
        counts = (
            list(logits_per_seq)
            if logits_per_seq is not None
            else [int(s.needs_sampling) for s in scheduled]
        )
        with self._lock:
            try:
                self.comm.send(encode_step(scheduled, counts, self.block_size))
                logits = self.local.execute(scheduled, logits_per_seq)
            except RankFailure as exc:
                self._fail(self._exit_details(wait=1.0) or exc.message)
                raise RankFailure(self._failure or exc.message) from exc
            self._steps += 1
            return logits

    def statistics(self) -> TPStatistics:
        return TPStatistics(
            world_size=self.world_size,
            num_steps=self._steps,
            failed=self._failure is not None,
            failure=self._failure,
            q_heads_per_rank=tuple(len(s.q_heads) for s in self.plan.shards),
            kv_heads_per_rank=tuple(len(s.kv_heads) for s in self.plan.shards),
        )

    def close(self, timeout: float = 10.0) -> None:
        """Stop the workers (politely, then by force) and release the group."""
        if self._closing:
            return
        self._closing = True
        if self._failure is None:
            with self._lock, contextlib.suppress(RankFailure):
                self.comm.send(("stop",))
        for proc in self._procs:
            self._exit_code(proc, timeout)
        self._terminate_workers()
        os.write(self._wake_w, b"x")
        if self._monitor is not None:
            self._monitor.join(timeout)
        os.close(self._wake_r)
        os.close(self._wake_w)
        self._failure = self._failure or "the tensor-parallel engine is closed"
        with self._lock:
            self.comm.close(self._failure, release=True)

    def __enter__(self) -> TPRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- failure handling -------------------------------------------------------------

    def _check_workers(self) -> None:
        """Raise :class:`RankFailure` if a worker has ended, before any collective
        starts: the monitor thread may not have recorded it yet, and a collective
        with a dead peer usually fails at once but can wait out the whole
        collective timeout (gloo, seen in CI: 10 s). A poll of the sentinels,
        ~10 us a step."""
        if self._procs and mp_connection.wait(self._sentinels, timeout=0):
            self._fail(self._exit_details(wait=1.0) or "a tensor-parallel worker exited")
            raise RankFailure(self._failure or "a tensor-parallel worker exited")

    def _watch(self) -> None:
        mp_connection.wait([*(p.sentinel for p in self._procs), self._wake_r])
        if not self._closing:
            self._fail(self._exit_details(wait=1.0) or "a tensor-parallel worker exited")

    def _exit_details(self, wait: float) -> str | None:
        """Which worker died and how, once its death is visible (up to ``wait`` s)."""
        ready = set(mp_connection.wait([p.sentinel for p in self._procs], timeout=wait))
        for rank, proc in enumerate(self._procs, start=1):
            if proc.sentinel not in ready or self._closing:
                continue
            code = self._exit_code(proc, 1.0)  # ended (its sentinel is ready): reaped at once
            how = "exited" if code is None else _describe_exit(code)
            return f"tensor-parallel rank {rank} (pid {proc.pid}) {how}; the engine is down"
        return None

    def _fail(self, reason: str) -> None:
        with self._fail_lock:
            if self._failure is None:
                self._failure = reason
            self.comm.close(self._failure)
            self._terminate_workers()

    def _terminate_workers(self) -> None:
        for proc in self._procs:
            if self._exit_code(proc) is None:
                proc.kill()
                self._exit_code(proc, 5.0)


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


# ---- launching -----------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker rank needs (pickled to spawned workers)."""

    rank: int
    world_size: int
    build: Callable[[], Transformer]
    num_kv_blocks: int
    block_size: int
    device: str
    dtype: str  # "float32" | "bfloat16"
    threads: int | None
    timeout: float
    startup_timeout: float
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    local_rank: int = -1  # -1: same as rank

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]

    @property
    def loopback(self) -> bool:
        return self.master_addr in ("127.0.0.1", "localhost")

    @property
    def rank_device(self) -> torch.device:
        return rank_device(self.device, self.rank if self.local_rank < 0 else self.local_rank)


def shard_and_place(model: Transformer, spec: WorkerSpec, comm: Comm) -> ModelRunner:
    """Shard ``model`` for ``spec.rank`` and give it a runner (KV for local heads only)."""
    plan = plan_for(model.args, spec.world_size)
    apply_tp(model, plan, spec.rank, comm)
    device = spec.rank_device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return ModelRunner(model, spec.num_kv_blocks, spec.block_size, device, spec.torch_dtype)


def _wait_ready(store: Any, spec: WorkerSpec, procs: Sequence[BaseProcess]) -> None:
    """Block until every worker has built its shard; raise with the worker's own error
    if one failed or died on the way."""
    pending = set(range(1, spec.world_size))
    deadline = time.monotonic() + spec.startup_timeout
    sentinels = [p.sentinel for p in procs]
    while pending:
        for rank in sorted(pending):
            if store.check([f"tp/error/{rank}"]):
                raise TensorParallelError(
                    f"tensor-parallel rank {rank} failed to start:\n{store.get(f'tp/error/{rank}').decode()}"
                )
            if store.check([f"tp/ready/{rank}"]):
                pending.discard(rank)
        for rank, proc in enumerate(procs, start=1):
            if proc.exitcode is not None and rank in pending:
                raise TensorParallelError(
                    f"tensor-parallel rank {rank} {_describe_exit(proc.exitcode)} while starting"
                )
        if pending and time.monotonic() > deadline:
            raise TensorParallelError(
                f"tensor-parallel ranks {sorted(pending)} not ready after {spec.startup_timeout} s"
            )
        if pending:
            mp_connection.wait(sentinels, timeout=0.05)  # wakes at once if a worker dies


def start_rank0(
    model: Transformer, spec: WorkerSpec, store: Any, procs: Sequence[BaseProcess] = ()
) -> TPRunner:
    """Rank 0's half of startup: shard, wait for the workers, connect, return the runner."""
    plan = plan_for(model.args, spec.world_size)
    comm = Comm(0, spec.world_size, spec.timeout)
    local = shard_and_place(model, spec, comm)
    _wait_ready(store, spec, procs)
    comm.connect(store, local.device, spec.loopback, spec.startup_timeout)
    return TPRunner(local, comm, plan, procs)


def start_tp(
    build: Callable[[], Transformer],
    world_size: int,
    *,
    num_kv_blocks: int,
    block_size: int = 16,
    device: str = "cpu",
    dtype: str = "float32",
    threads: int | None = 1,
    timeout: float = 30.0,
    startup_timeout: float = 300.0,
    model: Transformer | None = None,
) -> ModelRunner | TPRunner:
    """Spawn ``world_size - 1`` worker processes that each call ``build()`` (a picklable
    callable returning the full model on CPU) and shard it; rank 0 shards ``model`` (or
    its own ``build()``). At ``world_size == 1`` this is a plain :class:`ModelRunner`."""
    model = model if model is not None else build()
    spec = WorkerSpec(
        rank=0, world_size=world_size, build=build, num_kv_blocks=num_kv_blocks,
        block_size=block_size, device=device, dtype=dtype, threads=threads, timeout=timeout,
        startup_timeout=startup_timeout,
    )  # fmt: skip
    if world_size == 1:
        return ModelRunner(model, num_kv_blocks, block_size, spec.rank_device, spec.torch_dtype)
    plan_for(model.args, world_size)  # refuse a bad size before spawning anything
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=startup_timeout),
    )  # fmt: skip
    spec = dataclasses.replace(spec, master_port=store.port)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["backends.engine.tp_worker"])
    procs = [
        ctx.Process(target=run_spawned, args=(dataclasses.replace(spec, rank=r),), daemon=True)
        for r in range(1, world_size)
    ]
    for proc in procs:
        proc.start()
    try:
        return start_rank0(model, spec, store, procs)
    except BaseException:
        for proc in procs:
            proc.kill()
            proc.join(5.0)
        raise


@dataclass(frozen=True)
class TPLaunch:
    """What ``headrace engine`` needs from a (possibly tensor-parallel) model."""

    runner: ModelRunner | TPRunner
    tokenizer: Any
    args: ModelArgs  # the full model's
    name: str
    path: str


@dataclass(frozen=True)
class LoadModel:
    """Picklable builder: the full checkpoint, float32 on CPU (sharded afterwards)."""

    path: str | None

    def __call__(self) -> Transformer:
        from backends.engine.loader import load_model

        return load_model(self.path).model


def torchrun_env() -> dict[str, str] | None:
    """The standard launcher variables when this process was started by torchrun."""
    keys = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if not all(k in os.environ for k in keys):
        return None
    return {k: os.environ[k] for k in (*keys, "LOCAL_RANK") if k in os.environ}


def launch_tp(config: EngineConfig, n: int, *, timeout: float = 30.0) -> TPLaunch | None:
    """Load ``config.model`` and run it over ``n`` tensor-parallel ranks.

    Started normally: spawns ``n - 1`` workers and returns rank 0's :class:`TPLaunch`.
    Started by torchrun (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set, WORLD_SIZE == n):
    rank 0 returns its launch; other ranks serve as workers until rank 0 stops them and
    then return None (the caller exits). At ``n == 1`` the runner is a plain ModelRunner."""
    from backends.engine.loader import load_model

    if n < 1:
        raise TensorParallelError(f"--tp must be >= 1, got {n}")
    env = torchrun_env() if n > 1 else None
    if env is not None and int(env["WORLD_SIZE"]) != n:
        raise TensorParallelError(
            f"--tp {n} but torchrun started WORLD_SIZE={env['WORLD_SIZE']} ranks"
        )
    build = LoadModel(config.model)
    if env is not None and int(env["RANK"]) != 0:
        run_torchrun(build, config, env, timeout)
        return None
    loaded = load_model(config.model)
    threads = (
        max(1, (os.cpu_count() or 1) // n) if rank_device(config.device, 0).type == "cpu" else None
    )
    if threads is not None and n > 1:
        torch.set_num_threads(threads)
    blocks = kv_blocks_for(config, loaded.args, n)
    if env is None:
        runner = start_tp(
            build, n, num_kv_blocks=blocks, block_size=config.block_size, device=config.device,
            dtype=config.dtype, threads=threads, timeout=timeout, model=loaded.model,
        )  # fmt: skip
    else:
        runner = torchrun_rank0(loaded.model, build, config, env, blocks, timeout)
    return TPLaunch(runner, loaded.tokenizer, loaded.args, loaded.name, loaded.path)


# ---- worker ranks ---------------------------------------------------------------------------


class TokenWindow:
    """A sequence's token ids as far as one step reads them: ``len()`` is the step's end
    and only ``[start:end]`` is present (the rest never leaves rank 0)."""

    __slots__ = ("start", "tokens")

    def __init__(self, start: int, tokens: list[int]) -> None:
        self.start, self.tokens = start, tokens

    def __len__(self) -> int:
        return self.start + len(self.tokens)

    def __getitem__(self, index: slice) -> list[int]:
        if (
            not isinstance(index, slice)
            or index.step not in (None, 1)
            or (index.start or 0) < self.start
        ):
            raise IndexError(f"only token ids from position {self.start} are on this rank")
        stop = len(self) if index.stop is None else index.stop
        return self.tokens[index.start - self.start : stop - self.start]


class SeqView:
    """The part of a :class:`Sequence` the runner reads."""

    __slots__ = ("block_table", "token_ids")

    def __init__(self, start: int, tokens: list[int], block_table: list[int]) -> None:
        self.token_ids = TokenWindow(start, tokens)
        self.block_table = block_table

    def __repr__(self) -> str:
        return f"SeqView(start={self.token_ids.start}, new={len(self.token_ids.tokens)})"


def decode_step(message: tuple[Any, ...]) -> tuple[list[ScheduledSeq], list[int]]:
    """Inverse of :func:`encode_step`."""
    _, items, counts = message
    scheduled = [
        ScheduledSeq(SeqView(start, tokens, table), len(tokens), start)  # type: ignore[arg-type]
        for start, tokens, table in items
    ]
    return scheduled, counts


def serve(runner: ModelRunner, comm: Comm) -> int:
    """Run rank 0's steps until it says stop (0) or the group fails (1)."""
    try:
        while True:
            message = comm.recv()
            if message[0] == "stop":
                return 0
            scheduled, counts = decode_step(message)
            try:
                runner.execute(scheduled, counts)
            except ValueError:
                continue  # rank 0's runner rejected the same step before any collective
    except RankFailure as exc:
        print(f"headrace tp rank {comm.rank}: {exc.message}", file=sys.stderr, flush=True)
        return 1
    finally:
        comm.close(release=True)


def _start_worker(spec: WorkerSpec, store: Any, build: Callable[[], Transformer]) -> int:
    comm = Comm(spec.rank, spec.world_size, spec.timeout)
    try:
        runner = shard_and_place(build(), spec, comm)
    except BaseException:
        store.set(f"tp/error/{spec.rank}", traceback.format_exc())
        return 1
    store.set(f"tp/ready/{spec.rank}", "1")
    comm.connect(store, runner.device, spec.loopback, spec.startup_timeout)
    return serve(runner, comm)


def run_spawned(spec: WorkerSpec) -> None:
    """Entry point of a worker process spawned by :func:`start_tp`."""
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    store = dist.TCPStore(  # type: ignore[attr-defined]
        spec.master_addr, spec.master_port, spec.world_size, is_master=False,
        timeout=datetime.timedelta(seconds=spec.startup_timeout),
    )  # fmt: skip
    raise SystemExit(_start_worker(spec, store, spec.build))


def _torchrun_spec(
    build: Callable[[], Transformer],
    config: EngineConfig,
    env: dict[str, str],
    blocks: int,
    timeout: float,
) -> WorkerSpec:
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    return WorkerSpec(
        rank=rank, world_size=world, build=build, num_kv_blocks=blocks,
        block_size=config.block_size, device=config.device, dtype=config.dtype, threads=None,
        timeout=timeout, startup_timeout=300.0, master_addr=env["MASTER_ADDR"],
        master_port=int(env["MASTER_PORT"]), local_rank=int(env.get("LOCAL_RANK", rank)),
    )  # fmt: skip


def _torchrun_store(spec: WorkerSpec) -> Any:
    """The store torchrun's env vars describe (the agent's own store when it hosts one)."""
    url = "env://"
    wait = datetime.timedelta(seconds=spec.startup_timeout)
    store, _, _ = next(dist.rendezvous(url, spec.rank, spec.world_size, timeout=wait))  # type: ignore[attr-defined]
    return PrefixStore("headrace", store)


def run_torchrun(
    build: Callable[[], Transformer], config: EngineConfig, env: dict[str, str], timeout: float
) -> None:
    """A non-zero torchrun rank: build, shard, serve rank 0's steps, return when stopped."""
    model = build()
    blocks = kv_blocks_for(config, model.args, int(env["WORLD_SIZE"]))
    spec = _torchrun_spec(build, config, env, blocks, timeout)
    store = _torchrun_store(spec)
    code = _start_worker(spec, store, lambda: model)
    if code != 0:
        raise RankFailure(f"tensor-parallel rank {spec.rank} stopped with status {code}")


def torchrun_rank0(
    model: Transformer, build: Callable[[], Transformer], config: EngineConfig, env: dict[str, str],
    blocks: int, timeout: float,
) -> TPRunner:  # fmt: skip
    """Rank 0 under torchrun: the workers are torchrun's, not ours (no process handles;
    a dead worker shows up as a failed collective, and torchrun tears the group down)."""
    spec = _torchrun_spec(build, config, env, blocks, timeout)
    return start_rank0(model, spec, _torchrun_store(spec))
