"""Token ids and the resume contract, for targets that report token ids.

The router resumes a broken stream elsewhere by sending ``prompt_token_ids +
emitted ids`` with the same seed and ``max_tokens`` reduced; that only gives
the client one unbroken stream if the continuation equals what the first
backend would have produced. These checks prove it over HTTP, with the prompt
passed as a list of ints (the standard completions ``prompt`` form).
"""

from __future__ import annotations

from typing import Any

from .registry import expect, expect_equal
from .suite import HTTP, complete
from .target import HttpTarget

TOKENS: dict[str, Any] = {"return_token_ids": True, "ignore_eos_if_supported": True}
CUT = 5
LENGTH = 12


@HTTP.check("tokens.report", "tokens", requires=("token_ids",))
async def report(t: HttpTarget) -> str:
    """token_ids and prompt_token_ids agree with usage, streamed and not."""
    params = {"max_tokens": 8, "temperature": 0, **TOKENS}
    plain = await complete(t, **params)
    streamed = await complete(t, stream=True, stream_options={"include_usage": True}, **params)
    for where, out in (("non-stream", plain), ("stream", streamed)):
        assert out.usage is not None
        expect(out.prompt_token_ids is not None, f"{where}: no prompt_token_ids")
        expect_equal(len(out.prompt_token_ids or []), out.usage["prompt_tokens"],
                     f"{where}: len(prompt_token_ids) vs usage.prompt_tokens")
        expect_equal(len(out.ids), out.usage["completion_tokens"],
                     f"{where}: len(token_ids) vs usage.completion_tokens")
    expect_equal(streamed.ids, plain.ids, "streamed token_ids vs non-streamed")
    return f"{len(plain.ids)} ids"


@HTTP.check("tokens.prompt_ids", "tokens", requires=("token_ids",))
async def prompt_ids(t: HttpTarget) -> None:
    """A prompt given as its token ids generates what the text prompt generates."""
    params = {"max_tokens": 8, "temperature": 0, **TOKENS}
    text_run = await complete(t, **params)
    expect(text_run.prompt_token_ids, "no prompt_token_ids")
    ids_run = await complete(t, prompt=text_run.prompt_token_ids or [], **params)
    expect_equal(ids_run.prompt_token_ids, text_run.prompt_token_ids, "echoed prompt_token_ids")
    expect_equal(ids_run.ids, text_run.ids, "token_ids from the id prompt")


@HTTP.check("tokens.resume.greedy", "tokens", requires=("token_ids",))
async def resume_greedy(t: HttpTarget) -> str:
    """Greedy: prompt + first 5 emitted ids, max_tokens reduced, continues identically."""
    return await _resume(t, {"temperature": 0, "seed": 99})


@HTTP.check("tokens.resume.seeded", "tokens", requires=("token_ids", "seeds"))
async def resume_seeded(t: HttpTarget) -> str:
    """Sampled with a seed: the resumed request draws the same tokens as the unbroken one."""
    return await _resume(t, {"temperature": 1.0, "top_p": 1.0, "seed": 99})


async def _resume(t: HttpTarget, sampling: dict[str, Any]) -> str:
    whole = await complete(t, max_tokens=LENGTH, **sampling, **TOKENS)
    expect(whole.prompt_token_ids, "no prompt_token_ids")
    if len(whole.ids) <= CUT:
        expect(False, f"the unbroken run stopped after {len(whole.ids)} tokens; cannot cut at {CUT}")
    prompt = (whole.prompt_token_ids or []) + whole.ids[:CUT]
    rest = len(whole.ids) - CUT
    for stream in (False, True):
        resumed = await complete(t, stream=stream, prompt=prompt, max_tokens=rest, **sampling, **TOKENS)
        where = "streamed" if stream else "non-streamed"
        expect_equal(resumed.ids, whole.ids[CUT:], f"{where} continuation token ids")
    return f"resumed {rest} tokens after {CUT}"


@HTTP.check("tokens.resume.contract", "tokens", requires=("token_ids", "seeds", "exact_resume"))
async def resume_contract(t: HttpTarget) -> str:
    """``resumed_tokens``: the last k prompt ids are earlier output. The
    continuation counts them as output (usage: the original prompt, every
    token once; presence penalty and min_tokens over them), its text is the
    rest of the unbroken text, and its first chunk names the original prompt."""
    sampling = {"temperature": 0.9, "seed": 7, "presence_penalty": 0.5, "min_tokens": LENGTH}
    whole = await complete(t, max_tokens=LENGTH, **sampling, **TOKENS)
    expect(whole.prompt_token_ids, "no prompt_token_ids")
    original = whole.prompt_token_ids or []
    prompt = original + whole.ids[:CUT]
    for stream in (False, True):
        extra = {"stream_options": {"include_usage": True}} if stream else {}
        sampled = {**sampling, "min_tokens": LENGTH - CUT}
        resumed = await complete(t, stream=stream, prompt=prompt, max_tokens=LENGTH - CUT, resumed_tokens=CUT,
                                 **sampled, **extra, **TOKENS)  # fmt: skip
        where = "streamed" if stream else "non-streamed"
        expect_equal(resumed.ids, whole.ids[CUT:], f"{where} continuation token ids")
        expect_equal(resumed.prompt_token_ids, original, f"{where} prompt_token_ids (the original prompt)")
        expect(whole.text.endswith(resumed.text) and resumed.text, f"{where}: text {resumed.text!r} does not end the unbroken text")
        assert resumed.usage is not None and whole.usage is not None
        expect_equal(resumed.usage["prompt_tokens"], whole.usage["prompt_tokens"], f"{where} usage.prompt_tokens")
        expect_equal(resumed.usage["completion_tokens"], whole.usage["completion_tokens"], f"{where} usage.completion_tokens")
    return f"resumed {LENGTH - CUT} tokens after {CUT} with penalties and min_tokens"
