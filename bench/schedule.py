"""Arrival schedules and prompts, both reproducible from one seed.

Open-loop load means arrivals do not wait for completions: a Poisson process
(exponential gaps) at the offered rate, computed before the run, so that a
router run and a direct run (``--compare-direct``) see the very same arrival
times and the very same prompts.
"""

from __future__ import annotations

import random

from backends.errors import BadRequest

__all__ = ["WORKLOADS", "make_prompt", "poisson_schedule", "workload_prompt"]

# Common English words that byte-level BPE vocabularies (Llama, GPT-2, SmolLM)
# encode as one token each with their leading space, so N words ~ N tokens.
_WORD_TEXT = (
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there been one all we their has would when if "
    "so no will more can about other some time them these may only new its into than any "
    "could two first then do most also made over what such after where many well before "
    "must through back years much your way down should because each just those people how "
    "too little state good very make world still own see men work long here get both between "
    "life being under never day same another know while last might us great old year off "
    "come since against go came right used take three small large next early young water "
    "house city place number part music open black white light paper river sound table"
)
_WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())


def poisson_schedule(rate: float, duration: float, seed: int) -> list[float]:
    """Arrival offsets in seconds within ``[0, duration)``, exponential gaps at
    ``rate`` per second; the same arguments always give the same list."""
    if not rate > 0:
        raise BadRequest(f"rate must be > 0 requests/s, got {rate!r}", param="rps")
    if not duration > 0:
        raise BadRequest(f"duration must be > 0 s, got {duration!r}", param="duration")
    rng = random.Random(f"arrivals:{seed}:{rate!r}")
    offsets: list[float] = []
    t = rng.expovariate(rate)
    while t < duration:
        offsets.append(t)
        t += rng.expovariate(rate)
    return offsets


def make_prompt(seed: int, index: int, n_tokens: int) -> str:
    """Request ``index``'s prompt: about ``n_tokens`` tokens of random words.

    Distinct per request so that no two prompts share a long prefix (a prefix
    cache would otherwise flatter the numbers)."""
    if n_tokens < 1:
        raise BadRequest(f"prompt tokens must be >= 1, got {n_tokens}", param="prompt_tokens")
    rng = random.Random(f"prompt:{seed}:{index}")
    return " ".join(rng.choice(_WORDS) for _ in range(n_tokens))


# Workloads for speculative decoding: prompts whose answers repeat their input
# (where prompt lookup shines), and open-ended chat (where it has little to find).
WORKLOADS = ("random", "repeat", "chat")

_REPEAT_TASKS = (
    "Copy the following text exactly, word for word:\n\n{text}",
    "Extract every sentence of this passage, one per line, unchanged:\n\n{text}",
    "Rename the variable `total` to `sum_` in this code and print the whole code:\n\n"
    "def score(items):\n    total = 0\n    for item in items:\n        total += item.{word} * 2\n"
    "        if total > 100:\n            total = total - item.{word}\n    return total\n",
    "Summarise this passage, quoting its sentences verbatim:\n\n{text}",
)
_CHAT_TOPICS = (
    "Write a short story about a {word} who learns to sail.",
    "Explain how a {word} works to a ten-year-old.",
    "Give me three ideas for a weekend trip near a {word}.",
    "What are the pros and cons of living next to a {word}?",
)


def workload_prompt(workload: str, seed: int, index: int, n_tokens: int) -> str:
    """Request ``index``'s prompt for ``workload`` (see :data:`WORKLOADS`)."""
    if workload == "random":
        return make_prompt(seed, index, n_tokens)
    rng = random.Random(f"{workload}:{seed}:{index}")
    word = rng.choice(_WORDS)
    if workload == "chat":
        return rng.choice(_CHAT_TOPICS).format(word=word)
    if workload == "repeat":
        sentences = [" ".join(rng.choice(_WORDS) for _ in range(8)).capitalize() + "." for _ in range(max(1, n_tokens // 9))]
        return rng.choice(_REPEAT_TASKS).format(text=" ".join(sentences), word=word)
    raise BadRequest(f"unknown workload {workload!r}; use one of {', '.join(WORKLOADS)}", param="workload")
