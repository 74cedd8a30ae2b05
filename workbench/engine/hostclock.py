"""The engine thread's own time in a prompt's hybrid layers, as the engine spends it.

In a hybrid prompt layer the engine's thread splits the CPU tier's experts between the CPU and the
bus, queues the fetched experts' copies and kernels batch by batch, groups the resident tier and
adds the CPU's result; between two layers it queues the next layer's attention. When that work
takes longer than the copies and kernels it queues, the thread is the layer's long lane, and the
cost model has to know what it costs (``HardwareProfile.prompt_host_*``). ``HostClock`` records,
per hybrid layer of a prompt, the thread's busy seconds since the previous hybrid layer (wall time
less what it spent blocked: waiting for the routing, and for the CPU's background run) beside what
the layer did (experts fetched, batches, copy calls, whether the CPU computed a share), so that
calibration can fit those costs to the engine's own measurements.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class HostLayer:
    """One hybrid prompt layer as the engine's thread ran it (seconds)."""

    layer: int
    busy_s: float
    """The thread's time since the previous hybrid layer's end (the forward's start for the first),
    less ``wait_s`` and ``cpu_wait_s``."""
    wait_s: float
    """Blocked until the layer's routing reached the host."""
    cpu_wait_s: float
    """Blocked until the CPU's background run finished."""
    fetched: int
    """Experts copied to the GPU for the prompt."""
    batches: int
    """Batches they travelled in (one set of kernel launches and events each)."""
    copies: int
    """Host-to-GPU copy calls queued for them."""
    cpu_share: bool
    """Whether the CPU computed some of the layer's experts."""
    first: bool
    """The forward's first hybrid layer (its busy time includes what comes before it: embedding)."""
    cpu_run_s: float = 0.0
    """From the start of the CPU's background run to the end of the wait for it (0: none): its run's
    time where ``cpu_wait_s`` > 0, an upper bound otherwise."""

    def to_json(self) -> dict:
        return asdict(self)


class HostClock:
    """Collects ``HostLayer`` records of the prompts run while it is attached (``Engine.record_host``).
    Decode steps are not recorded."""

    def __init__(self):
        self.layers: list[HostLayer] = []
        self._last: float | None = None
        self._first = True

    def start(self) -> None:
        """A forward begins now."""
        self._last = time.perf_counter()
        self._first = True

    def layer(self, layer: int, wait_s: float, cpu_wait_s: float, fetched: int, batches: int, copies: int,
              cpu_share: bool, cpu_run_s: float = 0.0) -> None:
        """A hybrid prompt layer's host work ends now (see ``HostLayer`` for the fields)."""
        now = time.perf_counter()
        if self._last is not None:
            self.layers.append(HostLayer(layer, now - self._last - wait_s - cpu_wait_s, wait_s, cpu_wait_s, fetched,
                                         batches, copies, cpu_share, self._first, cpu_run_s))
        self._last, self._first = now, False

    def clear(self) -> None:
        self.layers.clear()

    def summary(self) -> dict:
        """Means per recorded hybrid layer, a forward's first left out: ``{"layers": n, "busy_ms",
        "wait_ms", "cpu_wait_ms", "cpu_run_ms", "fetched", "batches", "copies", "cpu_share"}`` (``cpu_share``: the
        share of layers where the CPU computed some experts); ``{"layers": 0}`` without records."""
        use = [r for r in self.layers if not r.first]
        if not use:
            return {"layers": 0}
        n = len(use)

        def mean(name: str, scale: float = 1.0) -> float:
            return scale * sum(float(getattr(r, name)) for r in use) / n

        return {"layers": n, "busy_ms": mean("busy_s", 1e3), "wait_ms": mean("wait_s", 1e3),
                "cpu_wait_ms": mean("cpu_wait_s", 1e3), "cpu_run_ms": mean("cpu_run_s", 1e3),
                "fetched": mean("fetched"), "batches": mean("batches"), "copies": mean("copies"),
                "cpu_share": mean("cpu_share")}
