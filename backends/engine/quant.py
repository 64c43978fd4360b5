"""4-bit weights kept packed: GGUF Q4_0 / Q4_1 served as llama.cpp serves them.

A dequantised 4-bit model read in bfloat16 moves 2 bytes per weight per decode step;
kept packed it moves ~0.56. At the batch sizes where decoding is bound by memory
(a few rows) that is the step. This module reads the 4-bit codes out of the GGUF
blocks (:func:`q4_from_gguf`) and runs them through torch's CPU int4 kernel
(``aten._weight_int4pack_mm_for_cpu``, the one gpt-fast uses), which computes
``x @ ((q - 8) * scale + zero).T`` with float32 accumulation:

- Q4_1 blocks hold ``w = d * q + m``, i.e. ``scale = d``, ``zero = m + 8 d``;
- Q4_0 blocks hold ``w = d * (q - 8)``, i.e. ``scale = d``, ``zero = 0``.

The kernel wants its scales in the activation dtype, so this path serves bfloat16
only (its float32 variant is a slow reference loop). Scales rounded to bfloat16 put
the weights within bfloat16 rounding of the file's, as close as the dequantised
bfloat16 weights are. The kernel's cost grows with the row count (it dequantises per
row block), so it serves the few-row steps where memory is the bound, and the dense
weights serve the rest. Which rows take it is decided per step by the runner
(:func:`packed_rows`): the leading decode rows, when at most :data:`INT4_MAX_SEQS`
sequences decode. A decode token is then computed the same way alone, batched with
up to that many others, or inside a speculative span; prefill chunks always run dense.
Each row's result does not depend on the other rows.

Where a C compiler is at hand, those same packed decode rows run through native decode
layers instead (native.py: the whole stack in one call, ~1.6x faster per step);
torch's kernel is the fallback.

The codes are attached to the model's Linear modules by :func:`attach_q4` after the
model reached its device and dtype; a Linear whose weight was replaced since (tensor
parallel sharding, a reload) is simply run dense.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

__all__ = [
    "INT4_MAX_ROWS",
    "INT4_MAX_SEQS",
    "Int4Linear",
    "ParamWatch",
    "Q4Weight",
    "attach_epoch",
    "attach_q4",
    "int4_supported",
    "packed_row_count",
    "packed_rows",
    "q4_from_gguf",
    "q4_of",
]

GROUP = 32  # GGUF Q4_0 / Q4_1 block size, and the kernel's group size here
# Up to this many rows the int4 kernel beats the dense bfloat16 GEMM on CPU (measured
# 2.7x at 1 row, 1.9x at 4, 1.1x at 8, 0.6x at 16: `headrace bench kernels`,
# bench/README.md "Packed weights").
INT4_MAX_ROWS = 8
# The runner packs the decode rows of steps with at most this many decoding sequences.
INT4_MAX_SEQS = 8
_packed_rows: ContextVar[int | None] = ContextVar("headrace_packed_rows", default=None)
_ATTR = "_headrace_q4"
_attached = [0]  # bumped by every attach_q4, so LinearGroups notice new codes


@dataclass(frozen=True)
class Q4Weight:
    """A [N, K] weight as 4-bit codes: ``w[n, k] = (q[n, k] - 8) * scale[n, k // 32]
    + zero[n, k // 32]``. ``codes`` holds two codes per byte ([N, K / 2] uint8, low
    nibble first); scale and zero are float32 [N, K / 32]."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.codes.shape[0]), int(self.codes.shape[1]) * 2

    def q(self) -> torch.Tensor:
        """The codes as int32 [N, K] (0..15)."""
        low = (self.codes & 0x0F).to(torch.int32)
        high = (self.codes >> 4).to(torch.int32)
        return torch.stack([low, high], dim=-1).flatten(-2)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]: what the kernel multiplies by (before any rounding)."""
        n, k = self.shape
        q = self.q().float().view(n, k // GROUP, GROUP)
        return ((q - 8) * self.scale[..., None] + self.zero[..., None]).view(n, k)


def q4_from_gguf(raw: np.ndarray, type_name: str, shape: Sequence[int]) -> Q4Weight | None:
    """The codes of a GGUF tensor of type ``Q4_0`` / ``Q4_1`` (``raw``: its bytes as
    uint8 blocks, ``shape``: [N, K] in torch order); None for any other type."""
    if type_name not in ("Q4_0", "Q4_1"):
        return None
    n, k = (int(s) for s in shape)
    if k % GROUP:
        return None
    block_bytes = 18 if type_name == "Q4_0" else 20
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n * k // GROUP, block_bytes)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [B, 1]
    if type_name == "Q4_1":
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        qs = blocks[:, 4:]
        zero = m + 8 * d
    else:
        qs = blocks[:, 2:]
        zero = np.zeros_like(d)
    # A block's 16 bytes hold codes 0..15 in the low nibbles and 16..31 in the high.
    low, high = qs & 0x0F, qs >> 4
    q = np.concatenate([low, high], axis=1).reshape(n, k)  # [N, K] codes 0..15
    codes = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)  # [N, K/2]
    return Q4Weight(
        codes=torch.from_numpy(codes),
        scale=torch.from_numpy(d.reshape(n, k // GROUP)),
        zero=torch.from_numpy(zero.reshape(n, k // GROUP)),
    )


def int4_supported(weight: torch.Tensor) -> bool:
    """Whether a weight of this device and dtype can run packed here."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
    )


class Int4Linear:
    """Several [N_i, K] 4-bit weights run as one packed matmul: ``self(x)`` is
    ``x @ cat(w_i).T`` for x [M, K] in bfloat16."""

    @staticmethod
    def fits(weights: Sequence[Q4Weight]) -> bool:
        """The kernel's shape rules: one K, and a total N that divides by 16."""
        return (
            len({w.shape[1] for w in weights}) == 1 and sum(w.shape[0] for w in weights) % 16 == 0
        )

    def __init__(self, weights: Sequence[Q4Weight], dtype: torch.dtype) -> None:
        if not weights or not self.fits(weights):
            raise ValueError(f"4-bit weights do not fit the kernel: {[w.shape for w in weights]}")
        q = torch.cat([w.q() for w in weights])  # [N, K] int32
        self.out_features = int(q.shape[0])
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        scale = torch.cat([w.scale for w in weights])  # [N, K/32]
        zero = torch.cat([w.zero for w in weights])
        # The kernel's layout: [K / group, N, 2] (scale, zero) in the activation dtype.
        self.scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
        self.scales_and_zeros = self.scales_and_zeros.to(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.packed, GROUP, self.scales_and_zeros
        )
        return y


def attach_q4(model: nn.Module, weights: Mapping[str, Q4Weight]) -> int:
    """Attach 4-bit codes to the Linear modules whose ``<name>.weight`` they belong to,
    tied to the weight tensor as it is now. Returns how many were attached."""
    modules = dict(model.named_modules())
    attached = 0
    for name, q4 in weights.items():
        module = modules.get(name.removesuffix(".weight"))
        if not isinstance(module, nn.Linear) or tuple(module.weight.shape) != q4.shape:
            continue
        setattr(module, _ATTR, (module.weight, _version(module.weight), q4))
        attached += 1
    _attached[0] += 1
    return attached


def attach_epoch() -> int:
    """Changes whenever :func:`attach_q4` attaches codes."""
    return _attached[0]


def q4_of(linear: nn.Linear) -> Q4Weight | None:
    """The codes attached to ``linear``, if its weight is still the one they describe."""
    entry: Any = getattr(linear, _ATTR, None)
    if entry is None or linear.bias is not None:
        return None
    weight, version, q4 = entry
    if weight is not linear.weight or _version(weight) != version:
        return None  # replaced or edited in place since
    return q4


def _version(t: torch.Tensor) -> int:
    return 0 if t.is_inference() else t._version


class ParamWatch:
    """Whether any of some modules' ``weight`` parameters was replaced, moved or
    updated in place, a forward hook was added to some modules, or 4-bit codes were
    attached, since the watch began: what a plan built from those weights checks once
    per step. ``map`` over C getters, no Python-level loop: ~0.1 ms for 300 weights."""

    def __init__(self, owners: Sequence[nn.Module], hooked: Sequence[nn.Module]) -> None:
        self.owners = list(owners)
        self.hooked_modules = list(hooked)
        self.epoch = attach_epoch()
        self.weights = self._weights()  # kept, so their ids cannot be reused
        # inference tensors have no version counter (and cannot be edited in place
        # outside inference mode anyway)
        self.versioned = not any(w.is_inference() for w in self.weights)
        self.state = self._state(self.weights)

    def _weights(self) -> list[torch.Tensor]:
        return list(map(_WEIGHT, map(_PARAMETERS, self.owners)))

    def _state(self, weights: list[torch.Tensor]) -> tuple[list[int], ...]:
        ids = list(map(id, weights))
        ptrs = list(map(torch.Tensor.data_ptr, weights))
        if not self.versioned:
            return ids, ptrs
        return ids, ptrs, list(map(_VERSION, weights))

    def hooked(self) -> bool:
        """Whether a forward (pre-)hook sits on any of the watched modules."""
        return any(map(_HOOKS, self.hooked_modules)) or any(map(_PRE_HOOKS, self.hooked_modules))

    def unchanged(self) -> bool:
        return (
            self.epoch == attach_epoch()
            and self._state(self._weights()) == self.state
            and not self.hooked()
        )


_PARAMETERS = operator.attrgetter("_parameters")
_WEIGHT = operator.itemgetter("weight")
_VERSION = operator.attrgetter("_version")
_HOOKS = operator.attrgetter("_forward_hooks")
_PRE_HOOKS = operator.attrgetter("_forward_pre_hooks")


@contextmanager
def packed_rows(n: int) -> Iterator[None]:
    """Within the block, linears with 4-bit codes run the first ``n`` rows of their
    input packed and the rest dense (``n = 0``: all dense)."""
    token = _packed_rows.set(n)
    try:
        yield
    finally:
        _packed_rows.reset(token)


def packed_row_count(total: int) -> int:
    """How many leading rows of a ``total``-row input run packed: as set by
    :func:`packed_rows`, else all of them for up to :data:`INT4_MAX_ROWS` rows."""
    n = _packed_rows.get()
    if n is None:
        return total if total <= INT4_MAX_ROWS else 0
    return min(n, total)
