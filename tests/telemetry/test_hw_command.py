"""``workbench hw`` end to end on this machine (no NVIDIA driver) and its text for a stand-in GPU."""

import json
import subprocess
import sys

from tests.telemetry.standin_nvml import FakeGpu, make_nvml
from workbench.cli import main
from workbench.commands.hw import format_gpu
from workbench.telemetry.nvml import Nvml, NvmlStatus


def test_hw_without_driver_text_and_json(capsys):
    if Nvml().status is NvmlStatus.OK:
        import pytest

        pytest.skip("an NVIDIA driver is present here")
    assert main(["hw"]) == 0
    out = capsys.readouterr().out
    assert "GPUs: N/A" in out and "No NVIDIA driver found" in out and "Host:" in out and "RAM" in out
    assert main(["hw", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["nvml"]["status"] == "no_library" and obj["nvml"]["gpus"] == []
    assert obj["host"]["ram_total"] > 0 and obj["host"]["pinned_bytes"] is None
    assert main(["hw", "--watch", "--json", "--count", "2", "--interval", "0.05"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(json.loads(line)["host"]["ram_total"] > 0 for line in lines)


def test_hw_imports_neither_torch_nor_qt():
    code = "import sys; from workbench.cli import main; main(['hw', '--json']); print(sorted(m for m in ('torch', 'PySide6') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith("[]")


def test_presets_listing(capsys):
    assert main(["hw", "--presets"]) == 0
    out = capsys.readouterr().out
    assert "bench-h200" in out and "rtx4090" in out and "server-12ch" in out
    assert main(["hw", "--presets", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["machines"]["bench-h200"]["h2d_pinned"] == 54.9e9


def test_gpu_text_shows_values_and_na():
    nvml = Nvml(make_nvml([FakeGpu(unsupported={"nvmlDeviceGetPowerUsage"}, processes=[(1, 2 << 30)])]))
    text = "\n".join(format_gpu(nvml.gpu(0)))
    assert "NVIDIA Stand-in 24GB" in text and "3.0 GiB used / 24.0 GiB" in text
    assert "power N/A / 450 W" in text and "gen 4 x16" in text and "2.0 GiB" in text
    lost = make_nvml([FakeGpu(lost=True)])
    assert "LOST" in "\n".join(format_gpu(Nvml(lost).gpu(0)))
