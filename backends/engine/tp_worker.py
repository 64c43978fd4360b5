"""The worker ranks of tensor parallelism (rank 0 lives in tp.py).

A worker has no scheduler, sampler or server. It builds the full model, keeps its shard
(:func:`backends.engine.tp.apply_tp`), allocates KV for its own KV heads, reports ready
through the rendezvous store, and then runs every step rank 0 broadcasts: a compact
description (per sequence: start position, new token ids, block table; plus how many
logits rows each sequence gives) rebuilt into :class:`ScheduledSeq` views and fed to the
same :class:`ModelRunner`, so the collectives inside its forward pair up with rank 0's.

Exit status: 0 after rank 0's "stop"; 1 when the group fails (a dead peer closes its
sockets, or a collective misses its deadline), so a worker never outlives rank 0 hanging.
A startup failure is written to the store (``tp/error/<rank>``) for rank 0 to report.
"""

from __future__ import annotations

import datetime
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from backends.engine.config import EngineConfig
from backends.engine.model import Transformer
from backends.engine.runner import ModelRunner
from backends.engine.scheduler import ScheduledSeq
from backends.engine.tp import (
    Comm,
    RankFailure,
    TPRunner,
    WorkerSpec,
    _PrefixStore,
    kv_blocks_for,
    shard_and_place,
    start_rank0,
)

__all__ = [
    "SeqView",
    "TokenWindow",
    "decode_step",
    "run_spawned",
    "run_torchrun",
    "serve",
    "torchrun_rank0",
]


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
    """Inverse of :func:`backends.engine.tp.encode_step`."""
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
        comm.close()


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
    """Entry point of a worker process spawned by :func:`backends.engine.tp.start_tp`."""
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
    return _PrefixStore("headrace", store)


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
