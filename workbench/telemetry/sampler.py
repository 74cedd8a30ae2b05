"""A background thread that samples GPUs and host into preallocated ring buffers.

>>> s = Sampler(rate_hz=4.0)          # nothing runs yet; buffers hold 10 minutes at 4 Hz
>>> unsubscribe = s.subscribe(print)  # called on the sampler thread with every Sample
>>> s.start(); ...; s.stop()
>>> t, used = s.series("memory_used", gpu=0)   # seconds since start, bytes

Failures never stop the sampler: a GPU that vanishes or an NVML error turns that GPU's fields into NA
(NaN in the series) and sampling goes on. Subscribers run on the sampler thread; a GUI must hand the
sample to its own thread (a queued signal) and return quickly.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from workbench.telemetry.host import HOST_FIELDS, HostMonitor, HostSnapshot
from workbench.telemetry.na import NA
from workbench.telemetry.nvml import NUMERIC_FIELDS as GPU_FIELDS
from workbench.telemetry.nvml import GpuSnapshot, Nvml, default_nvml

log = logging.getLogger(__name__)

__all__ = ["GPU_FIELDS", "HOST_FIELDS", "RingBuffer", "Sample", "Sampler"]


class RingBuffer:
    """``capacity`` rows of float64 columns plus a timestamp per row, preallocated; the oldest rows
    are overwritten once full. Not thread-safe by itself (the :class:`Sampler` locks around it)."""

    def __init__(self, capacity: int, columns: Sequence[str]):
        if capacity < 1:
            raise ValueError("ring buffer capacity must be at least 1")
        self.capacity = int(capacity)
        self.columns = {name: i for i, name in enumerate(columns)}
        self._t = np.full(self.capacity, np.nan)
        self._v = np.full((self.capacity, len(self.columns)), np.nan)
        self._next = 0  # row the next append writes
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def append(self, t: float, values: Sequence[float] | np.ndarray) -> None:
        """Add one row: ``t`` (seconds) and one value per column (NaN for unknown)."""
        self._t[self._next] = t
        self._v[self._next] = values
        self._next = (self._next + 1) % self.capacity
        self._count = min(self._count + 1, self.capacity)

    def _order(self) -> np.ndarray:
        start = (self._next - self._count) % self.capacity
        return (start + np.arange(self._count)) % self.capacity

    def times(self) -> np.ndarray:
        """Timestamps, oldest first (a copy), shape ``[len(self)]``."""
        return self._t[self._order()]

    def column(self, name: str) -> np.ndarray:
        """One column, oldest first (a copy), shape ``[len(self)]``."""
        return self._v[self._order(), self.columns[name]]

    def clear(self) -> None:
        self._next = self._count = 0


@dataclass(frozen=True)
class Sample:
    """One sampling instant: ``t`` seconds since the sampler started (monotonic clock), ``wall`` the
    Unix time, the host and every GPU (index order; a lost GPU is all NA with ``lost=True``)."""

    t: float
    wall: float
    host: HostSnapshot
    gpus: tuple[GpuSnapshot, ...]

    def to_json(self) -> dict:
        return {
            "t": self.t,
            "wall": self.wall,
            "host": self.host.to_json(),
            "gpus": [g.to_json() for g in self.gpus],
        }


def _host_na() -> HostSnapshot:
    return HostSnapshot(**{name: NA for name in HOST_FIELDS})


class Sampler:
    """Samples host and GPUs ``rate_hz`` times a second on a daemon thread.

    ``capacity``: rows kept per series (default: 10 minutes at ``rate_hz``). ``nvml`` / ``host``:
    where samples come from (defaults: the process-wide NVML and a :class:`HostMonitor`).
    ``processes``: also list the processes on each GPU (names via psutil). ``pcie_throughput``: read
    the PCIe RX/TX counters (about 40 ms per GPU per sample; turn off for fast rates or many GPUs).
    ``last_sample_s``: how long the latest sample took (s).
    The number of GPUs is fixed when the sampler is made; GPU fields are those of
    :class:`~workbench.telemetry.nvml.GpuSnapshot` (bytes, %, °C, W, MHz, bytes/s), host fields those
    of :class:`~workbench.telemetry.host.HostSnapshot` (bytes, %).
    """

    def __init__(
        self,
        rate_hz: float = 4.0,
        capacity: int | None = None,
        nvml: Nvml | None = None,
        host: HostMonitor | None = None,
        processes: bool = True,
        pcie_throughput: bool = True,
    ):
        if not rate_hz > 0:
            raise ValueError(f"sampling rate must be positive, got {rate_hz!r} Hz")
        self.rate_hz = float(rate_hz)
        self.nvml = nvml or default_nvml()
        self.host = host or HostMonitor()
        self.processes = processes
        self.pcie_throughput = pcie_throughput
        self.last_sample_s = 0.0
        self.n_gpus = self.nvml.device_count()
        columns = [f"host.{f}" for f in HOST_FIELDS]
        columns += [f"gpu{i}.{f}" for i in range(self.n_gpus) for f in GPU_FIELDS]
        self._ring = RingBuffer(capacity or max(1, int(600 * self.rate_hz)), columns)
        self._row = np.full(len(columns), np.nan)
        self._lock = threading.Lock()
        self._subscribers: list[Callable[[Sample], None]] = []
        self._latest: Sample | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = time.monotonic()
        self.errors = 0  # samples in which something raised (and was turned into NA)

    # -- control -------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start sampling (no-op if already running). Timestamps continue from the first start."""
        if self.running:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="workbench-sampler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop sampling and wait for the thread (at most ``timeout`` s); the buffers stay readable."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                log.warning("sampler thread did not stop within %.1f s", timeout)

    def __enter__(self) -> Sampler:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def subscribe(self, callback: Callable[[Sample], None]) -> Callable[[], None]:
        """Call ``callback(sample)`` on the sampler thread after every sample; returns an unsubscribe
        function. A callback that raises is logged and kept."""
        with self._lock:
            self._subscribers.append(callback)

        def unsubscribe() -> None:
            with self._lock:
                if callback in self._subscribers:
                    self._subscribers.remove(callback)

        return unsubscribe

    # -- reading -------------------------------------------------------------------------------
    def latest(self) -> Sample | None:
        """The most recent sample, or None before the first one."""
        return self._latest

    def __len__(self) -> int:
        return len(self._ring)

    def series(self, field: str, gpu: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(t, values)`` of one field, oldest first: ``t`` in seconds since start, values in the
        field's unit (NaN where unknown). ``gpu`` picks the GPU for GPU fields; host fields take none."""
        if gpu is None:
            if field not in HOST_FIELDS:
                hint = " (a GPU field: pass gpu=N)" if field in GPU_FIELDS else ""
                raise KeyError(f"unknown host field {field!r}{hint}; host fields: {', '.join(HOST_FIELDS)}")
            key = f"host.{field}"
        else:
            if field not in GPU_FIELDS:
                raise KeyError(f"unknown GPU field {field!r}; GPU fields: {', '.join(GPU_FIELDS)}")
            if not 0 <= gpu < self.n_gpus:
                raise KeyError(f"no GPU {gpu}: the sampler watches {self.n_gpus} GPU(s)")
            key = f"gpu{gpu}.{field}"
        with self._lock:
            return self._ring.times(), self._ring.column(key)

    # -- sampling ------------------------------------------------------------------------------
    def sample_once(self) -> Sample:
        """Take one sample now (on the calling thread), store it and notify subscribers."""
        failed = False
        began = time.perf_counter()
        try:
            host = self.host.snapshot()
        except Exception as e:
            log.warning("host sample failed: %s", e)
            host, failed = _host_na(), True
        gpus = []
        for i in range(self.n_gpus):
            try:
                gpus.append(self.nvml.gpu(i, self.processes, self.pcie_throughput))
            except Exception as e:  # the NVML layer should not raise; be safe anyway
                log.warning("GPU %d sample failed: %s", i, e)
                gpus.append(GpuSnapshot(index=i, lost=True))
                failed = True
        now = time.monotonic()
        sample = Sample(t=now - self._t0, wall=time.time(), host=host, gpus=tuple(gpus))
        row = self._row
        n = len(HOST_FIELDS)
        for j, name in enumerate(HOST_FIELDS):
            row[j] = getattr(host, name)
        for g in gpus:
            base = n + g.index * len(GPU_FIELDS)
            for j, name in enumerate(GPU_FIELDS):
                row[base + j] = getattr(g, name)
        with self._lock:
            self._ring.append(sample.t, row)
            self._latest = sample
            subscribers = list(self._subscribers)
        self.errors += failed
        self.last_sample_s = time.perf_counter() - began
        for cb in subscribers:
            try:
                cb(sample)
            except Exception:
                log.exception("sampler subscriber %r failed", cb)
        return sample

    def _run(self) -> None:
        period = 1.0 / self.rate_hz
        due = time.monotonic()
        while not self._stop.is_set():
            try:
                self.sample_once()
            except Exception:  # never let the thread die
                log.exception("sampling failed")
                self.errors += 1
            due += period
            delay = due - time.monotonic()
            if delay < 0:  # fell behind (slow NVML, busy machine): skip, don't burst
                due = time.monotonic()
                delay = 0.0
            self._stop.wait(delay)
