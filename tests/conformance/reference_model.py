"""The toy language model behind the reference server.

Tokens are syllables, so a stop string can straddle two of them. The next
token is a hash of (seed, absolute position, the last four ids), which makes
it deterministic for a seed and lets a request resumed from ``prompt +
emitted ids`` draw exactly what the unbroken one would: the property the
router's migration relies on. Flaws switch individual properties off.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field

CONSONANTS, VOWELS = "bdfgklmnprstvz", "aeiou"
VOCAB: list[str] = (
    ["<eos>"]
    + [c + v for c in CONSONANTS for v in VOWELS]
    + [" " + c + v for c in CONSONANTS for v in VOWELS]
    + [".", ",", "!"]
)
EOS = 0


def tokenize(text: str) -> list[int]:
    return [1 + ord(ch) % (len(VOCAB) - 1) for ch in text]


@dataclass
class Sampling:
    max_tokens: int = 16
    temperature: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False


@dataclass
class Generation:
    ids: list[int] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)  # text per id, after stop truncation
    logprobs: list[float] = field(default_factory=list)
    finish: str = "length"

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def _hash(*parts: object) -> int:
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def generate(prompt: list[int], s: Sampling, flaws: frozenset[str], choice: int = 0) -> Generation:
    seed = 0 if s.temperature == 0 else s.seed
    if seed is None or (s.temperature > 0 and "seed_ignored" in flaws):
        seed = random.getrandbits(32)
    seed += choice if s.temperature > 0 else 0
    context, out = list(prompt), Generation()
    limit = s.max_tokens + (1 if "max_tokens_off_by_one" in flaws else 0)
    for step in range(limit):
        where = step if s.temperature > 0 and "resume_drift" in flaws else len(context)
        h = _hash(seed, where, context[-4:])
        token = EOS if h % 61 == 0 else 1 + (h >> 8) % (len(VOCAB) - 1)
        if token == EOS and not s.ignore_eos:
            out.finish = "stop"
            return out
        token = token or 1
        context.append(token)
        out.ids.append(token)
        out.pieces.append(VOCAB[token])
        out.logprobs.append(-((h >> 16) % 1000) / 500.0 - 0.001)
        if _stopped(out, s.stop, flaws):
            out.finish = "stop"
            return out
    return out


def _stopped(out: Generation, stops: list[str], flaws: frozenset[str]) -> bool:
    text = out.text
    for stop in stops:
        found = out.pieces[-1].find(stop) if "stop_no_straddle" in flaws else text.find(stop)
        if found < 0:
            continue
        cut = found + (len(text) - len(out.pieces[-1]) if "stop_no_straddle" in flaws else 0)
        _truncate(out, cut)
        return True
    return False


def _truncate(out: Generation, cut: int) -> None:
    kept, total = [], 0
    for piece in out.pieces:
        take = piece[: max(cut - total, 0)]
        kept.append(take)
        total += len(piece)
    out.pieces = kept


def alternatives(token: int, k: int) -> list[int]:
    """``k`` runner-up tokens for logprobs, never the chosen one."""
    return [1 + (token + i) % (len(VOCAB) - 1) for i in range(k)]
