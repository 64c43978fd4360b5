"""The model's recommended sampling: the defaults for fields a request leaves unset.

OpenAI's defaults (temperature 1, top_p 1) are far hotter than what small
instruct models are tuned for; a request without ``temperature`` would sample
nonsense. As vLLM does (``--generation-config auto``), the engine fills the
sampling fields a request leaves unset from, in order of precedence::

    EngineConfig.sampling_defaults        the operator's, field by field
      > the checkpoint's recommendation   GGUF ``general.sampling.*`` keys, or
                                          generation_config.json beside safetensors
      > the engine's per-model table      :data:`MODEL_SAMPLING_DEFAULTS` (model cards),
                                          only for a checkpoint that recommends nothing
      > OpenAI's defaults                 temperature 1, top_p 1, top_k and min_p off

``EngineConfig.generation_config = "off"`` skips the middle two. A field the
request sets always wins, including OpenAI's neutral values (``temperature: 1``).

Like vLLM (which reads ``GenerationConfig.to_diff_dict()``), values in
generation_config.json equal to Hugging Face's own defaults (temperature 1.0,
top_p 1.0, top_k 50, repetition_penalty 1.0) are not recommendations: many
files spell out ``top_k: 50`` only because ``save_pretrained`` wrote it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

import msgspec

from backends.engine.config import EngineConfig, SamplingDefaults
from backends.errors import BadRequest

__all__ = [
    "MODEL_SAMPLING_DEFAULTS",
    "ResolvedSampling",
    "from_generation_config",
    "from_gguf_metadata",
    "model_table_defaults",
    "resolve_sampling_defaults",
]

log = logging.getLogger(__name__)

# (lower-case substring of the served model name, defaults, where they come from).
MODEL_SAMPLING_DEFAULTS: tuple[tuple[str, SamplingDefaults, str], ...] = (
    # huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct (and 360M, 1.7B):
    # model.generate(..., temperature=0.2, top_p=0.9, do_sample=True)
    ("smollm2", SamplingDefaults(temperature=0.2, top_p=0.9), "SmolLM2 model card"),
)

_GGUF_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
_HF_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
_HF_DEFAULTS: dict[str, float | int] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 50,
    "repetition_penalty": 1.0,
}


class ResolvedSampling(msgspec.Struct, frozen=True, kw_only=True):
    """The defaults in force and, for ``/v1/models``, where they come from."""

    defaults: SamplingDefaults
    source: str  # "" when OpenAI's defaults apply unchanged

    def payload(self) -> dict[str, Any]:
        return self.defaults.fields()


def from_gguf_metadata(meta: Mapping[str, Any]) -> SamplingDefaults:
    """llama.cpp's ``general.sampling.*`` keys (what ``convert_hf_to_gguf.py``
    copies from generation_config.json)."""
    return _defaults({ours: meta.get(key) for key, ours in _GGUF_KEYS.items()}, "GGUF metadata")


def from_generation_config(config: Mapping[str, Any]) -> SamplingDefaults:
    """A parsed generation_config.json, minus Hugging Face's own defaults."""
    raw = {k: config.get(k) for k in _HF_KEYS if config.get(k) != _HF_DEFAULTS.get(k)}
    return _defaults(raw, "generation_config.json")


def model_table_defaults(model_name: str) -> tuple[SamplingDefaults, str] | None:
    """The engine's own per-model defaults for a served name, if any."""
    name = model_name.lower()
    for pattern, defaults, source in MODEL_SAMPLING_DEFAULTS:
        if pattern in name:
            return defaults, source
    return None


def resolve_sampling_defaults(
    config: EngineConfig, recommended: SamplingDefaults | None, model_name: str
) -> ResolvedSampling:
    """The defaults for ``model_name``: see the module docstring for the order.
    ``recommended`` is the checkpoint's (``Tokenizer.recommended_sampling``)."""
    defaults, sources = SamplingDefaults(), []
    if config.generation_config == "auto":
        if recommended is not None and recommended.fields():
            defaults, sources = recommended, ["the model's generation config"]
        else:
            table = model_table_defaults(model_name)
            if table is not None:
                defaults, sources = table[0], [f"engine default ({table[1]})"]
    if config.sampling_defaults is not None and config.sampling_defaults.fields():
        defaults = config.sampling_defaults.over(defaults)
        sources.insert(0, "engine config")
    return ResolvedSampling(defaults=defaults, source=" over ".join(sources))


def _defaults(raw: Mapping[str, Any], where: str) -> SamplingDefaults:
    """Keep the well-formed values; a model file is a stranger's, so a bad one is
    logged and dropped rather than failing the load."""
    kept: dict[str, float | int] = {}
    for name, value in raw.items():
        if value is None:
            continue
        number = _number(value, integer=name == "top_k")
        if name == "top_k" and number is not None and number < 0:
            number = 0  # -1 and 0 both mean off
        try:
            if number is None:
                raise BadRequest("not a number")
            SamplingDefaults(**{name: number})  # type: ignore[arg-type]
        except BadRequest:
            log.warning("%s: ignoring sampling default %s=%r", where, name, value)
            continue
        kept[name] = number
    return SamplingDefaults(**kept)  # type: ignore[arg-type]


def _number(value: Any, *, integer: bool) -> float | int | None:
    for _ in range(3):  # gguf may give numpy scalars or one-element arrays
        if isinstance(value, list | tuple) and len(value) == 1:
            value = value[0]
        elif not isinstance(value, int | float) and hasattr(value, "item"):
            try:
                value = value.item()
            except (TypeError, ValueError):
                return None
        else:
            break
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    if integer:
        return int(value) if float(value).is_integer() else None
    return float(value)
