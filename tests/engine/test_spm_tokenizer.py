"""SentencePiece GGUF vocabularies (``tokenizer.ggml.model`` = ``llama``: Llama 2,
Mistral, Gemma): built from ``tokenizer.ggml.*`` as transformers' GGUF conversion
builds them, checked against ``AutoTokenizer.from_pretrained(dir, gguf_file=...)``
on a tiny vocabulary written with the ``gguf`` package (byte-fallback tokens,
control tokens, scores), and a tiny Mistral / Gemma 2 GGUF with it loading and
generating."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import pytest

from backends.engine.loader import read_tokenizer
from backends.engine.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError

WORDS = ["the", "winter", "water", "hello", "world", "in", "an", "ant", "token", "café"]
CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'\"-:;()\né日本"
TEXTS = [
    "the winter in the water",
    "Hello world!",
    " hello",
    "hello ",
    "  two  spaces   three",
    "line one\nline two\n\n",
    "\n starts with a newline",
    "café 日本",
    "Привет, мир",  # Cyrillic: byte fallback
    "emoji 🙂🎉 end",
    "日本語 テキスト",
    "tab\there",
    "",
    " ",
]


def spm_vocab(
    *, gemma: bool = False, size: int | None = None
) -> tuple[list[str], list[int], list[float]]:
    """(tokens, llama.cpp token types, scores): specials, 256 ``<0xNN>`` byte tokens,
    single characters, then every prefix of each word with and without ``▁``; padded
    with unused pieces to ``size``. Gemma files spell a run of spaces with spaces."""
    if gemma:
        tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
        types = [3, 3, 3, 2, 3, 3]
    else:
        tokens = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]
        types = [2, 3, 3, 3, 3]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    pieces = ["▁", *CHARS]
    for w in WORDS:
        pieces += [("▁" + w)[:k] for k in range(2, len(w) + 2)]
        pieces += [w[:k] for k in range(2, len(w) + 1)]
    pieces += ["  " if gemma else "▁▁", "▁▁▁", "日本", "<think>"]
    pieces = [p for p in dict.fromkeys(pieces) if p not in tokens]
    scores = [0.0] * len(tokens) + [-float(i) for i in range(len(pieces))]
    types += [4 if p == "<think>" else 1 for p in pieces]
    tokens += pieces
    if size is not None:
        assert size >= len(tokens)
        extra = size - len(tokens)
        tokens += [f"<unused{i}>" for i in range(extra)]
        types += [5] * extra
        scores += [-1e9] * extra
    return tokens, types, scores


def add_spm_tokenizer(
    w: gguf.GGUFWriter, *, gemma: bool, size: int | None = None, space_prefix: bool = True
) -> None:
    tokens, types, scores = spm_vocab(gemma=gemma, size=size)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    _add_spm_keys(w, scores, gemma=gemma, space_prefix=space_prefix)


def _add_spm_keys(
    w: gguf.GGUFWriter,
    scores: list[float],
    *,
    gemma: bool,
    space_prefix: bool = True,
    eos: bool = True,
) -> None:
    w.add_token_scores(scores)
    if eos:
        w.add_eos_token_id(1 if gemma else 2)
    if gemma:
        w.add_bos_token_id(2)
        w.add_unk_token_id(3)
        w.add_pad_token_id(0)
    else:
        w.add_bos_token_id(1)
        w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(space_prefix and not gemma)


def _write(path: Path, *, gemma: bool, space_prefix: bool = True) -> Path:
    w = gguf.GGUFWriter(str(path), "gemma2" if gemma else "llama")
    add_spm_tokenizer(w, gemma=gemma, space_prefix=space_prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module", params=["llama", "gemma"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    gemma = request.param == "gemma"
    folder = tmp_path_factory.mktemp(f"spm-{request.param}")
    path = _write(folder / "vocab.gguf", gemma=gemma)
    ref = AutoTokenizer.from_pretrained(str(folder), gguf_file=path.name)
    return request.param, read_tokenizer(str(path)), ref


def _control(name: str) -> list[str]:
    if name == "gemma":
        return ["<start_of_turn>user\nhi<end_of_turn>", "x<eos>", "a<think>b"]
    return ["[INST] hi [/INST] ok</s>", "x</s>", "[INST]<unk>", "a<think>b"]


def test_ids_match_transformers(pair: Any) -> None:
    name, ours, ref = pair
    for text in [*TEXTS, *_control(name)]:
        want = ref.encode(text)
        assert ours.encode(text) == want, (text, ref.convert_ids_to_tokens(want))
        assert ours.encode(text, add_special_tokens=False) == ref.encode(
            text, add_special_tokens=False
        ), text
    # A text that starts with BOS: transformers adds a second one, we do not.
    bos = ours.id_to_token(ours.bos_token_id)
    assert ours.encode(f"{bos}x", add_special_tokens=False) == ref.encode(
        f"{bos}x", add_special_tokens=False
    )
    assert ours.encode(f"{bos}x") == ours.encode(f"{bos}x", add_special_tokens=False)


def test_byte_fallback_and_control_tokens_are_used(pair: Any) -> None:
    name, ours, _ = pair
    ids = ours.encode("🙂", add_special_tokens=False)
    assert [ours.id_to_token(i) for i in ids][-4:] == ["<0xF0>", "<0x9F>", "<0x99>", "<0x82>"]
    control = "<start_of_turn>" if name == "gemma" else "[INST]"
    assert ours.backend.token_to_id(control) in ours.encode(f"{control} x")
    assert ours.encode("x")[0] == ours.bos_token_id  # add_bos_token


def test_decode_matches_transformers(pair: Any) -> None:
    name, ours, ref = pair
    for text in [*TEXTS, *_control(name)]:
        ids = ref.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(
                ids, skip_special_tokens=skip
            ), (text, skip)
    for text in TEXTS:  # the text comes back; as in transformers a text starting with
        # a space is encoded without a marker of its own, so decoding drops that space
        back = ours.decode(ours.encode(text))
        assert back == (text[1:] if name == "llama" and text.startswith(" ") else text)


def test_streaming_decode_equals_whole_decode(pair: Any) -> None:
    name, ours, _ = pair
    for text in [*TEXTS, " ".join(TEXTS), *_control(name)]:
        ids = ours.encode(text)
        # a prompt ending where a word does (prompts are whole text, so whole characters)
        cuts = [k for k in range(2, len(ids)) if ours.id_to_token(ids[k]).startswith("▁")]
        for prompt in ((), ids[:1], ids[: cuts[0]] if cuts else ids):
            out = ids[len(prompt) :]
            detok = IncrementalDetokenizer(ours, prompt)
            chunks = [detok.push([i]) for i in out]
            chunks.append(detok.flush())
            assert "".join(chunks) == detok.text
            assert all("\ufffd" not in c for c in chunks), text
            if not prompt:
                assert detok.text == ours.decode(out), text
            else:  # what the output adds to the prompt's text
                assert ours.decode(ids).startswith(ours.decode(list(prompt)))
                assert detok.text == ours.decode(ids)[len(ours.decode(list(prompt))) :], text


def test_pieces_spell_the_text(pair: Any) -> None:
    _, ours, _ = pair
    ids = ours.encode("hello 🙂 日本", add_special_tokens=False)
    raw = b"".join(ours.token_piece(i)[1] for i in ids)
    assert raw.decode().lstrip(" ") == "hello 🙂 日本"


def test_no_space_prefix_when_the_file_says_so(tmp_path: Path) -> None:
    tok = read_tokenizer(str(_write(tmp_path / "v.gguf", gemma=False, space_prefix=False)))
    ids = tok.encode("hello world", add_special_tokens=False)
    assert [tok.id_to_token(i) for i in ids] == ["hello", "▁world"]
    assert tok.decode(ids) == "hello world"
    assert tok.decode(tok.encode(" hi")) == " hi"


def test_other_tokenizer_models_fail_naming_theirs() -> None:
    meta = {"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]}
    with pytest.raises(TokenizerError, match="'bert'"):
        Tokenizer.from_gguf_metadata(meta)


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_tiny_family_gguf_with_spm_vocabulary_loads_and_generates(
    family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """test_families' tiny Mistral / Gemma 2 GGUF, written with this SentencePiece
    vocabulary instead of the byte-level one: it loads, tokenizes as transformers
    does, and greedy generation matches transformers' on the same prompt."""
    import torch
    from transformers import AutoTokenizer

    from backends.engine.config import EngineConfig
    from backends.engine.engine import LLMEngine
    from backends.engine.loader import load_model
    from backends.engine.runner import ModelRunner
    from backends.engine.sequence import SamplingParams
    from tests.engine import test_families, tiny

    gemma = family.startswith("gemma")

    tokens, types, scores = spm_vocab(gemma=gemma)
    monkeypatch.setattr(tiny, "vocab", lambda: (tokens, types, []))

    class SpmWriter(gguf.GGUFWriter):  # the helper's byte-level keys -> SentencePiece
        def add_tokenizer_model(self, model: str) -> None:
            super().add_tokenizer_model("llama")
            _add_spm_keys(self, scores, gemma=gemma, eos=False)

        def add_tokenizer_pre(self, pre: str) -> None:
            pass

        def add_token_merges(self, merges: Any) -> None:
            pass

        def add_eos_token_id(self, id: int) -> None:
            super().add_eos_token_id(1 if gemma else 2)

    monkeypatch.setattr(gguf, "GGUFWriter", SpmWriter)
    model = test_families._hf_model(family)
    # Random weights would emit stray byte tokens, which no text decodes to (each run
    # of invalid UTF-8 becomes U+FFFD, so a stream and a whole decode may differ):
    # logits of 0 for the byte tokens keep greedy output on the text pieces.
    first_byte = tokens.index("<0x00>")
    with torch.no_grad():
        model.get_output_embeddings().weight[first_byte : first_byte + 256] = 0.0
    path = test_families._write_gguf(model, family, tmp_path / f"{family}.gguf")
    monkeypatch.undo()

    loaded = load_model(str(path))
    tok = loaded.tokenizer
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    prompt_text = "hello 🙂 world, the winter"
    prompt = tok.encode(prompt_text)
    assert prompt == ref.encode(prompt_text)
    assert tok.eos_token_ids == ((1,) if gemma else (2,))
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=8,
            do_sample=False,
            min_new_tokens=8,
            eos_token_id=None,
            pad_token_id=0,
        )
    want = out[0, len(prompt) :].tolist()
    runner = ModelRunner(loaded.model, num_kv_blocks=16, block_size=4)
    config = EngineConfig(num_kv_blocks=16, block_size=4, max_num_batched_tokens=8, max_num_seqs=2)
    engine = LLMEngine(config, runner, eos_token_ids=[])
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    got: list[int] = []
    detok = IncrementalDetokenizer(tok, prompt)
    streamed = ""
    while engine.has_unfinished():
        for o in engine.step():
            got += o.new_token_ids
            streamed += detok.push(o.new_token_ids)
    streamed += detok.flush()
    assert got == want
    assert not any(first_byte <= i < first_byte + 256 for i in got)
    whole = tok.decode([*prompt, *got])
    assert whole.startswith(tok.decode(prompt))
    assert streamed == whole[len(tok.decode(prompt)) :]
    assert ref.decode(got) == tok.decode(got)
