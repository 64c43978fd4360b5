"""Write a plain Hugging Face copy (bf16 safetensors + tokenizer) of a GGUF model.

Peers such as vLLM's CPU build cannot load GGUF; this turns the default model
(``backends.engine.loader.default_model_path()``) into a directory they can.
Run with the project's virtualenv (transformers + gguf)::

    python bench/peers/dequantise.py OUT_DIR [--gguf FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def dequantise(gguf: Path, out: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # transformers >= 5 keeps GGUF weights packed unless told to unpack them,
    # and then still refuses to save; unpack, then drop the quantiser record
    # so save_pretrained writes a plain bf16 checkpoint.
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16,
        quantization_config=GgufConfig(dequantize=True))
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    if not tok.chat_template:
        raise SystemExit(f"{gguf} carries no chat template; refusing a copy without one")
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    # Some tokenizer versions write the template only to chat_template.jinja;
    # keep it in tokenizer_config.json too so every reader finds it.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("chat_template", tok.chat_template)
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--gguf", type=Path, help="default: the project's default model")
    args = p.parse_args(argv)
    if args.gguf is None:
        from backends.engine.loader import default_model_path

        args.gguf = Path(default_model_path())
    print(f"wrote {dequantise(args.gguf, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
