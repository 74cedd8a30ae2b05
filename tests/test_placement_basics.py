import pytest

from workbench.core.placement import CPU_COMPUTE, CPU_STREAM, ON_GPU0, Assignment, Placement
from workbench.core.units import UnitKey


def test_assignment_parse_roundtrip():
    for a in (ON_GPU0, Assignment("gpu:3"), CPU_COMPUTE, CPU_STREAM):
        assert Assignment.parse(str(a)) == a
    assert Assignment.parse("cpu") == CPU_COMPUTE
    with pytest.raises(ValueError):
        Assignment("gpu:0", "stream")
    with pytest.raises(ValueError):
        Assignment("tpu:0")


def test_placement_json_roundtrip_and_default_collapses():
    p = Placement()
    p.move([UnitKey(1, "expert", e) for e in (0, 1, 2, 5, 7, 8)], CPU_COMPUTE)
    p.set(UnitKey(2, "expert", 3), CPU_STREAM)
    p.set(UnitKey(None, "lm_head"), CPU_COMPUTE)
    p.set(UnitKey(4, "attn"), ON_GPU0)  # equal to the default: stored as nothing
    p.stream_slots = 4
    obj = p.to_json()
    assert obj["assign"]["cpu:compute"]["experts"] == {"1": "0-2,5,7-8"}
    q = Placement.from_json(obj)
    assert q == p
    assert q.get(UnitKey(1, "expert", 6)) == ON_GPU0
    assert q.get(UnitKey(2, "expert", 3)) == CPU_STREAM
    assert UnitKey(4, "attn") not in p.assignments


def test_unit_key_order_and_validation():
    keys = [UnitKey(None, "lm_head"), UnitKey(1, "expert", 2), UnitKey(0, "attn"), UnitKey(None, "embed"),
            UnitKey(1, "expert", 0), UnitKey(1, "router")]
    assert sorted(keys) == [UnitKey(None, "embed"), UnitKey(0, "attn"), UnitKey(1, "router"),
                            UnitKey(1, "expert", 0), UnitKey(1, "expert", 2), UnitKey(None, "lm_head")]
    with pytest.raises(ValueError):
        UnitKey(0, "expert")
    with pytest.raises(ValueError):
        UnitKey(0, "mlp")
