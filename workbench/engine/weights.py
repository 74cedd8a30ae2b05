"""Tensors straight from the model files: zero-copy views of mmap'd safetensors / GGUF data.

``WeightReader.tensor(name)`` returns a CPU tensor that views the file's pages (a read-only
``np.memmap`` + ``torch.from_numpy``; the engine never writes to them) for F32/F16/BF16 and FP8
data, so nothing is allocated until the caller copies it to where it belongs. GGUF block-quantized
types (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, MXFP4...) are dequantized to float32 with gguf-py's
dequantizer, one tensor or one expert slice at a time, so peak host memory stays near the size of
the unit being loaded.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import numpy as np
import torch

from workbench.core.errors import ModelFormatError
from workbench.core.inventory import Inventory
from workbench.core.units import TensorInfo

log = logging.getLogger(__name__)

_PLAIN = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": np.uint16,  # numpy has no bfloat16: read the bits, view them as torch.bfloat16
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
    "F8_E4M3": np.uint8,  # viewed as torch.float8_e4m3fn / float8_e5m2
    "F8_E5M2": np.uint8,
}
_TORCH_VIEW = {"BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class WeightReader:
    """Reads tensors (or expert slices of stacked tensors) of one Inventory from its files."""

    def __init__(self, inventory: Inventory):
        self.inventory = inventory
        self._maps: dict[Path, np.memmap] = {}

    def has(self, name: str) -> bool:
        return name in self.inventory.tensors

    def info(self, name: str) -> TensorInfo:
        try:
            return self.inventory.tensors[name]
        except KeyError:
            raise ModelFormatError(f"{self.inventory.path.name}: tensor {name} is missing") from None

    def _file(self, path: Path) -> np.memmap:
        m = self._maps.get(path)
        if m is None:
            m = np.memmap(path, dtype=np.uint8, mode="r")  # read-only: no commit charge for huge files
            self._maps[path] = m
        return m

    def _bytes(self, name: str, expert: int | None) -> tuple[np.ndarray, tuple[int, ...]]:
        """The stored bytes of tensor ``name`` (of expert ``expert`` of a stacked one: axis 0 dropped)
        as a view of the file, and the logical shape they hold."""
        info = self.info(name)
        shape = tuple(info.shape)
        start, nbytes = info.offset, info.nbytes
        if expert is not None:
            n_exp = shape[0]
            if not 0 <= expert < n_exp:
                raise ModelFormatError(f"{name}: expert {expert} out of range 0..{n_exp - 1}")
            nbytes //= n_exp
            start += expert * nbytes
            shape = shape[1:]
        raw = self._file(info.file)
        if start + nbytes > raw.shape[0]:
            raise ModelFormatError(f"{info.file.name} is truncated: tensor {name} ends past the end of the file")
        return raw[start:start + nbytes], shape

    def tensor(self, name: str, expert: int | None = None) -> torch.Tensor:
        """Tensor ``name`` on the CPU, in its stored dtype (F32/F16/BF16) or dequantized to float32.

        With ``expert`` given, axis 0 of the stored tensor stacks the experts and only expert
        ``expert``'s contiguous byte range is read; the result drops that axis.
        """
        data, shape = self._bytes(name, expert)
        dtype = self.info(name).dtype.upper()
        if dtype in _PLAIN:
            arr = data.view(_PLAIN[dtype]).reshape(shape)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                t = torch.from_numpy(arr)
            return t.view(_TORCH_VIEW[dtype]) if dtype in _TORCH_VIEW else t
        return _dequantize(data, dtype, shape, name)

    def blocks(self, name: str, expert: int | None = None) -> tuple[str, list[torch.Tensor]] | None:
        """A tensor stored in a format the engine keeps (``blocks.FORMATS``), as stored: ``("q8_0",
        [q int8 [..., K], d float16 [..., K/32]])``, ``("q4_k", [raw uint8 [..., K/256*144]])`` or
        ``("q6_k", [raw uint8 [..., K/256*210]])``, or
        None for other storage types. ``expert`` as in ``tensor``."""
        from .blocks import FORMATS

        fmt = FORMATS.get(self.info(name).dtype.upper())
        if fmt is None:
            return None
        data, shape = self._bytes(name, expert)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only views of the file
            if fmt != "q8_0":  # k-quants: the rows' super-blocks as stored
                return fmt, [torch.from_numpy(data.reshape(*shape[:-1], -1))]
            b = data.reshape(-1, 34)  # per block: float16 d, then 32 int8
            d = b[:, :2].copy().view(np.float16).reshape(*shape[:-1], shape[-1] // 32)
            q = b[:, 2:].view(np.int8).reshape(shape)
            return fmt, [torch.from_numpy(q), torch.from_numpy(d)]

    def close(self) -> None:
        self._maps.clear()


def _dequantize(data: np.ndarray, dtype: str, shape: tuple[int, ...], name: str) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    try:
        qtype = GGMLQuantizationType[dtype]
    except KeyError:
        raise ModelFormatError(f"tensor {name} has storage type {dtype}, which the engine cannot read") from None
    n_rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    rows = np.asarray(data).reshape(n_rows, -1)
    try:
        out = dequantize(rows, qtype)
    except NotImplementedError:
        raise ModelFormatError(f"tensor {name}: gguf cannot dequantize {dtype}") from None
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32).reshape(shape))
