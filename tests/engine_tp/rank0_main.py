"""A rank 0 in its own process, for the test that kills it: starts a 3-rank group on the
tiny model, prints the worker pids, then waits on stdin until it is killed."""

from __future__ import annotations

import sys

import torch

from backends.engine.tp_worker import TPRunner, start_tp
from tests.engine_tp.models import RandomModel, tiny_args

if __name__ == "__main__":
    torch.set_num_threads(1)
    runner = start_tp(
        RandomModel(tiny_args()), 3, num_kv_blocks=16, block_size=4, startup_timeout=60.0
    )
    assert isinstance(runner, TPRunner)
    print(" ".join(str(p.pid) for p in runner.workers), flush=True)
    sys.stdin.read()
