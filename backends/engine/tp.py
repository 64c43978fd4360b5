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

This module is the sharding (plan, transform, collectives); tp_worker.py runs the
processes. The engine spawns N-1 workers (or torchrun starts all N)::

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

import dataclasses
import datetime
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from backends.engine.config import EngineConfig
from backends.engine.model import ModelArgs, Transformer, TransformerBlock, refine_top_logits
from backends.engine.runner import ModelRunner, kv_bytes_per_block, resolve_device
from backends.errors import BackendUnavailable, HeadraceError

if TYPE_CHECKING:
    from backends.engine.tp_worker import TPLaunch, TPRunner

__all__ = [
    "Comm",
    "RankFailure",
    "RankShard",
    "ShardPlan",
    "TensorParallelError",
    "VocabParallelEmbedding",
    "VocabParallelHead",
    "apply_tp",
    "even_ranges",
    "kv_blocks_for",
    "launch_tp",
    "local_args",
    "plan_for",
    "plan_tp",
    "rank_device",
    "start_tp",
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

    def close(
        self, reason: str = "the tensor-parallel group is closed", *, release: bool = False
    ) -> None:
        """Mark the group unusable (later collectives raise at once); ``release`` also
        drops the process groups (only when no collective can be in flight)."""
        self._broken = self._broken or reason
        if release:
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
        local = F.linear(hidden, self.weight).float()  # [N, V_local]
        if hidden.shape[0] == 0:  # every rank sees the same N: skip the collective together
            return local.new_empty(0, sum(self.widths))
        if hidden.dtype != torch.float32:
            # Near-ties ranked in float32 as on one device: the overall maximum is within
            # one rounding step of its own shard's maximum, so refining each shard
            # against its own maximum covers it.
            refine_top_logits(local, hidden, self.weight)
        return self.comm.gather_cols(local, self.widths)  # rank 0: [N, V] float32


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


# ---- sizes and devices per rank ------------------------------------------------------


def rank_device(device: str, local_rank: int) -> torch.device:
    """The device of a rank: CUDA ranks take consecutive devices from the configured one
    (``cuda`` = ``cuda:0``), CPU ranks share the CPU."""
    base = resolve_device(device)
    if base.type == "cuda":
        return torch.device("cuda", (base.index or 0) + local_rank)
    return base


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


# ---- entry points (the processes live in tp_worker.py) ------------------------------------


def start_tp(
    build: Callable[[], Transformer], world_size: int, **kwargs: Any
) -> ModelRunner | TPRunner:
    """Spawn ``world_size - 1`` worker ranks that each ``build()`` the full model and keep
    their shard; see :func:`backends.engine.tp_worker.start_tp` for the options."""
    from backends.engine import tp_worker  # the process side imports this module

    return tp_worker.start_tp(build, world_size, **kwargs)


def launch_tp(config: EngineConfig, n: int, *, timeout: float = 30.0) -> TPLaunch | None:
    """Load ``config.model`` over ``n`` tensor-parallel ranks (spawned here, or started by
    torchrun); ``None`` on a torchrun worker rank once rank 0 stops it. See
    :func:`backends.engine.tp_worker.launch_tp`."""
    from backends.engine import tp_worker

    return tp_worker.launch_tp(config, n, timeout=timeout)
