"""Exact storage sizes of GGML tensor types (GGUF), from gguf-py's type table.

A GGML row of ``n`` elements of a block-quantized type holds ``n / block_size`` blocks of
``type_size`` bytes each; ``n`` must be a multiple of the block size.
"""

from __future__ import annotations

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from .errors import ModelFormatError

TYPE_BY_ID: dict[int, str] = {int(t.value): t.name for t in GGMLQuantizationType}
"""GGML type id (as stored in a GGUF tensor info) -> type name (``"Q4_K"``)."""

BLOCK: dict[str, tuple[int, int]] = {t.name: (int(b), int(s)) for t, (b, s) in GGML_QUANT_SIZES.items()}
"""Type name -> (elements per block, bytes per block)."""


def type_name(type_id: int) -> str:
    """``12 -> "Q4_K"``; an unknown id is a ModelFormatError."""
    try:
        return TYPE_BY_ID[type_id]
    except KeyError:
        raise ModelFormatError(f"unknown GGML tensor type id {type_id}") from None


def tensor_nbytes(type_name_: str, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of GGML type ``type_name_`` and numpy-order ``shape`` (innermost axis last).

    Raises ModelFormatError when the innermost dimension is not a multiple of the type's block size.
    """
    try:
        block, size = BLOCK[type_name_]
    except KeyError:
        raise ModelFormatError(f"GGML type {type_name_} has no known size") from None
    n = 1
    for d in shape:
        n *= int(d)
    inner = int(shape[-1]) if shape else 1
    if inner % block:
        raise ModelFormatError(f"a row of {inner} elements does not fit {type_name_} blocks of {block}")
    return n // block * size


def bytes_per_value(type_name_: str) -> float:
    """Average bytes per element: ``"Q8_0" -> 34 / 32``; accepts lower case (``"q8_0"``, ``"f16"``)."""
    key = type_name_.upper()
    if key not in BLOCK:
        raise ValueError(f"unknown GGML type {type_name_!r}")
    block, size = BLOCK[key]
    return size / block
