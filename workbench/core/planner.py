"""Planners: find a placement that fits a memory budget, each in well under a second for 94 x 256.

Strategies (``STRATEGIES``):

- ``all-gpu``: everything on the GPU(s); refused when it does not fit.
- ``cpu-moe``: every routed expert in host RAM (CPU compute), the rest on ``gpu:0`` (llama.cpp
  ``--cpu-moe``).
- ``n-cpu-moe``: the routed experts of the first N layers in RAM, N the smallest that fits
  (llama.cpp ``--n-cpu-moe N``).
- ``uniform``: the same number of GPU experts in every MoE layer (the hottest of each layer when
  stats exist), as many as fit.
- ``frequency``: experts ranked by predicted gain per byte (selection probability x the time a
  byte saves on the GPU instead of the CPU), hottest first, across layers, greedy until full.
- ``balanced``: minimises the cost model's decode time, overlap of CPU and GPU work included:
  a Lagrangian search over each layer's time-vs-bytes curve, a greedy fill of what is left, and the
  best (by the model) of that and the other planners' results — so never worse than ``frequency``.

Every result is checked against the budget with the memory estimate (``placement.check_budget``);
if the estimate disagrees with the planner's byte counting, the least valuable GPU experts go back
to the CPU until it fits. Budgets are honoured exactly, margin included.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from .costmodel import CostModel, Prediction
from .errors import PlacementError
from .fmt import bytes2human
from .memory import estimate_memory
from .placement import (
    CPU_COMPUTE,
    CPU_STREAM,
    ON_GPU0,
    TIER_CPU_COMPUTE,
    TIER_CPU_STREAM,
    Budget,
    Placement,
    check_budget,
    code_assignment,
    expert_grid,
    gpu,
    with_expert_grid,
)

log = logging.getLogger(__name__)

STRATEGIES = ("all-gpu", "cpu-moe", "n-cpu-moe", "uniform", "frequency", "balanced")


@dataclass
class Plan:
    """A planner's result: the placement, its prediction and what the planner decided."""

    strategy: str
    placement: Placement
    prediction: Prediction
    notes: list[str] = field(default_factory=list)
    n_cpu_moe: int | None = None
    """For ``n-cpu-moe``: the N chosen."""
    seconds: float = 0.0
    """Time the planner took (s)."""


class Planner:
    """Plans placements of one model for one machine, budget and context.

    ``cpu_mode`` is ``"compute"`` (CPU experts computed by the CPU) or ``"stream"`` (copied to a GPU
    cache of ``stream_slots`` per layer when picked; the cache's VRAM is reserved first).
    """

    def __init__(self, cost: CostModel, budget: Budget, ctx: int = 4096, kv_dtype: str = "f16",
                 prompt_tokens: int = 512, cpu_mode: str = "compute", stream_slots: int = 0):
        if cpu_mode not in ("compute", "stream"):
            raise ValueError(f"cpu_mode is 'compute' or 'stream', not {cpu_mode!r}")
        if cpu_mode == "stream" and stream_slots < 1:
            raise ValueError("streaming needs at least one stream slot per layer")
        if budget.n_gpus < 1:
            raise PlacementError("the budget has no GPU")
        self.cost = cost
        self.inv = cost.inv
        self.budget = budget
        self.ctx = ctx
        self.kv_dtype = kv_dtype
        self.prompt_tokens = prompt_tokens
        self.cpu_code = TIER_CPU_STREAM if cpu_mode == "stream" else TIER_CPU_COMPUTE
        self.cpu_assignment = CPU_STREAM if cpu_mode == "stream" else CPU_COMPUTE
        self.stream_slots = stream_slots if cpu_mode == "stream" else 0
        self.keys = cost.expert_keys
        self.L, self.E = cost.n_layers, cost.n_experts
        self.bytes = cost.expert_bytes
        self.present = cost.present
        self._room_cache: list[int] | None = None
        self._stream_cache = 0

    # -- entry point -----------------------------------------------------------------------------

    def plan(self, strategy: str) -> Plan:
        """Run one strategy; raises PlacementError when nothing of that shape fits."""
        if strategy not in STRATEGIES:
            raise PlacementError(f"unknown strategy {strategy!r}: choose one of {', '.join(STRATEGIES)}")
        t0 = time.perf_counter()
        method = getattr(self, "_" + strategy.replace("-", "_"))
        placement, notes, n, value = method()
        try:
            est = check_budget(placement, self.inv, self.budget, self.ctx, self.kv_dtype)
        except PlacementError:
            if value is None:
                raise
            grid = self._shrink_to_fit(expert_grid(placement, self.L, self.E), value)
            placement = self._placement(grid)
            est = check_budget(placement, self.inv, self.budget, self.ctx, self.kv_dtype)
            notes.append("some experts went back to RAM: the memory estimate needed more than planned")
        pred = self.cost.predict(placement, self.ctx, self.kv_dtype, self.prompt_tokens, memory=est)
        dt = time.perf_counter() - t0
        log.info("planned %s in %.3f s: %.2f tokens/s", strategy, dt, pred.decode_tps)
        return Plan(strategy, placement, pred, notes, n, dt)

    # -- building blocks -------------------------------------------------------------------------

    def _base(self) -> Placement:
        """Non-expert units on ``gpu:0``, every routed expert in host RAM."""
        grid = np.full((self.L, self.E), self.cpu_code, dtype=np.int16)
        return with_expert_grid(Placement(default=ON_GPU0, stream_slots=self.stream_slots), grid, self.keys)

    def _rooms(self) -> list[int]:
        """Bytes of routed experts each GPU can still take once the base placement is in place."""
        if self._room_cache is not None:
            return self._room_cache
        base = self._base()
        est = estimate_memory(self.inv, base, self.ctx, self.kv_dtype)
        rooms = []
        for i in range(self.budget.n_gpus):
            limit = self.budget.usable(gpu(i))
            if i == 0:
                used = est.total(gpu(0))
                self._stream_cache = est.tiers[gpu(0)].stream_cache if gpu(0) in est.tiers else 0
            elif self.keys:  # a GPU without units yet: what one expert there adds beyond its bytes
                probe = base.copy()
                probe.set(self.keys[0], code_assignment(i))
                e = estimate_memory(self.inv, probe, self.ctx, self.kv_dtype)
                used = e.total(gpu(i)) - self.inv.units[self.keys[0]].nbytes
            else:
                used = 0
            if i == 0 and used > limit:
                raise PlacementError(
                    f"even with every routed expert in RAM, gpu:0 needs {bytes2human(used)} "
                    f"(attention, embeddings, KV cache for {self.ctx} tokens, runtime) but the budget "
                    f"allows {bytes2human(limit)}; lower the context or raise the budget")
            rooms.append(max(0, limit - used))
        self._room_cache = rooms
        return rooms

    def _fill(self, priority, rooms: list[int]) -> np.ndarray:
        """Grid with the experts of ``priority`` (``(layer, expert)`` pairs, best first) on the GPUs:
        ``gpu:0`` takes them in order while they fit, then ``gpu:1`` the rest, and so on; an expert
        that does not fit is skipped, not the ones after it. The rest stay on the CPU."""
        grid = np.full((self.L, self.E), self.cpu_code, dtype=np.int16)
        pairs = np.asarray(priority, dtype=np.int64).reshape(-1, 2)
        for i, room in enumerate(rooms):
            if not len(pairs):
                break
            sizes = self.bytes[pairs[:, 0], pairs[:, 1]]
            take = np.cumsum(sizes) <= room
            n = int(np.argmin(take)) if not take.all() else len(take)
            chosen = list(range(n))
            left = room - sizes[:n].sum()
            rest = np.arange(n, len(pairs))
            while rest.size:  # skip what does not fit, keep taking what does
                fit = rest[sizes[rest] <= left]
                if not fit.size:
                    break
                j = fit[0]
                chosen.append(j)
                left -= sizes[j]
                rest = rest[rest > j]
            sel = pairs[chosen]
            grid[sel[:, 0], sel[:, 1]] = i
            keep = np.ones(len(pairs), dtype=bool)
            keep[chosen] = False
            pairs = pairs[keep]
        return grid

    def _placement(self, grid: np.ndarray) -> Placement:
        return with_expert_grid(self._base(), grid, self.keys)

    def _shrink_to_fit(self, grid: np.ndarray, value: np.ndarray) -> np.ndarray:
        """Move the least valuable GPU experts back to the CPU until the memory estimate fits."""
        for _ in range(64):
            est = estimate_memory(self.inv, self._placement(grid), self.ctx, self.kv_dtype)
            over = {i: est.total(gpu(i)) - self.budget.usable(gpu(i)) for i in range(self.budget.n_gpus)}
            over = {i: b for i, b in over.items() if b > 0}
            if not over:
                return grid
            for i, excess in over.items():
                cells = np.argwhere(grid == i)
                cells = cells[np.argsort(value[cells[:, 0], cells[:, 1]], kind="stable")]
                freed = 0
                for layer, expert in cells:
                    if freed >= excess:
                        break
                    grid[layer, expert] = self.cpu_code
                    freed += self.bytes[layer, expert]
        raise PlacementError("could not fit the placement into the budget")  # pragma: no cover

    def _gain_per_byte(self) -> np.ndarray:
        """Decode seconds one byte of each expert saves on ``gpu:0`` instead of the CPU, x its
        selection probability: ``[layers, experts]`` (0 for absent experts)."""
        cm = self.cost
        gpu_bw = cm.gpu_rate(0)
        if self.cpu_code == TIER_CPU_STREAM:
            per_byte = 1.0 / cm.profile.h2d_pinned
        else:
            per_byte = 1.0 / cm.expert_cpu_rate - 1.0 / gpu_bw
        return np.where(self.present, cm.p_sel * per_byte, -np.inf)

    def _ranked(self, value: np.ndarray) -> np.ndarray:
        """``(layer, expert)`` pairs of present experts, highest ``value`` first (ties: layer, expert)."""
        flat = np.flatnonzero(self.present.ravel())
        order = flat[np.argsort(-value.ravel()[flat], kind="stable")]
        return np.stack(np.unravel_index(order, (self.L, self.E)), axis=1)

    def _hottest_order(self) -> np.ndarray:
        """Per layer, expert indices hottest first (present ones before absent ones): ``[L, E]``."""
        p = np.where(self.present, self.cost.p_sel, -1.0)
        return np.argsort(-p, axis=1, kind="stable")

    # -- strategies --------------------------------------------------------------------------------

    def _all_gpu(self):
        rooms = list(self._rooms())
        rooms[0] += self._stream_cache  # nothing is streamed when everything is on the GPU
        grid = self._fill(self._ranked(np.zeros((self.L, self.E))), rooms)
        missing = int(((grid < 0) & self.present).sum())
        if missing:
            need = self.bytes[self.present].sum()
            raise PlacementError(
                f"the whole model does not fit: its routed experts need {bytes2human(need)} but the GPU(s) "
                f"have {bytes2human(sum(rooms))} left for them ({missing} experts too many); "
                "try n-cpu-moe, frequency or balanced")
        return self._placement(grid), [], None, None

    def _cpu_moe(self):
        self._rooms()
        return self._base(), [], None, None

    def _n_cpu_moe_grid(self) -> tuple[np.ndarray, int]:
        """The experts of layers ``0..N-1`` on the CPU, the rest on ``gpu:0``, N the smallest that fits."""
        room = self._rooms()[0]
        per_layer = (self.bytes * self.present).sum(axis=1)
        # GPU bytes of experts with N layers on the CPU: the experts of layers N.. stay on gpu:0.
        gpu_bytes = np.concatenate([np.cumsum(per_layer[::-1])[::-1], [0.0]])
        n = int(np.argmax(gpu_bytes <= room))
        grid = np.zeros((self.L, self.E), dtype=np.int16)
        grid[:n] = self.cpu_code
        return grid, n

    def _n_cpu_moe(self):
        grid, n = self._n_cpu_moe_grid()
        notes = [f"--n-cpu-moe {n}: the routed experts of layers 0..{n - 1} in RAM" if n else
                 "--n-cpu-moe 0: every routed expert fits on the GPU"]
        return self._placement(grid), notes, n, None

    def _uniform_grid(self) -> tuple[np.ndarray, int]:
        """``k`` GPU experts in every MoE layer (the hottest), ``k`` the largest that fits."""
        rooms = self._rooms()
        order = self._hottest_order()
        best = np.full((self.L, self.E), self.cpu_code, dtype=np.int16)
        best_k = 0
        lo, hi = 0, int(self.present.sum(axis=1).max())
        rows = np.arange(self.L)[:, None]
        while lo < hi:  # largest k whose k-per-layer set fits
            k = (lo + hi + 1) // 2
            cols = order[:, :k]
            keep = self.present[rows, cols]
            pairs = np.stack([np.broadcast_to(rows, cols.shape)[keep], cols[keep]], axis=1)
            grid = self._fill(pairs, rooms)
            if int((grid >= 0).sum()) == len(pairs):
                lo, best, best_k = k, grid, k
            else:
                hi = k - 1
        return best, best_k

    def _uniform(self):
        grid, k = self._uniform_grid()
        n_moe = int(self.present.any(axis=1).sum())
        value = np.where(grid >= 0, 1.0 + self.cost.p_sel, 0.0)
        return self._placement(grid), [f"{k} GPU experts in each of {n_moe} MoE layers"], None, value

    def _frequency_grid(self) -> np.ndarray:
        return self._fill(self._ranked(self._gain_per_byte()), self._rooms())

    def _frequency(self):
        return self._placement(self._frequency_grid()), [], None, self._gain_per_byte()

    def _balanced(self):
        cm = self.cost
        rooms = self._rooms()
        total_room = float(sum(rooms))
        base = self._base()
        order = self._hottest_order()
        notes: list[str] = []
        if self.cpu_code == TIER_CPU_STREAM:  # the curves model CPU compute: compare the others only
            candidates = {}
            notes.append("streaming: the curve search models CPU compute, so balanced picks the best of "
                         "frequency, uniform and n-cpu-moe")
        else:
            t, b = cm.layer_curves(base, order, self.prompt_tokens, self.kv_dtype)
            k = _lagrangian(t, b, total_room)
            k = _greedy_fill(t, b, k, total_room)
            pairs = [(layer, int(e)) for layer in range(self.L) for e in order[layer, :k[layer]]
                     if self.present[layer, e]]
            candidates = {"curve search": self._fill(pairs, rooms)}
        candidates["frequency"] = self._frequency_grid()
        candidates["n-cpu-moe"] = self._n_cpu_moe_grid()[0]
        candidates["uniform"] = self._uniform_grid()[0]
        best_name, best_grid, best_s = None, None, float("inf")
        for name, grid in candidates.items():
            s = 1.0 / cm.decode_tps(base, self.prompt_tokens, self.kv_dtype, grid=grid)
            if s < best_s - 1e-15:
                best_name, best_grid, best_s = name, grid, s
        notes.append(f"best by the cost model: {best_name}")
        value = np.where(best_grid >= 0, 1.0, 0.0) + self._gain_per_byte().clip(0)
        return self._placement(best_grid), notes, None, value


def _lagrangian(t: np.ndarray, b: np.ndarray, room: float) -> np.ndarray:
    """Per layer, the GPU expert count ``k`` minimising ``sum t[l, k]`` subject to
    ``sum b[l, k] <= room``, on the convex hull of the curves (multiplier search, 60 steps)."""
    rows = np.arange(t.shape[0])

    def pick(lam: float) -> np.ndarray:
        return np.argmin(t + lam * b, axis=1)

    k = pick(0.0)
    if b[rows, k].sum() <= room:
        return k
    lo, hi = 0.0, 1.0
    scale = max(float(t.max()), 1e-30) / max(float(b.max()), 1.0)
    hi = scale
    while b[rows, pick(hi)].sum() > room:
        hi *= 4
        if hi > 1e30:
            return np.zeros(t.shape[0], dtype=int)
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if b[rows, pick(mid)].sum() > room:
            lo = mid
        else:
            hi = mid
    return pick(hi)


def _greedy_fill(t: np.ndarray, b: np.ndarray, k: np.ndarray, room: float) -> np.ndarray:
    """Spend the room the multiplier search left: repeatedly grow the layer whose next step (to any
    larger k that fits) saves the most time per byte."""
    k = k.copy()
    rows = np.arange(t.shape[0])
    n = t.shape[1] - 1
    used = b[rows, k].sum()
    for _ in range(t.shape[0] * n):
        left = room - used
        best_gain, best = 0.0, None
        for layer in rows:
            cur = k[layer]
            if cur >= n:
                continue
            extra = b[layer, cur + 1:] - b[layer, cur]
            ok = (extra <= left) & (extra > 0)
            if not ok.any():
                continue
            gain = (t[layer, cur] - t[layer, cur + 1:]) / np.where(extra > 0, extra, 1)
            gain = np.where(ok, gain, -np.inf)
            j = int(np.argmax(gain))
            if gain[j] > best_gain:
                best_gain, best = gain[j], (layer, cur + 1 + j)
        if best is None:
            break
        layer, new_k = best
        used += b[layer, new_k] - b[layer, k[layer]]
        k[layer] = new_k
    return k


def plan(strategy: str, cost: CostModel, budget: Budget, **kwargs) -> Plan:
    """Shortcut: ``Planner(cost, budget, **kwargs).plan(strategy)``."""
    return Planner(cost, budget, **kwargs).plan(strategy)
