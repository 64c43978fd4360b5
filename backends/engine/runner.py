"""The model runner: owns the device, the weights and the paged KV cache.

The scheduler hands it a list of :class:`ScheduledSeq` ("compute the KV of these
tokens of that sequence"); the runner flattens them into one batch (``input_ids``,
``positions``, ``slot_mapping``, per-sequence block tables), runs ONE forward pass for
all of them, and returns float32 logits for the rows that need sampling. Decode
sequences of a step share one batched attention call (see attention.py), so a step
of 32 decoding sequences costs one pass over the weights, not 32.

Rows are laid out decode-like sequences first (decode tokens, short speculative
spans), prefill chunks after. With at most ``model.packed_seq_limit()`` sequences
decoding (``INT4_MAX_SEQS``, or fewer where native AMX kernels batch better), the
decode rows run through the packed 4-bit weights when the model has them (quant.py;
native.py runs all decode rows natively, with a kernel for few sequences and one for
many) and everything else through the dense ones; the choice depends on how many
sequences decode, not on how many rows they add, so a token is computed the same way
decoded alone, batched with a few others, or verified in a speculative span.

With ``batch_invariant`` (the engine's default), every token of every step is its own
query row (prefill chunks included), and the model computes each with batch-invariant
kernels (invariant.py): one dense kernel on fixed tiles for every linear, never the
4-bit one; where the native kernels apply, all rows through their batched matmul and
the logits through their float32 head. A token then gets the same numbers, bit for bit,
alone or batched, prefilled cold, after a cached prefix, in chunks of any size, or
decoded (a resumed request continues with the same tokens).

The KV cache is one tensor ``[L, 2, num_blocks, block_size, n_kv_heads, head_dim]``;
layer ``i`` gets the views ``kv[i, 0]`` and ``kv[i, 1]``. ``num_blocks`` is the limit
(config.resolve_num_kv_blocks); the tensor is reserved with ``torch.empty`` (on Linux
its pages take no memory until written) and grows resident on demand: before a step
reads or writes a block id past the blocks made ready so far, the runner zeroes the
blocks up to it in chunks of :data:`KV_GROW_BYTES` (masked slots must hold finite
numbers). Block ids stay what the block manager hands out (lowest first), so a
step's data pointers never move, and the resident part never passes the limit.
When the engine goes idle it keeps ``kv_idle_blocks`` resident (the prefix cache
trimmed below them, block_manager.trim) and :meth:`ModelRunner.release_kv` hands the
pages past them back to the OS; they are zeroed again when a step next reaches them.
:meth:`ModelRunner.memory` reports weights, KV reserved / resident and workspace.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import torch

from backends.engine.attention import AttentionMetadata, PrefillSpan
from backends.engine.model import ModelArgs, Transformer
from backends.engine.quant import packed_rows
from backends.engine.scheduler import ScheduledSeq
from frontend.heap import PAGE_SIZE, can_release_pages, release_pages

__all__ = [
    "KV_GROW_BYTES",
    "TORCH_DTYPES",
    "MemoryFootprint",
    "ModelRunner",
    "kv_bytes_per_block",
    "resolve_device",
]

# The KV cache becomes resident in chunks of about this many bytes (at least a block).
KV_GROW_BYTES = 4 << 20

# Spans of up to this many new tokens after a cached context go through the batched
# decode attention (one query row per token) instead of one SDPA call per sequence.
_SHORT_SPAN = 16

# The torch dtype of each dtype name a config or a worker spec gives (the one table).
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """``"auto"``: the first CUDA device when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def kv_bytes_per_block(args: ModelArgs, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V for one block across all layers."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * args.n_layers * block_size * args.n_kv_heads * args.head_dim * itemsize


class MemoryFootprint(msgspec.Struct, frozen=True, kw_only=True):
    """What a runner holds, in bytes. ``weights``: the model's parameters and buffers
    (dense; tied tensors once); ``packed``: 4-bit codes and the native kernels' weight
    layouts beside them; ``kv_reserved``: the KV cache's limit; ``kv_resident``: the
    part of it made ready (zeroed or written) so far; ``workspace``: the native
    kernels' scratch."""

    weights: int
    packed: int
    kv_reserved: int
    kv_resident: int
    kv_blocks: int
    kv_blocks_resident: int
    workspace: int

    def line(self) -> str:
        mib = 1 << 20
        return (
            f"weights {self.weights / mib:.1f} MiB, packed {self.packed / mib:.1f} MiB, "
            f"KV {self.kv_resident / mib:.1f} of {self.kv_reserved / mib:.1f} MiB resident "
            f"({self.kv_blocks_resident}/{self.kv_blocks} blocks), "
            f"workspace {self.workspace / mib:.1f} MiB"
        )


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class ModelRunner:
    def __init__(
        self,
        model: Transformer,
        num_kv_blocks: int,
        block_size: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        batch_invariant: bool = True,
        kv_idle_blocks: int | None = None,
    ) -> None:
        weight = model.tok_embeddings.weight
        self.device = torch.device(device) if device is not None else weight.device
        self.dtype = dtype or weight.dtype
        self.model = model.to(device=self.device, dtype=self.dtype)
        self.model.reset_rope()
        self.model.set_batch_invariant(batch_invariant)
        self.batch_invariant = batch_invariant
        self.args = model.args
        self.block_size = block_size
        self.num_kv_blocks = num_kv_blocks
        a = self.args
        # kv: [L, 2, NB, BS, Hkv, D], reserved; blocks [0, kv_ready) are zeroed or written
        self.kv = torch.empty(
            a.n_layers,
            2,
            num_kv_blocks,
            block_size,
            a.n_kv_heads,
            a.head_dim,
            device=self.device,
            dtype=self.dtype,
        )
        self._kv_views = [(self.kv[i, 0], self.kv[i, 1]) for i in range(a.n_layers)]
        per_block = kv_bytes_per_block(a, block_size, self.dtype)
        self.kv_grow_blocks = max(1, KV_GROW_BYTES // per_block)
        self.kv_ready = 0
        self._ensure_kv(1)  # block 0 pads the decode block tables
        # The most blocks kept resident at idle (release_kv), in whole chunks; all where
        # pages cannot go back (not a CPU tensor, no libc madvise).
        grow = self.kv_grow_blocks
        idle = num_kv_blocks if kv_idle_blocks is None else -(-max(1, kv_idle_blocks) // grow) * grow
        idle = min(idle, num_kv_blocks)
        self.kv_idle_blocks = idle if self.device.type == "cpu" and can_release_pages() else num_kv_blocks

    def release_kv(self, blocks: int) -> int:
        """Hand the memory of block ids from ``blocks`` on back to the OS (madvise
        ``MADV_DONTNEED`` on each layer's K and V pages past them; the part of a page
        shared with a kept block stays): the caller knows no sequence reads them. They
        are zeroed again when a step next reaches them, so the resident part shrinks
        to ``blocks`` rounded up to whole chunks. Returns the blocks ready after."""
        grow = self.kv_grow_blocks
        keep = max(grow, -(-blocks // grow) * grow)  # block 0's chunk always stays
        if keep >= self.kv_ready or self.kv_idle_blocks >= self.num_kv_blocks:
            return self.kv_ready
        page = PAGE_SIZE
        # kv: [L, 2, NB, ...] contiguous, so each (layer, K/V) holds its blocks in one run
        run = self.kv[0, 0].numel() * self.kv.element_size()  # bytes of one run
        per_block = run // self.num_kv_blocks
        base = self.kv.data_ptr()
        for i in range(self.kv.shape[0] * 2):
            start = -(-(base + i * run + keep * per_block) // page) * page
            end = (base + i * run + self.kv_ready * per_block) // page * page
            if end > start:
                release_pages(start, end - start)
        self.kv_ready = keep
        return keep

    def _ensure_kv(self, blocks: int) -> None:
        """Make block ids ``[0, blocks)`` ready (zeroed), growing in whole chunks."""
        if blocks <= self.kv_ready:
            return
        if blocks > self.num_kv_blocks:
            raise ValueError(f"block id {blocks - 1} is past the KV cache's {self.num_kv_blocks} blocks")
        grow = self.kv_grow_blocks
        end = min(self.num_kv_blocks, -(-blocks // grow) * grow)
        self.kv[:, :, self.kv_ready : end].zero_()
        self.kv_ready = end

    def memory(self) -> MemoryFootprint:
        """The runner's footprint now (see :class:`MemoryFootprint`)."""
        from backends.engine.quant import q4_of

        seen: set[int] = set()
        weights = packed = 0
        for t in [*self.model.parameters(), *self.model.buffers()]:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                weights += _nbytes(t)
        for module in self.model.modules():
            q4 = q4_of(module) if isinstance(module, torch.nn.Linear) else None
            extra: list[object] = [q4.codes, q4.scale, q4.zero] if q4 is not None else []
            for group in module.__dict__.values():  # model.LinearGroup's layouts, once built
                int4 = getattr(group, "_int4", None)  # torch's 4-bit kernel's
                extra += [getattr(group, "_packed", None), getattr(int4, "packed", None),
                          getattr(int4, "scales_and_zeros", None)]  # and oneDNN's
            for layout in extra:
                if not isinstance(layout, torch.Tensor):
                    continue
                key = id(layout) if layout.is_mkldnn else layout.data_ptr()  # opaque: no pointer
                if key not in seen:
                    seen.add(key)
                    packed += _nbytes(layout)
        workspace = 0
        plan = self.model.__dict__.get("_fast", {}).get("native")
        if plan:
            packed += sum(_nbytes(t) for t in plan.keep if t.data_ptr() not in seen)
            workspace = _nbytes(plan.work) if plan.work is not None else 0
        per_block = _nbytes(self.kv) // max(1, self.num_kv_blocks)
        return MemoryFootprint(
            weights=weights,
            packed=packed,
            kv_reserved=_nbytes(self.kv),
            kv_resident=per_block * self.kv_ready,
            kv_blocks=self.num_kv_blocks,
            kv_blocks_resident=self.kv_ready,
            workspace=workspace,
        )

    @property
    def max_model_len(self) -> int:
        return self.args.max_seq_len

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @torch.inference_mode()
    def execute(
        self, scheduled: Sequence[ScheduledSeq], logits_per_seq: Sequence[int] | None = None
    ) -> torch.Tensor:
        """One forward pass over every scheduled sequence's new tokens.

        Returns float32 logits ``[N, V]``. By default one row per sequence that needs
        sampling (its last new token), in order. With ``logits_per_seq[i] = k`` the
        last ``k`` new tokens of sequence ``i`` each give a row (speculative
        verification), rows of one sequence contiguous and in position order."""
        if not scheduled:
            return torch.empty(0, self.args.vocab_size, device=self.device)
        counts = (
            list(logits_per_seq)
            if logits_per_seq is not None
            else [int(s.needs_sampling) for s in scheduled]
        )
        if len(counts) != len(scheduled) or any(
            not 0 <= k <= s.num_new_tokens for k, s in zip(counts, scheduled, strict=True)
        ):
            raise ValueError(
                "logits_per_seq must give 0..num_new_tokens rows for each scheduled sequence"
            )
        input_ids, positions, meta, rows = self._prepare(scheduled, counts)
        # Decode rows come first in the flat batch; with few decoding sequences they
        # run through packed 4-bit weights where the model has them (quant.py). The
        # choice depends on how many sequences decode, never on how many rows each
        # adds, so a speculative step picks the same kernels as a plain one.
        plan = self.model.native_plan()  # checked once here for the step's choices
        limit = self.model.packed_seq_limit(plan)
        packed = meta.num_decodes if meta.num_decode_seqs <= limit else 0
        if self.batch_invariant:  # one kernel for every row: dense, or native batched
            packed = 0
        with packed_rows(packed):
            hidden = self.model(input_ids, positions, self._kv_views, meta)  # [T, dim]
        # Which rows are sampled depends on the batch: the dense head, except for the
        # decode rows of a few-sequence native step (the native head, row by row).
        native = (plan, rows < meta.num_decodes) if packed and plan is not None else None
        if self.batch_invariant and plan is not None:  # every row: the native head
            native = (plan, torch.ones_like(rows, dtype=torch.bool))
        with packed_rows(0):
            return self.model.compute_logits(hidden[rows], native)  # [N, V]

    def _prepare(
        self, scheduled: Sequence[ScheduledSeq], counts: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """The flat batch: every decode-like sequence's rows first (decode tokens and
        short spans after a cached context), then the prefill chunks; logits rows in
        the order of ``scheduled``."""
        bs = self.block_size
        # The highest block id this step touches: its blocks must be ready (zeroed)
        # before attention reads their masked slots.
        self._ensure_kv(1 + max((max(s.seq.block_table, default=0) for s in scheduled), default=0))
        for item in scheduled:
            seq, end = item.seq, item.end
            if (
                len(seq.block_table) * bs < end
                or end > self.args.max_seq_len
                or end > len(seq.token_ids)
            ):
                raise ValueError(
                    f"{seq!r}: cannot compute positions [{item.start}, {end}) "
                    f"with {len(seq.block_table)} blocks"
                )
        decoding = [
            i
            for i, it in enumerate(scheduled)
            if self.batch_invariant
            or (it.end - it.start <= _SHORT_SPAN and (it.start > 0 or it.end == 1))
        ]
        is_decode = set(decoding)
        order = decoding + [i for i in range(len(scheduled)) if i not in is_decode]
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        first_row = [0] * len(scheduled)
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSpan] = []
        spans: list[tuple[int, int]] = []  # decode rows of one sequence's tokens
        for i in order:
            item = scheduled[i]
            seq, start, end = item.seq, item.start, item.end
            table = seq.block_table
            first_row[i] = row0 = len(ids)
            ids += seq.token_ids[start:end]
            pos += range(start, end)
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            if i in is_decode:
                # Every token is its own query row of the batched decode attention,
                # over the cache up to its own position (all of the step's K/V is
                # written before attention reads): a token is computed the same way
                # whether it was decoded alone or verified in a speculative span.
                for p in range(start, end):
                    decode_tables.append(table[: -(-(p + 1) // bs)])
                    decode_lens.append(p + 1)
                if end - start > 1:
                    spans.append((row0, len(ids)))
            else:
                block_table = torch.tensor(
                    table[: -(-end // bs)], dtype=torch.int64, device=self.device
                )
                prefills.append(PrefillSpan(row0, len(ids), end, block_table))
        rows: list[int] = []
        for i, (item, count) in enumerate(zip(scheduled, counts, strict=True)):
            last = first_row[i] + item.num_new_tokens
            rows += range(last - count, last)
        width = max((len(t) for t in decode_tables), default=0)
        padded = [t + [0] * (width - len(t)) for t in decode_tables]
        dev = self.device
        context_lens = torch.tensor(decode_lens, dtype=torch.int64, device=dev)
        key_pos = torch.arange(width * bs, dtype=torch.int64, device=dev)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            decode_rows=torch.arange(len(decode_lens), dtype=torch.int64, device=dev),
            decode_block_tables=torch.tensor(padded, dtype=torch.int64, device=dev).view(
                len(padded), width
            ),
            decode_context_lens=context_lens,
            # Additive, as SDPA turns a boolean mask into anyway: once per step, not
            # once per layer.
            decode_mask=torch.zeros(
                len(decode_lens), 1, 1, width * bs, dtype=self.dtype, device=dev
            ).masked_fill_((key_pos[None, :] >= context_lens[:, None])[:, None, None, :], -torch.inf),
            prefills=tuple(prefills),
            num_decode_seqs=len(decoding),
            spans=tuple(spans),
        )
        return (
            torch.tensor(ids, dtype=torch.int64, device=dev),
            torch.tensor(pos, dtype=torch.int64, device=dev),
            meta,
            torch.tensor(rows, dtype=torch.int64, device=dev),
        )
