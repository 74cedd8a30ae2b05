"""Measuring helpers for benchmarks: peak GPU and host memory of a process tree, medians, tables.

The budget rule (BENCH.md): the peak GPU memory of the process as NVML reports it must stay within
the budget; both engines are checked the same way, by :class:`PeakSampler`.
"""

from __future__ import annotations

import logging
import os
import statistics
import threading
import time
from dataclasses import dataclass

import psutil

from workbench.telemetry.na import is_na
from workbench.telemetry.nvml import Nvml

log = logging.getLogger(__name__)


@dataclass
class Peaks:
    """Peaks seen while sampling, in bytes. ``gpu_process``: NVML's used memory of the sampled
    process tree (None where NVML hides per-process memory); ``gpu_device``: the GPU's used memory
    minus what was used when sampling started; ``host_rss``: resident memory of the process tree."""

    gpu_process: float | None = None
    gpu_device: float | None = None
    host_rss: float = 0.0
    samples: int = 0

    @property
    def gpu(self) -> float | None:
        """The figure the budget is checked against: per-process if NVML gives it, else device delta."""
        return self.gpu_process if self.gpu_process is not None else self.gpu_device

    def to_json(self) -> dict:
        return {"gpu_process_bytes": self.gpu_process, "gpu_device_bytes": self.gpu_device,
                "gpu_bytes": self.gpu, "host_rss_bytes": self.host_rss, "samples": self.samples}


class PeakSampler:
    """Samples GPU ``index`` and the process tree of ``pid`` (default: this process) every
    ``interval`` seconds on a thread; use as a context manager, then read ``peaks``.

    The tree's members are looked up again every ``tree_interval`` seconds, not every sample:
    listing children scans every process (~1.5 ms of Python holding the GIL), which slowed the
    engine being measured in the same process by 10-20% at a 20 ms interval."""

    def __init__(self, pid: int | None = None, index: int = 0, interval: float = 0.02,
                 nvml: Nvml | None = None, tree_interval: float = 0.5):
        self.pid = os.getpid() if pid is None else pid
        self.index = index
        self.interval = interval
        self.nvml = nvml or Nvml()
        self.peaks = Peaks()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handle = None
        self._base = 0.0
        self.tree_interval = tree_interval
        self._tree_at = float("-inf")
        self._tree_pids: set[int] = {self.pid}

    def _tree(self) -> set[int]:
        now = time.monotonic()
        if now - self._tree_at < self.tree_interval:
            return self._tree_pids
        self._tree_at = now
        try:
            p = psutil.Process(self.pid)
            self._tree_pids = {self.pid, *(c.pid for c in p.children(recursive=True))}
        except psutil.Error:
            self._tree_pids = {self.pid}
        return self._tree_pids

    def _gpu_sample(self, pids: set[int]) -> tuple[float | None, float | None]:
        if self._handle is None:
            return None, None
        q = self.nvml.query
        mem = q("nvmlDeviceGetMemoryInfo", self._handle, default=None)
        dev = None if mem is None else float(mem.used) - self._base
        used, seen = 0.0, False
        for fn in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
            for p in q(fn, self._handle, default=()) or ():
                m = getattr(p, "usedGpuMemory", None)
                if int(p.pid) in pids and m is not None:
                    used, seen = used + float(m), True
        return (used if seen else None), dev

    def sample(self) -> None:
        """Take one sample now (the thread calls this)."""
        pids = self._tree()
        rss = 0.0
        for pid in pids:
            try:
                rss += psutil.Process(pid).memory_info().rss
            except psutil.Error:
                pass
        proc, dev = self._gpu_sample(pids)
        pk = self.peaks
        pk.host_rss = max(pk.host_rss, rss)
        if proc is not None:
            pk.gpu_process = max(pk.gpu_process or 0.0, proc)
        if dev is not None:
            pk.gpu_device = max(pk.gpu_device or 0.0, dev)
        pk.samples += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def __enter__(self) -> PeakSampler:
        if self.nvml.available:
            self._handle = self.nvml.query("nvmlDeviceGetHandleByIndex", self.index, default=None)
            mem = self.nvml.query("nvmlDeviceGetMemoryInfo", self._handle, default=None)
            self._base = 0.0 if mem is None or is_na(getattr(mem, "used", None)) else float(mem.used)
        self._thread = threading.Thread(target=self._run, name="peak-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()


def median_spread(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max) of a non-empty list."""
    return statistics.median(values), min(values), max(values)


def markdown_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """A markdown table of ``rows``; ``columns``: (header, key). Floats print with 3 significant
    figures beyond the point where useful; None prints as a dash."""
    def cell(v) -> str:
        if v is None:
            return "–"
        if isinstance(v, float):
            return f"{v:,.1f}" if abs(v) >= 10 else f"{v:.3g}"
        return str(v)

    out = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + " --- |" * len(columns)]
    out += ["| " + " | ".join(cell(r.get(k)) for _, k in columns) + " |" for r in rows]
    return "\n".join(out)

