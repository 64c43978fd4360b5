"""Prefix keys: the chained block hashes a routing policy places a request by.

The engine registers its prefix cache, and publishes its KV events, under
``backends.base.hash_block`` chained over full blocks of prompt token ids. The
router computes the same hashes from the request, so a policy can match them
against what each engine reports it holds. One source per request, the first
that applies::

    prompt_token_ids given ─────────────────────────────────> chain_hashes(ids, block_size)
    messages / prompt, the model's tokenizer known ─ render ─> encode ─> chain_hashes
        (an in-process engine's own tokenizer; a configured GGUF file or HF folder;
         "bytes", the mock's; or what the backend's /v1/models names, loaded once)
    otherwise (a provider whose tokenizer we cannot have) ─> text blocks: blake2b
        chained over 64-character blocks of the whole rendered conversation, tools
        included; block_size 0 says so, prompt_tokens is estimated as chars / 4

The chat path renders exactly as the engine does (``EngineBackend.prompt_ids``:
the chat template with the generation prompt, then ``encode`` without special
tokens; a plain prompt is ``encode(prompt)``), so the hashes are the engine's.
Both kinds are stable across processes (no Python ``str`` hash), so two router
processes with the same config compute the same keys.

Cost, measured by ``bench/prefix_keys_bench.py``: tokenizing a 2k-token chat
costs milliseconds, so results are kept in a bounded LRU keyed by a digest of
the conversation (of the rendered text where the template reads the clock), and
a repeat is a digest plus a dict lookup. Tokenizers split text at their added
(special) tokens before anything else, so :class:`TokenizerEncoder` encodes
the pieces between special tokens separately and keeps them in an LRU of its
own: a conversation that grows by a turn tokenizes only the new turn.
"""

from __future__ import annotations

import array
import collections
import hashlib
import json
import logging
import re
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Literal, Protocol, TypeVar

import msgspec
import trio

from backends.base import BackendInfo, ChatMessage, GenerateRequest, chain_hashes
from backends.mock import encode_text, render_chat

if TYPE_CHECKING:
    from backends.engine.tokenizer import Tokenizer

__all__ = [
    "BYTES",
    "DEFAULT_BLOCK_SIZE",
    "BytesEncoder",
    "PrefixKeys",
    "PrefixKeysStatistics",
    "PromptEncoder",
    "PromptKeys",
    "TokenizerEncoder",
    "TokenizerLoadError",
    "load_encoder",
    "load_tokenizer",
    "render_text",
    "text_block_hashes",
]

log = logging.getLogger(__name__)

BYTES = "bytes"  # the tokenizer spec of the mock: UTF-8 bytes of its own chat rendering
DEFAULT_BLOCK_SIZE = 16  # the engine's default, for backends that do not say
TEXT_BLOCK_CHARS = 64
PREFIX_CHARS = 256  # how much rendered text a policy sees in RouteRequest.prefix
_MASK63 = (1 << 63) - 1
_TEXT_KEY = b"headrace-text"  # blake2b key: text-block hashes never mean token hashes

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class TokenizerLoadError(ValueError):
    """A tokenizer spec names nothing loadable (one line, naming the path)."""


class PromptKeys(msgspec.Struct, frozen=True, kw_only=True):
    """The RouteRequest fields of one request (``source`` says where they came from)."""

    block_hashes: tuple[int, ...]
    block_size: int  # tokens per block; 0: text blocks
    prompt_tokens: int  # exact, or chars / 4 for text blocks
    prefix: str  # the first PREFIX_CHARS of the rendered prompt ("" for token ids)
    source: Literal["ids", "tokens", "text"]


class PrefixKeysStatistics(msgspec.Struct, frozen=True, kw_only=True):
    requests: dict[str, int]  # by source: ids, tokens, text
    cache_hits: int
    cache_misses: int
    cache_entries: int
    segment_hits: int  # pieces between special tokens found already tokenized
    segment_misses: int
    models: dict[str, str]  # model -> where its tokenizer came from ("" = text blocks)


# ---------------------------------------------------------------- encoders


class PromptEncoder(Protocol):
    """A model's prompt -> token ids, as its backend computes them."""

    @property
    def pure(self) -> bool:
        """``render`` depends on the messages only (not on the clock)."""
        ...

    def render(self, messages: Sequence[ChatMessage]) -> str: ...

    def encode_chat(self, text: str) -> list[int]:
        """Ids of a rendered conversation."""
        ...

    def encode_prompt(self, text: str) -> list[int]:
        """Ids of a plain (completions) prompt."""
        ...


class BytesEncoder:
    """The mock's tokenizer (``backends.mock``): UTF-8 bytes of its chat rendering."""

    pure = True

    def render(self, messages: Sequence[ChatMessage]) -> str:
        return render_chat(messages)

    def encode_chat(self, text: str) -> list[int]:
        return encode_text(text)

    def encode_prompt(self, text: str) -> list[int]:
        return encode_text(text)


class TokenizerEncoder:
    """An engine :class:`~backends.engine.tokenizer.Tokenizer`, used as the
    engine uses it, with the pieces between special tokens cached.

    ``tokenizers`` cuts a text at its added tokens (leftmost-longest, on the raw
    text) before normalising, pre-tokenizing and merging the pieces one by one,
    so encoding the pieces separately gives the same ids. That holds only where
    no added token strips whitespace, matches single words or is matched on
    normalised text; otherwise every text is encoded whole. The first few
    split encodings are checked against a whole one, and splitting is dropped
    for good (with a warning) on a mismatch."""

    def __init__(self, tokenizer: Tokenizer, *, segments: int = 4096, checks: int = 4) -> None:
        self.tokenizer = tokenizer
        template = tokenizer.chat_template or ""
        self.pure = "strftime_now" not in template  # the one clock a template can read
        backend = tokenizer.backend
        added = backend.get_added_tokens_decoder()
        self._ids = {t.content: i for i, t in added.items()}
        exact = all(
            not (t.lstrip or t.rstrip or t.single_word or (t.normalized and backend.normalizer is not None))
            for t in added.values()
        )
        contents = sorted(self._ids, key=len, reverse=True)  # alternation is leftmost-first: longest first
        self._split = re.compile("|".join(map(re.escape, contents))) if exact and contents else None
        self._segments: _LRU[str, array.array[int]] = _LRU(segments)
        self._checks = checks

    def render(self, messages: Sequence[ChatMessage]) -> str:
        plain = [msgspec.structs.asdict(m) for m in messages]
        return self.tokenizer.apply_chat_template(plain, add_generation_prompt=True)

    def encode_chat(self, text: str) -> list[int]:
        if self._split is None:
            return self.tokenizer.encode(text, add_special_tokens=False)
        ids: list[int] = []
        pos = 0
        for match in self._split.finditer(text):
            if match.start() > pos:
                ids += self._segment(text[pos : match.start()])
            ids.append(self._ids[match.group()])
            pos = match.end()
        if pos < len(text):
            ids += self._segment(text[pos:])
        if self._checks:
            self._check(text, ids)
        return ids

    def encode_prompt(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def statistics(self) -> tuple[int, int]:
        return self._segments.hits, self._segments.misses

    def _segment(self, piece: str) -> array.array[int]:
        ids = self._segments.get(piece)
        if ids is None:
            ids = array.array("q", self.tokenizer.backend.encode(piece, add_special_tokens=False).ids)
            self._segments.put(piece, ids)
        return ids

    def _check(self, text: str, ids: list[int]) -> None:
        self._checks -= 1
        whole = self.tokenizer.encode(text, add_special_tokens=False)
        if whole != ids:
            log.warning("tokenizer: pieces between special tokens encode differently from the "
                        "whole text; encoding whole texts from now on")
            self._split = None
            self._checks = 0
            ids[:] = whole


def load_tokenizer(path: str) -> Tokenizer:
    """The tokenizer of a GGUF file or Hugging Face folder, read as
    ``backends.engine.loader.read_tokenizer`` reads it but without torch (the
    router never imports it): GGUF metadata only, or ``tokenizer.json`` with
    ``tokenizer_config.json`` and the eos ids that the chat template may name."""
    from backends.engine.tokenizer import Tokenizer

    p = Path(path)
    try:
        if p.is_dir() and (p / "config.json").is_file():
            return _hf_tokenizer(p)
        if p.is_dir():
            ggufs = sorted(p.glob("*.gguf"))
            if len(ggufs) != 1:
                raise TokenizerLoadError(f"tokenizer {path}: no config.json and not exactly one .gguf file")
            p = ggufs[0]
        if not p.is_file():
            raise TokenizerLoadError(f"tokenizer {path}: no such file or folder")
        from backends.engine import gguf_file  # numpy, not torch

        meta = {k: v for k, v in gguf_file.read(p).metadata.items() if k.startswith("tokenizer.")}
        return Tokenizer.from_gguf_metadata(meta)
    except TokenizerLoadError:
        raise
    except Exception as exc:  # unreadable, not GGUF, malformed JSON, unsupported vocabulary
        raise TokenizerLoadError(f"tokenizer {path}: cannot load: {exc}") from exc


def _hf_tokenizer(folder: Path) -> Tokenizer:
    from backends.engine.tokenizer import Tokenizer

    def read(name: str) -> dict[str, Any]:
        f = folder / name
        data = json.loads(f.read_text(encoding="utf-8")) if f.is_file() else {}
        return data if isinstance(data, dict) else {}

    config = read("tokenizer_config.json")
    template = folder / "chat_template.jinja"
    if "chat_template" not in config and template.is_file():
        config["chat_template"] = template.read_text(encoding="utf-8")
    eos: list[int] = []
    for source in (read("config.json"), read("generation_config.json")):
        value = source.get("eos_token_id")
        eos += value if isinstance(value, list) else [value] if isinstance(value, int) else []
    return Tokenizer.from_hf_files(str(folder / "tokenizer.json"), config, generation_eos=eos)


def load_encoder(spec: str) -> PromptEncoder:
    """``"bytes"`` (the mock's) or the path of a GGUF file / HF folder.
    Blocking (a GGUF vocabulary takes about a second): call it at startup or in
    a worker thread. Raises :class:`TokenizerLoadError`."""
    return BytesEncoder() if spec == BYTES else TokenizerEncoder(load_tokenizer(spec))


# ---------------------------------------------------------------- text blocks


def render_text(request: GenerateRequest) -> str:
    """The whole input as text, for text-block keys: tool definitions first
    (they open most providers' system prompts), then every message's role,
    name and content (non-text parts as their JSON), or the plain prompt."""
    parts: list[str] = []
    tools = request.extra.get("tools")
    if tools:
        parts.append("<|tools|>" + _json_text(tools) + "\n")
    if request.messages is not None:
        for m in request.messages:
            parts.append(f"<|{m.role}|>" if m.name is None else f"<|{m.role}:{m.name}|>")
            content = m.content
            if isinstance(content, list):
                content = "".join(
                    p["text"] if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                    else _json_text(p)
                    for p in content
                )
            parts.append((content or "") + "\n")
    else:
        parts.append(request.prompt or "")
    return "".join(parts)


def text_block_hashes(text: str, block_chars: int = TEXT_BLOCK_CHARS) -> list[int]:
    """Chained 63-bit blake2b of every full ``block_chars``-character block."""
    out: list[int] = []
    parent = b"\0" * 8
    for start in range(0, len(text) - block_chars + 1, block_chars):
        h = hashlib.blake2b(text[start : start + block_chars].encode(), digest_size=8, key=_TEXT_KEY)
        h.update(parent)
        parent = h.digest()
        out.append(int.from_bytes(parent, "little") & _MASK63)
    return out


def _json_text(value: object) -> str:
    return msgspec.json.encode(value, order="sorted").decode()


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(part)
    return h.digest()


# ---------------------------------------------------------------- the keys


class _LRU(Generic[K, V]):
    """A bounded mapping that forgets the least recently used entry."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("an LRU holds at least one entry")
        self.size = size
        self.hits = self.misses = 0
        self._data: collections.OrderedDict[K, V] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._data)

    def get(self, key: K) -> V | None:
        value = self._data.get(key)
        if value is None:
            self.misses += 1
            return None
        self.hits += 1
        self._data.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> None:
        self._data[key] = value
        self._data.move_to_end(key)
        if len(self._data) > self.size:
            self._data.popitem(last=False)


class _Model:
    """One model's key source: its encoder (None: text blocks), block size and
    where they came from."""

    __slots__ = ("block_size", "encoder", "source")

    def __init__(self, encoder: PromptEncoder | None, block_size: int | None, source: str) -> None:
        self.encoder, self.block_size, self.source = encoder, block_size, source


class PrefixKeys:
    """Prefix keys per model. A model's tokenizer is set from config
    (:meth:`set_encoder`) or learned once from a backend serving it
    (:meth:`learn`); a model without one gets text blocks. Synchronous and
    cheap on a repeat: :meth:`keys` runs on the request path."""

    def __init__(
        self,
        *,
        cache_entries: int = 2048,
        default_block_size: int = DEFAULT_BLOCK_SIZE,
        text_block_chars: int = TEXT_BLOCK_CHARS,
    ) -> None:
        self.default_block_size = default_block_size
        self.text_block_chars = text_block_chars
        # Keyed by (encoder, block size, digest): the encoder object itself, so
        # a model that changes tokenizer never reads the old one's entries.
        self._cache: _LRU[tuple[object, int, bytes], PromptKeys] = _LRU(cache_entries)
        # Encoders by spec ("bytes", a path, an in-process tokenizer): loaded once, shared.
        self._models: dict[str, _Model] = {}
        self._encoders: dict[str, PromptEncoder | None] = {}
        self._learning: dict[str, trio.Event] = {}
        self._counts = dict.fromkeys(("ids", "tokens", "text"), 0)

    # ------------------------------------------------------------ sources

    def set_encoder(
        self, model: str, encoder: PromptEncoder | None, *, block_size: int | None = None, source: str = "config"
    ) -> None:
        """Use ``encoder`` for ``model`` (``None``: text blocks); wins over
        anything :meth:`learn` finds. ``block_size`` None: learned, else the default."""
        self._models[model] = _Model(encoder, block_size, source if encoder is not None else "")

    async def learn(self, backend: object, info: BackendInfo) -> None:
        """Take the tokenizer of each model ``info`` lists that has none yet:
        an in-process engine's own (``backend.tokenizer``), else the one its
        ``/v1/models`` names (``info.tokenizer``: "bytes" or a path, loaded in a
        worker thread); a model with neither, or whose file cannot be read here,
        gets text blocks. Each model is settled once; later calls are lookups."""
        for model in info.models:
            known = self._models.get(model)
            if known is not None:
                if known.block_size is None and info.block_size:
                    known.block_size = info.block_size
                continue
            busy = self._learning.get(model)
            if busy is not None:
                await busy.wait()
                continue
            self._learning[model] = done = trio.Event()
            try:
                encoder, source = await self._find(backend, info)
                self._models[model] = _Model(encoder, info.block_size, source)
            finally:
                del self._learning[model]
                done.set()

    async def _find(self, backend: object, info: BackendInfo) -> tuple[PromptEncoder | None, str]:
        own = getattr(backend, "tokenizer", None)
        if own is not None and hasattr(own, "apply_chat_template") and hasattr(own, "backend"):
            spec = f"tokenizer@{id(own):x}"
            if spec not in self._encoders:
                self._encoders[spec] = TokenizerEncoder(own)
            return self._encoders[spec], f"backend {info.name}"
        named = info.tokenizer
        if not named:
            return None, ""
        if named not in self._encoders:
            try:
                self._encoders[named] = await trio.to_thread.run_sync(load_encoder, named)
            except TokenizerLoadError as exc:
                log.warning("backend %s: %s; routing its models by text blocks", info.name, exc)
                self._encoders[named] = None
        encoder = self._encoders[named]
        return encoder, named if encoder is not None else ""

    # ------------------------------------------------------------ keys

    def keys(self, request: GenerateRequest, model: str | None = None) -> PromptKeys:
        """The keys of ``request`` for ``model`` (default: the request's)."""
        name = model if model is not None else request.model
        entry = self._models.get(name) if name is not None else None
        if request.prompt_token_ids is not None:
            self._counts["ids"] += 1
            size = (entry.block_size if entry is not None else None) or self.default_block_size
            ids = request.prompt_token_ids
            return PromptKeys(block_hashes=tuple(chain_hashes(ids, size)), block_size=size,
                              prompt_tokens=len(ids), prefix="", source="ids")  # fmt: skip
        if entry is not None and entry.encoder is not None:
            found = self._tokenized(request, entry, entry.encoder)
            if found is not None:
                self._counts["tokens"] += 1
                return found
        self._counts["text"] += 1
        return self._text(request)

    def _tokenized(self, request: GenerateRequest, entry: _Model, encoder: PromptEncoder) -> PromptKeys | None:
        size = entry.block_size or self.default_block_size
        chat = request.messages is not None
        text: str | None = None
        if not chat:
            text = request.prompt or ""
            key = _digest(b"p", text.encode())
        elif encoder.pure:  # the rendering follows from the messages: skip it on a repeat
            key = _digest(b"m", msgspec.json.encode(request.messages))
        else:
            text = self._render(encoder, request)
            if text is None:
                return None
            key = _digest(b"c", text.encode())
        slot = (encoder, size, key)
        found = self._cache.get(slot)
        if found is not None:
            return found
        if text is None:
            text = self._render(encoder, request)
            if text is None:
                return None
        ids = encoder.encode_chat(text) if chat else encoder.encode_prompt(text)
        found = PromptKeys(block_hashes=tuple(chain_hashes(ids, size)), block_size=size,
                           prompt_tokens=len(ids), prefix=text[:PREFIX_CHARS], source="tokens")  # fmt: skip
        self._cache.put(slot, found)
        return found

    @staticmethod
    def _render(encoder: PromptEncoder, request: GenerateRequest) -> str | None:
        try:
            return encoder.render(request.messages or [])
        except Exception as exc:  # no template, or one that refuses this conversation:
            # the backend will refuse it too, and say why; route it by text.
            log.debug("chat template failed (%r); text blocks for request %s", exc, request.request_id)
            return None

    def _text(self, request: GenerateRequest) -> PromptKeys:
        text = render_text(request)
        slot = (None, 0, _digest(b"t", text.encode()))
        found = self._cache.get(slot)
        if found is None:
            hashes = text_block_hashes(text, self.text_block_chars)
            found = PromptKeys(block_hashes=tuple(hashes), block_size=0, prompt_tokens=(len(text) + 3) // 4,
                               prefix=text[:PREFIX_CHARS], source="text")  # fmt: skip
            self._cache.put(slot, found)
        return found

    def statistics(self) -> PrefixKeysStatistics:
        seg_hits = seg_misses = 0
        encoders = {id(m.encoder): m.encoder for m in self._models.values() if m.encoder is not None}
        for encoder in encoders.values():
            counts = getattr(encoder, "statistics", None)
            if counts is not None:
                hits, misses = counts()
                seg_hits, seg_misses = seg_hits + hits, seg_misses + misses
        return PrefixKeysStatistics(
            requests=dict(self._counts),
            cache_hits=self._cache.hits,
            cache_misses=self._cache.misses,
            cache_entries=len(self._cache),
            segment_hits=seg_hits,
            segment_misses=seg_misses,
            models={name: m.source for name, m in sorted(self._models.items())},
        )
