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
                for e in parse_ranges(text):
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


def parse_ranges(text: str) -> list[int]:
    """``"0-2,5,7-8" -> [0, 1, 2, 5, 7, 8]`` (a Linux CPU or node list reads the same way)."""
    out: list[int] = []
    for part in filter(None, str(text).split(",")):
        a, _, b = part.partition("-")
        out.extend(range(int(a), int(b or a) + 1))
    return out


# -- budgets, validation, diff, expert grids ---------------------------------------------------

TIER_CPU_COMPUTE = -1
TIER_CPU_STREAM = -2
"""Codes of the expert tier grid: ``k >= 0`` is ``gpu:k``; these two are the CPU modes."""


def tier_code(a: Assignment) -> int:
    """Grid code of an assignment: the GPU index, ``TIER_CPU_COMPUTE`` or ``TIER_CPU_STREAM``."""
    if is_gpu(a.tier):
        return gpu_index(a.tier)
    return TIER_CPU_STREAM if a.mode == "stream" else TIER_CPU_COMPUTE


def code_assignment(code: int) -> Assignment:
    """Inverse of ``tier_code``."""
    if code >= 0:
        return Assignment(gpu(int(code)))
    return CPU_STREAM if code == TIER_CPU_STREAM else CPU_COMPUTE


@dataclass(frozen=True)
class Budget:
    """Memory a placement may use. ``gpu_bytes[i]``: VRAM of ``gpu:i`` (bytes); ``margin``: bytes kept
    free on every GPU (the user's safety margin); ``host_bytes``: host RAM the model may use, or
    ``None`` for no limit."""

    gpu_bytes: tuple[int, ...]
    margin: int = 0
    host_bytes: int | None = None

    def __post_init__(self) -> None:
        if any(b < 0 for b in self.gpu_bytes) or self.margin < 0:
            raise ValueError("budgets and margins are byte counts >= 0")

    @property
    def n_gpus(self) -> int:
        return len(self.gpu_bytes)

    def usable(self, tier: str) -> int | None:
        """Bytes ``tier`` may hold (VRAM minus the margin, never below 0); ``None`` = no limit."""
        if tier == CPU:
            return self.host_bytes
        i = gpu_index(tier)
        if i >= len(self.gpu_bytes):
            return 0
        return max(0, self.gpu_bytes[i] - self.margin)

    @classmethod
    def from_profile(cls, profile, margin: int = 0, vram: int | None = None,
                     host_bytes: int | None = None) -> Budget:
        """Budget of a HardwareProfile; ``vram`` (bytes) overrides every GPU's VRAM."""
        gpus = tuple(vram if vram is not None else g.vram_bytes for g in profile.gpus)
        host = profile.host_ram_bytes if host_bytes is None else host_bytes
        return cls(gpus, margin, host or None)


def validate(placement: Placement, inventory, n_gpus: int | None = None) -> list[str]:
    """Problems of ``placement`` for ``inventory`` (empty when none), one sentence each: assignments
    to units the model does not have, streamed units that are not routed experts, streamed experts
    without stream slots, GPU tiers beyond ``n_gpus``."""
    problems: list[str] = []
    unknown = [k for k in placement.assignments if k not in inventory.units]
    if unknown:
        problems.append(f"{len(unknown)} assignment(s) name units this model does not have, e.g. {unknown[0]}")
    streamed = [k for k, a in placement.assignments.items() if a.mode == "stream"]
    if placement.default.mode == "stream":
        problems.append("the default assignment cannot be 'stream': only routed experts are streamed")
    bad_stream = [k for k in streamed if k.kind != "expert"]
    if bad_stream:
        problems.append(f"only routed experts can be streamed, not {bad_stream[0]}")
    if streamed and placement.stream_slots < 1:
        problems.append(f"{len(streamed)} expert(s) are streamed but the GPU stream cache has no slots")
    if placement.stream_slots < 0:
        problems.append("stream_slots must be >= 0")
    if n_gpus is not None:
        over = sorted(t for t in placement.tiers() if is_gpu(t) and gpu_index(t) >= n_gpus)
        if over:
            problems.append(f"{over[0]} is used but the machine has {n_gpus} GPU(s)")
    return problems


def check_budget(placement: Placement, inventory, budget: Budget, ctx: int = 4096, kv_dtype: str = "f16"):
    """Raise PlacementError unless ``placement`` is valid and every tier fits ``budget``.

    Returns the MemoryEstimate (``core.memory``) it checked, so that callers need not compute it twice.
    """
    from .errors import PlacementError
    from .fmt import bytes2human
    from .memory import estimate_memory

    problems = validate(placement, inventory, budget.n_gpus)
    if problems:
        raise PlacementError("; ".join(problems))
    est = estimate_memory(inventory, placement, ctx, kv_dtype)
    over = []
    for tier in est.tiers:
        limit = budget.usable(tier)
        need = est.total(tier)
        if limit is not None and need > limit:
            margin = f" after a {bytes2human(budget.margin)} margin" if is_gpu(tier) and budget.margin else ""
            over.append(f"{tier} needs {bytes2human(need)} but has {bytes2human(limit)}{margin}")
    if over:
        raise PlacementError("the placement does not fit: " + "; ".join(over))
    return est


def fits(placement: Placement, inventory, budget: Budget, ctx: int = 4096, kv_dtype: str = "f16") -> bool:
    """True when ``check_budget`` passes."""
    from .errors import PlacementError

    try:
        check_budget(placement, inventory, budget, ctx, kv_dtype)
    except PlacementError:
        return False
    return True


def diff(a: Placement, b: Placement, keys: Iterable[UnitKey] | None = None) -> list[tuple[UnitKey, Assignment, Assignment]]:
    """Units whose assignment differs between ``a`` and ``b``: ``[(key, in_a, in_b)]``, sorted.

    ``keys`` (e.g. ``inventory.units``) is needed when the defaults differ; without it only the
    explicitly assigned units are compared.
    """
    if keys is None:
        if a.default != b.default:
            raise ValueError("the placements have different defaults: pass the model's unit keys")
        keys = set(a.assignments) | set(b.assignments)
    return [(k, a.get(k), b.get(k)) for k in sorted(keys) if a.get(k) != b.get(k)]


def expert_grid(placement: Placement, n_layers: int, n_experts: int):
    """Tier codes of every routed expert, numpy int16 ``[layers, experts]`` (see ``tier_code``).
    Cells of units the model does not have carry the default's code."""
    import numpy as np

    grid = np.full((n_layers, n_experts), tier_code(placement.default), dtype=np.int16)
    for key, a in placement.assignments.items():
        if key.kind == "expert" and key.layer is not None and key.layer < n_layers and key.expert < n_experts:
            grid[key.layer, key.expert] = tier_code(a)
    return grid


def with_expert_grid(base: Placement, grid, keys: Iterable[UnitKey]) -> Placement:
    """A copy of ``base`` whose routed experts ``keys`` take the tiers of ``grid`` (``[layers, experts]``
    codes); other units keep ``base``'s assignments."""
    out = base.copy()
    default_code = tier_code(out.default)
    table = {int(c): code_assignment(int(c)) for c in set(grid.ravel().tolist())}
    codes = grid.tolist()
    assignments = out.assignments
    for key in keys:
        code = codes[key.layer][key.expert]
        if code == default_code:
            assignments.pop(key, None)
        else:
            assignments[key] = table[code]
    return out
