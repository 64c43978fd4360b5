"""Dense weights where the active kernels read them, and only there.

A GGUF Q4_0 / Q4_1 model is served from its 4-bit codes: with ``batch_invariant`` (the
engine's default) and the native kernels, every token of every step goes through
:class:`backends.engine.native.NativeDecode` and its float32 head, which read the
codes' own layouts, the norms and the (dense) embedding, never a layer's dense
bfloat16 linear weights. Kept resident beside the codes those would be a second copy
of every linear (about 200 MiB for SmolLM2-135M), so :func:`drop_dense` frees them
and :func:`ensure_dense` reads them back from the GGUF file, exactly as the loader did
(``loader.read_gguf_weights``, then the serving dtype), the moment a step takes a
torch path: the native kernels turned off on the model, a hook on a layer, a model
shared with an engine that is not batch-invariant. Tokens do not change: the torch
path then computes with the very weights it had before.

A dropped weight keeps its :class:`torch.nn.Parameter` (so the 4-bit codes attached
to it stay attached, quant.q4_of) with an empty ``[0, K]`` tensor as its data: a
read that bypassed :func:`ensure_dense` fails on the shape instead of computing with
garbage. Only the layers' linears with 4-bit codes are dropped; the embedding (also
the tied head) and the norms stay.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from backends.engine.quant import q4_of

__all__ = ["DenseSource", "drop_dense", "dropped", "ensure_dense"]

_ATTR = "_headrace_dense"
_count = [0]  # dropped weights in this process: ensure_dense is free while it is 0


@dataclass(frozen=True)
class DenseSource:
    """Where a dropped weight comes back from: ``name`` in the GGUF file at ``path``
    (of that size and modification time, so a file replaced since is refused)."""

    path: str
    name: str
    shape: tuple[int, int]
    stamp: tuple[int, int]


def _stamp(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def drop_dense(model: nn.Module, path: str) -> int:
    """Free the dense weight of every layer linear of ``model`` that has 4-bit codes
    attached (they come back from the GGUF file at ``path`` on demand); returns how
    many bytes were freed. Clears the dense kernels' caches built from them (oneDNN's
    prepacked copies, the straight-line decode plans)."""
    from backends.engine.model import LinearGroup

    if os.path.isdir(path):  # a folder holding one GGUF file (loader.read_checkpoint)
        (path,) = sorted(str(p) for p in Path(path).glob("*.gguf"))
    names = {id(m): n for n, m in model.named_modules()}
    freed = 0
    stamp = _stamp(path)
    for layer in getattr(model, "layers", ()):
        for module in layer.modules():
            if not isinstance(module, nn.Linear) or hasattr(module, _ATTR):
                continue
            weight = module.weight
            if q4_of(module) is None or weight.dim() != 2 or weight.shape[0] == 0:
                continue
            shape = (int(weight.shape[0]), int(weight.shape[1]))
            setattr(module, _ATTR, DenseSource(path, f"{names[id(module)]}.weight", shape, stamp))
            freed += weight.numel() * weight.element_size()
            with torch.no_grad():
                weight.data = weight.new_empty(0, shape[1])
            _count[0] += 1
        for module in layer.modules():
            for group in module.__dict__.values():
                if isinstance(group, LinearGroup):
                    group._seen = []  # stale: rebuilt (from restored weights) if ever used
                    group._packed = group._dense = group._int4 = None
    fast = model.__dict__.get("_fast", {})
    for key in (True, False):  # FastDecode plans over the dense kernels
        fast.pop(key, None)
    return freed


def dropped(model: nn.Module) -> list[nn.Linear]:
    """The linears of ``model`` whose dense weight is dropped now."""
    if not _count[0]:
        return []
    return [m for m in model.modules() if isinstance(m, nn.Linear) and hasattr(m, _ATTR)]


def ensure_dense(model: nn.Module) -> None:
    """Read back every dropped dense weight of ``model`` (a no-op when none is)."""
    if _count[0]:
        restore(dropped(model))


def restore(linears: Iterable[nn.Linear]) -> None:
    from backends.engine.loader import ModelLoadError, read_gguf_weights

    by_path: dict[tuple[str, tuple[int, int]], list[nn.Linear]] = {}
    for lin in linears:
        source: DenseSource = getattr(lin, _ATTR)
        by_path.setdefault((source.path, source.stamp), []).append(lin)
    for (path, stamp), group in by_path.items():
        try:
            now = _stamp(path)
        except OSError as exc:
            raise ModelLoadError(f"{path} is gone since it was loaded: cannot read its weights back ({exc})") from exc
        if now != stamp:
            raise ModelLoadError(f"{path} changed since it was loaded: cannot read its weights back")
        sources = {lin: getattr(lin, _ATTR) for lin in group}
        weights = read_gguf_weights(path, [s.name for s in sources.values()])
        for lin, source in sources.items():
            w = weights.pop(source.name)
            if tuple(w.shape) != source.shape:
                raise ModelLoadError(f"{path}: {source.name} has shape {tuple(w.shape)}")
            with torch.no_grad():
                lin.weight.data = w.to(device=lin.weight.device, dtype=lin.weight.dtype)
            delattr(lin, _ATTR)
            _count[0] -= 1
