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

This module is the sharding (plan and transform); the collectives are in tp_comm.py
and tp_worker.py runs the processes (it imports both; neither imports it). The engine
spawns N-1 workers (or torchrun starts all N)::

    rank 0: HTTP server, scheduler, sampler       ranks 1..N-1: tp_worker.serve()
      TPRunner.execute(scheduled)
        control.send(step)  ---- gloo broadcast ---->  control.recv() (waits idle forever)
        local forward       <--- all-reduce x 2/layer -->  local forward
        logits (gathered to rank 0)  <---- gather ----   (their vocab slice)

Every collective has a deadline; a closed connection or a missed deadline becomes
:class:`~backends.engine.tp_comm.RankFailure`, and rank 0 also watches its worker
processes, so a dead rank takes the engine down with a clear error instead of a hang.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from backends.engine.config import EngineConfig
from backends.engine.model import ModelArgs, Transformer, TransformerBlock, refine_top_logits
from backends.engine.runner import TORCH_DTYPES, kv_bytes_per_block, resolve_device
from backends.engine.tp_comm import Comm, TensorParallelError

__all__ = [
    "RankShard",
    "ShardPlan",
    "VocabParallelEmbedding",
    "VocabParallelHead",
    "apply_tp",
    "even_ranges",
    "kv_blocks_for",
    "local_args",
    "plan_for",
    "plan_tp",
    "rank_device",
]


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
    dtype = TORCH_DTYPES[config.dtype]
    per_block = max(
        kv_bytes_per_block(local_args(args, s), config.block_size, dtype) for s in plan.shards
    )
    max_len = config.resolve_max_model_len(args.max_seq_len)
    return config.resolve_num_kv_blocks(per_block, max_len, rank_device(config.device, 0).type)

