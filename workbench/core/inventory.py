"""Inventory: every unit of a checkpoint with its exact bytes, built from file headers only."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .spec import ModelSpec
from .units import TensorInfo, Unit, UnitKey


@dataclass
class Inventory:
    """What a checkpoint holds.

    ``format`` is ``"safetensors"`` or ``"gguf"``. ``config`` is a Hugging Face style
    ``config.json`` dict (synthesised from metadata for GGUF) so that the engine builds every model
    from one kind of description. ``metadata`` holds the GGUF key/values (arrays of tokens left out)
    or is empty. ``tensors`` maps each file tensor name to its header info; ``units`` maps each
    UnitKey to the tensors or expert slices it owns. Every tensor belongs to exactly one unit
    (a stacked expert tensor is shared out, one slice per expert).
    """

    path: Path
    format: str
    family: str
    spec: ModelSpec
    config: dict
    tensors: dict[str, TensorInfo]
    units: dict[UnitKey, Unit]
    files: list[Path] = field(default_factory=list)
    metadata: dict = field(default_factory=dict)
    fingerprint: str = ""

    @property
    def total_bytes(self) -> int:
        """Sum of the bytes of every tensor in the files."""
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def params_total(self) -> int:
        return sum(t.n_params for t in self.tensors.values())

    def expert_keys(self, layer: int | None = None) -> list[UnitKey]:
        """Routed expert units, sorted, of one layer or of all layers."""
        return sorted(k for k in self.units if k.kind == "expert" and (layer is None or k.layer == layer))

    def units_of_kind(self, kind: str) -> list[Unit]:
        return [self.units[k] for k in sorted(self.units) if k.kind == kind]

    def dtype_mix(self) -> dict[str, int]:
        """Bytes per storage type: ``{"BF16": 1234, "Q4_K": 5678}``."""
        mix: Counter[str] = Counter()
        for t in self.tensors.values():
            mix[t.dtype] += t.nbytes
        return dict(mix.most_common())
