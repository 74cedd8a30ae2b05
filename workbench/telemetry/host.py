"""The host: RAM, swap, this process, CPU load, CPU model and the ISA features CPU kernels care about.

Sizes in bytes, CPU load in percent (0-100, averaged over all logical cores). The engine's pinned host
memory is not visible to psutil; the engine registers a provider with
:func:`set_pinned_bytes_provider` and every snapshot reports it (NA while nobody registered one), so
telemetry never imports torch.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from workbench.telemetry.na import NA, jsonable

log = logging.getLogger(__name__)

# /proc/cpuinfo flag -> label shown to the user. AMX needs the tile flag and a data-type flag.
ISA_FLAGS = {
    "avx2": "AVX2",
    "avx512f": "AVX-512",
    "avx512_bf16": "AVX512-BF16",
    "amx_tile": "AMX",
    "amx_bf16": "AMX-BF16",
    "amx_int8": "AMX-INT8",
}


@dataclass(frozen=True)
class CpuInfo:
    """The CPU: model name, cores and ISA flags (the subset in :data:`ISA_FLAGS` found on this CPU).

    ``usable_cores`` is what this process may run on (CPU affinity / container limits), which is what
    thread pools should use; ``flags_known`` is False where the OS does not expose flags (not Linux).
    """

    model: str
    physical_cores: int | float  # NA when unknown
    logical_cores: int
    usable_cores: int
    flags: frozenset[str]
    flags_known: bool = True

    @property
    def features(self) -> list[str]:
        """Labels of the ISA features present, e.g. ``["AVX2", "AVX-512", "AVX512-BF16"]``."""
        return [label for flag, label in ISA_FLAGS.items() if flag in self.flags]

    @property
    def has_amx_bf16(self) -> bool:
        return {"amx_tile", "amx_bf16"} <= self.flags

    def to_json(self) -> dict:
        d = asdict(self)
        d["flags"] = sorted(self.flags)
        d["features"] = self.features
        return jsonable(d)


def parse_cpuinfo(text: str) -> tuple[str, frozenset[str]]:
    """``(model name, ISA flags)`` from the text of ``/proc/cpuinfo`` (first processor block).

    x86 lists ``flags``; other architectures list ``Features`` (aarch64) and may lack ``model name``.
    """
    model, flags = "", frozenset()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key = key.strip().lower()
        if key in ("model name", "cpu model", "hardware") and not model:
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = frozenset(value.split())
    return model, flags & frozenset(ISA_FLAGS)


def _usable_cores() -> int:
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    return max(1, min(n, int(quota))) if quota else n


def _cgroup_cpu_quota() -> float | None:
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return max(1.0, float(quota) / float(period))


@functools.lru_cache(maxsize=4)
def cpu_info(cpuinfo_path: str = "/proc/cpuinfo") -> CpuInfo:
    """This machine's CPU (read once per path)."""
    try:
        model, flags = parse_cpuinfo(Path(cpuinfo_path).read_text(errors="replace"))
        known = True
    except OSError:
        model, flags, known = "", frozenset(), False
    physical = psutil.cpu_count(logical=False)
    return CpuInfo(
        model=model or platform.processor() or platform.machine() or "unknown CPU",
        physical_cores=physical if physical else NA,
        logical_cores=psutil.cpu_count(logical=True) or 1,
        usable_cores=_usable_cores(),
        flags=flags,
        flags_known=known,
    )


def _cgroup_memory_limit() -> float:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:
            return float(text)
        return NA
    return NA


_pinned_provider: list[Callable[[], int] | None] = [None]
_pinned_lock = threading.Lock()


def set_pinned_bytes_provider(provider: Callable[[], int] | None) -> None:
    """Register the callable that returns the bytes of pinned (page-locked) host memory the engine
    holds; ``None`` unregisters it. Called by the engine; the call must be cheap and thread-safe."""
    with _pinned_lock:
        _pinned_provider[0] = provider


def clear_pinned_bytes_provider(provider: Callable[[], int]) -> None:
    """Unregister ``provider`` if it is the one registered (an engine closing; a newer one stays)."""
    with _pinned_lock:
        if _pinned_provider[0] == provider:
            _pinned_provider[0] = None


def pinned_bytes() -> float:
    """Bytes of pinned host memory the engine reports, NA when no provider is registered or it fails."""
    provider = _pinned_provider[0]
    if provider is None:
        return NA
    try:
        return float(provider())
    except Exception as e:  # a provider bug must not kill the sampler
        log.warning("pinned-memory provider failed: %s", e)
        return NA


@dataclass(frozen=True)
class HostSnapshot:
    """Host memory and load at one moment, in bytes. ``ram_used`` is ``ram_total - ram_available``
    (what other programs and this one hold, caches excluded); ``ram_limit``: the container's memory
    limit, NA without one; ``cpu_percent``: 0-100 over all logical cores since the previous snapshot;
    ``pinned_bytes``: page-locked memory the engine reports (NA when it reports none)."""

    ram_total: float
    ram_used: float
    ram_available: float
    ram_limit: float
    swap_total: float
    swap_used: float
    process_rss: float
    pinned_bytes: float
    cpu_percent: float

    def to_json(self) -> dict:
        return jsonable(asdict(self))


HOST_FIELDS = tuple(HostSnapshot.__dataclass_fields__)


class HostMonitor:
    """Takes :class:`HostSnapshot` s of this machine and process (cheap: a few psutil calls)."""

    def __init__(self, pid: int | None = None):
        self._process = psutil.Process(pid)
        psutil.cpu_percent(interval=None)  # the first call only starts the measurement

    def snapshot(self) -> HostSnapshot:
        vm = psutil.virtual_memory()
        try:
            swap = psutil.swap_memory()
            swap_total, swap_used = float(swap.total), float(swap.used)
        except (OSError, RuntimeError):
            swap_total = swap_used = NA
        try:
            rss = float(self._process.memory_info().rss)
        except psutil.Error:
            rss = NA
        return HostSnapshot(
            ram_total=float(vm.total),
            ram_used=float(vm.total - vm.available),
            ram_available=float(vm.available),
            ram_limit=_cgroup_memory_limit(),
            swap_total=swap_total,
            swap_used=swap_used,
            process_rss=rss,
            pinned_bytes=pinned_bytes(),
            cpu_percent=float(psutil.cpu_percent(interval=None)),
        )
