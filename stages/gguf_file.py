"""A lean GGUF reader: metadata, tensor index and memory-mapped tensor bytes.

``gguf.GGUFReader`` builds a numpy view for every element of every metadata array — for a
49k-token vocabulary that is ~4 s per process, paid by every stage worker. This reader
parses the same header in tens of milliseconds by skipping array contents it is not asked
for; dequantization still goes through ``gguf.quants.dequantize``.

    f = GGUFFile("model.gguf")
    f.fields["llama.block_count"]            # scalars and short arrays
    f.read("blk.0.attn_q.weight", rows=(0, 64))   # float32 numpy (rows, cols)
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MAX_ARRAY_KEPT = 64  # longer arrays (vocabularies, merges) are skipped: only their length is kept


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF order: dims[0] is the innermost (columns)
    qtype: int
    offset: int  # absolute byte offset in the file

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.dims))


class GGUFFile:
    def __init__(self, path: str) -> None:
        self.path = path
        self._mm = np.memmap(path, dtype=np.uint8, mode="r")
        self._pos = 0
        if bytes(self._mm[:4]) != b"GGUF":
            raise ValueError("not a GGUF file (bad magic)")
        self._pos = 4
        version = self._unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version}")
        n_tensors, n_kv = self._unpack("<Q"), self._unpack("<Q")
        self.fields: dict[str, object] = {}
        self.array_lengths: dict[str, int] = {}
        for _ in range(n_kv):
            key = self._string()
            self.fields[key] = self._value(self._unpack("<I"), key)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = tuple(self._unpack("<Q") for _ in range(self._unpack("<I")))
            infos.append((name, dims, self._unpack("<I"), self._unpack("<Q")))
        align = int(self.fields.get("general.alignment", 32))
        start = -(-self._pos // align) * align
        self.tensors = {n: TensorInfo(n, d, t, start + off) for n, d, t, off in infos}

    # ---- header parsing ---------------------------------------------------------------------
    def _unpack(self, fmt: str) -> int | float | bool:
        size = struct.calcsize(fmt)
        (v,) = struct.unpack_from(fmt, self._mm, self._pos)
        self._pos += size
        return v

    def _string(self) -> str:
        n = self._unpack("<Q")
        s = bytes(self._mm[self._pos:self._pos + n]).decode("utf-8", errors="replace")
        self._pos += n
        return s

    def _value(self, vtype: int, key: str) -> object:
        if vtype in _SCALARS:
            return self._unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self._string()
        if vtype != _ARRAY:
            raise ValueError(f"GGUF key {key}: unknown value type {vtype}")
        etype, count = self._unpack("<I"), self._unpack("<Q")
        self.array_lengths[key] = count
        if count <= _MAX_ARRAY_KEPT:
            return [self._value(etype, key) for _ in range(count)]
        self._skip_array(etype, count)
        return None

    def _skip_array(self, etype: int, count: int) -> None:
        if etype in _SCALARS:
            self._pos += struct.calcsize(_SCALARS[etype]) * count
        elif etype == _STRING:  # each string is a u64 length and its bytes
            for _ in range(count):
                (n,) = struct.unpack_from("<Q", self._mm, self._pos)
                self._pos += 8 + n
        else:
            for _ in range(count):
                self._value(etype, "")

    # ---- tensors ----------------------------------------------------------------------------
    def raw(self, name: str, rows: tuple[int, int] | None = None) -> tuple[np.ndarray, int]:
        """The stored bytes of ``name`` (optionally rows [a, b) of it), shaped for dequantize."""
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
        info = self.tensors[name]
        qtype = GGMLQuantizationType(info.qtype)
        block, type_size = GGML_QUANT_SIZES[qtype]
        cols = info.dims[0]
        row_bytes = cols // block * type_size
        n_rows = int(np.prod(info.dims[1:], dtype=np.int64)) if len(info.dims) > 1 else 1
        lo, hi = rows if rows else (0, n_rows)
        data = self._mm[info.offset + lo * row_bytes: info.offset + hi * row_bytes].reshape(hi - lo, row_bytes)
        return data, info.qtype

    def read(self, name: str, rows: tuple[int, int] | None = None) -> np.ndarray:
        """Dequantized float32 (rows, cols); 1-D tensors come back 1-D."""
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize
        data, qtype = self.raw(name, rows)
        info = self.tensors[name]
        out = dequantize(data, GGMLQuantizationType(qtype)).astype(np.float32, copy=False)
        out = out.reshape(len(data), info.dims[0])
        return out.reshape(-1) if len(info.dims) == 1 else out
