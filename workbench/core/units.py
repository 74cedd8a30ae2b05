"""Units: the placeable pieces of a model, and the tensors (or tensor slices) each one owns.

A unit is ``(layer, kind, expert)``. ``layer`` is ``None`` for model-wide units (embeddings, the
final norm, lm_head); ``expert`` is the expert index for routed experts and ``None`` otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

KINDS = ("embed", "attn", "router", "shared", "expert", "dense_mlp", "norm", "lm_head")
"""Every unit kind, in the order a decoder meets them."""

_KIND_ORDER = {k: i for i, k in enumerate(KINDS)}


@dataclass(frozen=True)
class UnitKey:
    """Names one unit: ``UnitKey(3, "expert", 17)``, ``UnitKey(3, "attn")``, ``UnitKey(None, "embed")``."""

    layer: int | None
    kind: str
    expert: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in _KIND_ORDER:
            raise ValueError(f"unknown unit kind {self.kind!r}; kinds are {', '.join(KINDS)}")
        if (self.kind == "expert") != (self.expert is not None):
            raise ValueError("an expert index is given for routed experts and only for them")

    def sort_key(self) -> tuple[int, int, int, int]:
        """Order: embed first, then layer by layer (attn, router, shared, experts...), lm_head last."""
        if self.layer is None:
            group = 0 if self.kind == "embed" else 2
            return (group, 0, _KIND_ORDER[self.kind], -1)
        return (1, self.layer, _KIND_ORDER[self.kind], -1 if self.expert is None else self.expert)

    def __lt__(self, other: UnitKey) -> bool:
        return self.sort_key() < other.sort_key()

    def to_json(self) -> dict:
        return {"layer": self.layer, "kind": self.kind, "expert": self.expert}

    @classmethod
    def from_json(cls, obj: dict) -> UnitKey:
        return cls(obj.get("layer"), obj["kind"], obj.get("expert"))

    def __str__(self) -> str:
        where = "model" if self.layer is None else f"layer {self.layer}"
        return f"{where} {self.kind}" + ("" if self.expert is None else f" {self.expert}")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as stored in a file, read from the header only.

    ``shape`` is the logical element shape in numpy (row-major) order, outermost axis first; for a
    GGUF tensor it is the reverse of ggml's ``ne``. ``dtype`` is the file's type name
    (safetensors: ``BF16``, ``F32``...; GGUF: ``F16``, ``Q8_0``, ``Q4_K``, ``MXFP4``...).
    ``offset`` is the absolute byte offset of the data in ``file``; ``nbytes`` its exact size.
    ``params``, when set, overrides the parameter count the shape implies: packed weights stored
    as bytes (safetensors MXFP4 ``*_blocks``: 32 parameters per 16-byte block) and scale
    tensors (``*_scales``, ``weight_scale_inv``: 0 parameters).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    file: Path
    offset: int
    params: int | None = None

    @property
    def n_params(self) -> int:
        if self.params is not None:
            return self.params
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class TensorRef:
    """A whole tensor, or expert ``expert`` of a tensor whose axis 0 stacks the experts.

    A stacked tensor's expert ``e`` is the contiguous byte range
    ``[offset + e * nbytes, offset + (e + 1) * nbytes)`` with ``nbytes = tensor.nbytes // E``.
    """

    tensor: TensorInfo
    expert: int | None = None

    @property
    def n_experts_stacked(self) -> int:
        return 1 if self.expert is None else self.tensor.shape[0]

    @property
    def nbytes(self) -> int:
        return self.tensor.nbytes // self.n_experts_stacked

    @property
    def offset(self) -> int:
        return self.tensor.offset + (0 if self.expert is None else self.expert * self.nbytes)

    @property
    def n_params(self) -> int:
        return self.tensor.n_params // self.n_experts_stacked


@dataclass
class Unit:
    """One placeable unit and the tensors it owns. ``nbytes`` is exact (quantized sizes as stored)."""

    key: UnitKey
    tensors: list[TensorRef] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def n_params(self) -> int:
        return sum(t.n_params for t in self.tensors)

    @property
    def dtypes(self) -> set[str]:
        return {t.tensor.dtype for t in self.tensors}
