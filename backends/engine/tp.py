"""Tensor parallelism: Megatron sharding applied to the built model, gpt-fast style.

The model (model.py) knows nothing about parallelism. :func:`apply_tp` mutates a built
:class:`Transformer` in place so that rank ``r`` of ``N`` keeps only its shard::

    wq, wk, wv   column-parallel: the rows of this rank's query heads / KV heads
    wo           row-parallel: the matching columns, then all-reduce(sum)
    w1, w3       column-parallel: a slice of the intermediate size
    w2           row-parallel: the same slice of columns, then all-reduce(sum)
    embedding    vocab-parallel: a vocab range; masked lookup, then all-reduce(sum)
    output head  vocab-parallel: the same range; logits gathered to rank 0
    norms        replicated (tiny)

and sets each attention module's local head counts and ``model.args`` to the local
sizes, so the runner allocates KV only for this rank's KV heads. At N=1 it does nothing.

Grouped-query attention is split by KV group (engines.md §3): the groups are dealt out
as evenly as possible, so SmolLM2 (9 q heads, 3 KV heads) at N=2 gives rank 0 two groups
(6 q heads) and rank 1 one group (3 q heads). vLLM, TGI and gpt-fast refuse that; an
uneven split is exact because the row-parallel partial sums are full-width on every rank.
When N exceeds the KV heads, each KV head is *replicated* on consecutive ranks and its
group's query heads are split among them (vLLM's ``num_kv_head_replicas``); N larger than
the number of query heads is refused. Intermediate size and vocab are split as evenly as
possible (uneven allowed).

Processes (the engine spawns N-1 workers, or torchrun starts all N)::

    rank 0: HTTP server, scheduler, sampler       ranks 1..N-1: tp_worker.serve()
      TPRunner.execute(scheduled)
        control.send(step)  ---- gloo broadcast ---->  control.recv() (waits idle forever)
        local forward       <--- all-reduce x 2/layer -->  local forward
        logits (gathered to rank 0)  <---- gather ----   (their vocab slice)

Every collective has a deadline; a closed connection or a missed deadline becomes
:class:`RankFailure`, and rank 0 also watches its worker processes, so a dead rank
takes the engine down with a clear error instead of a hang.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import pickle
import signal
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing import connection as mp_connection
from multiprocessing.process import BaseProcess
from typing import Any, cast

import msgspec
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from backends.engine.config import EngineConfig
from backends.engine.model import ModelArgs, Transformer, TransformerBlock
from backends.engine.runner import ModelRunner, kv_bytes_per_block, resolve_device
from backends.engine.scheduler import ScheduledSeq
from backends.errors import BackendUnavailable, HeadraceError

__all__ = [
    "Comm",
    "RankFailure",
    "RankShard",
    "ShardPlan",
    "TPLaunch",
    "TPRunner",
    "TPStatistics",
    "TensorParallelError",
    "apply_tp",
    "even_ranges",
    "launch_tp",
    "local_args",
    "plan_tp",
    "rank_device",
    "start_tp",
    "torchrun_env",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_PrefixStore: Any = dist.PrefixStore  # type: ignore[attr-defined]
_IDLE_WAIT = datetime.timedelta(days=365)  # workers wait this long for the next step


class TensorParallelError(HeadraceError):
    """The tensor-parallel configuration cannot work (bad world size, startup failure)."""


class RankFailure(BackendUnavailable):
    """A rank died, stalled past the collective deadline, or the group was closed."""


# ---- the sharding plan (pure) ----------------------------------------------------------


def even_ranges(total: int, parts: int) -> list[range]:
    """``total`` items cut into ``parts`` contiguous ranges, sizes differing by at most one
    (the first ``total % parts`` ranges get the extra item)."""
    base, extra = divmod(total, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (i < extra)
        out.append(range(start, start + size))
        start += size
    return out


@dataclass(frozen=True)
class RankShard:
    """What one rank holds: global indices of its query heads, KV heads, intermediate
    features and vocab rows (all contiguous)."""

    rank: int
    q_heads: range
    kv_heads: range
    hidden: range
    vocab: range


@dataclass(frozen=True)
class ShardPlan:
    world_size: int
    n_heads: int
    n_kv_heads: int
    hidden_dim: int
    vocab_size: int
    shards: tuple[RankShard, ...]

    @property
    def kv_replicas(self) -> int:
        """The most ranks holding one KV head (1: no replication)."""
        counts = [sum(h in s.kv_heads for s in self.shards) for h in range(self.n_kv_heads)]
        return max(counts)


def plan_tp(
    n_heads: int, n_kv_heads: int, hidden_dim: int, vocab_size: int, world_size: int
) -> ShardPlan:
    """Split heads by KV group (replicating KV heads when ``world_size > n_kv_heads``),
    the intermediate size and the vocab as evenly as possible."""
    if world_size < 1:
        raise TensorParallelError(f"tensor-parallel size must be >= 1, got {world_size}")
    if n_kv_heads < 1 or n_heads % n_kv_heads:
        raise TensorParallelError(
            f"{n_heads} query heads do not form groups over {n_kv_heads} KV heads"
        )
    for what, size in (
        ("query heads", n_heads),
        ("intermediate size", hidden_dim),
        ("vocab", vocab_size),
    ):
        if world_size > size:
            raise TensorParallelError(
                f"tensor-parallel size {world_size} exceeds the model's {what} ({size}): "
                "some rank would hold nothing"
            )
    group = n_heads // n_kv_heads
    if world_size <= n_kv_heads:
        kv = even_ranges(n_kv_heads, world_size)
        q = [range(r.start * group, r.stop * group) for r in kv]
    else:
        kv, q = [], []
        for head, ranks in enumerate(even_ranges(world_size, n_kv_heads)):
            for part in even_ranges(group, len(ranks)):
                kv.append(range(head, head + 1))
                q.append(range(head * group + part.start, head * group + part.stop))
    hidden, vocab = even_ranges(hidden_dim, world_size), even_ranges(vocab_size, world_size)
    shards = tuple(RankShard(r, q[r], kv[r], hidden[r], vocab[r]) for r in range(world_size))
    return ShardPlan(world_size, n_heads, n_kv_heads, hidden_dim, vocab_size, shards)


def plan_for(args: ModelArgs, world_size: int) -> ShardPlan:
    return plan_tp(args.n_heads, args.n_kv_heads, args.hidden_dim, args.vocab_size, world_size)


def local_args(args: ModelArgs, shard: RankShard) -> ModelArgs:
    """The rank's view of the model: local head counts and intermediate size (the
    vocab stays global: logits reach rank 0 whole)."""
    return dataclasses.replace(
        args,
        n_heads=len(shard.q_heads),
        n_kv_heads=len(shard.kv_heads),
        hidden_dim=len(shard.hidden),
    )


# ---- collectives ----------------------------------------------------------------------


class Comm:
    """The collectives of one tensor-parallel group, each with a deadline.

    Built before the group exists (the sharded modules hold it), connected once every
    rank is ready. Model collectives run on gloo (CPU) or NCCL (CUDA); the control
    channel (rank 0 -> workers) always runs on gloo. A failed or late collective raises
    :class:`RankFailure` and the group is unusable afterwards."""

    def __init__(self, rank: int, world_size: int, timeout: float) -> None:
        self.rank, self.world_size = rank, world_size
        self.timeout = datetime.timedelta(seconds=timeout)
        self._ctrl: Any = None
        self._model: Any = None
        self._broken: str | None = None

    def connect(
        self, store: Any, device: torch.device, loopback: bool, startup_timeout: float
    ) -> None:
        """Create the process groups (every rank calls this; it returns once all have)."""
        wait = datetime.timedelta(seconds=startup_timeout)
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._timeout = wait
        opts._devices = [
            dist.ProcessGroupGloo.create_device(hostname="127.0.0.1" if loopback else "")
        ]
        prefix = _PrefixStore("tp/gloo", store)
        self._ctrl = dist.ProcessGroupGloo(prefix, self.rank, self.world_size, opts)
        if device.type == "cuda":
            nccl = dist.ProcessGroupNCCL.Options()
            nccl._timeout = self.timeout
            prefix = _PrefixStore("tp/nccl", store)
            self._model = dist.ProcessGroupNCCL(prefix, self.rank, self.world_size, nccl)
        else:
            self._model = self._ctrl

    def close(self, reason: str = "the tensor-parallel group is closed") -> None:
        self._broken = self._broken or reason
        self._ctrl = self._model = None

    def _run(self, what: str, start: Callable[[], Any]) -> None:
        if self._broken is not None:
            raise RankFailure(self._broken)
        try:
            start().wait()
        except RuntimeError as exc:  # gloo/NCCL: closed connection, timeout
            self._broken = f"tensor-parallel {what} failed on rank {self.rank}: {exc}"
            raise RankFailure(self._broken) from exc

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]
        opts.timeout = self.timeout
        self._run("all-reduce", lambda: self._model.allreduce([t], opts))
        return t

    def gather_cols(self, t: torch.Tensor, widths: Sequence[int]) -> torch.Tensor:
        """Rank 0: the ranks' ``[N, widths[r]]`` pieces side by side ``[N, sum(widths)]``;
        other ranks get their own piece back."""
        wide = max(widths)
        padded = F.pad(t, (0, wide - t.shape[1])).contiguous()
        outs = [[torch.empty_like(padded) for _ in widths]] if self.rank == 0 else []
        opts = dist.GatherOptions()
        opts.rootRank = 0
        opts.timeout = self.timeout
        self._run("gather", lambda: self._model.gather(outs, [padded], opts))
        if self.rank != 0:
            return t
        return torch.cat([piece[:, :w] for piece, w in zip(outs[0], widths, strict=True)], dim=1)

    def send(self, message: object) -> None:
        """Rank 0: broadcast a control message to every worker."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        size = torch.tensor([len(data)], dtype=torch.int64)
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self._run("control send", lambda: self._ctrl.broadcast(size, 0, self.timeout))
        self._run("control send", lambda: self._ctrl.broadcast(payload, 0, self.timeout))

    def recv(self) -> Any:
        """Workers: the next control message (waits as long as rank 0 stays idle)."""
        size = torch.zeros(1, dtype=torch.int64)
        self._run("control receive", lambda: self._ctrl.broadcast(size, 0, _IDLE_WAIT))
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        self._run("control receive", lambda: self._ctrl.broadcast(payload, 0, self.timeout))
        return pickle.loads(payload.numpy().tobytes())


# ---- the transform ----------------------------------------------------------------------


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, start + n)`` of the embedding; other ids contribute zeros, and the
    all-reduce leaves each token with exactly its one owner's row."""

    def __init__(self, weight: torch.Tensor, start: int, comm: Comm) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.comm = start, comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start  # ids: [T]
        inside = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)  # [T, dim]
        return self.comm.all_reduce_(out.masked_fill(~inside[:, None], 0))


class VocabParallelHead(nn.Module):
    """The LM head over this rank's vocab rows; rank 0 receives the whole logits."""

    def __init__(self, weight: nn.Parameter, widths: Sequence[int], comm: Comm) -> None:
        super().__init__()
        self.weight = weight
        self.widths, self.comm = tuple(widths), comm

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = F.linear(hidden, self.weight)  # [N, V_local]
        if hidden.shape[0] == 0:  # every rank sees the same N: skip the collective together
            return local.new_empty(0, sum(self.widths))
        return self.comm.gather_cols(local, self.widths)  # rank 0: [N, V]


def _keep(linear: nn.Linear, rows: slice | None = None, cols: slice | None = None) -> None:
    """Replace a Linear's weight (and bias) by a copy of its shard, freeing the rest."""
    w = linear.weight.detach()
    if rows is not None:
        w = w[rows]
        if linear.bias is not None:
            linear.bias = nn.Parameter(linear.bias.detach()[rows].clone(), requires_grad=False)
    if cols is not None:
        w = w[:, cols]
    linear.weight = nn.Parameter(w.clone(), requires_grad=False)
    linear.out_features, linear.in_features = w.shape


def _all_reduce_output(comm: Comm) -> Callable[[nn.Module, Any, torch.Tensor], torch.Tensor]:
    def hook(_module: nn.Module, _inputs: Any, output: torch.Tensor) -> torch.Tensor:
        return comm.all_reduce_(output)

    return hook


def _span(r: range, scale: int = 1) -> slice:
    return slice(r.start * scale, r.stop * scale)


def apply_tp(model: Transformer, plan: ShardPlan, rank: int, comm: Comm | None) -> Transformer:
    """Shard ``model`` in place for ``rank`` (no-op when the plan has one rank)."""
    if plan.world_size == 1:
        return model
    if comm is None:
        raise TensorParallelError("apply_tp needs a Comm when world_size > 1")
    shard, args = plan.shards[rank], model.args
    q, kv = _span(shard.q_heads, args.head_dim), _span(shard.kv_heads, args.head_dim)
    hidden = _span(shard.hidden)
    for block in model.layers:
        layer = cast(TransformerBlock, block)
        attn, ffn = layer.attention, layer.feed_forward
        _keep(attn.wq, rows=q)
        _keep(attn.wk, rows=kv)
        _keep(attn.wv, rows=kv)
        _keep(attn.wo, cols=q)
        attn.n_heads, attn.n_kv_heads = len(shard.q_heads), len(shard.kv_heads)
        attn.register_forward_hook(_all_reduce_output(comm))
        _keep(ffn.w1, rows=hidden)
        _keep(ffn.w3, rows=hidden)
        _keep(ffn.w2, cols=hidden)
        ffn.register_forward_hook(_all_reduce_output(comm))
    vocab = _span(shard.vocab)
    widths = [len(s.vocab) for s in plan.shards]
    embedding = VocabParallelEmbedding(
        model.tok_embeddings.weight.detach()[vocab].clone(), vocab.start, comm
    )
    head_weight = embedding.weight
    if not args.tie_embeddings:
        head_weight = nn.Parameter(model.output.weight.detach()[vocab].clone(), requires_grad=False)
    model.tok_embeddings = embedding  # type: ignore[assignment]
    model.output = VocabParallelHead(head_weight, widths, comm)  # type: ignore[assignment]
    model.args = local_args(args, shard)
    return model


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
        self._lock = threading.Lock()
        self._fail_lock = threading.Lock()
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
        """The worker processes this rank spawned (empty under torchrun)."""
        return tuple(self._procs)

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
            proc.join(timeout)
        self._terminate_workers()
        os.write(self._wake_w, b"x")
        if self._monitor is not None:
            self._monitor.join(timeout)
        os.close(self._wake_r)
        os.close(self._wake_w)
        self._failure = self._failure or "the tensor-parallel engine is closed"
        self.comm.close(self._failure)

    def __enter__(self) -> TPRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- failure handling -------------------------------------------------------------

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
            for _ in range(20):  # another thread may be reaping it right now
                proc.join(0.05)
                if proc.exitcode is not None:
                    break
            how = "exited" if proc.exitcode is None else _describe_exit(proc.exitcode)
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
            if proc.exitcode is None:
                proc.kill()
                proc.join(5.0)


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


# ---- launching -----------------------------------------------------------------------------


def rank_device(device: str, local_rank: int) -> torch.device:
    """The device of a rank: CUDA ranks take consecutive devices from the configured one
    (``cuda`` = ``cuda:0``), CPU ranks share the CPU."""
    base = resolve_device(device)
    if base.type == "cuda":
        return torch.device("cuda", (base.index or 0) + local_rank)
    return base


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
        return _DTYPES[self.dtype]

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
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=spec.startup_timeout)
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
        if pending and datetime.datetime.now() > deadline:
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
    import multiprocessing as mp

    from backends.engine import tp_worker

    model = model if model is not None else build()
    spec = WorkerSpec(
        0,
        world_size,
        build,
        num_kv_blocks,
        block_size,
        device,
        dtype,
        threads,
        timeout,
        startup_timeout,
    )
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
        ctx.Process(
            target=tp_worker.run_spawned, args=(dataclasses.replace(spec, rank=r),), daemon=True
        )
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


def kv_blocks_for(config: EngineConfig, args: ModelArgs, world_size: int) -> int:
    """KV blocks per rank (every rank must hold the same number): the budget of
    ``config`` applies per rank, sized by the rank with the most KV heads."""
    plan = plan_for(args, world_size)
    dtype = _DTYPES[config.dtype]
    per_block = max(
        kv_bytes_per_block(local_args(args, s), config.block_size, dtype) for s in plan.shards
    )
    max_len = config.resolve_max_model_len(args.max_seq_len)
    return config.resolve_num_kv_blocks(per_block, max_len, rank_device(config.device, 0).type)


def launch_tp(config: EngineConfig, n: int, *, timeout: float = 30.0) -> TPLaunch | None:
    """Load ``config.model`` and run it over ``n`` tensor-parallel ranks.

    Started normally: spawns ``n - 1`` workers and returns rank 0's :class:`TPLaunch`.
    Started by torchrun (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set, WORLD_SIZE == n):
    rank 0 returns its launch; other ranks serve as workers until rank 0 stops them and
    then return None (the caller exits). At ``n == 1`` the runner is a plain ModelRunner."""
    from backends.engine import tp_worker
    from backends.engine.loader import load_model

    if n < 1:
        raise TensorParallelError(f"--tp must be >= 1, got {n}")
    env = torchrun_env() if n > 1 else None
    if env is not None and int(env["WORLD_SIZE"]) != n:
        raise TensorParallelError(
            f"--tp {n} but torchrun started WORLD_SIZE={env['WORLD_SIZE']} ranks"
        )
    rank = int(env["RANK"]) if env else 0
    build = LoadModel(config.model)
    if rank != 0:
        assert env is not None
        tp_worker.run_torchrun(build, config, env, timeout)
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
        runner = tp_worker.torchrun_rank0(loaded.model, build, config, env, blocks, timeout)
    return TPLaunch(runner, loaded.tokenizer, loaded.args, loaded.name, loaded.path)
