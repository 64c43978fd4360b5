"""Tensor parallelism over real processes (gloo on 127.0.0.1): N=2 (uneven: 3 KV groups,
intermediate 77, vocab 101), N=3 and N=4 (replicated KV heads) give the same greedy
tokens as N=1 and logits within 1e-4 relative; a worker killed with SIGKILL brings rank 0 down with a clear error in
seconds, and workers of a killed rank 0 exit instead of hanging; a worker that cannot
start is reported with its own error."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from multiprocessing import connection as mp_connection
from pathlib import Path

import pytest
import torch

from backends.engine.config import EngineConfig
from backends.engine.engine import LLMEngine
from backends.engine.runner import ModelRunner
from backends.engine.scheduler import ScheduledSeq
from backends.engine.sequence import SamplingParams, Sequence
from backends.engine.tp_comm import RankFailure, TensorParallelError
from backends.engine.tp_worker import TPRunner, start_tp
from tests.engine_tp.models import FailingBuild, RandomModel, tiny_args

BLOCKS, BLOCK_SIZE = 48, 4
PROMPTS = [[5, 17, 99, 3, 42, 8, 61, 7, 70, 11, 2], [1, 2, 3], [88] * 9, [30, 31, 32, 33, 34, 35]]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Rank 0 is this process: one thread per rank, as on the 2-core CI machines."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _start(build: RandomModel, world: int) -> TPRunner:
    runner = start_tp(
        build,
        world,
        num_kv_blocks=BLOCKS,
        block_size=BLOCK_SIZE,
        timeout=10.0,
        startup_timeout=60.0,
    )
    assert isinstance(runner, TPRunner)
    return runner


# Each against its own N=1 model. N=2: tied, uneven (2 KV groups + 1). N=3: untied, q/k/v
# bias, one group each. N=4 > 3 KV groups: KV head 0 replicated on ranks 0 and 1.
CASES = {
    2: RandomModel(tiny_args(tie=True)),
    3: RandomModel(tiny_args(tie=False, bias=True), seed=1),
    4: RandomModel(tiny_args(tie=True, bias=True), seed=2),
}


@pytest.fixture(scope="module", params=sorted(CASES), ids=lambda n: f"tp{n}")
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[ModelRunner, TPRunner]]:
    build = CASES[request.param]
    reference = ModelRunner(build(), BLOCKS, BLOCK_SIZE)
    with _start(build, request.param) as tp:
        yield reference, tp
        workers = tp.workers
    assert [p.exitcode for p in workers] == [0] * (request.param - 1)  # stopped cleanly


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def _seqs() -> list[Sequence]:
    seqs = []
    for i, prompt in enumerate(PROMPTS):
        seq = Sequence(f"s{i}", list(prompt), SamplingParams())
        seq.block_table = list(range(i, BLOCKS, len(PROMPTS)))  # interleaved blocks
        seqs.append(seq)
    return seqs


def test_logits_match_one_rank_through_chunked_prefill_and_batched_decode(
    pair: tuple[ModelRunner, TPRunner],
) -> None:
    reference, tp = pair
    seqs = _seqs()
    steps: list[list[ScheduledSeq]] = [
        [
            ScheduledSeq(seqs[0], 5),
            ScheduledSeq(seqs[1], 3),
        ],  # a chunk (no logits) + a whole prompt
        [ScheduledSeq(seqs[0], 6, 5), ScheduledSeq(seqs[2], 9), ScheduledSeq(seqs[3], 6)],
    ]
    for step in steps:
        want, got = reference.execute(step), tp.execute(step)
        assert got.shape == want.shape
        assert _relative_error(got, want) < 1e-4
    for seq in seqs:
        seq.num_computed_tokens = len(seq.token_ids)
    for t in range(3):  # decode: all four sequences in one batch
        for seq in seqs:
            seq.token_ids.append(10 + t)
        step = [ScheduledSeq(s, 1) for s in seqs]
        want, got = reference.execute(step), tp.execute(step)
        assert got.shape == (len(seqs), 101)
        assert _relative_error(got, want) < 1e-4
        for seq in seqs:
            seq.num_computed_tokens += 1


def _greedy(runner: ModelRunner | TPRunner) -> dict[str, list[int]]:
    config = EngineConfig(
        num_kv_blocks=BLOCKS, block_size=BLOCK_SIZE, max_num_batched_tokens=8, max_num_seqs=4
    )
    engine = LLMEngine(config, runner, eos_token_ids=[])
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return tokens


def test_greedy_tokens_match_one_rank(pair: tuple[ModelRunner, TPRunner]) -> None:
    _, tp = pair
    # A fresh reference runner: the engine reuses block ids from 0.
    want = _greedy(ModelRunner(CASES[tp.world_size](), BLOCKS, BLOCK_SIZE))
    got = _greedy(tp)
    assert got == want
    assert all(len(t) == 10 for t in got.values())
    assert tp.statistics().num_steps > 0


def test_a_killed_worker_takes_rank0_down_with_a_clear_error() -> None:
    build = RandomModel(tiny_args())
    tp = _start(build, 2)
    try:
        seqs = _seqs()
        tp.execute([ScheduledSeq(seqs[1], 3)])  # healthy first
        worker = tp.workers[0]
        os.kill(worker.pid, signal.SIGKILL)  # type: ignore[arg-type]
        mp_connection.wait([worker.sentinel], 10)  # not join(): that would race the runner's own poll
        start = time.monotonic()
        with pytest.raises(RankFailure, match=r"rank 1 .* killed by SIGKILL"):
            tp.execute([ScheduledSeq(seqs[2], 9)])
        assert time.monotonic() - start < 5
        assert tp.failure is not None and "SIGKILL" in tp.failure
        with pytest.raises(RankFailure):  # and it stays down
            tp.check()
    finally:
        tp.close()


def test_no_collective_starts_once_a_worker_is_dead(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 itself sees a dead worker before a step's first collective, even
    when the monitor thread has not recorded the death yet: a collective with
    a dead peer usually fails at once, but once (CI) waited out the whole
    10 s collective timeout."""
    monkeypatch.setattr(TPRunner, "_watch", lambda self: None)  # a monitor that has not run yet
    tp = _start(RandomModel(tiny_args()), 2)
    try:
        seqs = _seqs()
        tp.execute([ScheduledSeq(seqs[1], 3)])
        sent: list[object] = []
        monkeypatch.setattr(tp.comm, "send", sent.append)  # a collective would start here
        worker = tp.workers[0]
        os.kill(worker.pid, signal.SIGKILL)  # type: ignore[arg-type]
        mp_connection.wait([worker.sentinel], 10)
        with pytest.raises(RankFailure, match=r"rank 1 .* killed by SIGKILL"):
            tp.execute([ScheduledSeq(seqs[2], 9)])
        assert sent == []
        assert tp.failure is not None and "SIGKILL" in tp.failure
    finally:
        tp.close()


def test_a_worker_that_cannot_start_is_reported_with_its_error() -> None:
    model = RandomModel(tiny_args())()
    with pytest.raises(TensorParallelError, match=r"rank 1 failed to start(.|\n)*no such model"):
        start_tp(
            FailingBuild(),
            2,
            num_kv_blocks=BLOCKS,
            block_size=BLOCK_SIZE,
            model=model,
            startup_timeout=60.0,
        )


def test_a_world_size_beyond_the_query_heads_is_refused_before_spawning() -> None:
    with pytest.raises(TensorParallelError, match="query heads"):
        start_tp(RandomModel(tiny_args()), 7, num_kv_blocks=BLOCKS, block_size=BLOCK_SIZE)


def test_workers_exit_when_rank0_is_killed() -> None:
    """The workers hold the rank-0 process's stdout/stderr: ``communicate`` returns only
    once every one of them has exited, so a hanging worker fails this test by timeout."""
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.engine_tp.rank0_main"],
        cwd=root, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        pids = proc.stdout.readline().split()
        assert len(pids) == 2, proc.stderr.read() if proc.stderr else ""
        proc.kill()
        _, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
        proc.wait()
    for rank in (1, 2):
        assert f"headrace tp rank {rank}: tensor-parallel control receive failed" in err


def test_torchrun_launch_matches_one_rank() -> None:
    """The same ranks started by torchrun (standard RANK/WORLD_SIZE/MASTER_* variables)."""
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "tests.engine_tp.torchrun_main"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("torchrun world=2"))
    assert float(line.rsplit("=", 1)[1]) < 1e-4
