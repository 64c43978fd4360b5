"""``headrace bench kernels``: the engine's linear kernels at decode batch sizes.

Times, for the linears of one model (default: the packaged SmolLM2's shapes), a
whole pass over every layer at ``M`` rows with

- ``int4``: packed 4-bit codes (``aten._weight_int4pack_mm_for_cpu``, what the engine
  runs for the decode rows of small batches with GGUF Q4 weights, quant.py);
- ``bf16``: dense bfloat16 prepacked for oneDNN (the engine's dense path up to 32 rows;
  only where oneDNN has bfloat16 kernels, AVX-512 and up: elsewhere ``-``);
- ``fp32``: dense float32 ``F.linear``.

Each layer gets its own weights, so the pass reads as many bytes as a real decode
step instead of re-reading a cached one. Times are the calling thread's CPU time
(``time.thread_time``) with ``--threads 1`` by default, which a noisy shared box
disturbs far less than wall time; the crossover row count is what the engine's
``INT4_MAX_ROWS`` / ``INT4_MAX_SEQS`` come from::

    headrace bench kernels [--rows 1 2 4 8 16 32] [--threads 1] [--json F]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from backends.errors import ClientError
from bench.progress import ProgressBar
from bench.report import dash, report_tool

__all__ = ["SMOLLM2_SHAPES", "main", "measure"]

# (out_features, in_features) of one SmolLM2-135M layer: fused QKV, O, fused gate/up, down.
SMOLLM2_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
_GROUP = 32


def bf16_packed_supported() -> bool:
    """Whether oneDNN has bfloat16 kernels on this CPU (the engine's test too, model.py)."""
    import torch

    return bool(torch.backends.mkldnn.is_available()) and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())  # type: ignore[no-untyped-call]


def _kinds() -> tuple[str, ...]:
    return ("int4", "bf16", "fp32") if bf16_packed_supported() else ("int4", "fp32")


def _weights(shapes: tuple[tuple[int, int], ...], layers: int) -> dict[str, list[list[Any]]]:
    import torch

    kinds = _kinds()
    out: dict[str, list[list[Any]]] = {kind: [] for kind in kinds}
    for _ in range(layers):
        i4, b16, f32 = [], [], []
        for n, k in shapes:
            q = torch.randint(0, 16, (n, k), dtype=torch.int32)
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            scales = (torch.rand(k // _GROUP, n, 2) * 0.01).to(torch.bfloat16)
            i4.append((packed, scales, k))
            dense = torch.randn(n, k) * 0.02
            if "bf16" in kinds:
                b16.append((torch.ops.mkldnn._reorder_linear_weight(dense.to(torch.bfloat16), 1), k))
            f32.append(dense)
        out["int4"].append(i4)
        out["fp32"].append(f32)
        if "bf16" in kinds:
            out["bf16"].append(b16)
    return out


def _pass(kind: str, layers: list[list[Any]], xs: dict[int, Any]) -> None:
    import torch
    import torch.nn.functional as F

    for layer in layers:
        for w in layer:
            if kind == "int4":
                packed, scales, k = w
                torch.ops.aten._weight_int4pack_mm_for_cpu(xs[k], packed, _GROUP, scales)
            elif kind == "bf16":
                packed, k = w
                torch.ops.mkldnn._linear_pointwise(xs[k], packed, None, "none", [], "")
            else:
                F.linear(xs[w.shape[1]].float(), w)


def measure(rows: list[int], *, layers: int = 30, repeats: int = 3, threads: int = 1,
            shapes: tuple[tuple[int, int], ...] = SMOLLM2_SHAPES) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    weights = _weights(shapes, layers)
    bar = ProgressBar("kernels")
    results = []
    for i, m in enumerate(rows):
        xs = {k: torch.randn(m, k).to(torch.bfloat16) for _, k in shapes}
        row: dict[str, Any] = {"rows": m, "bf16_ms": None}
        for kind in weights:
            _pass(kind, weights[kind], xs)  # warm-up
            start = time.thread_time()
            for _ in range(repeats):
                _pass(kind, weights[kind], xs)
            row[f"{kind}_ms"] = (time.thread_time() - start) / repeats * 1e3
        row["int4_speedup_vs_bf16"] = None if row["bf16_ms"] is None else row["bf16_ms"] / row["int4_ms"]
        results.append(row)
        bar.update((i + 1) / len(rows), f"M={m}", time.monotonic())
    bar.close("done")
    return {"kind": "kernels", "layers": layers, "shapes": [list(s) for s in shapes],
            "threads": threads, "torch": str(torch.__version__), "results": results}


def format_results(doc: dict[str, Any]) -> str:
    lines = [f"linears of {doc['layers']} layers, CPU ms per pass ({doc['threads']} thread(s))",
             f"{'rows':>5} {'int4':>8} {'bf16':>8} {'fp32':>8} {'int4 vs bf16':>13}"]
    lines += [f"{r['rows']:>5} {r['int4_ms']:>8.1f} {dash(r['bf16_ms']):>8} {r['fp32_ms']:>8.1f} "
              f"{dash(r['int4_speedup_vs_bf16'], '.2f', 'x'):>13}" for r in doc["results"]]
    if any(r["bf16_ms"] is None for r in doc["results"]):
        lines.append("bf16: - (no oneDNN bfloat16 kernels on this CPU; the engine runs float32 here)")
    return "\n".join(lines)



def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="headrace bench kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", dest="json_path", type=Path)
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)

    def compute() -> dict[str, Any]:
        if min(args.rows) < 1 or args.layers < 1 or args.repeats < 1 or args.threads < 1:
            raise ClientError("--rows, --layers, --repeats and --threads must be >= 1")
        return measure(args.rows, layers=args.layers, repeats=args.repeats, threads=args.threads)

    return report_tool("kernels", compute, format_results, args.json_path)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
