"""GGUF headers: metadata key/values and tensor infos, read without touching tensor data.

Layout (little endian): ``b"GGUF"``, ``u32 version`` (2 or 3), ``u64 n_tensors``, ``u64 n_kv``, the
key/values, the tensor infos (name, ``u32 n_dims``, ``u64 ne[n_dims]`` innermost first, ``u32
type``, ``u64 offset``), padding to ``general.alignment`` (32), then the data. Arrays of strings
(the tokenizer's tokens and merges) are skipped by walking their lengths and kept as a lazy
``GGUFStringArray`` that decodes on first use; numeric arrays become lists. Every count and length is checked against the file
size before anything is allocated.
"""

from __future__ import annotations

import mmap
import re
import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..errors import ModelFormatError
from ..ggml_types import tensor_nbytes, type_name
from ..units import TensorInfo

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_SCALARS = {
    0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
    6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8),
}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8",
          11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
MAX_COUNT = 1 << 24
"""No GGUF has more tensors or keys than this; a larger count is corruption."""
MAX_DIMS = 8


class GGUFStringArray(Sequence):
    """An array of strings in a GGUF file, decoded on first access (tokens, merges)."""

    def __init__(self, path: Path, offset: int, count: int):
        self.path, self.offset, self.count = path, offset, count
        self._items: list[str] | None = None

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i):
        return self.materialize()[i]

    def materialize(self) -> list[str]:
        """All strings, decoded (UTF-8, invalid bytes replaced)."""
        if self._items is None:
            with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                pos, items = self.offset, []
                for _ in range(self.count):
                    (n,) = _U64.unpack_from(buf, pos)
                    items.append(bytes(buf[pos + 8:pos + 8 + n]).decode("utf-8", "replace"))
                    pos += 8 + n
            self._items = items
        return self._items

    def __repr__(self) -> str:
        return f"<{self.count} strings>"


class _Cursor:
    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.size, self.path = buf, 0, len(buf), path

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise ModelFormatError(f"{self.path.name} is truncated or corrupt: {what} runs past the end of the file")

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def string(self, what: str) -> str:
        n = self.u64(what)
        self.need(n, what)
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", "replace")
        self.pos += n
        return s

    def value(self, vtype: int, key: str):
        if vtype in _SCALARS:
            fmt, size = _SCALARS[vtype]
            self.need(size, f"value of {key}")
            (v,) = struct.unpack_from(fmt, self.buf, self.pos)
            self.pos += size
            return v
        if vtype == _STRING:
            return self.string(f"value of {key}")
        if vtype == _ARRAY:
            etype, count = self.u32(f"array type of {key}"), self.u64(f"array length of {key}")
            if etype in _NUMPY:
                size = _SCALARS[etype][1]
                self.need(count * size, f"array {key} of {count} values")
                arr = np.frombuffer(self.buf, dtype=_NUMPY[etype], count=count, offset=self.pos)
                self.pos += count * size
                return arr.tolist()
            if etype == _STRING:
                self.need(count * 8, f"array {key} of {count} strings")
                start = self.pos
                buf, size, pos = self.buf, self.size, self.pos
                for _ in range(count):
                    if pos + 8 > size:
                        pos = size + 1
                        break
                    pos += 8 + _U64.unpack_from(buf, pos)[0]
                self.need(pos - self.pos, f"array {key} of {count} strings")
                self.pos = pos
                lazy = GGUFStringArray(self.path, start, count)
                return lazy.materialize() if count <= 64 else lazy
            if etype == _ARRAY:  # arrays of arrays: rare, small
                self.need(count * 12, f"array {key} of {count} arrays")
                return [self.value(_ARRAY, key) for _ in range(count)]
            raise ModelFormatError(f"{self.path.name}: array {key} has unsupported element type {etype}")
        raise ModelFormatError(f"{self.path.name}: key {key} has unknown value type {vtype}")


def read_gguf_header(path: Path) -> tuple[dict, dict[str, TensorInfo]]:
    """Metadata and tensor infos of one GGUF file. Numpy-order shapes, absolute data offsets.

    Raises ModelFormatError for a bad magic or version, absurd counts, unknown types, truncated
    headers and tensors whose data lies past the end of the file.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size < 24:
                raise ModelFormatError(f"{path.name} is not a GGUF file: only {size} bytes")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse(buf, path, size)
    except OSError as e:
        raise ModelFormatError(f"cannot read {path}: {e.strerror or e}") from None


def _parse(buf, path: Path, size: int) -> tuple[dict, dict[str, TensorInfo]]:
    if buf[:4] != b"GGUF":
        raise ModelFormatError(f"{path.name} is not a GGUF file (magic {bytes(buf[:4])!r}, expected b'GGUF')")
    c = _Cursor(buf, path)
    c.pos = 4
    version = c.u32("version")
    if version not in (2, 3):
        raise ModelFormatError(f"{path.name}: GGUF version {version} is not supported (2 and 3 are)")
    n_tensors, n_kv = c.u64("tensor count"), c.u64("key count")
    if n_tensors > MAX_COUNT or n_kv > MAX_COUNT:
        raise ModelFormatError(f"{path.name}: absurd header counts ({n_tensors} tensors, {n_kv} keys): corrupt file")
    if n_tensors * 24 + n_kv * 12 > size:
        raise ModelFormatError(
            f"{path.name} is truncated or corrupt: {n_tensors} tensors and {n_kv} keys do not fit in {size} bytes"
        )
    meta: dict = {"GGUF.version": version}
    for _ in range(n_kv):
        key = c.string("a metadata key")
        meta[key] = c.value(c.u32(f"type of {key}"), key)
    infos = []
    for _ in range(n_tensors):
        name = c.string("a tensor name")
        n_dims = c.u32(f"dimension count of {name}")
        if n_dims > MAX_DIMS:
            raise ModelFormatError(f"{path.name}: tensor {name!r} claims {n_dims} dimensions")
        ne = [c.u64(f"shape of {name}") for _ in range(n_dims)]
        ttype = type_name(c.u32(f"type of {name}"))
        offset = c.u64(f"offset of {name}")
        infos.append((name, tuple(reversed(ne)), ttype, offset))
    align = int(meta.get("general.alignment", 32) or 32)
    if align <= 0 or align & (align - 1):
        raise ModelFormatError(f"{path.name}: general.alignment {align} is not a power of two")
    data_start = (c.pos + align - 1) // align * align
    tensors: dict[str, TensorInfo] = {}
    for name, shape, ttype, offset in infos:
        nbytes = tensor_nbytes(ttype, shape) if shape else tensor_nbytes(ttype, (1,))
        end = data_start + offset + nbytes
        if end > size:
            raise ModelFormatError(
                f"{path.name} is truncated: tensor {name!r} ends at byte {end}, the file has {size}"
            )
        if name in tensors:
            raise ModelFormatError(f"{path.name}: tensor {name!r} appears twice")
        tensors[name] = TensorInfo(name, shape, ttype, nbytes, path, data_start + offset)
    return meta, tensors


_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def gguf_files(path: Path) -> list[Path]:
    """The files of a GGUF model: the file itself, or every part of a split ``*-00001-of-0000N.gguf``."""
    m = _SPLIT.match(path.name)
    if not m:
        return [path]
    count = int(m["count"])
    files = [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ModelFormatError(f"split GGUF {path.name}: missing part(s) {', '.join(missing)}")
    return files


def read_gguf(path: Path) -> tuple[dict, dict[str, TensorInfo], list[Path]]:
    """Metadata (of the first part), tensor infos of all parts, and the part files."""
    files = gguf_files(Path(path))
    meta: dict = {}
    tensors: dict[str, TensorInfo] = {}
    for i, f in enumerate(files):
        m, t = read_gguf_header(f)
        if i == 0:
            meta = m
        dup = set(t) & set(tensors)
        if dup:
            raise ModelFormatError(f"tensor {sorted(dup)[0]!r} appears in two parts of {files[0].name}")
        tensors.update(t)
    expected = meta.get("split.tensors.count")
    if expected is not None and int(expected) != len(tensors):
        raise ModelFormatError(f"{files[0].name}: split header announces {expected} tensors, the parts hold {len(tensors)}")
    return meta, tensors, files
