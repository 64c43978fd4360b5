"""One rank of a torchrun launch on the tiny model (the torchrun path of tp_worker).

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.engine_tp.torchrun_main

Rank 0 runs a prefill and a decode step and prints the largest relative difference from
the same model on one process; other ranks serve until rank 0 stops them."""

from __future__ import annotations

import torch

from backends.engine.config import EngineConfig
from backends.engine.runner import ModelRunner
from backends.engine.scheduler import ScheduledSeq
from backends.engine.sequence import SamplingParams, Sequence
from backends.engine.tp_worker import run_torchrun, torchrun_env, torchrun_rank0
from tests.engine_tp.models import RandomModel, tiny_args


def main() -> None:
    torch.set_num_threads(1)
    env = torchrun_env()
    assert env is not None, "run me under torchrun"
    config = EngineConfig(device="cpu", num_kv_blocks=16, block_size=4)
    build = RandomModel(tiny_args(tie=False))
    if env["RANK"] != "0":
        run_torchrun(build, config, env, 10.0)
        return
    runner = torchrun_rank0(build(), build, config, env, 16, 10.0)
    reference = ModelRunner(build(), 16, 4)
    seq = Sequence("a", [1, 2, 3, 4, 5, 6, 7], SamplingParams())
    seq.block_table = [3, 1]
    worst = 0.0
    for n in (7, 1):
        if n == 1:
            seq.num_computed_tokens = 7
            seq.token_ids.append(9)
        got, want = (
            runner.execute([ScheduledSeq(seq, n)]),
            reference.execute([ScheduledSeq(seq, n)]),
        )
        worst = max(worst, float((got - want).abs().max() / want.abs().max()))
    runner.close()
    print(f"torchrun world={env['WORLD_SIZE']} max_relative_error={worst:.3g}", flush=True)


if __name__ == "__main__":
    main()
