"""scripts/gpu_check.py's comparison, fed a stand-in GPU and nvidia-smi-like strings."""

import importlib.util
from pathlib import Path

from tests.telemetry.standin_nvml import FakeGpu, make_nvml
from workbench.telemetry.nvml import Nvml

_spec = importlib.util.spec_from_file_location(
    "gpu_check", Path(__file__).parents[2] / "scripts" / "gpu_check.py"
)
gpu_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)

SMI = {
    "name": "NVIDIA Stand-in 24GB",
    "uuid": "GPU-00000000-1111-2222-3333-444444444444",
    "pci.bus_id": "00000000:01:00.0",
    "memory.total": "24576",
    "memory.used": "3072",
    "memory.free": "21204",
    "memory.reserved": "300",
    "utilization.gpu": "40",
    "utilization.memory": "17",
    "temperature.gpu": "56",
    "power.draw": "120.5",
    "enforced.power.limit": "450.00",
    "clocks.gr": "1800",
    "clocks.sm": "1800",
    "clocks.mem": "10500",
    "clocks.max.gr": "2520",
    "clocks.max.sm": "2520",
    "clocks.max.mem": "10501",
    "pcie.link.gen.current": "1",
    "pcie.link.gen.max": "4",
    "pcie.link.gen.gpumax": None,
    "pcie.link.width.current": "16",
    "pcie.link.width.max": "16",
}


def test_matching_fields_pass_and_real_differences_fail():
    g = Nvml(make_nvml([FakeGpu(unsupported={"nvmlDeviceGetTemperature"})])).gpu(0)
    values = dict(SMI, **{"temperature.gpu": "[N/A]"})
    rows, failed = gpu_check.compare(g, values)
    assert failed == 0, "\n".join(rows)
    assert any("pcie_gen_gpu_max" in r and "skip" in r for r in rows)
    bad = dict(values, name="NVIDIA Other", **{"memory.used": str(3072 + 400), "clocks.max.gr": "2505"})
    rows, failed = gpu_check.compare(g, bad)
    assert failed == 3
    assert {r.split()[0] for r in rows if r.endswith("FAIL")} == {"name", "memory_used", "clock_max_graphics"}
