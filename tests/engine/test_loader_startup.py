"""The loader's start-up shortcuts give exactly what the slow, reference paths give.

GGUF files are parsed by gguf_file.parse instead of gguf.GGUFReader (40x faster on
the default model), and the model is built on ``meta`` without the torch calls that
import torch._dynamo; see gguf_file.py and model.py for the measurements."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from torch import nn

from backends.engine import gguf_file
from backends.engine.loader import ModelLoadError, default_model_path, read_checkpoint
from backends.engine.model import ModelArgs, Transformer, _embedding, rope_cache
from tests.engine import tiny


def _typed(value: Any) -> Any:
    """A metadata value with the Python type of every element spelled out (1 == True)."""
    if isinstance(value, list):
        return [_typed(v) for v in value]
    return (type(value).__name__, value)


def assert_same_as_gguf_reader(path: Path) -> None:
    fast, ref = gguf_file.parse(path), gguf_file.read_by_reader(path)
    assert list(fast.metadata) == list(ref.metadata)
    for key, value in ref.metadata.items():
        assert _typed(fast.metadata[key]) == _typed(value), key
    assert [t.name for t in fast.tensors] == [t.name for t in ref.tensors]
    for ours, theirs in zip(fast.tensors, ref.tensors, strict=True):
        assert ours.tensor_type == theirs.tensor_type, ours.name
        assert (ours.data.dtype, ours.data.shape) == (theirs.data.dtype, theirs.data.shape)
        np.testing.assert_array_equal(ours.data, theirs.data, err_msg=ours.name)


def _write(path: Path, fill: Any, *, endianess: gguf.GGUFEndian = gguf.GGUFEndian.LITTLE) -> Path:
    w = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    fill(w)
    w.add_tensor("t", np.arange(6, dtype=np.float32).reshape(2, 3))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_the_default_model_parses_as_gguf_reader_parses_it() -> None:
    assert_same_as_gguf_reader(Path(default_model_path()))


@pytest.mark.parametrize("name", ["tiny-f32.gguf", "tiny-q8.gguf"])
def test_tiny_models_parse_as_gguf_reader_parses_them(tiny_dir: Path, name: str) -> None:
    assert_same_as_gguf_reader(tiny_dir / name)


@pytest.mark.parametrize(
    "qtype",
    [gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16,
     gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1],
)
def test_quantised_tensors_parse_as_gguf_reader_parses_them(
    tmp_path: Path, tiny_hf_model: Any, qtype: gguf.GGMLQuantizationType
) -> None:
    assert_same_as_gguf_reader(tiny.write_gguf(tiny_hf_model, tmp_path / "q.gguf", qtype=qtype))


def test_every_metadata_type_parses_as_gguf_reader_parses_it(tmp_path: Path) -> None:
    def fill(w: gguf.GGUFWriter) -> None:
        w.add_uint8("x.u8", 200)
        w.add_int8("x.i8", -5)
        w.add_uint16("x.u16", 60000)
        w.add_int16("x.i16", -300)
        w.add_uint32("x.u32", 4_000_000_000)
        w.add_int32("x.i32", -7)
        w.add_float32("x.f32", 0.1)
        w.add_bool("x.bool", True)
        w.add_uint64("x.u64", 2**63 + 5)
        w.add_int64("x.i64", -(2**40))
        w.add_float64("x.f64", 0.1)
        w.add_string("x.str", "héllo ▁ \n")
        w.add_string("x.empty_str", "")
        w.add_custom_alignment(64)
        w.add_array("x.strs", ["a", "", "ü€", "Ġthe"])
        w.add_array("x.ints", [1, -2, 3])
        w.add_array("x.floats", [0.5, -1.25, 0.1])
        w.add_array("x.bools", [True, False])

    assert_same_as_gguf_reader(_write(tmp_path / "types.gguf", fill))


def test_files_the_fast_parse_declines_are_read_by_gguf_reader(tmp_path: Path) -> None:
    """Big-endian files and arrays of arrays: GGUFReader's result, unchanged."""
    big = _write(tmp_path / "big.gguf", lambda w: w.add_array("x.s", ["a", "bc"]),
                 endianess=gguf.GGUFEndian.BIG)
    nested = _write(tmp_path / "nested.gguf", lambda w: w.add_array("x.n", [[1, 2], [3]]))
    for path in (big, nested):
        with pytest.raises(gguf_file.Declined):
            gguf_file.parse(path)
        got, ref = gguf_file.read(path), gguf_file.read_by_reader(path)
        assert got.metadata == ref.metadata
        np.testing.assert_array_equal(got.tensors[0].data, ref.tensors[0].data)
    assert gguf_file.read(nested).metadata["x.n"] == [1, 2, 3]  # GGUFReader flattens


def test_a_truncated_file_is_still_a_clear_error(tmp_path: Path, tiny_gguf: Path) -> None:
    data = tiny_gguf.read_bytes()
    for cut in (len(data) - 100, 5000, 30):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match="GGUF"):
            read_checkpoint(str(bad))


def test_the_scalar_table_is_gguf_readers() -> None:
    ref = {int(k): v for k, v in gguf.GGUFReader.gguf_scalar_to_np.items()}
    assert ref == gguf_file._SCALARS  # GGUFValueType -> numpy scalar type
    assert (gguf_file._STRING, gguf_file._ARRAY) == (gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY)


def test_the_embedding_draws_what_nn_embedding_draws() -> None:
    """Models built on the CPU from a seed (the tests' random models) are unchanged:
    same weights, and the generator left where nn.Embedding left it."""
    torch.manual_seed(3)
    ref, ref_next = nn.Embedding(50, 8), torch.rand(4)
    torch.manual_seed(3)
    ours, ours_next = _embedding(50, 8), torch.rand(4)
    assert torch.equal(ours.weight, ref.weight) and torch.equal(ours_next, ref_next)
    assert isinstance(ours.weight, nn.Parameter) and ours.weight.requires_grad
    assert (ours.padding_idx, ours.max_norm, ours.sparse) == (None, None, False)


def test_a_model_built_on_meta_has_the_rope_shapes_of_one_built_on_the_cpu() -> None:
    args = ModelArgs(vocab_size=40, dim=32, n_layers=1, n_heads=4, n_kv_heads=2,
                     hidden_dim=64, head_dim=8, max_seq_len=64)
    with torch.device("meta"):
        model = Transformer(args)
    assert model.rope.is_meta and model.rope.shape == rope_cache(args).shape
    assert model.rope.dtype == torch.float32


def test_loading_a_gguf_model_does_not_import_torch_dynamo(tiny_gguf: Path) -> None:
    """torch._dynamo costs 1.4 s of CPU to import; nothing in a load needs it."""
    code = (
        "import sys; from backends.engine.loader import load_model; "
        f"load_model({str(tiny_gguf)!r}); print('torch._dynamo' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120, cwd=Path(__file__).parents[2])
    assert out.stdout.strip() == "False", out.stderr
