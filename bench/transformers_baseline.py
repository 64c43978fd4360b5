"""Hugging Face transformers ``generate()`` on a GGUF model: the yardstick.

The engine's tokens/s mean little alone; quoted against eager transformers on
the same machine, the same model and the same prompts they are a ratio that
survives a noisy shared box. Greedy, exactly ``max_new_tokens`` per row
(``min_new_tokens`` bans end-of-sequence until then), at batch sizes 1 and 16
by default::

    python -m bench.transformers_baseline --dtype bfloat16     # or: headrace bench baseline

``decode_tok_s`` leaves out the prefill (a 1-token generate is timed and
subtracted), ``tok_s`` is the whole call. Progress goes to stderr per step.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from backends.errors import BadRequest, ClientError
from bench.progress import ProgressBar
from bench.report import report_tool
from bench.roofline import default_gguf
from bench.schedule import make_prompt

__all__ = ["load_model", "main", "measure", "run_baseline"]

DTYPES = ("float32", "bfloat16")


def load_model(gguf: Path, dtype: str, device: str = "cpu") -> tuple[Any, Any]:
    """(model, tokenizer) from a GGUF file, dequantised to ``dtype``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in DTYPES:
        raise BadRequest(f"dtype must be one of {DTYPES}, got {dtype!r}", param="dtype")
    if not gguf.is_file():
        raise BadRequest(f"no GGUF file at {gguf}", param="gguf")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model: Any = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=getattr(torch, dtype))
    tok.padding_side = "left"  # decoder-only: pad before the prompt
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model.to(device).eval(), tok


class _Progress:
    """A StoppingCriteria that never stops, only reports each generated step."""

    def __init__(self, bar: ProgressBar, total: int) -> None:
        self.bar, self.total, self.steps = bar, total, 0

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        import torch

        self.steps += 1
        self.bar.update(self.steps / self.total, f"step {self.steps}/{self.total}",
                        time.monotonic())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _generate(model: Any, inputs: Any, new_tokens: int, pad_id: int,
              bar: ProgressBar | None) -> float:
    import torch
    from transformers import StoppingCriteriaList

    criteria = StoppingCriteriaList([_Progress(bar, new_tokens)] if bar else [])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, stopping_criteria=criteria,
                             pad_token_id=pad_id)
    elapsed = time.perf_counter() - start
    produced = out.shape[1] - inputs["input_ids"].shape[1]
    if produced != new_tokens:
        raise BadRequest(f"generate() made {produced} tokens, expected {new_tokens}")
    return elapsed


def measure(model: Any, tok: Any, batch: int, new_tokens: int, *, prompt_tokens: int = 32,
            seed: int = 0) -> dict[str, Any]:
    """Time one greedy batch of ``batch`` distinct prompts (bench.schedule's)."""
    prompts = [make_prompt(seed, i, prompt_tokens) for i in range(batch)]
    inputs = tok(prompts, return_tensors="pt", padding=True).to(model.device)
    pad = int(tok.pad_token_id)
    _generate(model, inputs, 2, pad, None)  # warm-up at this shape
    prefill = _generate(model, inputs, 1, pad, None)
    bar = ProgressBar(f"transformers batch {batch}")
    total = _generate(model, inputs, new_tokens, pad, bar)
    bar.close(f"{batch * new_tokens / total:.1f} tok/s")
    decode = max(total - prefill, 1e-9)
    return {"batch": batch, "new_tokens": new_tokens, "prompt_len": int(inputs["input_ids"].shape[1]),
            "seconds": total, "prefill_s": prefill, "tok_s": batch * new_tokens / total,
            "decode_tok_s": batch * (new_tokens - 1) / decode,
            "per_stream_decode_tok_s": (new_tokens - 1) / decode}


def run_baseline(*, gguf: Path | None = None, dtype: str = "float32", batches: tuple[int, ...] = (1, 16),
                 max_new_tokens: int = 64, prompt_tokens: int = 32, device: str = "cpu",
                 threads: int | None = None) -> dict[str, Any]:
    import torch
    import transformers

    if max_new_tokens < 2 or any(b < 1 for b in batches):
        raise ClientError("--max-new-tokens must be >= 2 and batch sizes >= 1")
    if threads:
        torch.set_num_threads(threads)
    path = gguf or default_gguf()
    print(f"transformers: loading {path.name} as {dtype} ...", file=sys.stderr)
    model, tok = load_model(path, dtype, device)
    results = [measure(model, tok, b, max_new_tokens, prompt_tokens=prompt_tokens) for b in batches]
    return {"kind": "transformers_baseline", "model": path.name, "dtype": dtype, "device": device,
            "threads": torch.get_num_threads(), "torch": str(torch.__version__),
            "transformers": transformers.__version__, "results": results}


def format_results(doc: dict[str, Any]) -> str:
    lines = [f"transformers generate() {doc['model']} {doc['dtype']} on {doc['device']} "
             f"({doc['threads']} threads)",
             f"{'batch':>5} {'tok/s':>8} {'decode tok/s':>13} {'per stream':>11} {'prefill ms':>11}"]
    lines += [f"{r['batch']:>5} {r['tok_s']:>8.1f} {r['decode_tok_s']:>13.1f} "
              f"{r['per_stream_decode_tok_s']:>11.1f} {r['prefill_s'] * 1e3:>11.1f}"
              for r in doc["results"]]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="headrace bench baseline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", type=Path, help="model file (default: the packaged SmolLM2)")
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, help="torch intra-op threads")
    p.add_argument("--json", dest="json_path", type=Path)
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    return report_tool(
        "baseline",
        lambda: run_baseline(gguf=args.gguf, dtype=args.dtype, batches=tuple(args.batch),
                             max_new_tokens=args.max_new_tokens, prompt_tokens=args.prompt_tokens,
                             device=args.device, threads=args.threads),
        format_results, args.json_path)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
