import json
import math
from dataclasses import replace

import pytest

from workbench.core.errors import WorkbenchError
from workbench.core.hardware import (
    PRESETS_PATH,
    GpuProfile,
    HardwareProfile,
    HardwareProfileError,
    load_presets,
    preset,
    preset_names,
)

GiB = 2**30
ISSUE_GPUS = (
    "rtx3060-12g",
    "rtx3090",
    "rtx4060ti-16g",
    "rtx4090",
    "rtx5090",
    "rtx6000-ada",
    "a100-80g",
    "h100-80g",
    "h200",
)
ISSUE_HOSTS = ("ddr4-2ch", "ddr5-2ch", "server-8ch", "server-12ch")


def test_presets_load_validate_and_cite_sources():
    p = load_presets()
    assert p.problems() == []
    assert set(ISSUE_GPUS) <= set(p.gpus) and set(ISSUE_HOSTS) <= set(p.hosts)
    for entry in [*p.gpus.values(), *p.hosts.values(), *p.machines.values()]:
        assert entry["sources"] and all(len(s) > 20 for s in entry["sources"])
    for eff in p.efficiency.values():
        assert eff["source"]
    assert "bench-h200" in preset_names()


def test_datasheet_figures_carried_into_profiles():
    p = load_presets()
    g = p.gpu("rtx4090")
    assert g.vram_bytes == 24 * GiB and g.pcie_gen == 4 and g.pcie_width == 16
    assert g.mem_bandwidth == pytest.approx(1008e9 * p.efficiency["gpu_memory"]["value"])
    h200 = p.gpu("h200")
    assert h200.vram_bytes > 140 * GiB and h200.pcie_gen == 5
    # a PCIe 4 x8 card in a PCIe 5 host runs at gen 4 x8: a quarter of a gen-5 x16 link
    slow = preset("rtx4060ti-16g+ddr5-2ch")
    fast = preset("rtx5090+ddr5-2ch")
    assert slow.h2d_pinned == pytest.approx(fast.h2d_pinned / 4, rel=0.01)
    # a gen-5 card in a gen-4 host runs at gen 4
    assert preset("rtx5090+ddr4-2ch").h2d_pinned == pytest.approx(preset("rtx4090+ddr4-2ch").h2d_pinned)
    assert fast.h2d_pageable < fast.h2d_pinned and fast.d2h_pinned == fast.h2d_pinned


def test_preset_names_and_composition():
    two = preset("2x rtx3090+ddr4-2ch")
    assert len(two.gpus) == 2 and two.gpus[0].name == "NVIDIA GeForce RTX 3090"
    assert two.host_ram_bytes == 64 * GiB and two.cpu_cores == 8
    server = preset("server-12ch")
    assert server.gpus == () and math.isnan(server.h2d_pinned)
    assert (
        server.provenance["h2d_pinned"] == "absent"
        and server.provenance["host_read_bandwidth"] == "preset:server-12ch"
    )
    assert server.host_read_bandwidth > preset("ddr5-2ch").host_read_bandwidth * 4
    assert set(server.cpu_expert_throughput) >= {"bf16", "f32", "int8", "int4"}
    bench = preset("bench-h200")
    assert bench.h2d_pinned == 54.9e9 and bench.host_read_bandwidth == 88e9 and bench.cpu_cores == 16
    assert bench.gpus[0].mem_bandwidth == 4.12e12 and bench.cpu_expert_throughput["bf16"] == 47e9
    for bad, msg in (
        ("rtx4090", "name a host"),
        ("nope", "unknown hardware preset"),
        ("nope+ddr4-2ch", "unknown GPU"),
    ):
        with pytest.raises(WorkbenchError, match=msg):
            preset(bad)


def test_profile_json_roundtrip_and_save_load(tmp_path):
    for name in ("bench-h200", "server-8ch", "2x rtx4090+server-8ch"):
        prof = preset(name)
        text = json.dumps(prof.to_json(), allow_nan=False)
        back = HardwareProfile.from_json(json.loads(text))
        assert back.to_json() == prof.to_json()
        path = tmp_path / f"{name}.json"
        prof.save(path)
        assert HardwareProfile.load(path).to_json() == prof.to_json()
        assert not path.with_name(path.name + ".tmp").exists()
    with_syncs = replace(preset("bench-h200"), sync_by_format={"q8_0": 6e-5})
    assert HardwareProfile.from_json(json.loads(json.dumps(with_syncs.to_json()))) == with_syncs
    bad = replace(with_syncs, sync_by_format={"q8_0": 2.0})
    assert any("sync_by_format[q8_0]" in p for p in bad.problems())
    # a plain profile written before 'provenance' existed still loads
    old = preset("bench-h200").to_json()
    del old["provenance"]
    assert HardwareProfile.from_json(old).provenance == {}


def test_bad_profiles_are_refused_with_reasons(tmp_path):
    good = preset("rtx4090+ddr5-2ch")
    d = good.to_json()
    d["h2d_pinned"] = 25  # GB/s typed where B/s is meant
    d["gpus"][0]["vram_bytes"] = 24
    d["cpu_cores"] = 0
    with pytest.raises(HardwareProfileError) as e:
        HardwareProfile.from_json(d).validate()
    msg = str(e.value)
    assert "h2d_pinned" in msg and "not GB/s" in msg and "vram_bytes" in msg and "cpu_cores" in msg
    with pytest.raises(HardwareProfileError, match="not a valid hardware profile"):
        HardwareProfile.from_json({"name": "x", "bogus_field": 1})
    bad = tmp_path / "bad.json"
    bad.write_text("{ not json")
    with pytest.raises(HardwareProfileError, match="is not JSON"):
        HardwareProfile.load(bad)
    with pytest.raises(HardwareProfileError, match="cannot read"):
        HardwareProfile.load(tmp_path / "missing.json")
    assert GpuProfile("x", 24 * GiB, 1e12, 1e14, pcie_gen=9).problems() == [
        "pcie_gen 9 is not a PCIe generation"
    ]


def test_broken_presets_file_is_reported(tmp_path):
    d = json.loads(PRESETS_PATH.read_text())
    d["gpus"]["rtx4090"]["sources"] = []
    del d["hosts"]["ddr4-2ch"]["cpu_cores"]
    path = tmp_path / "presets.json"
    path.write_text(json.dumps(d))
    problems = load_presets(path).problems()
    assert "GPU preset rtx4090: no source cited" in problems
    assert "host preset ddr4-2ch: missing cpu_cores" in problems
    d["schema_version"] = 7
    path.write_text(json.dumps(d))
    with pytest.raises(HardwareProfileError, match="schema_version"):
        load_presets(path)


def test_measured_h200_profile_file_agrees_with_the_preset():
    measured = HardwareProfile.load(PRESETS_PATH.with_name("bench-h200-calibrated.json"))
    assert measured.provenance["gpus"] == "measured" and "torch 2.11" in measured.source
    bench = preset("bench-h200")
    g, m = bench.gpus[0], measured.gpus[0]
    assert g.vram_bytes == m.vram_bytes and g.pcie_gen == m.pcie_gen == 5
    for a, b in ((g.launch_s, m.launch_s), (g.expert_bandwidth, m.expert_bandwidth), (g.bf16_flops, m.bf16_flops)):
        assert a == pytest.approx(b, rel=0.01)
    assert bench.h2d_pinned == pytest.approx(measured.h2d_pinned, rel=0.02)  # BENCH.md and calibrate agree


def test_a_profile_at_another_host_read_moves_each_cpu_rate_by_its_share_of_ram_time():
    base = replace(preset("bench-h200"), host_read_bandwidth=100e9,
                   cpu_expert_throughput={"bf16": 100e9, "q8_0": 50e9, "f32": 150e9})
    slower = base.at_host_read(80e9)
    assert slower.host_read_bandwidth == pytest.approx(80e9)
    assert slower.cpu_expert_throughput["bf16"] == pytest.approx(80e9)  # at the RAM's rate: moves with it
    assert slower.cpu_expert_throughput["f32"] == pytest.approx(120e9)  # above it (caches): all RAM time
    # half of its time on the RAM: 1 / (0.5 / 0.8 + 0.5) = 0.889 of the rate
    assert slower.cpu_expert_throughput["q8_0"] == pytest.approx(50e9 / (0.5 / 0.8 + 0.5))
    assert slower.gpus == base.gpus and slower.sync_s == base.sync_s  # the GPU side stays
    # a reading far off (a probe that met a burst) moves the RAM read at most by the limits
    assert base.at_host_read(1e9).host_read_bandwidth == pytest.approx(50e9)
    assert base.at_host_read(float("nan")) is base and base.at_host_read(0.0) is base
