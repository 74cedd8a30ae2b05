import os
from pathlib import Path

import pytest

from workbench.telemetry.host import (
    HostMonitor,
    clear_pinned_bytes_provider,
    cpu_info,
    parse_cpuinfo,
    pinned_bytes,
    set_pinned_bytes_provider,
)
from workbench.telemetry.na import NA

SAPPHIRE_RAPIDS = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu vme sse sse2 avx avx2 avx512f avx512dq avx512_bf16 amx_bf16 amx_tile amx_int8 avx512_fp16

processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu
"""
ZEN3 = "processor : 0\nmodel name : AMD Ryzen 7 5800X 8-Core Processor\nflags : fpu sse avx avx2 fma\n"
ARM = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm aes sve\nCPU implementer\t: 0x41\n"


def test_parse_cpuinfo_flags_and_model():
    model, flags = parse_cpuinfo(SAPPHIRE_RAPIDS)
    assert model == "Intel(R) Xeon(R) Platinum 8480+"
    assert flags == {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8"}
    assert parse_cpuinfo(ZEN3) == ("AMD Ryzen 7 5800X 8-Core Processor", frozenset({"avx2"}))
    assert parse_cpuinfo(ARM) == ("", frozenset())


def test_cpu_info_features_from_a_file(tmp_path):
    p = tmp_path / "cpuinfo"
    p.write_text(SAPPHIRE_RAPIDS)
    info = cpu_info(str(p))
    assert info.features == ["AVX2", "AVX-512", "AVX512-BF16", "AMX", "AMX-BF16", "AMX-INT8"]
    assert info.has_amx_bf16 and info.flags_known
    missing = cpu_info(str(tmp_path / "absent"))
    assert not missing.flags_known and missing.features == [] and missing.model


def test_this_machine():
    info = cpu_info()
    assert info.logical_cores >= info.usable_cores >= 1
    if Path("/proc/cpuinfo").exists():
        text = Path("/proc/cpuinfo").read_text()
        assert ("avx2" in text.split()) == ("AVX2" in info.features)
    snap = HostMonitor().snapshot()
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    assert snap.ram_total == int(meminfo["MemTotal"].split()[0]) * 1024
    assert 0 < snap.ram_available <= snap.ram_total and snap.ram_used == snap.ram_total - snap.ram_available
    assert snap.process_rss > 10 << 20  # this Python process with numpy and pytest loaded
    assert 0 <= snap.cpu_percent <= 100


def test_pinned_bytes_provider():
    assert pinned_bytes() is NA
    try:
        set_pinned_bytes_provider(lambda: 3 << 30)
        assert pinned_bytes() == 3 << 30
        assert HostMonitor(os.getpid()).snapshot().pinned_bytes == 3 << 30

        def broken():
            raise RuntimeError("engine torn down")

        set_pinned_bytes_provider(broken)
        assert pinned_bytes() is NA

        def newer():
            return 5

        set_pinned_bytes_provider(newer)
        clear_pinned_bytes_provider(broken)  # an older engine closing leaves the newer one registered
        assert pinned_bytes() == 5
        clear_pinned_bytes_provider(newer)
        assert pinned_bytes() is NA
    finally:
        set_pinned_bytes_provider(None)
    assert pinned_bytes() is NA


@pytest.mark.skipif(not Path("/proc/meminfo").exists(), reason="Linux only")
def test_snapshot_json_is_strict():
    import json

    json.dumps(HostMonitor().snapshot().to_json(), allow_nan=False)
    json.dumps(cpu_info().to_json(), allow_nan=False)
