"""text/gguf_file.py reads what `gguf.GGUFReader` reads: every metadata value and every
tensor's type, shape and bytes, on the embedded model and a tiny written file."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from tokenyard.text.gguf_file import GGUFFile


def _same_as_reader(path: Path) -> None:
    ours = GGUFFile(path)
    reader = gguf.GGUFReader(str(path), "r")
    skip = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}  # the reader's pseudo-keys
    assert set(ours.fields) == set(reader.fields) - skip
    for key, field in reader.fields.items():
        if key in skip:
            continue
        expected = field.contents()
        if field.types == [gguf.GGUFValueType.FLOAT32]:
            expected = float(str(np.float32(expected)))  # shortest repr, by design
        assert ours.fields[key] == expected, key
    assert [t.name for t in ours.tensors] == [t.name for t in reader.tensors]
    for mine, theirs in zip(ours.tensors, reader.tensors, strict=True):
        assert mine.tensor_type == theirs.tensor_type
        assert mine.shape == tuple(int(d) for d in theirs.shape)
        assert mine.n_elements == theirs.n_elements
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape
        assert np.array_equal(mine.data, theirs.data), mine.name


def test_reads_the_embedded_model_like_gguf_reader(embedded_gguf_path: Path) -> None:
    _same_as_reader(embedded_gguf_path)


def test_reads_every_value_type_and_a_quantized_tensor(tmp_path: Path) -> None:
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("s", "héllo")
    writer.add_float32("f", 1e-5)
    writer.add_bool("b", True)
    writer.add_int64("i", -3)
    writer.add_array("strings", ["a", "", "ü"])
    writer.add_array("ints", [1, 2, 3])
    writer.add_array("floats", [0.5, -1.25])
    writer.add_tensor("plain", np.arange(12, dtype=np.float32).reshape(3, 4))
    q = gguf.quants.quantize(np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32),
                             gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blocks", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _same_as_reader(path)
    fields = GGUFFile(path).fields
    assert (fields["s"], fields["f"], fields["b"], fields["i"]) == ("héllo", 1e-5, True, -3)
    assert fields["strings"] == ["a", "", "ü"] and fields["floats"] == [0.5, -1.25]


def test_refuses_a_file_that_is_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x05")  # cut short
    with pytest.raises(ValueError, match="truncated"):
        GGUFFile(path)
    path.write_bytes(b"NOPE" * 8)
    with pytest.raises(ValueError, match="not a GGUF"):
        GGUFFile(path)
