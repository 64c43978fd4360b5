"""Model families beyond Llama (families.py) against transformers, in float32.

Each family: a tiny random model built by transformers (2 layers, every weight random,
norms included), saved as safetensors and written as a GGUF file with llama.cpp's
tensor names for its architecture, loaded by our loader and run through the engine's
own paths: one prefill, chunked prefill then decode steps, a prefix-cache hit followed
by a long prefill chunk and by a short span, on the batch-invariant kernels and on the
fast ones. Windows are 5 tokens over 4-token KV blocks and prompts of 28 tokens, so
every path must mask keys that fell out of the window.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from backends.engine.loader import ModelLoadError, load_model
from backends.engine.model import Transformer, permute_qk_from_hf
from backends.engine.runner import ModelRunner
from backends.engine.scheduler import ScheduledSeq
from backends.engine.sequence import SamplingParams, Sequence
from tests.engine import tiny

TOKENS = [(i * 37 + 11) % 260 + 3 for i in range(28)]
COMMON: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
    "bos_token_id": 1, "eos_token_id": tiny.EOS_ID,
}


def _config(family: str) -> PretrainedConfig:
    n = len(tiny.vocab()[0])
    if family == "qwen2":  # Q/K/V biases
        return Qwen2Config(vocab_size=n, **COMMON, rope_theta=10000.0, tie_word_embeddings=False)
    if family == "qwen3":  # QK-norm, head_dim apart from hidden / heads
        return Qwen3Config(vocab_size=n, **COMMON, head_dim=24, tie_word_embeddings=True)
    if family == "mistral":  # every layer windowed
        return MistralConfig(vocab_size=n, **COMMON, sliding_window=5, tie_word_embeddings=False)
    if family == "gemma2":  # soft-capping, local/global, tied and scaled embeddings
        return Gemma2Config(vocab_size=n, **COMMON, head_dim=16, sliding_window=5,
                            query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                            final_logit_softcapping=3.0)
    assert family == "gemma3"  # QK-norm, local/global with two RoPE bases
    return Gemma3TextConfig(vocab_size=n, **COMMON, head_dim=16, sliding_window=5,
                            query_pre_attn_scalar=16,
                            layer_types=["sliding_attention", "full_attention"],
                            rope_parameters={
                                "sliding_attention": {"rope_type": "default",
                                                      "rope_theta": 10000.0},
                                "full_attention": {"rope_type": "default",
                                                   "rope_theta": 1_000_000.0}})


FAMILIES = ["qwen2", "qwen3", "mistral", "gemma2", "gemma3"]


def _hf_model(family: str) -> torch.nn.Module:
    torch.manual_seed(FAMILIES.index(family))
    model = AutoModelForCausalLM.from_config(_config(family), attn_implementation="eager")
    model = model.float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.15)
            if "norm" in name and not family.startswith("gemma"):  # gemma: 1 + weight
                p.add_(1.0)
    return model


_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GEMMA_LAYER = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}


def _write_gguf(model: torch.nn.Module, family: str, path: Path,
                qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32) -> Path:
    """As llama.cpp's convert_hf_to_gguf.py writes it: Mistral as "llama" with q/k rows
    permuted to adjacent pairs, the others under their own name, rotate-half rows
    left as they are, Gemma's norm weights stored as ``1 + weight``."""
    c = model.config
    arch = "llama" if family == "mistral" else family
    gemma = family.startswith("gemma")
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    tokens, types, merges = tiny.vocab()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = c.rope_parameters
    theta = (rope["full_attention"] if family == "gemma3" else rope)["rope_theta"]
    w.add_rope_freq_base(theta)
    w.add_rope_dimension_count(head_dim)
    if getattr(c, "sliding_window", None):
        w.add_sliding_window(c.sliding_window)
    if family == "gemma2":  # a scale apart from head_dim ** -0.5, as a key (llama.cpp
        # derives it from the model size: gemma_attn_scale)
        w.add_attention_scale(c.query_pre_attn_scalar**-0.5)
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    if family == "gemma3":
        w.add_sliding_window_pattern([t == "sliding_attention" for t in c.layer_types])
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(tiny.EOS_ID)
    for name, t in model.state_dict().items():
        x = t.detach().float()
        if gemma and name.endswith("norm.weight"):
            x = x + 1.0
        if name == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "model.norm.weight":
            out = "output_norm.weight"
        elif name == "lm_head.weight":
            if c.tie_word_embeddings:
                continue
            out = "output.weight"
        else:
            _, _, i, rest = name.split(".", 3)
            out = f"blk.{i}." + ((gemma and _GEMMA_LAYER.get(rest)) or _GGUF_LAYER[rest])
            if family == "mistral" and rest == "self_attn.q_proj.weight":
                x = permute_qk_from_hf(x, c.num_attention_heads)
            elif family == "mistral" and rest == "self_attn.k_proj.weight":
                x = permute_qk_from_hf(x, c.num_key_value_heads)
        array = np.ascontiguousarray(x.numpy())
        if array.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(out, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(out, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    name = request.param
    model = _hf_model(name)
    folder = tiny.write_hf(model, tmp_path_factory.mktemp(name) / "hf")
    gguf_path = _write_gguf(model, name, folder.parent / f"{name}.gguf")
    with torch.no_grad():
        expected = model(torch.tensor([TOKENS])).logits[0]  # [28, V]
    return name, folder, gguf_path, expected


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _seq(ids: list[int], blocks: list[int], computed: int = 0) -> Sequence:
    seq = Sequence("s", ids, SamplingParams())
    seq.block_table, seq.num_computed_tokens = blocks, computed
    return seq


def _engine_paths(runner: ModelRunner, expected: torch.Tensor) -> dict[str, float]:
    """The largest relative error of each path against transformers' logits."""
    errs = {}
    # one prefill of the whole prompt, every position's logits
    whole = _seq(TOKENS, list(range(7)))
    errs["prefill"] = _rel(runner.execute([ScheduledSeq(whole, 28)], [28]), expected)
    # a 10-token chunk, then decode steps one token at a time
    seq = _seq(TOKENS[:16], list(range(10, 14)))
    first = runner.execute([ScheduledSeq(seq, 10)], [10])
    seq.num_computed_tokens = 10
    steps = [first]
    for _ in range(6):
        steps.append(runner.execute([ScheduledSeq(seq, 1)], [1]))
        seq.num_computed_tokens += 1
    errs["chunk+decode"] = _rel(torch.cat(steps), expected[:16])
    # prefix-cache hits on seq's first two blocks: a 20-token chunk and a 5-token span,
    # in one step
    long = _seq(TOKENS, [10, 11, 20, 21, 22, 23, 24], computed=8)
    short = _seq(TOKENS[:13], [10, 11, 30, 31], computed=8)
    hits = runner.execute([ScheduledSeq(long, 20), ScheduledSeq(short, 5)], [20, 5])
    errs["prefix-hit"] = max(_rel(hits[:20], expected[8:]), _rel(hits[20:], expected[8:13]))
    return errs


@pytest.mark.parametrize("invariant", [True, False], ids=["invariant", "fast"])
def test_safetensors_logits_match_transformers(family: Any, invariant: bool) -> None:
    name, folder, _, expected = family
    loaded = load_model(str(folder))
    assert loaded.args.family == name and not loaded.args.plain
    runner = ModelRunner(loaded.model, num_kv_blocks=40, block_size=4,
                         batch_invariant=invariant)
    errs = _engine_paths(runner, expected)
    assert max(errs.values()) < 1e-4, errs


def test_gguf_logits_match_transformers(family: Any) -> None:
    name, _, path, expected = family
    loaded = load_model(str(path))
    assert loaded.args.family == ("llama" if name == "mistral" else name)
    for invariant in (True, False):
        runner = ModelRunner(loaded.model, num_kv_blocks=40, block_size=4,
                             batch_invariant=invariant)
        errs = _engine_paths(runner, expected)
        assert max(errs.values()) < 1e-4, (invariant, errs)


def test_family_switches_are_read(family: Any) -> None:
    """What each family's checkpoint turns on, from either format."""
    name, folder, path, _ = family
    for args in (load_model(str(folder)).args, load_model(str(path)).args):
        assert args.attention_bias == (name == "qwen2")
        assert args.qk_norm == (name in {"qwen3", "gemma3"})
        windows = {"mistral": (5, 5), "gemma2": (5, 0), "gemma3": (5, 0)}.get(name, ())
        assert args.sliding_windows == windows
        assert (args.attn_softcap, args.final_softcap) == (
            (2.0, 3.0) if name == "gemma2" else (0.0, 0.0))
        assert args.embed_scale == (8.0 if name.startswith("gemma") else 0.0)
        assert args.tie_embeddings == (name in {"qwen3", "gemma2", "gemma3"})


def test_bfloat16_torch_path_stays_close(family: Any) -> None:
    """bfloat16 takes the torch modules (the native kernels serve plain Llama only) and
    stays within bfloat16 rounding of transformers' float32 logits."""
    _, folder, _, expected = family
    model = load_model(str(folder), dtype=torch.bfloat16).model
    assert model.native_plan() is None
    runner = ModelRunner(model, num_kv_blocks=40, block_size=4)
    logits = runner.execute([ScheduledSeq(_seq(TOKENS, list(range(7))), 28)], [28])
    assert _rel(logits, expected) < 5e-2


def test_window_masks_keys_that_left_it(tmp_path: Path) -> None:
    """The sliding window really cuts: a token 6 positions back changes the last
    logits without a window and leaves them bit for bit as they were with one."""
    model = _hf_model("mistral")
    folder = tiny.write_hf(model, tmp_path / "hf")
    ours = load_model(str(folder)).model
    changed = [9, *TOKENS[1:7]]  # position 0 differs; the last token is at position 6

    def last(m: Transformer, ids: list[int]) -> torch.Tensor:
        runner = ModelRunner(m, num_kv_blocks=8, block_size=4)
        return runner.execute([ScheduledSeq(_seq(ids, [0, 1, 2]), len(ids))])[0]

    # position 6 sees 2..6 in each layer, and position 2 saw 0 in the first: two
    # windowed layers reach 8 positions back
    assert not torch.equal(last(ours, TOKENS[:7]), last(ours, changed))
    far = [9, *TOKENS[1:11]]  # position 10: back to 2 only
    assert torch.equal(last(ours, TOKENS[:11]), last(ours, far))


def test_unsupported_architectures_fail_at_load_naming_them(tmp_path: Path) -> None:
    model = _hf_model("qwen2")
    folder = tiny.write_hf(model, tmp_path / "hf")
    config = (folder / "config.json").read_text().replace("Qwen2ForCausalLM",
                                                          "FalconForCausalLM")
    (folder / "config.json").write_text(config)
    with pytest.raises(ModelLoadError, match="FalconForCausalLM"):
        load_model(str(folder))
    path = tmp_path / "phi.gguf"
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="'phi3'"):
        load_model(str(path))


def test_gemma_gguf_scale_follows_llama_cpp() -> None:
    """llama.cpp's Gemma scale (no query_pre_attn_scalar in a GGUF file): the 27B models
    use dim / heads (Gemma 2 27B: 4608 / 32 = 144, as its query_pre_attn_scalar), the
    others head_dim (256)."""
    from backends.engine.families import gemma_attn_scale

    assert gemma_attn_scale("gemma2", 46, 4608, 32, 128) == 144**-0.5
    assert gemma_attn_scale("gemma2", 42, 3584, 16, 256) == 256**-0.5
    assert gemma_attn_scale("gemma3", 62, 5376, 32, 128) == 168**-0.5


def test_tensor_parallel_serves_every_family_switch() -> None:
    """Two ranks (gloo, real processes) give one rank's logits with every switch on:
    Q/K/V biases shard with their rows; QK-norms, the sandwich norms, windows,
    soft-capping, the scale and the RoPE bases act per head or per token."""
    import dataclasses

    from backends.engine.tp_worker import TPRunner, start_tp
    from tests.engine_tp.models import RandomModel, tiny_args

    args = dataclasses.replace(
        tiny_args(tie=True, bias=True), family="gemma3", qk_norm=True,
        sliding_windows=(3, 0), layer_ropes=((10000.0, 1.0), (1e6, 2.0)), attn_softcap=2.0,
        final_softcap=3.0, attn_scale=0.3, embed_scale=6.9, sandwich_norms=True,
        activation="gelu_tanh")
    build = RandomModel(args, seed=4)
    reference = ModelRunner(build(), 24, 4)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tp = start_tp(build, 2, num_kv_blocks=24, block_size=4, timeout=10.0,
                      startup_timeout=60.0)
        assert isinstance(tp, TPRunner)
        with tp:
            ids = [5, 17, 99, 3, 42, 8, 61, 7, 70, 11, 2, 9]
            for runner_ in (reference, tp):
                seq = _seq(ids, [0, 1, 2])
                first = runner_.execute([ScheduledSeq(seq, 9)], [9])
                seq.num_computed_tokens = 9
                rest = [first]
                for _ in range(3):
                    rest.append(runner_.execute([ScheduledSeq(seq, 1)], [1]))
                    seq.num_computed_tokens += 1
                if runner_ is reference:
                    want = torch.cat(rest)
                else:
                    got = torch.cat(rest)
    finally:
        torch.set_num_threads(threads)
    assert got.shape == want.shape == (12, 101)
    assert _rel(got, want) < 1e-4


def test_engine_greedy_matches_transformers_generate(family: Any) -> None:
    """The whole engine (scheduler, chunked prefill, prefix cache, batched decode):
    greedy tokens as transformers' ``generate`` gives them, for two requests sharing
    a 12-token prefix (the second one hits the first one's cached blocks)."""
    from backends.engine.config import EngineConfig
    from backends.engine.engine import LLMEngine

    name, folder, _, _ = family
    ref = _hf_model(name)
    prompts = [TOKENS[:14], [*TOKENS[:12], 7, 8, 9]]
    want = {}
    for i, p in enumerate(prompts):
        with torch.no_grad():
            out = ref.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False,
                               min_new_tokens=8, eos_token_id=None, pad_token_id=0)
        want[f"r{i}"] = out[0, len(p):].tolist()
    runner = ModelRunner(load_model(str(folder)).model, num_kv_blocks=40, block_size=4)
    config = EngineConfig(num_kv_blocks=40, block_size=4, max_num_batched_tokens=8,
                          max_num_seqs=4)
    engine = LLMEngine(config, runner, eos_token_ids=[])
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    got: dict[str, list[int]] = {"r0": [], "r1": []}
    engine.add_request("r0", prompts[0], params)
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    engine.add_request("r1", prompts[1], params)
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    assert engine.statistics().prefix_hit_rate > 0  # r1 reused r0's first 3 blocks
    assert got == want


def test_qwen_windows_start_at_max_window_layers() -> None:
    """A Qwen2 config with use_sliding_window and no layer_types (older configs):
    the layers from max_window_layers on are windowed; without the flag none is."""
    from backends.engine.families import hf_family_args

    config = {"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 2,
              "hidden_size": 64}
    assert hf_family_args(config, "qwen2", 4)["sliding_windows"] == (0, 0, 32, 32)
    assert "sliding_windows" not in hf_family_args({**config, "use_sliding_window": False},
                                                   "qwen2", 4)


def test_bfloat16_invariant_whatever_the_batch_and_cache(family: Any) -> None:
    """bfloat16 on the batch-invariant kernels: the same request gives the same logits,
    bit for bit, alone, batched with another request, after a prefix-cache hit and
    decoded token by token."""
    _, folder, _, _ = family
    runner = ModelRunner(load_model(str(folder), dtype=torch.bfloat16).model,
                         num_kv_blocks=40, block_size=4)
    alone = runner.execute([ScheduledSeq(_seq(TOKENS, list(range(7))), 28)], [28])
    other = _seq([3, 4, 5, 6, 7, 8, 9], [30, 31])
    batched = runner.execute([ScheduledSeq(other, 7), ScheduledSeq(_seq(TOKENS, list(
        range(10, 17))), 28)], [7, 28])[7:]
    assert torch.equal(alone, batched)
    hit = runner.execute([ScheduledSeq(_seq(TOKENS, [10, 11, 20, 21, 22, 23, 24], 8), 20)],
                         [20])
    assert torch.equal(alone[8:], hit)
    seq = _seq(TOKENS[:12], [10, 11, 25], 8)
    steps = []
    for _ in range(4):
        steps.append(runner.execute([ScheduledSeq(seq, 1)], [1]))
        seq.num_computed_tokens += 1
    assert torch.equal(alone[8:12], torch.cat(steps))


@pytest.mark.parametrize("name", ["qwen2", "gemma2"])
def test_q4_gguf_in_bfloat16_serves_its_codes(name: str, tmp_path: Path) -> None:
    """A Q4_0 file in bfloat16, its 4-bit codes attached as the engine attaches them
    (backend.py): the linears whose rows were not permuted keep their codes (the packed
    decode rows take them where the machine has the int4 kernel), and the logits stay
    within bfloat16 rounding of the dequantised float32 model's."""
    from backends.engine.quant import attach_q4, q4_of

    path = _write_gguf(_hf_model(name), name, tmp_path / "q4.gguf",
                       gguf.GGMLQuantizationType.Q4_0)
    want = ModelRunner(load_model(str(path)).model, num_kv_blocks=40, block_size=4)
    loaded = load_model(str(path), dtype=torch.bfloat16)
    assert attach_q4(loaded.model, loaded.q4) > 0
    attn = loaded.model.layers[0].attention
    assert q4_of(attn.wq) is None and q4_of(attn.wo) is not None  # q rows permuted: dense
    for invariant in (True, False):
        got = ModelRunner(loaded.model, num_kv_blocks=40, block_size=4,
                          batch_invariant=invariant)
        for runner_ in (want, got):
            seq = _seq(TOKENS[:12], [0, 1, 2])
            rows = [runner_.execute([ScheduledSeq(seq, 8)], [8])]
            seq.num_computed_tokens = 8
            for _ in range(4):
                rows.append(runner_.execute([ScheduledSeq(seq, 1)], [1]))
                seq.num_computed_tokens += 1
            if runner_ is want:
                expected = torch.cat(rows)
        assert _rel(torch.cat(rows), expected) < 5e-2


def test_multimodal_gemma3_serves_its_language_model(tmp_path: Path) -> None:
    """A Gemma3ForConditionalGeneration checkpoint (the 4B-27B models): its language
    model, from ``text_config`` and the ``language_model`` tensors, vision tower left
    out, gives the text-only logits transformers gives; a linear RoPE scaling on the
    global layers, as gemma-3-4b has."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    n = len(tiny.vocab()[0])
    text = {**COMMON, "vocab_size": n, "head_dim": 16, "sliding_window": 5,
            "query_pre_attn_scalar": 16, "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0,
                                   "rope_theta": 1_000_000.0}}}
    config = Gemma3Config(text_config=text, mm_tokens_per_image=4, vision_config={
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "image_size": 28, "patch_size": 14})
    torch.manual_seed(7)
    model = Gemma3ForConditionalGeneration._from_config(config, attn_implementation="eager")
    model = model.float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.15)
        expected = model(input_ids=torch.tensor([TOKENS])).logits[0]
    folder = tiny.write_hf(model, tmp_path / "hf")
    loaded = load_model(str(folder))
    assert loaded.args.layer_ropes == ((10000.0, 1.0), (1_000_000.0, 4.0))
    for invariant in (True, False):
        runner = ModelRunner(loaded.model, num_kv_blocks=40, block_size=4,
                             batch_invariant=invariant)
        errs = _engine_paths(runner, expected)
        assert max(errs.values()) < 1e-4, (invariant, errs)
