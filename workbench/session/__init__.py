"""The app state without Qt: open model, placement, stats, hardware, project, engine and chat.

A :class:`Session` owns everything the window shows; views subscribe to ``session.events``
(psygnal) and keep no state of their own. Every placement edit goes through a Session method
(``move_units``, ``set_assignments``, ``set_placement``) so that the GUI's undo commands, the
planner buttons and scripts change the model the same way.

Blocking work (reading headers, loading the engine, profiling, generating) is done by plain
methods that take ``progress``/``cancel`` arguments; the GUI runs them in worker threads. Methods
that change the state are fast and meant for the GUI thread, except the generation and profile
jobs, which emit their events from the worker thread (the GUI re-queues them onto its own thread).
"""

from __future__ import annotations

import logging
import math
import threading
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from psygnal import Signal, SignalGroup

from workbench.core.costmodel import model_prompt_pair_reads
from workbench.core.errors import PlacementError, WorkbenchError
from workbench.core.fmt import bytes2human
from workbench.core.hardware import HardwareProfile
from workbench.core.inventory import Inventory
from workbench.core.placement import CPU, Assignment, Placement, gpu_index, is_gpu
from workbench.core.stats import ExpertStats
from workbench.core.units import UnitKey
from workbench.session import services
from workbench.session.chat import ChatMessage, ChatMixin, ChatState

__all__ = ["ChatMessage", "ChatState", "Prediction", "Session", "SessionEvents", "code_assignment", "tier_code"]

log = logging.getLogger(__name__)

DEFAULT_MARGIN = 1 << 30
"""Bytes kept free on every device by default (1 GiB)."""

MEASURE_GRAIN = 64 << 20
"""Measured free memory is rounded down to this many bytes (64 MiB) so that budgets and predictions
are not recomputed for every small fluctuation."""

TIER_CPU_COMPUTE = 0
TIER_CPU_STREAM = 1
TIER_GPU0 = 2
"""Codes of :meth:`Session.tier_grid`: 0 = CPU compute, 1 = CPU stream, 2 + N = ``gpu:N``."""


def tier_code(a: Assignment) -> int:
    if is_gpu(a.tier):
        return TIER_GPU0 + gpu_index(a.tier)
    return TIER_CPU_STREAM if a.mode == "stream" else TIER_CPU_COMPUTE


def code_assignment(code: int) -> Assignment:
    if code >= TIER_GPU0:
        return Assignment(f"gpu:{code - TIER_GPU0}")
    return Assignment(CPU, "stream" if code == TIER_CPU_STREAM else "compute")


@dataclass
class Prediction:
    """What a placement would cost. ``memory`` is a ``core.memory.MemoryEstimate`` (None when
    the model has none), ``decode_tps``/``prefill_tps`` tokens per second (NaN when unknown),
    ``budgets`` bytes per tier, ``over`` one sentence per tier over its budget."""

    memory: object | None = None
    decode_tps: float = math.nan
    prefill_tps: float = math.nan
    budgets: dict[str, int] = field(default_factory=dict)
    over: dict[str, str] = field(default_factory=dict)

    def tier_total(self, tier: str) -> int | None:
        tiers = getattr(self.memory, "tiers", None) or {}
        t = tiers.get(tier)
        return None if t is None else int(t.total)


class SessionEvents(SignalGroup):
    model_opened = Signal(object)  # Inventory
    placement_changed = Signal(object)  # Placement
    stats_changed = Signal(object)  # counts [n_layers, n_experts] float64
    prediction_changed = Signal(object)  # Prediction
    hardware_changed = Signal(object)  # HardwareProfile | None
    budgets_changed = Signal(object)  # dict tier -> bytes
    settings_changed = Signal()  # ctx, kv_dtype, margin
    project_changed = Signal(object, bool)  # path | None, dirty
    engine_state = Signal(str, str)  # "none"|"loading"|"ready"|"busy"|"error", message
    chat_changed = Signal()
    generation_started = Signal()
    generation_token = Signal(str, float)  # text delta, decode tokens/s so far
    generation_finished = Signal(object)  # ChatMessage of the reply
    message = Signal(str)  # a one-line status for the user


class Session(ChatMixin):
    """Everything the workbench knows; see the module docstring."""

    def __init__(self) -> None:
        self.events = SessionEvents()
        self.inventory: Inventory | None = None
        self.placement = Placement()
        self.stats: ExpertStats | None = None  # routing counts per layer x expert
        self.stats_source = ""  # "profiled", "live", "project"
        self.hardware: HardwareProfile | None = None
        self.hardware_note = ""  # why the profile is a preset (no GPU, no NVML...)
        self.measured: dict[str, tuple[int, int]] = {}  # tier -> (total, free) bytes, NVML / psutil
        self.margin = DEFAULT_MARGIN  # bytes kept free on every GPU (the user sets it)
        self.host_margin = DEFAULT_MARGIN  # bytes of host RAM kept free
        self.sampler = None  # telemetry.sampler.Sampler once detect_hardware ran
        self.ctx = 4096
        self.kv_dtype = "f16"
        self.project_path: Path | None = None
        self.dirty = False
        self.engine = None
        self.engine_placement: Placement | None = None
        self.chat = ChatState()
        self._prediction: Prediction | None = None
        self._unit_bytes: dict[UnitKey, int] = {}
        self._moe_layers: list[int] = []
        self.live_stats: ExpertStats | None = None
        self.live_view = True
        self._live_baseline: np.ndarray | None = None
        self._chat_runtime = None
        self.tps_times: deque[float] = deque(maxlen=4096)
        self.tps_values: deque[float] = deque(maxlen=4096)
        self._lock = threading.Lock()

    # -- model -------------------------------------------------------------------------------

    @property
    def moe_layers(self) -> list[int]:
        """Layers that have routed experts: the rows of the experts grid."""
        return self._moe_layers

    @property
    def n_experts(self) -> int:
        return self.inventory.spec.n_experts if self.inventory is not None else 0

    def set_model(self, inv: Inventory, placement: Placement | None = None) -> None:
        """Make ``inv`` the open model (GUI thread; read it first with :func:`services.open_model`)."""
        self.close_engine()
        self.inventory = inv
        self._unit_bytes = {k: v[0] for k, v in services.unit_sizes(inv).items()}
        self._moe_layers = sorted({k.layer for k in inv.units if k.kind == "expert"})
        self.placement = placement.copy() if placement is not None else services.default_placement(inv)
        self.stats = None
        self.live_stats = None
        self.stats_source = ""
        self.chat = ChatState()
        self.project_path = None
        self.dirty = False
        self._prediction = self.predict()
        self.events.model_opened.emit(inv)
        self.events.placement_changed.emit(self.placement)
        self.events.stats_changed.emit(self.stats)
        self.events.chat_changed.emit()
        self._project_changed()
        self.events.prediction_changed.emit(self._prediction)

    def unit_bytes(self, key: UnitKey) -> int:
        """Bytes of one unit as stored (0 for a unit the model lacks)."""
        return self._unit_bytes.get(key, 0)

    # -- placement edits (every edit goes through these; the GUI wraps them in undo commands) -

    def tiers(self) -> list[str]:
        """The tiers one can place units on: every GPU of the hardware profile, then ``cpu``."""
        n = len(self.hardware.gpus) if self.hardware is not None else 0
        used = {t for t in self.placement.tiers() if is_gpu(t)}
        n = max(n, max((gpu_index(t) + 1 for t in used), default=0), 1)
        return [f"gpu:{i}" for i in range(n)] + [CPU]

    def check_move(self, keys: list[UnitKey], assignment: Assignment) -> tuple[Prediction, str]:
        """Predict ``move_units(keys, assignment)`` without doing it. Returns the prediction and
        the reason it would be refused ("" if it is allowed): a tier whose bytes grow past its
        budget. Units not in the model refuse the move too."""
        assert self.inventory is not None
        missing = [k for k in keys if k not in self.inventory.units]
        if missing:
            return Prediction(), f"{missing[0]} is not in this model"
        before = self.prediction()
        pred = self._predict_changes(before, dict.fromkeys(keys, assignment))
        for tier, reason in pred.over.items():
            grew = (pred.tier_total(tier) or 0) > (before.tier_total(tier) or 0)
            if grew:
                return pred, reason
        return pred, ""

    def _predict_changes(self, before: Prediction, changes: dict[UnitKey, Assignment]) -> Prediction:
        """The prediction of the current placement with ``changes`` applied.

        When only routed experts move between tiers already in use, none of them streamed, the
        memory is the current estimate plus the bytes moved and the speed comes from the cost
        model's decode alone (milliseconds at 94 x 256: drag feedback and drops stay fluid;
        prefill is left unknown). Otherwise the full prediction."""
        trial = self.placement.copy()
        for k, a in changes.items():
            trial.set(k, a)
        mem = before.memory
        simple = mem is not None and all(
            k.kind == "expert" and a.mode != "stream" and a.tier in mem.tiers and self.placement.get(k).mode != "stream"
            for k, a in changes.items()
        )
        if not simple:
            return self.predict(trial)
        tiers = {name: replace(t, weights=dict(t.weights)) for name, t in mem.tiers.items()}
        for k, a in changes.items():
            src = self.placement.get(k).tier
            if src != a.tier:
                n = self.unit_bytes(k)
                tiers[src].weights["expert"] -= n
                tiers[a.tier].weights["expert"] += n
        if any(t.weights_total == 0 and t.kv_cache == 0 for name, t in tiers.items() if name != CPU):
            return self.predict(trial)  # a GPU left empty: the full estimate drops its runtime overhead
        pred = Prediction(memory=replace(mem, tiers=tiers), budgets=before.budgets)
        pred.decode_tps = services.decode_tps(self, trial)
        self._judge(pred)
        return pred

    def move_units(self, keys: list[UnitKey], assignment: Assignment, force: bool = False) -> dict:
        """Move ``keys`` to ``assignment``; returns their previous assignments (for undo).
        Raises PlacementError with the reason when the move would break a budget (unless
        ``force``)."""
        missing = [k for k in keys if self.inventory is None or k not in self.inventory.units]
        if missing:
            raise PlacementError(f"{missing[0]} is not in this model")
        pred, reason = self.check_move(keys, assignment)
        if reason and not force:
            raise PlacementError(reason)
        previous = {k: self.placement.get(k) for k in keys}
        self.placement.move(keys, assignment)
        self._placement_edited(pred)
        return previous

    def set_assignments(self, assignments: dict[UnitKey, Assignment]) -> None:
        """Set each key's assignment (undo of a move)."""
        pred = self._predict_changes(self.prediction(), assignments)
        for k, a in assignments.items():
            self.placement.set(k, a)
        self._placement_edited(pred)

    def set_placement(self, placement: Placement) -> Placement:
        """Replace the whole placement (planner, project); returns the previous one."""
        previous = self.placement
        self.placement = placement.copy()
        self._placement_edited()
        return previous

    def plan(self, strategy: str) -> Placement:
        """The planner's placement for ``strategy`` under the current budgets (not applied)."""
        if self.inventory is None:
            raise WorkbenchError("open a model first")
        return services.plan(self, strategy)

    def _placement_edited(self, prediction: Prediction | None = None) -> None:
        self.dirty = True
        self.events.placement_changed.emit(self.placement)
        self._project_changed()
        if prediction is None:
            self.refresh_prediction()
        else:
            self._prediction = prediction
            self.events.prediction_changed.emit(prediction)

    def tier_grid(self) -> np.ndarray:
        """Tier code of every routed expert, int8 ``[len(moe_layers), n_experts]`` (see TIER_*)."""
        rows = self.moe_layers
        grid = np.full((len(rows), self.n_experts), tier_code(self.placement.default), dtype=np.int8)
        row_of = {layer: i for i, layer in enumerate(rows)}
        for k, a in self.placement.assignments.items():
            if k.kind == "expert" and k.layer in row_of and k.expert < self.n_experts:
                grid[row_of[k.layer], k.expert] = tier_code(a)
        return grid

    # -- stats -------------------------------------------------------------------------------

    def set_stats(self, stats: ExpertStats | None, source: str = "profiled") -> None:
        """Make ``stats`` the routing statistics the grid, cost model and planner use. ``source``:
        "profiled", "live" (from the engine while it answers) or "project"."""
        self.stats = stats
        self.stats_source = source if stats is not None else ""
        if source != "live":
            self.dirty = True
            self._project_changed()
        self.events.stats_changed.emit(self.stats)
        if source != "live":
            self.refresh_prediction()

    def set_counts(self, counts: np.ndarray, source: str = "profiled") -> None:
        """Routing counts ``[n_layers, n_experts]`` (lookups per expert per layer) as new stats."""
        assert self.inventory is not None
        stats = ExpertStats.for_spec(self.inventory.spec)
        stats.add(np.asarray(counts, dtype=np.float64))
        self.set_stats(stats, source)

    def frequency_grid(self) -> np.ndarray:
        """Share of each layer's lookups per expert relative to uniform, float32
        ``[len(moe_layers), n_experts]``: 1.0 = an average expert, 0 = never chosen; NaN rows where
        nothing was counted yet."""
        rows = self.moe_layers
        out = np.full((len(rows), self.n_experts), np.nan, dtype=np.float32)
        stats = self.shown_stats()
        if stats is None or not rows:
            return out
        counted = stats.counts[rows].sum(axis=1) > 0
        share = stats.frequencies()[rows, : self.n_experts] * self.n_experts
        out[counted] = share[counted]
        return out

    # -- hardware, budgets, prediction --------------------------------------------------------

    def set_hardware(self, profile: HardwareProfile | None, note: str = "") -> None:
        self.hardware = profile
        self.hardware_note = note
        self.dirty = self.inventory is not None
        if self.engine is not None:
            self._tune_prompts()
        self.events.hardware_changed.emit(profile)
        self._budgets_changed()

    def set_measured(self, measured: dict[str, tuple[int, int]]) -> None:
        """Memory as measured now: tier (``"gpu:0"``..., ``"cpu"``) -> (total, free) bytes, where
        free counts what every process uses (NVML free; psutil available for host RAM)."""
        grain = MEASURE_GRAIN
        rounded = {t: (int(total), int(free) // grain * grain) for t, (total, free) in measured.items()}
        if rounded != self.measured:
            self.measured = rounded
            self._budgets_changed()

    def detect_hardware(self, rate_hz: float = 10.0) -> None:
        """Start the telemetry sampler and choose the hardware profile to plan for: the preset that
        matches this machine's GPUs, or, when NVML sees no GPU, the default preset (with the reason
        in ``hardware_note``; the Hardware menu picks another)."""
        self.sampler = services.start_sampler(rate_hz)
        profile, note = services.profile_for_this_machine(self.sampler)
        self.set_hardware(profile, note)
        self.dirty = False
        self.telemetry_tick()

    def telemetry_tick(self) -> None:
        """Take the sampler's latest memory figures (GUI thread, a few times per second)."""
        sample = self.sampler.latest() if self.sampler is not None else None
        if sample is not None:
            self.set_measured(services.measured_memory(sample))

    def stop_telemetry(self) -> None:
        if self.sampler is not None:
            self.sampler.stop()

    def set_margin(self, margin: int) -> None:
        self.margin = max(0, int(margin))
        self.events.settings_changed.emit()
        self._budgets_changed()

    def set_context(self, ctx: int, kv_dtype: str | None = None) -> None:
        self.ctx = max(1, int(ctx))
        if kv_dtype:
            self.kv_dtype = kv_dtype
        self.events.settings_changed.emit()
        self.refresh_prediction()

    def budgets(self) -> dict[str, int]:
        """Bytes each tier may hold: each GPU's free memory as measured (other processes
        included) or else its VRAM from the hardware profile, minus the user's margin; the host's
        available RAM minus ``host_margin``. A tier missing from the dict has no known budget."""
        out: dict[str, int] = {}
        ours = self.engine_bytes()
        for tier in self.tiers():
            if tier in self.measured:  # what others use counts against us; what we hold does not
                avail = self.measured[tier][1] + ours.get(tier, 0)
            else:
                avail = self.capacity(tier)
            if avail is not None:
                out[tier] = max(0, int(avail) - (self.host_margin if tier == CPU else self.margin))
        return out

    def capacity(self, tier: str) -> int | None:
        """Total bytes of a tier: measured, else from the hardware profile; None if unknown."""
        if tier in self.measured:
            return self.measured[tier][0]
        if self.hardware is None:
            return None
        if tier == CPU:
            return self.hardware.host_ram_bytes
        i = gpu_index(tier)
        return self.hardware.gpus[i].vram_bytes if i < len(self.hardware.gpus) else None

    def _budgets_changed(self) -> None:
        self.events.budgets_changed.emit(self.budgets())
        self.refresh_prediction()

    def predict(self, placement: Placement | None = None) -> Prediction:
        """Memory per tier and tokens/s of ``placement`` (default: the current one)."""
        if self.inventory is None:
            return Prediction()
        placement = self.placement if placement is None else placement
        pred = Prediction(budgets=self.budgets())
        pred.memory, pred.decode_tps, pred.prefill_tps = services.predict(self, placement)
        self._judge(pred)
        return pred

    def _judge(self, pred: Prediction) -> None:
        """Fill ``pred.over`` with a sentence for every tier over its budget."""
        for tier, budget in pred.budgets.items():
            total = pred.tier_total(tier)
            if total is not None and total > budget:
                where = "host RAM" if tier == CPU else tier.upper().replace(":", " ")
                pred.over[tier] = (
                    f"{where} would need {bytes2human(total)}, {bytes2human(total - budget)} over its budget of "
                    f"{bytes2human(budget)} (free memory minus the "
                    f"{bytes2human(self.host_margin if tier == CPU else self.margin)} margin)"
                )

    def prediction(self) -> Prediction:
        if self._prediction is None:
            self._prediction = self.predict()
        return self._prediction

    def refresh_prediction(self) -> None:
        self._prediction = self.predict()
        self.events.prediction_changed.emit(self._prediction)

    # -- project -----------------------------------------------------------------------------

    def _project_changed(self) -> None:
        self.events.project_changed.emit(self.project_path, self.dirty)

    def save_project(self, path: str | Path) -> None:
        """Write the project (model reference, hardware, placement, stats, chat) to ``path``."""
        if self.inventory is None:
            raise WorkbenchError("open a model first")
        services.save_project(self, Path(path))
        self.project_path = Path(path)
        self.dirty = False
        self._project_changed()

    def apply_project(self, project, path: Path) -> None:
        """Make a loaded project (see :func:`services.load_project`) the session's state."""
        inv, placement, hardware, stats, settings = project
        self.set_model(inv, placement)
        if hardware is not None:
            self.set_hardware(hardware, "from the project file")
        if stats is not None:
            self.set_stats(stats, "project")
        self.ctx = int(settings.get("ctx", self.ctx))
        self.kv_dtype = str(settings.get("kv_dtype", self.kv_dtype))
        self.margin = int(settings.get("margin", self.margin))
        self.events.settings_changed.emit()
        self._budgets_changed()
        self.chat = ChatState.from_json(settings.get("chat") or {})
        self.events.chat_changed.emit()
        self.project_path = Path(path)
        self.dirty = False
        self._project_changed()

    # -- engine ------------------------------------------------------------------------------

    def load_guardrail(self) -> str:
        """Why loading the current placement may not fit ("" if it fits): one sentence per tier
        over its budget, with by how much."""
        return "; ".join(self.prediction().over.values())

    def load_engine(self, progress=None, cancel: threading.Event | None = None, force: bool = False) -> None:
        """Load the current placement on the engine, or migrate the loaded engine to it when only
        routed experts moved. ``progress(fraction, message)``; ``cancel`` stops it; ``force`` skips
        the engine's own VRAM check (the user chose "load anyway"). Blocking: run in a worker."""
        if self.inventory is None:
            raise WorkbenchError("open a model first")
        placement = self.placement.copy()
        self.events.engine_state.emit("loading", "loading weights")
        try:
            if not force and self.engine is not None and self._only_experts_moved(placement):
                self.engine.apply_placement(placement, services.byte_progress(progress, "moving"), cancel)
            else:
                self.close_engine()
                self.engine = services.load_engine(self.inventory, placement, progress, cancel, force,
                                                   hardware=self.hardware)
                self._tune_prompts()
                try:
                    self.chat_runtime()  # tokenizer and template now, not at the first message
                except WorkbenchError as e:
                    log.info("no chat for this model: %s", e)
        except BaseException as e:
            self.events.engine_state.emit("error" if self.engine is None else "ready", str(e))
            raise
        self.engine_placement = placement
        self.events.engine_state.emit("ready", f"engine ready on {services.engine_device(self.engine)}")

    def _tune_prompts(self) -> None:
        """Hand the loaded engine the hardware profile's cost of a prompt's further token per CPU
        expert (``costmodel.model_prompt_pair_reads``; none without a profile or its measurement)."""
        hw, inv = self.hardware, self.inventory
        self.engine.set_prompt_pair_reads(None if hw is None or inv is None else model_prompt_pair_reads(inv, hw))

    def _only_experts_moved(self, placement: Placement) -> bool:
        """True when the loaded engine runs this model and ``placement`` differs from its
        placement in routed experts only (the engine migrates those without reloading)."""
        if self.engine is None or self.engine.inventory is not self.inventory:
            return False
        old = self.engine.placement
        keys = set(old.assignments) | set(placement.assignments)
        return all(old.get(k) == placement.get(k) for k in keys if k.kind != "expert") and \
            old.default == placement.default

    def engine_bytes(self) -> dict[str, int]:
        """Bytes the loaded engine holds per tier (empty when none is loaded)."""
        report = getattr(self.engine, "memory_report", None)
        return {k: int(v) for k, v in report().items()} if report else {}

    def engine_placement_summary(self) -> str:
        """One line: where the loaded engine runs and what it holds per tier."""
        if self.engine is None:
            return "not loaded"
        held = ", ".join(f"{t} {bytes2human(b)}" for t, b in self.engine_bytes().items())
        return f"{services.engine_device(self.engine)} · {held}"

    def close_engine(self) -> None:
        if self.engine is not None:
            close = getattr(self.engine, "close", None)
            if close:
                close()
            self.engine = None
            self.engine_placement = None
            self._chat_runtime = None
            self.live_stats = None
            self.events.engine_state.emit("none", "")

    def start_live_routing(self) -> None:
        """Count live routing from now on (call when a generation starts)."""
        if self.engine is not None:
            self._live_baseline = np.asarray(self.engine.routing_counts(), dtype=np.float64)

    def read_live_counts(self) -> None:
        """Pull the routing counts of the current (or last) answer from the engine into
        ``live_stats``: the grid shows them while the model answers; the profiled stats the
        planner uses stay as they are."""
        if self.engine is None or self.inventory is None:
            return
        counts = np.asarray(self.engine.routing_counts(), dtype=np.float64)
        if self._live_baseline is not None and self._live_baseline.shape == counts.shape:
            counts = counts - self._live_baseline
        if self.live_stats is not None and np.array_equal(self.live_stats.counts, counts):
            return
        stats = ExpertStats.for_spec(self.inventory.spec)
        stats.add(counts)
        self.live_stats = stats
        self.events.stats_changed.emit(self.stats)

    def set_live_view(self, on: bool) -> None:
        """Colour the grid by live routing (True) or by the profiled stats (False)."""
        self.live_view = bool(on)
        self.events.stats_changed.emit(self.stats)

    def shown_stats(self) -> ExpertStats | None:
        if self.live_view and self.live_stats is not None and self.live_stats.counts.any():
            return self.live_stats
        return self.stats

    def profile(self, prompts: list[str], progress=None, cancel: threading.Event | None = None) -> np.ndarray:
        """Run ``prompts`` through the engine (prefill only) and return the routing counts
        ``[n_layers, n_experts]`` they produce. Blocking; loads the engine if needed."""
        if self.engine is None:
            self.load_engine(progress, cancel)
        runtime = self.chat_runtime()
        try:
            return services.profile(self.engine, runtime.tokenizer, prompts, progress, cancel)
        finally:
            runtime.generator.reset_cache()  # profiling overwrote the KV cache
