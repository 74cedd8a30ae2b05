"""Session: the app state without Qt. Edits, undo data, budgets, predictions, stats, events."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest

from tests.ui.synthetic import synthetic_inventory
from workbench.core.errors import PlacementError
from workbench.core.hardware import preset
from workbench.core.placement import CPU_COMPUTE, ON_GPU0, Assignment
from workbench.core.units import UnitKey
from workbench.session import TIER_CPU_COMPUTE, TIER_GPU0, ChatState, Session


@pytest.fixture
def session():
    s = Session()
    s.set_hardware(preset("rtx4090+ddr5-2ch"))
    s.set_model(synthetic_inventory(n_layers=6, n_experts=16, expert_bytes=64 * 2**20))
    return s


def test_session_does_not_import_qt_or_torch():
    code = ("import sys, workbench.session; s = workbench.session.Session(); "
            "bad = [m for m in ('PySide6', 'pyqtgraph', 'torch') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_move_and_restore(session):
    events = []
    session.events.placement_changed.connect(lambda p: events.append(p))
    keys = [UnitKey(2, "expert", e) for e in range(4)]
    before = session.prediction()
    previous = session.move_units(keys, CPU_COMPUTE)
    assert all(session.placement.get(k) == CPU_COMPUTE for k in keys)
    assert session.tier_grid()[2, :4].tolist() == [TIER_CPU_COMPUTE] * 4
    assert session.tier_grid()[2, 4:].tolist() == [TIER_GPU0] * 12
    after = session.prediction()
    moved = 4 * session.unit_bytes(keys[0])
    assert before.tier_total("gpu:0") - after.tier_total("gpu:0") == moved
    assert after.tier_total("cpu") - before.tier_total("cpu") == moved
    assert not math.isnan(after.decode_tps) and after.decode_tps != before.decode_tps
    assert session.dirty and events
    session.set_assignments(previous)
    assert session.placement.get(keys[0]) == ON_GPU0
    assert session.prediction().tier_total("gpu:0") == before.tier_total("gpu:0")


def test_fast_drag_prediction_equals_full_prediction(session):
    keys = [UnitKey(layer, "expert", e) for layer in (1, 3) for e in range(0, 16, 3)]
    session.move_units(keys[:3], CPU_COMPUTE)
    pred, reason = session.check_move(keys, CPU_COMPUTE)
    trial = session.placement.copy()
    trial.move(keys, CPU_COMPUTE)
    full = session.predict(trial)
    assert reason == ""
    for tier in ("gpu:0", "cpu"):
        assert pred.tier_total(tier) == full.tier_total(tier)
    assert pred.decode_tps == pytest.approx(full.decode_tps, rel=1e-9)


def test_over_budget_move_is_refused_with_the_reason(session):
    session.move_units(session.inventory.expert_keys(), CPU_COMPUTE)
    gpu_now = session.prediction().tier_total("gpu:0")
    capacity = session.capacity("gpu:0")
    # leave room for one expert and a half on the GPU
    session.set_margin(capacity - gpu_now - int(1.5 * 64 * 2**20))
    one = [UnitKey(0, "expert", 0)]
    two = [UnitKey(0, "expert", 1), UnitKey(0, "expert", 2)]
    assert session.check_move(one, ON_GPU0)[1] == ""
    pred, reason = session.check_move(two, ON_GPU0)
    assert "GPU 0" in reason and "over its budget" in reason
    with pytest.raises(PlacementError, match="over its budget"):
        session.move_units(two, ON_GPU0)
    assert session.placement.get(two[0]) == CPU_COMPUTE
    # moving more off an over-full GPU is never refused
    session.set_margin(capacity)
    assert session.check_move(one, CPU_COMPUTE)[1] == ""


def test_budgets_are_measured_free_memory_minus_margin(session):
    session.set_measured({"gpu:0": (24 * 2**30, 20 * 2**30), "cpu": (64 * 2**30, 50 * 2**30)})
    session.set_margin(2**30)
    assert session.budgets() == {"gpu:0": 19 * 2**30, "cpu": 49 * 2**30}
    session.set_measured({})
    assert session.budgets()["gpu:0"] == session.hardware.gpus[0].vram_bytes - 2**30


def test_frequency_grid_is_per_layer(session):
    counts = np.zeros((6, 16))
    counts[0, :2] = [30, 10]  # layer 0: two experts
    counts[1, :] = 1  # layer 1: uniform
    session.set_counts(counts)
    f = session.frequency_grid()
    assert f[0, 0] == pytest.approx(30 / 40 * 16) and f[0, 2] == 0
    assert np.allclose(f[1], 1.0)
    assert np.isnan(f[2]).all()  # nothing counted in layer 2


def test_chat_state_round_trip():
    c = ChatState()
    c.system_prompt = "Be brief."
    c.sampling["temperature"] = 0.0
    c.template_override = "{{ messages[0].content }}"
    from workbench.session import ChatMessage

    c.messages = [ChatMessage("user", "hi"), ChatMessage("assistant", "hello", {"tokens": 3})]
    d = ChatState.from_json(c.to_json())
    assert d.to_json() == c.to_json()


def test_plan_strategy_fits_the_budget(session):
    session.set_measured({"gpu:0": (8 * 2**30, 3 * 2**30)})
    placement = session.plan("frequency")
    previous = session.set_placement(placement)
    assert session.prediction().tier_total("gpu:0") <= session.budgets()["gpu:0"]
    assert session.prediction().over == {}
    session.set_placement(previous)
    assert session.placement.get(UnitKey(0, "expert", 0)) == Assignment("gpu:0")


def test_fast_predictions_after_move_and_undo_match_full_ones(session):
    keys = [UnitKey(4, "expert", e) for e in range(0, 16, 2)]
    previous = session.move_units(keys, CPU_COMPUTE)
    fast = session.prediction()
    full = session.predict()
    for tier in ("gpu:0", "cpu"):
        assert fast.tier_total(tier) == full.tier_total(tier)
    assert fast.decode_tps == pytest.approx(full.decode_tps, rel=1e-9)
    session.set_assignments(previous)
    assert session.prediction().tier_total("gpu:0") == session.predict().tier_total("gpu:0")
    with pytest.raises(PlacementError, match="not in this model"):
        session.move_units([UnitKey(99, "expert", 0)], CPU_COMPUTE, force=True)
