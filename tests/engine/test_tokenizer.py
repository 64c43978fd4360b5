"""Tokenizer from GGUF metadata / tokenizer.json, chat templates, streaming detokenization."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.engine.loader import read_checkpoint, read_tokenizer
from backends.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from backends.errors import BadRequest
from tests.engine import tiny


@pytest.fixture(scope="module")
def tok(tiny_gguf: Path) -> Tokenizer:
    return read_checkpoint(str(tiny_gguf)).tokenizer


@pytest.fixture(scope="module")
def smol_tok() -> Tokenizer:
    return read_tokenizer()


def test_gguf_and_tokenizer_json_tokenize_alike(tiny_dir: Path, tok: Tokenizer) -> None:
    hf = read_checkpoint(str(tiny_dir / "hf")).tokenizer
    text = "the winter in the water, <|im_start|>an ant"
    assert tok.encode(text) == hf.encode(text)
    assert tok.eos_token_ids == hf.eos_token_ids == (tiny.EOS_ID,)


def test_merges_and_special_tokens_apply(tok: Tokenizer) -> None:
    ids = tok.encode(" the<|im_end|>")
    assert ids == [tok.backend.token_to_id("Ġthe"), 2]
    assert tok.decode(ids) == " the"
    assert tok.decode(ids, skip_special_tokens=False) == " the<|im_end|>"


def test_smollm2_matches_its_reference_tokenization(smol_tok: Tokenizer) -> None:
    """Known ids from SmolLM2's own tokenizer.json; digits are split one by one."""
    assert smol_tok.encode("What is the capital of France?") == [
        1780,
        314,
        260,
        3575,
        282,
        4649,
        47,
    ]
    assert len(smol_tok.encode("2024")) == 4
    assert smol_tok.eos_token_ids == (2,)


def test_chat_template_renders_with_generation_prompt(smol_tok: Tokenizer) -> None:
    text = smol_tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    )
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n")


def test_template_raise_exception_is_a_bad_request() -> None:
    t = Tokenizer(
        Tokenizer.from_gguf_metadata(_meta()).backend,
        bos_token_id=None,
        eos_token_ids=[2],
        chat_template="{{ raise_exception('roles must alternate') }}",
    )
    with pytest.raises(BadRequest, match="roles must alternate"):
        t.apply_chat_template([{"role": "user", "content": "x"}])


def test_template_is_sandboxed() -> None:
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    t = Tokenizer(
        Tokenizer.from_gguf_metadata(_meta()).backend,
        bos_token_id=None,
        eos_token_ids=[2],
        chat_template=evil,
    )
    with pytest.raises(BadRequest):
        t.apply_chat_template([{"role": "user", "content": "x"}])


def test_no_template_is_a_bad_request(tmp_path: Path, tiny_hf_model) -> None:  # type: ignore[no-untyped-def]
    path = tiny.write_gguf(tiny_hf_model, tmp_path / "nochat.gguf", chat_template=None)
    with pytest.raises(BadRequest, match="no chat template"):
        read_checkpoint(str(path)).tokenizer.apply_chat_template([{"role": "user", "content": "x"}])


def test_out_of_vocabulary_ids_are_rejected(tok: Tokenizer) -> None:
    with pytest.raises(BadRequest, match="outside the vocabulary"):
        tok.check_ids([1, tok.vocab_size])
    with pytest.raises(BadRequest):
        tok.decode([-1])


@settings(max_examples=40, deadline=None)
@given(
    st.text(
        st.characters(exclude_characters="\ufffd", exclude_categories=("Cs",)),
        min_size=1,
        max_size=30,
    )
)
def test_streaming_text_equals_full_decode_and_never_splits_a_character(text: str) -> None:
    """The tiny vocabulary is bytes, so multi-byte characters span several tokens."""
    tok = _tiny_tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt_ids=tok.encode("hi"))
    pieces = [detok.push([i]) for i in ids] + [detok.flush()]
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


def _meta() -> dict[str, object]:
    tokens, types, merges = tiny.vocab()
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": 2,
    }


_TINY: list[Tokenizer] = []


def _tiny_tokenizer() -> Tokenizer:
    if not _TINY:
        _TINY.append(Tokenizer.from_gguf_metadata(_meta()))
    return _TINY[0]


def test_smollm2_streaming_text_keeps_spaces_and_multibyte_characters(smol_tok: Tokenizer) -> None:
    text = " Bonjour, ça va? 日本語のテキスト 🎉🚀 done"
    ids = smol_tok.encode(text)
    detok = IncrementalDetokenizer(smol_tok, prompt_ids=smol_tok.encode("Say:"))
    pieces = [detok.push([i]) for i in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


# ---- token pieces (what logprobs show) ------------------------------------------------


def test_every_token_has_a_distinct_non_empty_piece(tok: Tokenizer) -> None:
    texts = [tok.token_piece(i)[0] for i in range(tok.vocab_size)]
    assert all(texts) and len(set(texts)) == len(texts)


def test_pieces_are_the_bytes_a_token_adds(tok: Tokenizer) -> None:
    text = " the water \u2019 é"
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(tok.token_piece(i)[1] for i in ids) == text.encode()
    assert tok.token_piece(tok.backend.token_to_id("Ġthe")) == (" the", b" the")
    assert tok.token_piece(tiny.EOS_ID) == ("<|im_end|>", b"<|im_end|>")
    # A byte of a multi-byte character: shown as its escape, given as the byte.
    e2 = tok.backend.token_to_id(tiny.bytes_to_unicode()[0xE2])
    assert tok.token_piece(e2) == ("\\xe2", b"\xe2")
    past = tok.vocab_size + 3  # a model vocabulary padded past the tokenizer's
    assert tok.token_piece(past) == (f"token_id:{past}", f"token_id:{past}".encode())


def test_tokenizer_json_gives_the_same_pieces(tiny_dir: Path, tok: Tokenizer) -> None:
    hf = read_checkpoint(str(tiny_dir / "hf")).tokenizer
    assert [hf.token_piece(i) for i in range(tok.vocab_size)] == [
        tok.token_piece(i) for i in range(tok.vocab_size)
    ]


def test_sentencepiece_pieces_map_the_word_marker_and_byte_fallback() -> None:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    vocab = {"<unk>": 0, "▁the": 1, "<0xE2>": 2, "<0x80>": 3, "<0x99>": 4, "s": 5}
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback()])
    sp = Tokenizer(backend, bos_token_id=None, eos_token_ids=(), chat_template=None)
    assert sp.token_piece(1) == (" the", b" the")
    assert [sp.token_piece(i)[1] for i in (2, 3, 4)] == [b"\xe2", b"\x80", b"\x99"]
    assert sp.token_piece(2)[0] == "\\xe2"


def test_smollm2_pieces_spell_the_text(smol_tok: Tokenizer) -> None:
    text = "The capital of France is Paris. 日本 🎉"
    ids = smol_tok.encode(text)
    pieces = [smol_tok.token_piece(i) for i in ids]
    assert b"".join(raw for _, raw in pieces) == text.encode()
    assert pieces[:3] == [("The", b"The"), (" capital", b" capital"), (" of", b" of")]
    assert all(t for t, _ in pieces)
