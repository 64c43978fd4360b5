"""Tensor-parallel communication: the collectives of one group, and its errors.

Shared by the sharding (tp.py: the sharded modules hold a :class:`Comm`) and the
processes (tp_worker.py: rank 0's runner broadcasts steps, the workers receive them);
neither of those imports the other's module for it. Model collectives run on gloo
(CPU) or NCCL (CUDA); the control channel (rank 0 -> workers) always runs on gloo::

    Comm.connect        every rank, once: the process groups over the rendezvous store
    Comm.all_reduce_    sum over the ranks, in place (row-parallel outputs, embedding)
    Comm.gather_cols    the ranks' column pieces side by side on rank 0 (logits)
    Comm.send / recv    rank 0's control messages to the workers (pickled)

Every collective has a deadline; a closed connection or a missed deadline becomes
:class:`RankFailure` (an upstream error), and the group is unusable afterwards. A
configuration that cannot work is :class:`TensorParallelError`.
"""

from __future__ import annotations

import datetime
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from backends.errors import BackendUnavailable, HeadraceError

__all__ = ["Comm", "PrefixStore", "RankFailure", "TensorParallelError"]

PrefixStore: Any = dist.PrefixStore  # type: ignore[attr-defined]
_IDLE_WAIT = datetime.timedelta(days=365)  # workers wait this long for the next step


class TensorParallelError(HeadraceError):
    """The tensor-parallel configuration cannot work (bad world size, startup failure)."""


class RankFailure(BackendUnavailable):
    """A rank died, stalled past the collective deadline, or the group was closed."""


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
        prefix = PrefixStore("tp/gloo", store)
        self._ctrl = dist.ProcessGroupGloo(prefix, self.rank, self.world_size, opts)
        if device.type == "cuda":
            nccl = dist.ProcessGroupNCCL.Options()
            nccl._timeout = self.timeout
            prefix = PrefixStore("tp/nccl", store)
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
