"""A stand-in for the ``pynvml`` module: the same function names, constants and error type, backed
by a few fake GPUs whose failures a test can switch on (not supported, lost, library missing).

Only used where the real library cannot produce the case on a machine without a GPU.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field

NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNKNOWN = 999


class NVMLError(Exception):
    def __init__(self, value: int):
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return f"NVML error {self.value}"


@dataclass
class FakeGpu:
    name: bytes = b"NVIDIA Stand-in 24GB"
    uuid: str = "GPU-00000000-1111-2222-3333-444444444444"
    total: int = 24 << 30
    used: int = 3 << 30
    reserved: int = 300 << 20
    util: tuple[int, int] = (42, 17)
    temperature: int = 55
    power_mw: int = 123_456
    limit_mw: int = 450_000
    clocks: tuple[int, int, int] = (1800, 1800, 10_500)
    max_clocks: tuple[int, int, int] = (2520, 2520, 10_501)
    pcie: tuple[int, int, int, int] = (4, 16, 4, 16)  # gen, width, max gen, max width
    throughput_kb: tuple[int, int] = (1000, 2000)  # rx, tx KB/s
    processes: list = field(default_factory=list)  # (pid, used bytes or None)
    lost: bool = False
    unsupported: set = field(default_factory=set)
    raise_other: dict = field(default_factory=dict)  # function name -> exception instance


class _Handle:
    def __init__(self, index: int):
        self.index = index


def make_nvml(
    gpus: list[FakeGpu] | None = None,
    init_error: int | None = None,
    missing: tuple[str, ...] = (),
) -> types.SimpleNamespace:
    """A module-like object with pynvml's API over ``gpus``. ``init_error``: nvmlInit raises that
    NVML code; ``missing``: function names the object lacks (an old library). ``calls`` counts calls."""
    gpus = [FakeGpu()] if gpus is None else gpus
    lib = types.SimpleNamespace()
    state = {"init": False, "calls": {}}
    lib.state = state
    lib.gpus = gpus
    for name, value in globals().items():
        if name.startswith("NVML_ERROR_"):
            setattr(lib, name, value)
    lib.NVMLError = NVMLError
    lib.nvmlMemory_v2 = 0x02000028
    lib.NVML_TEMPERATURE_GPU = 0
    lib.NVML_CLOCK_GRAPHICS, lib.NVML_CLOCK_SM, lib.NVML_CLOCK_MEM = 0, 1, 2
    lib.NVML_PCIE_UTIL_TX_BYTES, lib.NVML_PCIE_UTIL_RX_BYTES = 0, 1

    def api(fn):
        def wrapped(*args):
            state["calls"][fn.__name__] = state["calls"].get(fn.__name__, 0) + 1
            if fn.__name__ not in ("nvmlInit", "nvmlShutdown") and not state["init"]:
                raise NVMLError(NVML_ERROR_UNINITIALIZED)
            if args and isinstance(args[0], _Handle):
                g = gpus[args[0].index]
                if g.lost:
                    raise NVMLError(NVML_ERROR_GPU_IS_LOST)
                if fn.__name__ in g.unsupported:
                    raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
                if fn.__name__ in g.raise_other:
                    raise g.raise_other[fn.__name__]
                return fn(g, *args[1:])
            return fn(*args)

        wrapped.__name__ = fn.__name__
        if fn.__name__ not in missing:
            setattr(lib, fn.__name__, wrapped)
        return wrapped

    @api
    def nvmlInit():
        if init_error is not None:
            raise NVMLError(init_error)
        state["init"] = True

    @api
    def nvmlShutdown():
        state["init"] = False

    @api
    def nvmlDeviceGetCount():
        return len(gpus)

    @api
    def nvmlSystemGetDriverVersion():
        return "999.99"

    @api
    def nvmlDeviceGetHandleByIndex(i):
        if gpus[i].lost:
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        return _Handle(i)

    @api
    def nvmlDeviceGetName(g):
        return g.name

    @api
    def nvmlDeviceGetUUID(g):
        return g.uuid

    @api
    def nvmlDeviceGetPciInfo(g):
        return types.SimpleNamespace(busId=b"00000000:01:00.0")

    @api
    def nvmlDeviceGetMemoryInfo(g, version=None):
        free = g.total - g.used - (g.reserved if version else 0)
        if version:
            return types.SimpleNamespace(total=g.total, used=g.used, free=free, reserved=g.reserved)
        return types.SimpleNamespace(total=g.total, used=g.used + g.reserved, free=free)

    @api
    def nvmlDeviceGetUtilizationRates(g):
        return types.SimpleNamespace(gpu=g.util[0], memory=g.util[1])

    @api
    def nvmlDeviceGetTemperature(g, sensor):
        return g.temperature

    @api
    def nvmlDeviceGetPowerUsage(g):
        return g.power_mw

    @api
    def nvmlDeviceGetEnforcedPowerLimit(g):
        return g.limit_mw

    @api
    def nvmlDeviceGetClockInfo(g, kind):
        return g.clocks[kind]

    @api
    def nvmlDeviceGetMaxClockInfo(g, kind):
        return g.max_clocks[kind]

    @api
    def nvmlDeviceGetCurrPcieLinkGeneration(g):
        return g.pcie[0]

    @api
    def nvmlDeviceGetCurrPcieLinkWidth(g):
        return g.pcie[1]

    @api
    def nvmlDeviceGetMaxPcieLinkGeneration(g):
        return g.pcie[2]

    @api
    def nvmlDeviceGetGpuMaxPcieLinkGeneration(g):
        return g.pcie[2]

    @api
    def nvmlDeviceGetMaxPcieLinkWidth(g):
        return g.pcie[3]

    @api
    def nvmlDeviceGetPcieThroughput(g, counter):
        return g.throughput_kb[0] if counter == 1 else g.throughput_kb[1]

    @api
    def nvmlDeviceGetComputeRunningProcesses(g):
        return [types.SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in g.processes]

    @api
    def nvmlDeviceGetGraphicsRunningProcesses(g):
        return []

    return lib
