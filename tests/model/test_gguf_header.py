"""turnkv's GGUF header reader (turnkv/model/gguf_file.py) against gguf.GGUFReader: the same metadata
values and types, the same tensor table and bytes, and the same dequantized values, on a small file
with every metadata value type and plain and block-quantized tensors; damage is a ModelLoadError."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from turnkv.errors import ModelLoadError
from turnkv.model import gguf_file


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "small.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -5)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ✓")
    writer.add_array("t.ints", [3, -1, 7])
    writer.add_array("t.floats", [0.5, -2.25])
    writer.add_array("t.bools", [True, False, True])
    writer.add_array("t.strs", ["a", "", "ü" * 40])
    writer.add_array("t.empty", [])
    rng = np.random.default_rng(0)
    writer.add_tensor("plain.f32", rng.standard_normal((3, 8)).astype(np.float32))
    writer.add_tensor("plain.f16", rng.standard_normal(16).astype(np.float16))
    for kind in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1):
        values = rng.standard_normal((4, 64)).astype(np.float32)
        writer.add_tensor(f"quant.{kind.name}", gguf.quants.quantize(values, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_metadata_and_tensors_match_gguf_reader(small_gguf):
    ours, theirs = gguf_file.open_reader(small_gguf), gguf.GGUFReader(str(small_gguf))
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.metadata) == list(expected)
    for key, value in expected.items():
        assert ours.metadata[key] == value and type(ours.metadata[key]) is type(value), key
    assert ours.metadata["t.strs"] == ["a", "", "ü" * 40] and ours.metadata["t.u64"] == 2**63 + 5
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.tensor_type == b.tensor_type and a.data.dtype == b.data.dtype, a.name
        assert a.data.shape == tuple(b.data.shape) and np.array_equal(a.data, b.data), a.name
        want = gguf.quants.dequantize(b.data, b.tensor_type)
        got = gguf_file._dequantize(a, chunk=64)  # several calls per tensor
        assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want), a.name


@pytest.mark.parametrize("cut", [0, 3, 12, 40, -1])
def test_a_cut_file_is_a_clear_error(small_gguf, tmp_path, cut):
    data = small_gguf.read_bytes()
    cut_file = tmp_path / "cut.gguf"
    cut_file.write_bytes(data[:cut] if cut >= 0 else data[:-64])
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        gguf_file.open_reader(cut_file)
