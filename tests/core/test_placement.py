import numpy as np
import pytest

from workbench.core.errors import PlacementError
from workbench.core.memory import estimate_memory, placement_cpu_moe
from workbench.core.placement import (
    CPU_COMPUTE,
    CPU_STREAM,
    ON_GPU0,
    TIER_CPU_COMPUTE,
    TIER_CPU_STREAM,
    Assignment,
    Budget,
    Placement,
    check_budget,
    diff,
    expert_grid,
    fits,
    validate,
    with_expert_grid,
)
from workbench.core.units import UnitKey

from .synth_inventory import synth_inventory


def test_validate_reports_each_problem():
    inv = synth_inventory(2, 4)
    p = Placement()
    assert validate(p, inv) == []
    p.set(UnitKey(7, "expert", 0), CPU_COMPUTE)
    p.set(UnitKey(0, "expert", 1), CPU_STREAM)
    p.set(UnitKey(0, "attn"), CPU_STREAM)
    p.set(UnitKey(1, "expert", 2), Assignment("gpu:1"))
    problems = validate(p, inv, n_gpus=1)
    text = " | ".join(problems)
    assert "units this model does not have" in text
    assert "only routed experts can be streamed" in text
    assert "no slots" in text
    assert "gpu:1 is used" in text
    p.stream_slots = 2
    assert not any("no slots" in s for s in validate(p, inv, n_gpus=1))


def test_check_budget_uses_the_memory_estimate_and_margin():
    inv = synth_inventory(4, 8)
    p = placement_cpu_moe(inv)
    need = estimate_memory(inv, p, 1024).total("gpu:0")
    assert fits(p, inv, Budget((need,)), ctx=1024)
    assert not fits(p, inv, Budget((need - 1,)), ctx=1024)
    assert not fits(p, inv, Budget((need,), margin=1), ctx=1024)
    with pytest.raises(PlacementError, match="gpu:0 needs .* after a"):
        check_budget(p, inv, Budget((need,), margin=4096), ctx=1024)
    host = estimate_memory(inv, p, 1024).total("cpu")
    with pytest.raises(PlacementError, match="cpu needs"):
        check_budget(p, inv, Budget((need,), host_bytes=host - 1), ctx=1024)
    est = check_budget(p, inv, Budget((need,), host_bytes=host), ctx=1024)
    assert est.total("gpu:0") == need


def test_budget_from_profile():
    from workbench.core.hardware import GpuProfile, HardwareProfile

    hw = HardwareProfile("m", (GpuProfile("g", 24 * 2**30, 1e12, 1e14),), 64 * 2**30, 5e10, 2e10, 5e9, 2e10)
    b = Budget.from_profile(hw, margin=2**30)
    assert b.usable("gpu:0") == 23 * 2**30 and b.usable("cpu") == 64 * 2**30 and b.usable("gpu:3") == 0
    assert Budget.from_profile(hw, vram=2**30).gpu_bytes == (2**30,)


def test_diff_with_and_without_keys():
    inv = synth_inventory(2, 4)
    a, b = Placement(), Placement()
    b.set(UnitKey(1, "expert", 3), CPU_COMPUTE)
    assert diff(a, b) == [(UnitKey(1, "expert", 3), ON_GPU0, CPU_COMPUTE)]
    c = Placement(default=CPU_COMPUTE)
    with pytest.raises(ValueError):
        diff(a, c)
    d = diff(a, c, inv.units)
    assert len(d) == len(inv.units)
    assert diff(a, a.copy(), inv.units) == []


def test_expert_grid_roundtrip():
    inv = synth_inventory(3, 6)
    p = Placement(stream_slots=2)
    p.move([UnitKey(0, "expert", e) for e in range(3)], CPU_COMPUTE)
    p.set(UnitKey(2, "expert", 5), CPU_STREAM)
    p.set(UnitKey(1, "expert", 1), Assignment("gpu:1"))
    g = expert_grid(p, 3, 6)
    assert g.dtype == np.int16 and g.shape == (3, 6)
    assert list(g[0, :4]) == [TIER_CPU_COMPUTE] * 3 + [0]
    assert g[2, 5] == TIER_CPU_STREAM and g[1, 1] == 1
    q = with_expert_grid(Placement(stream_slots=2), g, inv.expert_keys())
    assert q == p
    g2 = g.copy()
    g2[1, :] = TIER_CPU_COMPUTE
    r = with_expert_grid(p, g2, inv.expert_keys())
    assert [k for k, _, _ in diff(p, r, inv.units)] == [UnitKey(1, "expert", e) for e in range(6)]
