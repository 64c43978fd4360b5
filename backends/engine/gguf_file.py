"""GGUF files read without torch: metadata and tensor views, for the engine's
loader and the router's tokenizer (which never imports torch).

gguf.GGUFReader parses each element of each metadata array into its own numpy memmap
view: SmolLM2's 49152 tokens and 48900 merges took 2.5 s of its 5.4 s load.
:func:`parse` reads the same layout (GGUF v2/v3, little-endian, no arrays of arrays)
with one struct read per string, and :func:`read` hands every file it declines or
cannot parse to GGUFReader (whose errors and results are the reference). Its tensors
are plain ndarray views of an mmap (GGUFReader's are np.memmap views, whose
Python-level __getitem__ slowed gguf's dequantisation by a third).
tests/engine/test_loader_startup.py checks that both give the same metadata and
tensors."""

from __future__ import annotations

import math
import mmap
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

__all__ = ["Declined", "GGUFFile", "GGUFTensor", "parse", "read", "read_by_reader"]


class GGUFTensor(NamedTuple):
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    # as GGUFReader lays it out: elements (numpy order) for F16/F32/F64/I8-I64 tensors,
    # uint8 bytes of shape [..., bytes per row] for quantised ones
    data: np.ndarray


@dataclass(frozen=True)
class GGUFFile:
    metadata: dict[str, Any]  # as GGUFReader's ``field.contents()``, GGUF.* keys first
    tensors: list[GGUFTensor]


class Declined(Exception):
    """A GGUF file the fast parse leaves to GGUFReader (big-endian, arrays of arrays)."""


def read(path: Path) -> GGUFFile:
    """Metadata and tensors of a GGUF file: the fast parse, or GGUFReader's where that
    declines or fails (so a broken file gets GGUFReader's error, as before)."""
    try:
        return parse(path)
    except (Declined, ValueError, KeyError, OverflowError, struct.error, OSError):
        return read_by_reader(path)


def read_by_reader(path: Path) -> GGUFFile:
    """The reference: everything as gguf.GGUFReader gives it."""
    import gguf  # imported here: only GGUF reads pay for it

    reader = gguf.GGUFReader(str(path))
    tensors = [GGUFTensor(t.name, t.tensor_type, t.data) for t in reader.tensors]
    return GGUFFile({name: f.contents() for name, f in reader.fields.items()}, tensors)


_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_STRING, _ARRAY = 8, 9  # gguf.GGUFValueType
_ALIGNMENT_KEY = "general.alignment"


def parse(path: Path) -> GGUFFile:
    """GGUFReader's parse of header, metadata and tensor infos (gguf_reader.py), in
    plain Python; raises :class:`Declined` (or a parse error) for anything else."""
    import gguf

    if sys.byteorder != "little":
        raise Declined("big-endian host")
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if buf[:4] != b"GGUF":
        raise Declined("no GGUF magic")
    version = _scalar(buf, 4, np.uint32)
    if version & 0xFFFF == 0 or version not in (2, gguf.GGUF_VERSION):
        raise Declined(f"byte order or version {version}")
    n_tensors, n_kv = _scalar(buf, 8, np.uint64), _scalar(buf, 16, np.uint64)
    meta: dict[str, Any] = {
        "GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_kv,
    }
    off = 24
    alignment = gguf.GGUF_DEFAULT_ALIGNMENT
    for _ in range(n_kv):
        key, off = _string(buf, off)
        (kind,), off = _U32.unpack_from(buf, off), off + 4
        if key in meta:
            raise Declined(f"duplicate key {key}")  # GGUFReader's KeyError
        meta[key], off = _value(buf, off, kind)
        if key == _ALIGNMENT_KEY:
            if kind != gguf.GGUFValueType.UINT32 or meta[key] & (meta[key] - 1) or not meta[key]:
                raise Declined("bad general.alignment")
            alignment = meta[key]
    infos = []
    for _ in range(n_tensors):
        name, off = _string(buf, off)
        (n_dims,), off = _U32.unpack_from(buf, off), off + 4
        dims = struct.unpack_from(f"<{n_dims}Q", buf, off)
        off += 8 * n_dims
        kind, offset = struct.unpack_from("<IQ", buf, off)
        off += 12
        infos.append((name, dims, gguf.GGMLQuantizationType(kind), offset))
    start = off + (-off % alignment)
    return GGUFFile(meta, _gguf_tensors(buf, start, infos))


# element types of unquantised tensors (GGUFReader._build_tensors)
_TENSOR_ITEMS = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8,
                 "I16": np.int16, "I32": np.int32, "I64": np.int64}


def _gguf_tensors(buf: mmap.mmap, start: int, infos: list[tuple[Any, ...]]) -> list[GGUFTensor]:
    import gguf

    tensors: list[GGUFTensor] = []
    seen: set[str] = set()
    for name, dims, kind, offset in infos:
        if name in seen:
            raise Declined(f"duplicate tensor {name}")
        seen.add(name)
        n_elements = math.prod(dims)
        shape = tuple(reversed(dims))
        item = _TENSOR_ITEMS.get(kind.name)
        if item is None:
            block, size = gguf.GGML_QUANT_SIZES[kind]
            item, count = np.uint8, n_elements * size // block
            shape = gguf.quant_shape_to_byte_shape(shape, kind)
        else:
            count = n_elements
        data = np.frombuffer(buf, dtype=item, count=count, offset=start + offset)
        tensors.append(GGUFTensor(name, kind, data.reshape(shape)))
    return tensors


_SCALARS: dict[int, type[np.generic]] = {
    0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
    6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64,
}  # gguf.GGUFValueType -> numpy (GGUFReader.gguf_scalar_to_np)


def _scalar(buf: mmap.mmap, off: int, item: type[np.generic]) -> Any:
    return np.frombuffer(buf, dtype=item, count=1, offset=off).tolist()[0]


def _string(buf: mmap.mmap, off: int) -> tuple[str, int]:
    (size,) = _U64.unpack_from(buf, off)
    end = off + 8 + size
    if end > len(buf):
        raise Declined("string past the end of the file")
    return buf[off + 8 : end].decode("utf-8"), end


def _value(buf: mmap.mmap, off: int, kind: int) -> tuple[Any, int]:
    """One metadata value as GGUFReader's ``contents()`` gives it, and the offset after."""
    if kind == _STRING:
        return _string(buf, off)
    if kind in _SCALARS:
        return _scalar(buf, off, _SCALARS[kind]), off + np.dtype(_SCALARS[kind]).itemsize
    if kind != _ARRAY:
        raise Declined(f"value type {kind}")
    inner, count = struct.unpack_from("<IQ", buf, off)
    off += 12
    if inner == _STRING:
        strings = []
        for _ in range(count):  # the hot loop: every token and merge of the vocabulary
            text, off = _string(buf, off)
            strings.append(text)
        return strings, off
    if inner not in _SCALARS:
        raise Declined(f"array of type {inner}")
    values = np.frombuffer(buf, dtype=_SCALARS[inner], count=count, offset=off)
    return values.tolist(), off + values.nbytes
