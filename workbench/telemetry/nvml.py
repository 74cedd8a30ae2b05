"""NVIDIA GPUs through NVML (the ``nvidia-ml-py`` package, imported as ``pynvml``).

Every NVML call goes through one choke point, :meth:`Nvml.query` (and the module function
:func:`nvml_query` on the process-wide instance): NVML is initialised lazily on first use, a field the
GPU or driver does not support comes back as :data:`NA`, a missing function is logged once, and a GPU
that falls off the bus marks its snapshot ``lost`` instead of raising. A machine without the NVIDIA
driver is a clear state (:attr:`Nvml.status` with :attr:`Nvml.message`), never an exception.

Units: bytes, bytes/s, percent, degrees Celsius, watts, MHz. NVML numbers GPUs in PCI order and
ignores ``CUDA_VISIBLE_DEVICES``; match a CUDA device to an NVML index by UUID
(:meth:`Nvml.index_of_uuid`).
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from types import ModuleType
from typing import Any

import psutil

from workbench.telemetry.na import NA, is_na

log = logging.getLogger(__name__)

# NVML return codes (nvml.h); looked up on the library module first, these are the fallbacks.
_ERR = {
    "UNINITIALIZED": 1,
    "NOT_SUPPORTED": 3,
    "NO_PERMISSION": 4,
    "DRIVER_NOT_LOADED": 9,
    "LIBRARY_NOT_FOUND": 12,
    "FUNCTION_NOT_FOUND": 13,
    "GPU_IS_LOST": 15,
    "GPU_NOT_FOUND": 28,
}


class NvmlStatus(enum.Enum):
    """Where NVML stands on this machine."""

    UNKNOWN = "not initialised yet"
    OK = "ok"
    NO_LIBRARY = "no NVIDIA driver (NVML library not found)"
    NO_DRIVER = "NVIDIA driver not loaded"
    NO_GPU = "no NVIDIA GPU"
    FAILED = "NVML failed"


_HINTS = {
    NvmlStatus.NO_LIBRARY: (
        "No NVIDIA driver found (libnvidia-ml is missing): GPU fields show N/A. "
        "Install the NVIDIA driver to see GPUs; planning with a hardware preset still works."
    ),
    NvmlStatus.NO_DRIVER: (
        "The NVIDIA driver is installed but not loaded: GPU fields show N/A. "
        "Check `nvidia-smi`; loading the kernel module or a reboot usually fixes it."
    ),
    NvmlStatus.NO_GPU: "NVML runs but sees no NVIDIA GPU: GPU fields show N/A.",
}


@dataclass(frozen=True)
class GpuProcess:
    """One process holding memory on a GPU. ``used_bytes`` is NA where the driver hides it."""

    pid: int
    name: str
    used_bytes: float  # bytes
    kind: str  # "compute", "graphics" or "compute+graphics"


@dataclass(frozen=True)
class GpuSnapshot:
    """One GPU at one moment. Numbers are NA where the GPU or driver does not report them.

    Memory in bytes (``memory_reserved``: held by the driver, reported apart by NVML memory info v2),
    utilisation in percent over the driver's last sample period, temperature in degrees Celsius,
    power in watts, clocks in MHz, PCIe throughput in bytes/s (``pcie_rx``: host to GPU).
    ``pcie_gen_max``/``pcie_width_max``: the most the GPU *and* its slot allow;
    ``pcie_gen_gpu_max``: the most the GPU allows. ``lost``: the GPU stopped answering.
    """

    index: int
    name: str = "N/A"
    uuid: str = "N/A"
    pci_bus_id: str = "N/A"
    memory_total: float = NA
    memory_used: float = NA
    memory_free: float = NA
    memory_reserved: float = NA
    util_gpu: float = NA
    util_memory: float = NA
    temperature: float = NA
    power_draw: float = NA
    power_limit: float = NA
    clock_graphics: float = NA
    clock_sm: float = NA
    clock_memory: float = NA
    clock_max_graphics: float = NA
    clock_max_sm: float = NA
    clock_max_memory: float = NA
    pcie_gen: float = NA
    pcie_gen_max: float = NA
    pcie_gen_gpu_max: float = NA
    pcie_width: float = NA
    pcie_width_max: float = NA
    pcie_rx: float = NA
    pcie_tx: float = NA
    processes: tuple[GpuProcess, ...] = ()
    lost: bool = False

    def to_json(self) -> dict:
        """Plain dict; NA becomes ``None``."""
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "processes":
                v = [{**p.__dict__, "used_bytes": None if is_na(p.used_bytes) else p.used_bytes} for p in v]
            elif isinstance(v, float) and is_na(v):
                v = None
            out[f.name] = v
        return out


NUMERIC_FIELDS = tuple(
    f.name
    for f in fields(GpuSnapshot)
    if f.name not in ("index", "name", "uuid", "pci_bus_id", "processes", "lost")
)


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return "N/A" if is_na(value) else str(value)


def _scaled(value: Any, factor: float) -> float:
    return NA if is_na(value) else float(value) * factor


@dataclass
class _Static:
    name: str
    uuid: str
    pci_bus_id: str
    clock_max: tuple[float, float, float]
    pcie_gen_max: float
    pcie_gen_gpu_max: float
    pcie_width_max: float


class Nvml:
    """NVML for this process: lazy init, one query choke point, per-GPU snapshots.

    ``lib`` is a module with pynvml's API; ``None`` imports ``pynvml`` on first use. Tests pass a
    stand-in module to exercise the error paths. Thread-safe: the sampler thread and the GUI may both
    use one instance.
    """

    def __init__(self, lib: ModuleType | Any | None = None):
        self._lib = lib
        self._lock = threading.RLock()
        self._status = NvmlStatus.UNKNOWN
        self._detail = ""
        self._handles: dict[int, Any] = {}
        self._handle_index: dict[int, int] = {}  # id(handle) -> GPU index
        self._lost: set[int] = set()
        self._static: dict[int, _Static] = {}
        self._logged: set[str] = set()
        self._proc_names: dict[int, str] = {}

    # -- state ---------------------------------------------------------------------------------
    @property
    def status(self) -> NvmlStatus:
        """Initialises NVML if needed and says where it stands."""
        self._ensure_init()
        return self._status

    @property
    def available(self) -> bool:
        """True when NVML runs and sees at least one GPU."""
        return self.status is NvmlStatus.OK

    @property
    def message(self) -> str:
        """A sentence for the user about the NVML state, with a hint; ``""`` when all is well."""
        status = self.status
        if status is NvmlStatus.OK:
            return ""
        hint = _HINTS.get(status, f"NVML failed: {self._detail}. GPU fields show N/A.")
        return hint

    def _code(self, name: str) -> int:
        return int(getattr(self._lib, f"NVML_ERROR_{name}", _ERR[name]))

    def _error_type(self) -> type[BaseException]:
        return getattr(self._lib, "NVMLError", ())  # () matches nothing in an except clause

    def _ensure_init(self) -> None:
        if self._status is not NvmlStatus.UNKNOWN:
            return
        with self._lock:
            if self._status is not NvmlStatus.UNKNOWN:
                return
            self._init_locked()

    def _init_locked(self) -> None:
        if self._lib is None:
            try:
                import pynvml
            except ImportError as e:
                self._set_status(NvmlStatus.NO_LIBRARY, f"nvidia-ml-py is not installed ({e})")
                return
            self._lib = pynvml
        err = self._error_type()
        try:
            self._lib.nvmlInit()
        except err as e:
            code = getattr(e, "value", None)
            if code == self._code("LIBRARY_NOT_FOUND"):
                self._set_status(NvmlStatus.NO_LIBRARY, str(e))
            elif code == self._code("DRIVER_NOT_LOADED"):
                self._set_status(NvmlStatus.NO_DRIVER, str(e))
            else:
                self._set_status(NvmlStatus.FAILED, str(e))
            return
        except OSError as e:  # a broken library file
            self._set_status(NvmlStatus.FAILED, str(e))
            return
        try:
            count = int(self._lib.nvmlDeviceGetCount())
        except err as e:
            self._set_status(NvmlStatus.FAILED, str(e))
            return
        self._set_status(NvmlStatus.OK if count > 0 else NvmlStatus.NO_GPU, f"{count} GPU(s)")

    def _set_status(self, status: NvmlStatus, detail: str) -> None:
        self._status, self._detail = status, detail
        if status is NvmlStatus.OK:
            log.debug("NVML: %s", detail)
        else:
            log.info("NVML: %s (%s)", status.value, detail)

    def shutdown(self) -> None:
        """Release NVML; the next query initialises it again."""
        with self._lock:
            if self._status is NvmlStatus.OK or self._status is NvmlStatus.NO_GPU:
                try:
                    self._lib.nvmlShutdown()
                except self._error_type():
                    pass
            self._status = NvmlStatus.UNKNOWN
            self._handles.clear()
            self._handle_index.clear()
            self._static.clear()
            self._lost.clear()

    # -- the choke point -------------------------------------------------------------------------
    def query(self, fn: str | Callable, *args: Any, default: Any = NA) -> Any:
        """Call an NVML function (a pynvml name like ``"nvmlDeviceGetName"`` or the function itself).

        Returns ``default`` (NA) instead of raising when NVML is absent, the field is not supported,
        the function does not exist in this driver, the GPU is lost or any other NVML error occurs.
        """
        self._ensure_init()
        if self._status not in (NvmlStatus.OK, NvmlStatus.NO_GPU):
            return default
        name = fn if isinstance(fn, str) else getattr(fn, "__name__", repr(fn))
        try:
            func = getattr(self._lib, fn) if isinstance(fn, str) else fn
        except AttributeError:
            self._log_once(name, f"NVML: {name} does not exist in this nvidia-ml-py; its fields show N/A")
            return default
        for attempt in (0, 1):
            try:
                return func(*args)
            except self._error_type() as e:
                code = getattr(e, "value", None)
                if code == self._code("UNINITIALIZED") and attempt == 0:
                    with self._lock:
                        self._status = NvmlStatus.UNKNOWN
                        self._init_locked()
                    if self._status is not NvmlStatus.OK:
                        return default
                    continue
                self._on_error(name, code, e, args)
                return default
        return default

    def _on_error(self, name: str, code: Any, error: BaseException, args: tuple) -> None:
        if code in (self._code("GPU_IS_LOST"), self._code("GPU_NOT_FOUND")):
            index = self._handle_index.get(id(args[0])) if args else None
            if index is not None and index not in self._lost:
                log.warning("NVML: GPU %d is lost (%s); its fields show N/A", index, error)
                self._lost.add(index)
        elif code in (self._code("DRIVER_NOT_LOADED"), self._code("LIBRARY_NOT_FOUND")):
            with self._lock:
                self._set_status(NvmlStatus.NO_DRIVER, str(error))
        elif code in (
            self._code("NOT_SUPPORTED"),
            self._code("FUNCTION_NOT_FOUND"),
            self._code("NO_PERMISSION"),
        ):
            self._log_once(name, f"NVML: {name}: {error}; this field shows N/A")
        else:
            self._log_once(f"{name}:{code}", f"NVML: {name} failed: {error}; this field shows N/A")

    def _log_once(self, key: str, message: str) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.info(message)

    # -- devices ---------------------------------------------------------------------------------
    def device_count(self) -> int:
        """Number of GPUs NVML sees (0 without a driver)."""
        n = self.query("nvmlDeviceGetCount", default=0)
        return int(n) if not is_na(n) else 0

    def driver_version(self) -> str:
        """The NVIDIA driver version, or ``"N/A"``."""
        return _text(self.query("nvmlSystemGetDriverVersion"))

    def is_lost(self, index: int) -> bool:
        """True once GPU ``index`` stopped answering."""
        return index in self._lost

    def _handle(self, index: int) -> Any:
        h = self._handles.get(index)
        if h is None:
            h = self.query("nvmlDeviceGetHandleByIndex", index, default=None)
            if h is not None:
                self._handles[index] = h
                self._handle_index[id(h)] = index
        return h

    def _static_info(self, index: int, h: Any) -> _Static:
        s = self._static.get(index)
        if s is not None:
            return s
        q = self.query
        pci = q("nvmlDeviceGetPciInfo", h, default=None)
        bus_id = _text(getattr(pci, "busId", NA)) if pci is not None else "N/A"
        s = _Static(
            name=_text(q("nvmlDeviceGetName", h)),
            uuid=_text(q("nvmlDeviceGetUUID", h)),
            pci_bus_id=bus_id,
            clock_max=tuple(
                _scaled(q("nvmlDeviceGetMaxClockInfo", h, self._const(c, v)), 1.0)
                for c, v in (("NVML_CLOCK_GRAPHICS", 0), ("NVML_CLOCK_SM", 1), ("NVML_CLOCK_MEM", 2))
            ),
            pcie_gen_max=_scaled(q("nvmlDeviceGetMaxPcieLinkGeneration", h), 1),
            pcie_gen_gpu_max=_scaled(q("nvmlDeviceGetGpuMaxPcieLinkGeneration", h), 1),
            pcie_width_max=_scaled(q("nvmlDeviceGetMaxPcieLinkWidth", h), 1),
        )
        if s.name != "N/A" and index not in self._lost:  # cache only what a healthy GPU told us
            self._static[index] = s
        return s

    def _const(self, name: str, fallback: int) -> int:
        return int(getattr(self._lib, name, fallback))

    def index_of_uuid(self, uuid: str) -> int | None:
        """The NVML index of the GPU with this UUID (as CUDA reports it, with or without ``GPU-``)."""
        want = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
        for i in range(self.device_count()):
            h = self._handle(i)
            if h is not None and self._static_info(i, h).uuid == want:
                return i
        return None

    def gpu(self, index: int, processes: bool = True, pcie_throughput: bool = True) -> GpuSnapshot:
        """A snapshot of GPU ``index``; every field NA (and ``lost``) when the GPU does not answer.

        ``processes``: list the processes holding memory on it. ``pcie_throughput``: read the PCIe
        RX/TX counters, which costs about 40 ms per GPU (NVML samples 20 ms per direction); without
        it ``pcie_rx``/``pcie_tx`` are NA and a snapshot takes about a millisecond.
        """
        h = self._handle(index)
        if h is None:
            if self.status is NvmlStatus.OK:
                self._lost.add(index)
            return GpuSnapshot(index=index, lost=index in self._lost)
        q = self.query
        st = self._static_info(index, h)
        mem = q("nvmlDeviceGetMemoryInfo", h, getattr(self._lib, "nvmlMemory_v2", 0x02000028), default=None)
        reserved = _scaled(getattr(mem, "reserved", NA), 1) if mem is not None else NA
        if mem is None:
            mem = q("nvmlDeviceGetMemoryInfo", h, default=None)
        util = q("nvmlDeviceGetUtilizationRates", h, default=None)
        clocks = [
            _scaled(q("nvmlDeviceGetClockInfo", h, self._const(c, v)), 1.0)
            for c, v in (("NVML_CLOCK_GRAPHICS", 0), ("NVML_CLOCK_SM", 1), ("NVML_CLOCK_MEM", 2))
        ]
        snap = GpuSnapshot(
            index=index,
            name=st.name,
            uuid=st.uuid,
            pci_bus_id=st.pci_bus_id,
            memory_total=_scaled(getattr(mem, "total", NA), 1) if mem is not None else NA,
            memory_used=_scaled(getattr(mem, "used", NA), 1) if mem is not None else NA,
            memory_free=_scaled(getattr(mem, "free", NA), 1) if mem is not None else NA,
            memory_reserved=reserved,
            util_gpu=_scaled(getattr(util, "gpu", NA), 1) if util is not None else NA,
            util_memory=_scaled(getattr(util, "memory", NA), 1) if util is not None else NA,
            temperature=_scaled(q("nvmlDeviceGetTemperature", h, self._const("NVML_TEMPERATURE_GPU", 0)), 1),
            power_draw=_scaled(q("nvmlDeviceGetPowerUsage", h), 1e-3),
            power_limit=_scaled(q("nvmlDeviceGetEnforcedPowerLimit", h), 1e-3),
            clock_graphics=clocks[0],
            clock_sm=clocks[1],
            clock_memory=clocks[2],
            clock_max_graphics=st.clock_max[0],
            clock_max_sm=st.clock_max[1],
            clock_max_memory=st.clock_max[2],
            pcie_gen=_scaled(q("nvmlDeviceGetCurrPcieLinkGeneration", h), 1),
            pcie_gen_max=st.pcie_gen_max,
            pcie_gen_gpu_max=st.pcie_gen_gpu_max,
            pcie_width=_scaled(q("nvmlDeviceGetCurrPcieLinkWidth", h), 1),
            pcie_width_max=st.pcie_width_max,
            pcie_rx=_scaled(
                q("nvmlDeviceGetPcieThroughput", h, self._const("NVML_PCIE_UTIL_RX_BYTES", 1)), 1024
            )
            if pcie_throughput
            else NA,
            pcie_tx=_scaled(
                q("nvmlDeviceGetPcieThroughput", h, self._const("NVML_PCIE_UTIL_TX_BYTES", 0)), 1024
            )
            if pcie_throughput
            else NA,
            processes=self._processes(h) if processes else (),
            lost=index in self._lost,
        )
        return snap

    def gpus(self, processes: bool = True, pcie_throughput: bool = True) -> list[GpuSnapshot]:
        """Snapshots of every GPU NVML sees (empty without a driver)."""
        return [self.gpu(i, processes, pcie_throughput) for i in range(self.device_count())]

    def _processes(self, h: Any) -> tuple[GpuProcess, ...]:
        found: dict[int, GpuProcess] = {}
        for kind, fn in (
            ("compute", "nvmlDeviceGetComputeRunningProcesses"),
            ("graphics", "nvmlDeviceGetGraphicsRunningProcesses"),
        ):
            for p in self.query(fn, h, default=()) or ():
                pid = int(p.pid)
                used = NA if getattr(p, "usedGpuMemory", None) is None else float(p.usedGpuMemory)
                old = found.get(pid)
                if old is not None:
                    kind_ = old.kind if old.kind == kind else "compute+graphics"
                    used = (
                        old.used_bytes
                        if is_na(used)
                        else max(used, 0 if is_na(old.used_bytes) else old.used_bytes)
                    )
                    found[pid] = GpuProcess(pid, old.name, used, kind_)
                else:
                    found[pid] = GpuProcess(pid, self._process_name(pid), used, kind)
        return tuple(sorted(found.values(), key=lambda p: p.pid))

    def _process_name(self, pid: int) -> str:
        name = self._proc_names.get(pid)
        if name is None:
            try:
                name = psutil.Process(pid).name()
            except (psutil.Error, OSError):
                name = "?"  # another container's PID namespace, or gone already
            if len(self._proc_names) > 4096:
                self._proc_names.clear()
            self._proc_names[pid] = name
        return name


_default: list[Nvml] = []
_default_lock = threading.Lock()


def default_nvml() -> Nvml:
    """The process-wide :class:`Nvml` (created on first use, backed by ``pynvml``)."""
    with _default_lock:
        if not _default:
            _default.append(Nvml())
        return _default[0]


def nvml_query(fn: str | Callable, *args: Any, default: Any = NA) -> Any:
    """:meth:`Nvml.query` on the process-wide instance."""
    return default_nvml().query(fn, *args, default=default)


@dataclass(frozen=True)
class NvmlReport:
    """What ``workbench hw`` shows about GPUs: the state, a message for the user and the GPUs."""

    status: NvmlStatus
    message: str
    driver_version: str
    gpus: tuple[GpuSnapshot, ...] = field(default_factory=tuple)

    def to_json(self) -> dict:
        return {
            "status": self.status.name.lower(),
            "message": self.message,
            "driver_version": None if self.driver_version == "N/A" else self.driver_version,
            "gpus": [g.to_json() for g in self.gpus],
        }


def report(nvml: Nvml | None = None, processes: bool = True) -> NvmlReport:
    """Everything NVML can say now, never raising."""
    nvml = nvml or default_nvml()
    return NvmlReport(nvml.status, nvml.message, nvml.driver_version(), tuple(nvml.gpus(processes)))
