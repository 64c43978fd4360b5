"""Tokenizer and chat template, taken from the same file as the weights.

A GGUF file carries its vocabulary as llama.cpp metadata (``tokenizer.ggml.*``); we
rebuild a Hugging Face ``tokenizers`` tokenizer from it: a byte-level BPE
(``tokenizer.ggml.model`` ``gpt2``) with the pre-tokenizer llama.cpp uses for that
``tokenizer.ggml.pre``, or a SentencePiece BPE with byte fallback (``llama``: Llama 2,
Mistral, Gemma), as transformers' GGUF conversion builds it (merges recovered from the
scores, the ``▁`` word marker, ``<0xNN>`` byte tokens). A Hugging Face directory carries
``tokenizer.json`` and ``tokenizer_config.json``. Either way nothing is fetched from
the network.

Each token also has a *piece*: its bytes (a byte-level BPE token's bytes, a
SentencePiece ``<0xNN>`` token's byte, a special token's text) and the text shown
for it in logprobs, where a token holding part of a UTF-8 character spells its
bytes as ``\\xNN`` escapes (so no two tokens of a distribution share a text).

Chat templates are Jinja, rendered in a sandbox (they come from model files, i.e.
from strangers) with the helpers Hugging Face templates expect (``raise_exception``,
``tojson``, ``strftime_now``).

:class:`IncrementalDetokenizer` turns a token stream into a text stream without ever
emitting half of a multi-byte character (vLLM's prefix/read offsets).
"""

from __future__ import annotations

import datetime
import functools
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from backends.engine import generation_config
from backends.engine.config import SamplingDefaults
from backends.errors import BadRequest, HeadraceError

__all__ = ["IncrementalDetokenizer", "Tokenizer", "TokenizerError"]

# llama.cpp token types (tokenizer.ggml.token_type)
_CONTROL, _USER_DEFINED = 3, 4

_SPACE = "\u2581"  # SentencePiece's word marker
# Architectures whose SentencePiece vocabulary has no space prefix and ranks merges by
# the order of the tokens in the file (transformers' gemma_tokenizer).
_GEMMA_SPM = {"gemma", "gemma2", "gemma3"}

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte fallback

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class TokenizerError(HeadraceError):
    """The model file has no usable tokenizer (a startup error, not a request error)."""


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """llama.cpp's split rules per ``tokenizer.ggml.pre`` (llama-vocab.cpp)."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in {"smollm", "starcoder", "refact", "command-r"}:
        # GPT-2 regex, but every digit is its own token.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in {"llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "dbrx"}:
        split = pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated")
        return pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    return byte_level


_SPM_NAMED = ("unknown", "bos", "eos", "padding")


def _sentencepiece(meta: Mapping[str, Any], tokens: list[str]) -> tuple[list[str], HFTokenizer]:
    """A SentencePiece BPE with byte fallback from ``tokenizer.ggml.*``, as transformers'
    GGUF conversion builds it (``LlamaTokenizer``, or ``GemmaTokenizer`` for Gemma).

    Returns the tokens as the vocabulary spells them (Gemma files store a run of
    spaces as real spaces; the vocabulary looks it up as ``▁▁``) and the tokenizer.
    Merges come from the file or, as SentencePiece files have none, from the
    vocabulary: every split of a token into two tokens, ranked by the token's score
    (Gemma: by its place in the file, which is its merge order)."""
    gemma = meta.get("general.architecture") in _GEMMA_SPM
    if gemma:
        tokens = [_SPACE * len(t) if t and set(t) == {" "} else t for t in tokens]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if "tokenizer.ggml.merges" in meta:
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    else:
        if gemma:
            ranks = {tok: float(-i) for i, tok in enumerate(tokens)}
        else:
            scores = meta.get("tokenizer.ggml.scores")
            scores = [0.0] * len(tokens) if scores is None else list(scores)
            ranks = {tok: float(sc) for tok, sc in zip(tokens, scores, strict=False)}
        merges = _merges_from_scores(vocab, ranks)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < len(tokens) else None
    backend = HFTokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            fuse_unk=True,
            byte_fallback=True,
            unk_token=unk if gemma else None,
            ignore_merges=False,
        )
    )
    steps: list[decoders.Decoder] = [
        decoders.Replace(_SPACE, " "),
        decoders.ByteFallback(),
        decoders.Fuse(),
    ]
    if gemma:  # no space prefix: every space is a marker, split nowhere
        backend.normalizer = normalizers.Replace(" ", _SPACE)
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    elif meta.get("tokenizer.ggml.add_space_prefix", True):
        # A marker in front of the text (not after a special token); decode drops it.
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            _SPACE, prepend_scheme="first", split=False
        )
        steps.append(decoders.Strip(" ", 1, 0))
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            _SPACE, prepend_scheme="never", split=False
        )
    backend.decoder = decoders.Sequence(steps)
    return tokens, backend


def _merges_from_scores(
    vocab: Mapping[str, int], ranks: Mapping[str, float]
) -> list[tuple[str, str]]:
    """transformers' ``generate_merges``: each token's splits into two tokens of the
    vocabulary, best-ranked token first (ties: longer left, then longer right part)."""
    found: list[tuple[str, str, float]] = []
    for piece, rank in ranks.items():
        local = [
            (piece[:k], piece[k:], rank)
            for k in range(1, len(piece))
            if piece[:k] in vocab and piece[k:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        found.extend(local)
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


class Tokenizer:
    """Text <-> token ids, special tokens and the chat template of one model."""

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        chat_template: str | None,
        add_bos_token: bool = False,
        recommended_sampling: SamplingDefaults | None = None,
    ) -> None:
        """``recommended_sampling``: what the model file recommends for sampling
        (its generation config), read with the rest of its conventions."""
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        self.recommended_sampling = recommended_sampling or SamplingDefaults()
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self._template: jinja2.Template | None = None
        self._pieces: dict[int, tuple[str, bytes]] = {}
        self._added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
        self._byte_level = isinstance(backend.decoder, decoders.ByteLevel)

    # ---- construction -------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Build from ``tokenizer.ggml.*`` keys (values already decoded to Python)."""
        kind = meta.get("tokenizer.ggml.model")
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        types: list[int] = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
        if kind == "gpt2":
            merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
            vocab = {tok: i for i, tok in enumerate(tokens)}
            backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
            backend.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre"))
            backend.decoder = decoders.ByteLevel()
            default_bos = False
        elif kind == "llama":
            tokens, backend = _sentencepiece(meta, tokens)
            default_bos = True  # llama.cpp adds BOS to a SentencePiece vocabulary by default
        else:
            raise TokenizerError(
                f"unsupported GGUF tokenizer model {kind!r}"
                " (byte-level BPE 'gpt2' and SentencePiece 'llama' are supported)"
            )
        special = [
            AddedToken(tokens[i], special=True, normalized=False)
            for i, t in enumerate(types)
            if t == _CONTROL
        ]
        user = [
            AddedToken(tokens[i], special=False, normalized=False)
            for i, t in enumerate(types)
            if t == _USER_DEFINED
        ]
        if kind == "llama":  # transformers makes bos/eos/unk/pad special whatever their type
            named = (meta.get(f"tokenizer.ggml.{k}_token_id") for k in _SPM_NAMED)
            have = {t.content for t in special}
            for i in named:
                if i is not None and 0 <= int(i) < len(tokens) and tokens[int(i)] not in have:
                    special.append(AddedToken(tokens[int(i)], special=True, normalized=False))
                    have.add(tokens[int(i)])
        backend.add_special_tokens(special)
        backend.add_tokens(user)
        eos = meta.get("tokenizer.ggml.eos_token_id")
        eot = meta.get("tokenizer.ggml.eot_token_id")
        eos_ids = [int(i) for i in (eos, eot) if i is not None]
        bos = meta.get("tokenizer.ggml.bos_token_id")
        return cls(
            backend,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=list(dict.fromkeys(eos_ids)),
            chat_template=meta.get("tokenizer.chat_template"),
            add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", default_bos)),
            recommended_sampling=generation_config.from_gguf_metadata(meta),
        )

    @classmethod
    def from_hf_files(
        cls,
        tokenizer_json: str,
        tokenizer_config: Mapping[str, Any],
        generation_eos: Iterable[int] = (),
        generation: Mapping[str, Any] | None = None,
    ) -> Tokenizer:
        """Build from a ``tokenizer.json`` path and the parsed ``tokenizer_config.json``
        (and ``generation_config.json``, for its recommended sampling)."""
        backend = HFTokenizer.from_file(tokenizer_json)
        bos_id = _token_id(backend, tokenizer_config.get("bos_token"))
        eos_id = _token_id(backend, tokenizer_config.get("eos_token"))
        eos_ids = [i for i in (eos_id, *generation_eos) if i is not None]
        # tokenizer.json's post-processor already adds BOS where the model wants it.
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_ids=list(dict.fromkeys(eos_ids)),
            chat_template=_template_text(tokenizer_config.get("chat_template")),
            recommended_sampling=generation_config.from_generation_config(generation or {}),
        )

    # ---- text <-> ids --------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        bos = self.bos_token_id if add_special_tokens and self.add_bos_token else None
        if bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        self.check_ids(ids)
        text: str = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return text

    def check_ids(self, ids: Iterable[int]) -> None:
        """Raise :class:`BadRequest` for an id outside the vocabulary."""
        for i in ids:
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.vocab_size:
                raise BadRequest(
                    f"token id {i!r} is outside the vocabulary [0, {self.vocab_size})",
                    param="prompt",
                )

    def id_to_token(self, token_id: int) -> str | None:
        token: str | None = self.backend.id_to_token(token_id)
        return token

    def token_piece(self, token_id: int) -> tuple[str, bytes]:
        """``(text, bytes)`` of one token, as logprobs show it: the bytes it adds to
        the output (special tokens: their text), and their UTF-8 text, with bytes
        that are not a whole character written as ``\\xNN``. An id the tokenizer
        does not know (a model vocabulary padded past it) is ``token_id:N``."""
        piece = self._pieces.get(token_id)
        if piece is None:
            raw = self._token_bytes(token_id)
            if raw is None:
                text = f"token_id:{token_id}"
                piece = (text, text.encode())
            else:
                piece = (raw.decode("utf-8", errors="backslashreplace"), raw)
            self._pieces[token_id] = piece
        return piece

    def _token_bytes(self, token_id: int) -> bytes | None:
        added = self._added.get(token_id)
        if added is not None:
            return added.encode()
        token = self.backend.id_to_token(token_id)
        if token is None:
            return None
        if self._byte_level:
            chars = _unicode_to_byte()
            if all(c in chars for c in token):
                return bytes(chars[c] for c in token)
            return token.encode()
        byte = _BYTE_PIECE.fullmatch(token)
        if byte is not None:
            return bytes([int(byte.group(1), 16)])
        return token.replace("\u2581", " ").encode()  # SentencePiece's word marker

    # ---- chat ------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """Render a conversation to the prompt text the model was trained on."""
        if self.chat_template is None:
            raise BadRequest(
                "this model has no chat template; use /v1/completions", param="messages"
            )
        if self._template is None:
            self._template = _jinja_env().from_string(self.chat_template)
        special = {
            "bos_token": self._token_text(self.bos_token_id),
            "eos_token": self._token_text(self.eos_token_ids[0] if self.eos_token_ids else None),
        }
        try:
            return self._template.render(
                messages=[_plain_message(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                **special,
                **extra,
            )
        except jinja2.TemplateError as exc:
            raise BadRequest(f"chat template failed: {exc}", param="messages") from exc

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.backend.id_to_token(token_id) or "")


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: printable stand-in character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def _token_id(backend: HFTokenizer, token: Any) -> int | None:
    if isinstance(token, dict):  # {"content": "<s>", ...} in older configs
        token = token.get("content")
    if not isinstance(token, str):
        return None
    found: int | None = backend.token_to_id(token)
    return found


def _template_text(template: Any) -> str | None:
    """tokenizer_config's chat_template: a string, or a list of named templates."""
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _plain_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """OpenAI content parts -> one string, which is what templates index into."""
    out = dict(message)
    content = out.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (
                isinstance(part, dict)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                raise BadRequest("only text content parts are supported", param="messages")
            texts.append(part["text"])
        out["content"] = "".join(texts)
    elif content is None:
        out["content"] = ""
    return out


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _jinja_env() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    return env


class IncrementalDetokenizer:
    """Streams text for a growing list of token ids.

    Decodes a short window ``ids[prefix:]`` and emits only what lies past
    ``ids[prefix:read]``; a window ending in U+FFFD is an incomplete UTF-8 sequence,
    so nothing is emitted until the next token completes it."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
    ):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        # A little prompt context, so a leading space of the first output token survives.
        self.ids: list[int] = list(prompt_ids[-4:])
        self._prefix = 0
        self._read = len(self.ids)
        self.text = ""

    def push(self, token_ids: Iterable[int]) -> str:
        """Add tokens; return the text they complete (maybe "")."""
        self.ids.extend(token_ids)
        before = self._tok.backend.decode(
            self.ids[self._prefix : self._read], skip_special_tokens=self._skip
        )
        after = self._tok.backend.decode(self.ids[self._prefix :], skip_special_tokens=self._skip)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        new = after[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += new
        return new

    def flush(self) -> str:
        """At the end of the stream: whatever is still held back (an incomplete
        character decodes as U+FFFD, as every other server does)."""
        before = self._tok.backend.decode(
            self.ids[self._prefix : self._read], skip_special_tokens=self._skip
        )
        after = self._tok.backend.decode(self.ids[self._prefix :], skip_special_tokens=self._skip)
        new = after[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += new
        return new
