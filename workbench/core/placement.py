"""Placement: where every unit of a model lives (tier) and, for experts in RAM, how they are served.

Tiers are ``"gpu:N"`` or ``"cpu"``. A unit on a GPU is ``resident``. A routed expert on the CPU tier
is either ``compute`` (the CPU computes it; activations travel) or ``stream`` (its weights are
copied into a GPU cache of ``stream_slots`` slots per layer when selected). Units without an
explicit assignment take ``default``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from .units import UnitKey

CPU = "cpu"
MODES = ("resident", "compute", "stream")


def gpu(index: int = 0) -> str:
    return f"gpu:{index}"


def is_gpu(tier: str) -> bool:
    return tier.startswith("gpu:")


def gpu_index(tier: str) -> int:
    """``"gpu:1" -> 1``; raises ValueError for the CPU tier."""
    if not is_gpu(tier):
        raise ValueError(f"{tier!r} is not a GPU tier")
    return int(tier.split(":", 1)[1])


@dataclass(frozen=True)
class Assignment:
    """Where one unit lives: ``Assignment("gpu:0")``, ``Assignment("cpu", "compute")``."""

    tier: str
    mode: str = "resident"

    def __post_init__(self) -> None:
        if self.tier != CPU and not (is_gpu(self.tier) and self.tier[4:].isdigit()):
            raise ValueError(f"unknown tier {self.tier!r}: tiers are 'cpu' and 'gpu:N'")
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}: modes are {', '.join(MODES)}")
        if is_gpu(self.tier) and self.mode != "resident":
            raise ValueError("a unit on a GPU is resident")
        if self.tier == CPU and self.mode == "resident":
            object.__setattr__(self, "mode", "compute")

    def __str__(self) -> str:
        return self.tier if is_gpu(self.tier) else f"{self.tier}:{self.mode}"

    @classmethod
    def parse(cls, text: str) -> Assignment:
        """Inverse of ``str()``: ``"gpu:0"``, ``"cpu:compute"``, ``"cpu:stream"``, ``"cpu"``."""
        if text.startswith("gpu:"):
            return cls(text)
        if text == CPU:
            return cls(CPU, "compute")
        tier, _, mode = text.partition(":")
        return cls(tier, mode)


ON_GPU0 = Assignment(gpu(0))
CPU_COMPUTE = Assignment(CPU, "compute")
CPU_STREAM = Assignment(CPU, "stream")


@dataclass
class Placement:
    """Maps every unit to an Assignment. The one thing the GUI edits, the planner produces, the
    engine executes, the project file saves and the exporters translate."""

    default: Assignment = ON_GPU0
    assignments: dict[UnitKey, Assignment] = field(default_factory=dict)
    stream_slots: int = 0

    def get(self, key: UnitKey) -> Assignment:
        return self.assignments.get(key, self.default)

    __getitem__ = get

    def set(self, key: UnitKey, assignment: Assignment) -> None:
        if assignment == self.default:
            self.assignments.pop(key, None)
        else:
            self.assignments[key] = assignment

    def move(self, keys: Iterable[UnitKey], assignment: Assignment) -> None:
        for key in keys:
            self.set(key, assignment)

    def copy(self) -> Placement:
        return Placement(self.default, dict(self.assignments), self.stream_slots)

    def tiers(self) -> set[str]:
        return {self.default.tier} | {a.tier for a in self.assignments.values()}

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Placement):
            return NotImplemented
        keys = set(self.assignments) | set(other.assignments)
        return self.stream_slots == other.stream_slots and all(self.get(k) == other.get(k) for k in keys)

    # -- JSON: assignments grouped by value, experts as compact ranges ---------------------------

    def to_json(self) -> dict:
        groups: dict[str, dict] = {}
        for key in sorted(self.assignments):
            g = groups.setdefault(str(self.assignments[key]), {"experts": {}, "units": []})
            if key.kind == "expert":
                g["experts"].setdefault(str(key.layer), []).append(key.expert)
            else:
                g["units"].append([key.layer, key.kind])
        out = {}
        for name, g in groups.items():
            entry: dict = {}
            if g["experts"]:
                entry["experts"] = {layer: _ranges(ix) for layer, ix in g["experts"].items()}
            if g["units"]:
                entry["units"] = g["units"]
            out[name] = entry
        return {"default": str(self.default), "stream_slots": self.stream_slots, "assign": out}

    @classmethod
    def from_json(cls, obj: dict) -> Placement:
        p = cls(Assignment.parse(obj.get("default", "gpu:0")), {}, int(obj.get("stream_slots", 0)))
        for name, entry in obj.get("assign", {}).items():
            a = Assignment.parse(name)
            for layer, text in entry.get("experts", {}).items():
                for e in _parse_ranges(text):
                    p.set(UnitKey(int(layer), "expert", e), a)
            for layer, kind in entry.get("units", []):
                p.set(UnitKey(layer, kind), a)
        return p


def _ranges(ix: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8] -> "0-2,5,7-8"``."""
    ix = sorted(ix)
    parts, start = [], None
    for i, e in enumerate(ix):
        if start is None:
            start = e
        if i + 1 == len(ix) or ix[i + 1] != e + 1:
            parts.append(str(start) if start == e else f"{start}-{e}")
            start = None
    return ",".join(parts)


def _parse_ranges(text: str) -> list[int]:
    out: list[int] = []
    for part in filter(None, str(text).split(",")):
        a, _, b = part.partition("-")
        out.extend(range(int(a), int(b or a) + 1))
    return out
