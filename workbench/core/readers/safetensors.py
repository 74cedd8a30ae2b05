"""Safetensors headers: tensor names, shapes, dtypes and byte ranges, without reading tensor data.

A safetensors file is ``u64 N`` (little endian), ``N`` bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}}`` and the data; offsets are relative to
the end of the header.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from ..errors import ModelFormatError
from ..units import TensorInfo

DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8,
    "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
}
"""Bytes per element of each safetensors dtype."""

MAX_HEADER_BYTES = 100 * 2**20
"""Largest header accepted (bytes); real ones are a few MB even for 100k tensors."""


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Tensor infos of one ``.safetensors`` file (absolute offsets). Reads only the header.

    Raises ModelFormatError for a truncated file, an oversized or malformed header, an unknown
    dtype or a tensor whose bytes lie past the end of the file.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ModelFormatError(f"{path.name} is not a safetensors file: only {size} bytes")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or n > size - 8:
                raise ModelFormatError(
                    f"{path.name}: header of {n} bytes is larger than "
                    f"{'the file' if n > size - 8 else 'any real header'} (corrupt or not safetensors)"
                )
            raw = f.read(n)
    except OSError as e:
        raise ModelFormatError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ModelFormatError(f"{path.name}: the safetensors header is not valid JSON (corrupt file?)") from None
    if not isinstance(header, dict):
        raise ModelFormatError(f"{path.name}: the safetensors header is not a JSON object")
    data_start = 8 + n
    out: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = entry["dtype"], tuple(entry["shape"])
            begin, end = entry["data_offsets"]
            numel = math.prod(shape)
            if type(numel) is not int or type(begin) is not int or type(end) is not int:
                raise TypeError
        except (KeyError, TypeError, ValueError):
            raise ModelFormatError(f"{path.name}: malformed header entry for tensor {name!r}") from None
        if dtype not in DTYPE_BYTES:
            raise ModelFormatError(f"{path.name}: tensor {name!r} has unknown dtype {dtype!r}")
        if shape and min(shape) < 0:
            raise ModelFormatError(f"{path.name}: tensor {name!r} has a negative dimension")
        if end - begin != numel * DTYPE_BYTES[dtype] or begin < 0:
            raise ModelFormatError(
                f"{path.name}: tensor {name!r} {dtype}{list(shape)} spans {end - begin} bytes, "
                f"expected {numel * DTYPE_BYTES[dtype]}"
            )
        if data_start + end > size:
            raise ModelFormatError(
                f"{path.name} is truncated: tensor {name!r} ends at byte {data_start + end}, "
                f"the file has {size}"
            )
        out[name] = TensorInfo(name, shape, dtype, end - begin, path, data_start + begin, _packed_params(name, dtype, shape))
    return out


def _packed_params(name: str, dtype: str, shape: tuple[int, ...]) -> int | None:
    """Parameters of tensors whose shape does not count them: MXFP4 blocks (U8, 16 bytes = 32 values
    per block, gpt-oss) hold 2 per byte; block scales (``*_scales``, FP8 ``weight_scale_inv``) none."""
    if name.endswith("weight"):
        return None
    if name.endswith("_blocks") and dtype == "U8" and shape and shape[-1] == 16:
        n = 32
        for d in shape[:-1]:
            n *= d
        return n
    if (name.endswith("_scales") and dtype in ("U8", "F8_E8M0")) or name.endswith(("weight_scale_inv", ".weight_scale")):
        return 0
    return None


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of an HF folder: the shards named by ``model.safetensors.index.json``,
    else ``model.safetensors``, else every ``*.safetensors`` file (sorted)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise ModelFormatError(f"{index} is not a valid safetensors index") from None
        files = [folder / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelFormatError(f"{folder}: shard(s) named by the index are missing: {', '.join(missing)}")
        return files
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"{folder} holds no .safetensors file (pickled .bin checkpoints are not read)")
    return files


def read_safetensors_folder(folder: Path) -> tuple[dict[str, TensorInfo], list[Path]]:
    """Tensor infos of all weight files of an HF folder; a name in two files is an error."""
    files = safetensors_files(folder)
    tensors: dict[str, TensorInfo] = {}
    for f in files:
        for name, info in read_safetensors_header(f).items():
            if name in tensors:
                raise ModelFormatError(f"tensor {name!r} is in both {tensors[name].file.name} and {f.name}")
            tensors[name] = info
    return tensors, files
