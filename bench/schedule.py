"""Arrival schedules and prompts, both reproducible from one seed.

Open-loop load means arrivals do not wait for completions: a Poisson process
(exponential gaps) at the offered rate, computed before the run, so that a
router run and a direct run (``--compare-direct``) see the very same arrival
times and the very same prompts.
"""

from __future__ import annotations

import random

from backends.errors import BadRequest
from bench.workload_texts import CODE_FILES, PASSAGES

__all__ = ["WORKLOADS", "make_prompt", "poisson_schedule", "repeat_text", "workload_prompt"]

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

# The 'repeat' tasks the issue names: copy, extraction, summarise-with-quotes and a
# code edit, over readable texts (bench.workload_texts): a small instruct model
# copies real sentences but paraphrases word salad.
_COPY = "Repeat the following text exactly, word for word:\n\n{text}"
_EXTRACT = (
    "Copy every sentence that mentions {keyword} from the text below, exactly as it is "
    "written.\n\n{text}"
)
_QUOTE = "Quote the text below in full, then answer the question: {question}\n\n{text}"
_CODE_EDIT = (
    "Rename `{old}` to `{new}` in this code and print the whole file with the change."
    "\n\n```\n{code}```"
)
_REPEAT_KINDS = ("copy", "extract", "quote", "code")
_CHAT_TOPICS = (
    "Write a short story about a {word} who learns to sail.",
    "Explain how a {word} works to a ten-year-old.",
    "Give me three ideas for a weekend trip near a {word}.",
    "What are the pros and cons of living next to a {word}?",
)


def repeat_text(first: int, second: int, n_tokens: int) -> str:
    """Whole sentences of passage ``first``, then of passage ``second``, until
    about ``n_tokens`` tokens (1.3 tokens per word) or both are used up."""
    words, out = 0, list[str]()
    for sentence in PASSAGES[first].sentences + PASSAGES[second].sentences:
        if out and words * 1.3 >= n_tokens:
            break
        out.append(sentence)
        words += len(sentence.split())
    return " ".join(out)


def _repeat_prompt(rng: random.Random, n_tokens: int) -> str:
    kind = rng.choice(_REPEAT_KINDS)
    if kind == "code":
        f = rng.choice(CODE_FILES)
        old, new = rng.choice(f.renames)
        return _CODE_EDIT.format(old=old, new=new, code=f.text)
    first, second = rng.sample(range(len(PASSAGES)), 2)
    text = repeat_text(first, second, n_tokens)
    keywords = [k for p in (first, second) for k in PASSAGES[p].keywords if k in text]
    if kind == "extract" and keywords:
        return _EXTRACT.format(keyword=keywords[0], text=text)
    if kind == "quote":
        return _QUOTE.format(question=PASSAGES[first].question, text=text)
    return _COPY.format(text=text)


def workload_prompt(workload: str, seed: int, index: int, n_tokens: int) -> str:
    """Request ``index``'s prompt for ``workload`` (see :data:`WORKLOADS`)."""
    if workload == "random":
        return make_prompt(seed, index, n_tokens)
    rng = random.Random(f"{workload}:{seed}:{index}")
    if workload == "chat":
        return rng.choice(_CHAT_TOPICS).format(word=rng.choice(_WORDS))
    if workload == "repeat":
        return _repeat_prompt(rng, n_tokens)
    raise BadRequest(f"unknown workload {workload!r}; use one of {', '.join(WORKLOADS)}", param="workload")
