"""Tokens/s of the engine at a given tensor-parallel size (a correctness-first number on
CPU: gloo all-reduces cost more than they save on a small model).

    .venv/bin/python -m tests.engine_tp.bench_tp --tp 1 [--threads 1]
    .venv/bin/python -m tests.engine_tp.bench_tp --tp 2

Prints one line: size, requests, generated tokens, seconds, tokens/s, and a digest of the
greedy tokens (equal digests across --tp values: identical output)."""

from __future__ import annotations

import argparse
import hashlib
import time

import torch

from backends.engine.config import EngineConfig
from backends.engine.engine import LLMEngine
from backends.engine.sequence import SamplingParams
from backends.engine.tp_worker import launch_tp


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--model")
    p.add_argument("--threads", type=int, help="torch threads of rank 0 (default: cores // tp)")
    args = p.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    config = EngineConfig(model=args.model, device="cpu", max_model_len=512, num_kv_blocks=256)
    launched = launch_tp(config, args.tp)
    assert launched is not None
    engine = LLMEngine(config, launched.runner, launched.tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = [
        f"Question {i}: what is the capital of country number {i}? Answer:"
        for i in range(args.requests)
    ]
    for i, text in enumerate(prompts):
        engine.add_request(f"r{i}", launched.tokenizer.encode(text), params)
    tokens: dict[str, list[int]] = {}
    start = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    elapsed = time.perf_counter() - start
    total = sum(len(t) for t in tokens.values())
    digest = hashlib.sha256(repr(sorted(tokens.items())).encode()).hexdigest()[:12]
    print(
        f"tp={args.tp} requests={args.requests} tokens={total} seconds={elapsed:.2f} tok/s={total / elapsed:.1f} greedy={digest}"
    )
    close = getattr(launched.runner, "close", None)
    if close is not None:
        close()


if __name__ == "__main__":
    main()
