"""A GGUF file's metadata as Python values and its tensors as views of one memory map.

`gguf.GGUFReader` makes numpy views of every element of every metadata array: about 28 s
on this machine for Gemma 3's vocabulary (262,144 tokens, scores and types), a few
seconds for SmolLM2's. Reading the same header with `struct` takes a fraction of a
second. Torch-free: the HTTP process reads tokenizers with it too.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
#: numpy element types of unquantized tensors; every other type is read as uint8 blocks.
_PLAIN_TENSORS = {
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: `shape` in GGUF order (fastest dimension first), `data` a read-only
    view in numpy order: values for F32/F16/..., uint8 [..., bytes per row] for blocks."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    n_elements: int
    data: np.ndarray[Any, Any]


class GGUFFile:
    """A GGUF v2/v3 file: `fields` (key -> str, int, float, bool or list) and `tensors`.

    float32 scalars come back as their shortest repr (1e-05, not 9.99999974e-06), as a
    Hugging Face config writes them. Raises ValueError for a file that is not GGUF v2/v3,
    is cut short, or names an unknown value or tensor type.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with self.path.open("rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        try:
            if bytes(self._map[:4]) != b"GGUF":
                raise ValueError(f"{path} is not a GGUF file (missing 'GGUF' magic)")
            self._pos = 4
            if self._take("<I") not in (2, 3):
                raise ValueError(f"{path} is not a GGUF v2/v3 file")
            n_tensors, n_fields = self._take("<Q"), self._take("<Q")
            self.fields: dict[str, Any] = {}
            for _ in range(n_fields):
                key = self._string()
                self.fields[key] = self._value(GGUFValueType(self._take("<I")))
            infos = [self._tensor_info() for _ in range(n_tensors)]
        except (struct.error, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: damaged or truncated GGUF header ({exc})") from exc
        alignment = int(self.fields.get("general.alignment", _DEFAULT_ALIGNMENT))
        start = -(-self._pos // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in infos]

    def _take(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        size = self._take("<Q")
        end = self._pos + size
        if end > len(self._map):
            raise ValueError(f"{self.path}: GGUF string runs past the end of the file")
        text = self._map[self._pos:end].decode("utf-8")
        self._pos = end
        return text

    def _value(self, kind: GGUFValueType) -> Any:
        if kind == GGUFValueType.STRING:
            return self._string()
        if kind == GGUFValueType.ARRAY:
            item, count = GGUFValueType(self._take("<I")), self._take("<Q")
            if item in _SCALARS:
                dtype = np.dtype(_SCALARS[item])
                values = np.frombuffer(self._map, dtype, count, self._pos)
                self._pos += count * dtype.itemsize
                return values.tolist()
            return [self._value(item) for _ in range(count)]
        value = self._take(_SCALARS[kind])
        if kind == GGUFValueType.FLOAT32:
            return float(str(np.float32(value)))
        return value

    def _tensor_info(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self._string()
        dims = tuple(self._take("<Q") for _ in range(self._take("<I")))
        return name, dims, GGMLQuantizationType(self._take("<I")), self._take("<Q")

    def _tensor(
        self, start: int, name: str, dims: tuple[int, ...], kind: GGMLQuantizationType,
        offset: int,
    ) -> GGUFTensor:
        n_elements = int(np.prod(dims)) if dims else 1
        shape = tuple(reversed(dims))
        if kind in _PLAIN_TENSORS:
            dtype = np.dtype(_PLAIN_TENSORS[kind])
            count = n_elements
        else:
            block, size = GGML_QUANT_SIZES[kind]
            dtype, count = np.dtype(np.uint8), n_elements // block * size
            shape = (*shape[:-1], shape[-1] // block * size)
        if start + offset + count * dtype.itemsize > len(self._map):
            raise ValueError(f"{self.path}: tensor {name} runs past the end of the file")
        data = np.frombuffer(self._map, dtype, count, start + offset).reshape(shape)
        return GGUFTensor(name, kind, dims, n_elements, data)
