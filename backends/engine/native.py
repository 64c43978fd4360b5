"""Decode steps over 4-bit weights in one native call (native_decode.c).

A single-stream decode step of SmolLM2-135M in bfloat16 spends ~15-19 ms in torch: the
int4 kernel streams the 4-bit weights at half the memory bandwidth, and ~250 small
tensor ops cost microseconds of dispatch each. :class:`NativeDecode` runs the whole
stack of layers (norms, Q/K/V, RoPE, the KV-cache write, paged attention, SwiGLU,
residuals) as one C function over the GGUF blocks, threads from torch's own OpenMP
pool, and returns the last layer's output; the final norm and the LM head stay in
torch. It serves every decode row of a step, with one of two matmul kernels:

- few sequences (the runner's "packed" rows: at most
  ``Transformer.packed_seq_limit()`` decoding sequences): the weights streamed once,
  each row's input split per block of 32 into two int8 layers (about 16 bits) and
  multiplied by integer dot products (AVX512-VNNI / AVX-VNNI), else in float32;
- many sequences (``batched=True``): each tile of weights dequantised once to
  bfloat16 and multiplied into up to 32 rows at once by AMX tiles, else by AVX512-BF16
  dot products, else in float32. Its cost hardly grows with the rows.

Mixed steps run their decode rows through it apart from the prefill rows
(:func:`backends.engine.attention.split_decodes`), so a decode token is computed the
same way whatever else the step holds.

The two kernels round differently (so do torch's prefill kernels), so a token's bits
depend on which one a step takes: on a CPU with AMX the switch falls between 2 and 3
decoding sequences, elsewhere between 8 and 9. With ``batch_invariant`` (the engine's
default, invariant.py) the runner makes every token of every step a row of this call,
prefill rows included, always with ``batched=True``, and takes the logits from
:meth:`NativeDecode.head`: one kernel for every token, whatever the batch, the cache
state or the chunking.

Numerics: float32 activations and residual stream (the torch path rounds them to
bfloat16 at every op), K/V stored in bfloat16 as the torch path stores them. Each
row's result is independent of the other rows and of the thread count, within each
kernel. Tokens are within bfloat16 rounding of the torch path's, not bit for bit:
logits measured against the float32 model are at least as close as the torch path's
(tests/engine/test_native.py).

The C source is compiled at first use with the system C compiler (``cc -O3
-march=native -fopenmp``) into a per-user cache and loaded with ctypes (which drops the
GIL for the call). No compiler, a failed build, or ``HEADRACE_NATIVE=0``: the torch
path serves, unchanged. ``HEADRACE_NATIVE_AMX=0`` keeps the AMX kernel off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from backends.engine.attention import AttentionMetadata
from backends.engine.quant import GROUP, ParamWatch, Q4Weight, q4_of

if TYPE_CHECKING:
    from backends.engine.model import Transformer

__all__ = ["AMX_FEW_SEQS", "NativeDecode", "NotApplicable", "amx_blocks", "library", "q4_blocks"]

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native_decode.c")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno",
          "-fPIC", "-shared"]
_lock = threading.Lock()
_lib: list[ctypes.CDLL | None] = []  # [] until the first library() call


class NotApplicable(Exception):
    """The model (or this build) cannot take the native decode path."""


class _Layer(ctypes.Structure):
    _fields_ = [
        ("qkv", ctypes.c_void_p), ("out", ctypes.c_void_p),
        ("gate_up", ctypes.c_void_p), ("down", ctypes.c_void_p),
        ("attn_norm", ctypes.c_void_p), ("ffn_norm", ctypes.c_void_p),
        ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
        ("amx_codes", ctypes.c_void_p * 4), ("amx_scales", ctypes.c_void_p * 4),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        ("n_layers", ctypes.c_int), ("dim", ctypes.c_int), ("n_heads", ctypes.c_int),
        ("n_kv_heads", ctypes.c_int), ("head_dim", ctypes.c_int), ("hidden", ctypes.c_int),
        ("block_size", ctypes.c_int), ("eps", ctypes.c_float),
        ("layers", ctypes.POINTER(_Layer)),
    ]


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "headrace"


def _cpu_key() -> str:
    """What ``-march=native`` compiles for: the CPU's model and flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in lines if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(keep)))


def _flags() -> list[str]:
    """The compiler flags, plus any in ``HEADRACE_NATIVE_CFLAGS`` (e.g. ``-mno-avx512vnni
    -mno-avxvnni`` builds the float32 matmuls on a VNNI CPU)."""
    return [*_FLAGS, *os.environ.get("HEADRACE_NATIVE_CFLAGS", "").split()]


def _build(cc: str) -> Path:
    source = SOURCE.read_bytes()
    flags = _flags()
    key = hashlib.sha256(source + " ".join([cc, *flags, _cpu_key()]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"native_decode-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        subprocess.run([cc, *flags, str(SOURCE), "-o", str(out), "-lm"], check=True,
                       capture_output=True, timeout=120)
        os.replace(out, target)  # atomic: concurrent builders each land a whole file
    return target


def library() -> ctypes.CDLL | None:
    """The compiled kernels, built on first use; None where they cannot be."""
    with _lock:
        if _lib:
            return _lib[0]
        lib: ctypes.CDLL | None = None
        # Several builds may be loaded side by side (tests load a float32 one): each
        # build's file is its own, so each load is its own library.
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if os.environ.get("HEADRACE_NATIVE", "1") == "0":
            log.info("native decode kernels disabled (HEADRACE_NATIVE=0)")
        elif cc is None:
            log.warning("no C compiler found: decode steps run through torch only")
        else:
            try:
                lib = ctypes.CDLL(str(_build(cc)))
            except (OSError, subprocess.SubprocessError) as exc:
                detail = getattr(exc, "stderr", b"") or b""
                log.warning("native decode kernels unavailable (%s) %s", exc,
                            detail.decode(errors="replace")[-2000:])
                lib = None
        if lib is not None:
            lib.hr_decode.restype = ctypes.c_int
            lib.hr_decode.argtypes = [
                ctypes.POINTER(_Model), ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
            ]
            lib.hr_head.restype = ctypes.c_int
            lib.hr_head.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                    ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
            lib.hr_amx.restype = ctypes.c_int
            lib.hr_amx.argtypes = []
            lib.hr_work_floats.restype = ctypes.c_long
            lib.hr_work_floats.argtypes = [ctypes.POINTER(_Model), ctypes.c_int, ctypes.c_int,
                                           ctypes.c_int]
        _lib.append(lib)
        return lib


TILE = 4  # output rows per tile (NT in native_decode.c)
# With AMX, steps of more decoding sequences than this take the batched kernel: its
# cost hardly grows with the rows (measured in-process, SmolLM2 bfloat16, per step: 1
# sequence 7.2 ms integer / 8.5 ms AMX, 2: 8.6 / 8.9, 4: 12.7 / 10.1, 8: 21.3 / 11.6).
AMX_FEW_SEQS = 2


def _stacked(
    weights: Sequence[Q4Weight], multiple: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The weights stacked along N, padded with zero rows to a multiple of ``multiple``:
    codes [N', K] uint8 (0..15), d and m [N', K / 32] float16 (``w = d * q + m``; a
    Q4_0 block has ``m = -8 d``)."""
    q = torch.cat([w.q() for w in weights]).to(torch.uint8)
    scale = torch.cat([w.scale for w in weights])  # float32
    offset = torch.cat([w.zero for w in weights]) - 8 * scale  # the file's m, exactly
    pad = -q.shape[0] % multiple
    return tuple(  # type: ignore[return-value]
        torch.nn.functional.pad(t, (0, 0, 0, pad))
        for t in (q, scale.to(torch.float16), offset.to(torch.float16))
    )


def q4_blocks(weights: Sequence[Q4Weight]) -> torch.Tensor:
    """The weights stacked along N in the kernel's layout (see native_decode.c),
    [ceil(N / 4), K / 32, 80] uint8: per tile of 4 rows and block column, the rows'
    float16 d, their float16 m, then their codes. Padding rows are zeros."""
    q, d, m = _stacked(weights, TILE)
    nb = q.shape[1] // GROUP
    q = q.view(-1, TILE, nb, GROUP)
    codes = q[..., :16] | (q[..., 16:] << 4)  # [tiles, 4, nb, 16]
    out = torch.empty(q.shape[0], nb, 5 * 16, dtype=torch.uint8)
    out[..., 0:8] = d.view(-1, TILE, nb).transpose(1, 2).contiguous().view(torch.uint8)
    out[..., 8:16] = m.view(-1, TILE, nb).transpose(1, 2).contiguous().view(torch.uint8)
    out[..., 16:] = codes.transpose(1, 2).reshape(q.shape[0], nb, 64)
    return out


def amx_blocks(weights: Sequence[Q4Weight]) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights stacked along N in the AMX kernel's layout (native_decode.c):
    codes [ceil(N / 16), K / 32, 256] uint8, two per byte (element e of a block's
    16 x 32 pair layout, e = 32 kp + 2 n + j for input 2 kp + j of output n, low nibble
    of byte e for e < 256, high nibble of byte e - 256 above), and float16 scales
    [ceil(N / 16), K / 32, 32] (the 16 outputs' d, then their m)."""
    q, d, m = _stacked(weights, 16)
    nb, tiles = q.shape[1] // GROUP, q.shape[0] // 16
    # [tiles, n 16, nb, kp 16, j 2] -> [tiles, nb, kp, n, j]
    e = q.view(tiles, 16, nb, 16, 2).permute(0, 2, 3, 1, 4).reshape(tiles, nb, 512)
    codes = (e[..., :256] | (e[..., 256:] << 4)).contiguous()
    scales = torch.cat([t.view(tiles, 16, nb).transpose(1, 2) for t in (d, m)], dim=-1)
    return codes, scales.contiguous()


class NativeDecode:
    """The decoder layers of a decode-only step as one native call: what
    ``for layer in model.layers: x = layer(x, rope, kv, meta)`` computes, within
    bfloat16 rounding. Built where every layer is the plain module with 4-bit codes on
    all seven linears, nothing hooks it and the weights are bfloat16 on the CPU;
    :meth:`valid` tells when the weights changed since."""

    def __init__(self, model: Transformer) -> None:
        from backends.engine.model import Attention, FeedForward, TransformerBlock

        lib = library()
        if lib is None:
            raise NotApplicable("no native kernels")
        a = model.args
        weight = model.tok_embeddings.weight
        if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
            raise NotApplicable("serves bfloat16 on the CPU only")
        if (a.dim % GROUP or a.hidden_dim % GROUP or (a.n_heads * a.head_dim) % GROUP
                or a.head_dim % 16 or a.head_dim > 256 or a.n_heads % a.n_kv_heads
                or a.attention_bias):
            raise NotApplicable("shapes")
        self.lib, self.args = lib, a
        self.amx = bool(lib.hr_amx()) and os.environ.get("HEADRACE_NATIVE_AMX", "1") != "0"
        owners: list[nn.Module] = []
        keep: list[torch.Tensor] = []  # what the C structs point into
        groups: list[tuple[list[Q4Weight], ...]] = []  # per layer: qkv, out, gate_up, down
        layers = (_Layer * a.n_layers)()
        self.modules: list[nn.Module] = [model]
        for i, block in enumerate(model.layers):
            if type(block) is not TransformerBlock:
                raise NotApplicable("layer type")
            attn, ffn = block.attention, block.feed_forward
            if type(attn) is not Attention or type(ffn) is not FeedForward:
                raise NotApplicable("layer type")
            parts = [block, block.attention_norm, attn, block.ffn_norm, ffn]
            self.modules += parts
            linears = [attn.wq, attn.wk, attn.wv, attn.wo, ffn.w1, ffn.w3, ffn.w2]
            codes = [q4_of(lin) for lin in linears]
            if any(c is None for c in codes) or block.attention_norm.weight.device.type != "cpu":
                raise NotApplicable("no 4-bit codes")
            q4 = [c for c in codes if c is not None]
            groups.append((q4[0:3], q4[3:4], q4[4:6], q4[6:7]))
            norms = [block.attention_norm.weight.detach().float().contiguous(),
                     block.ffn_norm.weight.detach().float().contiguous()]
            keep += norms
            amx: list[int] = [0] * 8
            if self.amx:
                for part, group in enumerate(groups[-1]):
                    codes_, scales_ = amx_blocks(group)
                    keep += [codes_, scales_]
                    amx[part], amx[4 + part] = codes_.data_ptr(), scales_.data_ptr()
            owners += [*linears, block.attention_norm, block.ffn_norm]
            layers[i] = _Layer(None, None, None, None, *(t.data_ptr() for t in norms), None,
                               None, (ctypes.c_void_p * 4)(*amx[:4]),
                               (ctypes.c_void_p * 4)(*amx[4:]))
        self.watch = ParamWatch(owners, self.modules)
        if self.watch.hooked():
            raise NotApplicable("hooked")
        self.keep, self.layers = keep, layers
        self.model = _Model(a.n_layers, a.dim, a.n_heads, a.n_kv_heads, a.head_dim,
                            a.hidden_dim, 0, a.norm_eps,
                            ctypes.cast(layers, ctypes.POINTER(_Layer)))
        self.kv_seen: tuple[Any, ...] = ()
        self.work: torch.Tensor | None = None
        # The integer kernels' layout (few rows; many rows without AMX), built where a
        # step first needs it: with AMX, the batch-invariant default never reads it.
        self._groups: list[tuple[list[Q4Weight], ...]] | None = groups
        if not self.amx:
            self._lay_out_q4()

    def _lay_out_q4(self) -> None:
        if self._groups is None:
            return
        for i, parts in enumerate(self._groups):
            blocks = [q4_blocks(group) for group in parts]
            self.keep += blocks
            layer = self.layers[i]
            layer.qkv, layer.out, layer.gate_up, layer.down = (t.data_ptr() for t in blocks)
        self._groups = None

    def rewatch(self) -> None:
        """Watch the weights as they are now: after dense.drop_dense emptied the dense
        copies, which the kernels never read (the codes, norms and layouts here are
        unchanged)."""
        self.watch = ParamWatch(self.watch.owners, self.watch.hooked_modules)

    def valid(self) -> bool:
        """Every weight still the one the kernels were built from, nothing hooked."""
        return self.watch.unchanged()

    def head(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """float32 logits [N, V] of bfloat16 ``hidden`` [N, dim] through the head
        ``weight`` [V, dim] (bfloat16, on the CPU): float32 sums of the products, never
        rounded to bfloat16. None where the shapes or dtypes do not fit."""
        v, dim = weight.shape
        if (weight.dtype != torch.bfloat16 or hidden.dtype != torch.bfloat16
                or weight.device.type != "cpu" or dim % GROUP or not weight.is_contiguous()):
            return None
        x = hidden.contiguous()
        out = torch.empty(x.shape[0], v, dtype=torch.float32)
        rc = self.lib.hr_head(weight.data_ptr(), v, dim, x.data_ptr(), x.shape[0],
                              out.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"native head failed ({rc})")
        return out

    def _bind_kv(self, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        seen = tuple((k.data_ptr(), v.data_ptr()) for k, v in kv_caches)
        if seen == self.kv_seen:
            return
        a = self.args
        for i, (k, v) in enumerate(kv_caches):
            for t in (k, v):
                if (t.dtype != torch.bfloat16 or not t.is_contiguous() or t.dim() != 4
                        or tuple(t.shape[2:]) != (a.n_kv_heads, a.head_dim)):
                    raise ValueError(
                        f"native decode needs bfloat16 contiguous KV caches [blocks, block "
                        f"size, {a.n_kv_heads}, {a.head_dim}], got {t.dtype} {tuple(t.shape)}"
                    )
            self.layers[i].k_cache, self.layers[i].v_cache = seen[i]
        self.model.block_size = int(kv_caches[0][0].shape[1])
        self.kv_seen = seen

    def __call__(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        *,
        batched: bool = False,
    ) -> torch.Tensor:
        """x: [B, dim] embeddings of B decode rows -> the last layer's output, in
        x's dtype. ``batched``: the many-sequence matmul kernel (each tile of weights
        dequantised once, AMX / bfloat16 dot products), else the few-sequence one
        (integer dot products, streaming the 4-bit weights)."""
        self._bind_kv(kv_caches)
        if not (batched and self.amx):
            self._lay_out_q4()
        rows = int(x.shape[0])
        hidden = x.float().contiguous()
        cos = rope[0].reshape(rows, -1).contiguous()
        sin = rope[1].reshape(rows, -1).contiguous()
        tables = meta.decode_block_tables.contiguous()
        width = int(tables.shape[1])
        max_context = max(width * self.model.block_size, 1)
        threads = torch.get_num_threads()
        need = int(self.lib.hr_work_floats(ctypes.byref(self.model), rows, max_context, threads))
        if self.work is None or self.work.numel() < need:
            self.work = torch.empty(need, dtype=torch.float32)
        slots = meta.slot_mapping.contiguous()
        context = meta.decode_context_lens.contiguous()
        rc = self.lib.hr_decode(
            ctypes.byref(self.model), rows, hidden.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            slots.data_ptr(), tables.data_ptr(), width, context.data_ptr(), max_context,
            self.work.data_ptr(), threads, int(batched),
        )
        if rc != 0:
            raise RuntimeError(f"native decode failed ({rc})")
        return hidden.to(x.dtype)
