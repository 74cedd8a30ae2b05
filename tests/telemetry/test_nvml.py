import json
import logging
import math
import os

import psutil
import pytest

from tests.telemetry.standin_nvml import (
    NVML_ERROR_DRIVER_NOT_LOADED,
    NVML_ERROR_LIBRARY_NOT_FOUND,
    NVML_ERROR_UNKNOWN,
    FakeGpu,
    NVMLError,
    make_nvml,
)
from workbench.telemetry.na import NA, is_na
from workbench.telemetry.nvml import NUMERIC_FIELDS, Nvml, NvmlStatus, report


def test_real_library_without_driver_is_a_clear_state():
    nvml = Nvml()  # the real pynvml; this machine has no NVIDIA driver
    if nvml.status is NvmlStatus.OK:
        pytest.skip("an NVIDIA driver is present here")
    assert nvml.status in (NvmlStatus.NO_LIBRARY, NvmlStatus.NO_DRIVER)
    assert "N/A" in nvml.message and "driver" in nvml.message
    assert nvml.device_count() == 0
    assert nvml.gpus() == []
    assert nvml.query("nvmlDeviceGetCount") is NA
    assert nvml.driver_version() == "N/A"
    out = report(nvml).to_json()
    json.dumps(out, allow_nan=False)
    assert out["status"] in ("no_library", "no_driver") and out["gpus"] == []


def test_healthy_gpu_fields_and_units():
    me = os.getpid()
    gpu = FakeGpu(processes=[(me, 1 << 30), (2**22 + 12345, None)])
    nvml = Nvml(make_nvml([gpu]))
    assert nvml.status is NvmlStatus.OK and nvml.message == ""
    g = nvml.gpu(0)
    assert g.name == "NVIDIA Stand-in 24GB"  # bytes decoded
    assert g.uuid == gpu.uuid and g.pci_bus_id == "00000000:01:00.0"
    assert (g.memory_total, g.memory_used, g.memory_reserved) == (24 << 30, 3 << 30, 300 << 20)
    assert g.memory_free == gpu.total - gpu.used - gpu.reserved
    assert (g.util_gpu, g.util_memory, g.temperature) == (42, 17, 55)
    assert g.power_draw == pytest.approx(123.456) and g.power_limit == pytest.approx(450.0)  # W
    assert (g.clock_graphics, g.clock_sm, g.clock_memory) == (1800, 1800, 10_500)
    assert g.clock_max_memory == 10_501
    assert (g.pcie_gen, g.pcie_width, g.pcie_gen_max, g.pcie_width_max) == (4, 16, 4, 16)
    assert (g.pcie_rx, g.pcie_tx) == (1000 * 1024, 2000 * 1024)  # bytes/s
    procs = {p.pid: p for p in g.processes}
    assert procs[me].name == psutil.Process(me).name() and procs[me].used_bytes == 1 << 30
    assert procs[2**22 + 12345].name == "?" and procs[2**22 + 12345].used_bytes is NA
    assert not g.lost
    assert nvml.driver_version() == "999.99"
    assert nvml.index_of_uuid(gpu.uuid.removeprefix("GPU-")) == 0
    json.dumps(g.to_json(), allow_nan=False)


def test_not_supported_fields_are_na_and_logged_once(caplog):
    gpu = FakeGpu(unsupported={"nvmlDeviceGetTemperature", "nvmlDeviceGetPowerUsage"})
    nvml = Nvml(make_nvml([gpu]))
    with caplog.at_level(logging.INFO, logger="workbench.telemetry.nvml"):
        a = nvml.gpu(0)
        b = nvml.gpu(0)
    for g in (a, b):
        assert g.temperature is NA and g.power_draw is NA
        assert str(g.temperature) == "N/A" and f"{g.power_draw:>6.1f}" == "   N/A"
        assert g.memory_used == 3 << 30 and not g.lost
    assert sum("nvmlDeviceGetTemperature" in r.message for r in caplog.records) == 1


def test_library_not_found_driver_not_loaded_and_no_gpu():
    for code, status in (
        (NVML_ERROR_LIBRARY_NOT_FOUND, NvmlStatus.NO_LIBRARY),
        (NVML_ERROR_DRIVER_NOT_LOADED, NvmlStatus.NO_DRIVER),
    ):
        nvml = Nvml(make_nvml(init_error=code))
        assert nvml.status is status
        assert nvml.gpus() == [] and nvml.query("nvmlDeviceGetCount") is NA
        assert "driver" in nvml.message
    nvml = Nvml(make_nvml([]))
    assert nvml.status is NvmlStatus.NO_GPU and "no NVIDIA GPU" in nvml.message
    assert nvml.gpus() == []
    other = Nvml(make_nvml(init_error=NVML_ERROR_UNKNOWN))
    assert other.status is NvmlStatus.FAILED and "NVML failed" in other.message


def test_gpu_lost_mid_run_turns_fields_na_without_raising(caplog):
    gpus = [FakeGpu(), FakeGpu(uuid="GPU-2")]
    nvml = Nvml(make_nvml(gpus))
    assert nvml.gpu(1).memory_used == 3 << 30
    gpus[1].lost = True
    with caplog.at_level(logging.WARNING, logger="workbench.telemetry.nvml"):
        g = nvml.gpu(1)
    assert g.lost and nvml.is_lost(1)
    assert all(
        is_na(getattr(g, f))
        for f in NUMERIC_FIELDS
        if not f.startswith(("clock_max", "pcie_gen_", "pcie_width_max"))
    )
    assert any("GPU 1 is lost" in r.message for r in caplog.records)
    assert not nvml.gpu(0).lost and nvml.gpu(0).memory_used == 3 << 30


def test_lost_before_first_handle():
    gpus = [FakeGpu(lost=True)]
    nvml = Nvml(make_nvml(gpus))
    g = nvml.gpu(0)
    assert g.lost and g.name == "N/A" and math.isnan(g.memory_total)


def test_missing_function_and_unexpected_errors_give_na():
    gpu = FakeGpu(raise_other={"nvmlDeviceGetUtilizationRates": NVMLError(NVML_ERROR_UNKNOWN)})
    lib = make_nvml([gpu], missing=("nvmlDeviceGetGpuMaxPcieLinkGeneration",))
    nvml = Nvml(lib)
    g = nvml.gpu(0)
    assert g.pcie_gen_gpu_max is NA and g.pcie_gen_max == 4
    assert g.util_gpu is NA and g.util_memory is NA and g.memory_used == 3 << 30


def test_uninitialized_is_reinitialised_once():
    lib = make_nvml([FakeGpu()])
    nvml = Nvml(lib)
    assert nvml.device_count() == 1
    lib.state["init"] = False  # someone called nvmlShutdown behind our back
    assert nvml.gpu(0).memory_total == 24 << 30
    assert lib.state["calls"]["nvmlInit"] == 2


def test_static_fields_are_read_once():
    lib = make_nvml([FakeGpu()])
    nvml = Nvml(lib)
    for _ in range(3):
        nvml.gpu(0)
    assert lib.state["calls"]["nvmlDeviceGetName"] == 1
    assert lib.state["calls"]["nvmlDeviceGetMemoryInfo"] == 3
