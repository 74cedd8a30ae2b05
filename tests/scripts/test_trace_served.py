"""scripts/trace_served.py: a decode step split by the decode server's own clock."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "trace_served.py"


@pytest.fixture(scope="module")
def mod():
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("trace_served", SCRIPT)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def test_a_step_splits_into_the_cpus_part_and_the_rest(mod):
    """Three served layers a step (0, 1, 2; µs): an empty layer spans 50, an engaged one (one pair,
    40 of CPU) 110, so the hand-off beyond the CPU's work is 20; records outside the steps are left out."""
    us = 1000
    steps, rows = [], []
    for s in range(3):
        t0 = 10_000_000 * (s + 1)
        seen0 = t0 + 30 * us
        rows.append([0, s, seen0, seen0 + 1 * us, 0])  # empty: spans 50 to layer 1
        seen1 = seen0 + 50 * us
        rows.append([1, s, seen1, seen1 + 40 * us, 1])  # engaged: spans 110 to layer 2
        seen2 = seen1 + 110 * us
        rows.append([2, s, seen2, seen2 + 2 * us, 0])
        steps.append((t0, seen2 + 2 * us + 15 * us))
    rows.append([0, 9, 99_000_000_000, 99_000_000_100, 3])  # a warm-up step's packet
    s = mod.summarize(np.array(rows, dtype=np.int64), steps)
    assert s["n"] == {"0": 6, "1": 3, "2": 0, "3+": 0, "bus": 0}
    assert s["span"]["0"] == pytest.approx(50) and s["span"]["1"] == pytest.approx(110)
    assert s["cpu"]["1"] == pytest.approx(40) and s["after"]["1"] == pytest.approx(70)
    assert s["handoff"]["1"] == pytest.approx(20) and s["handoff"]["2"] is None
    assert s["lead_us"] == pytest.approx(30) and s["tail_us"] == pytest.approx(15)
    assert s["engaged"] == 1 and s["step_ms"] == pytest.approx(0.207)
    assert "| 1 | 3 | 40.0 | 110.0 | 70.0 | 20.0 |" in mod.report(s)


def test_layers_where_the_bus_took_pairs_are_counted_apart(mod):
    """A layer whose packet marks bus pairs goes to ``bus`` whatever the CPU's pairs; records of five
    columns (before the bus's) count none."""
    us = 1000
    rows = [[0, 0, 10 * us, 11 * us, 1, 0], [1, 0, 100 * us, 150 * us, 1, 1], [2, 0, 300 * us, 301 * us, 0, 0]]
    s = mod.summarize(np.array(rows, dtype=np.int64), [(0, 400 * us)])
    assert s["n"] == {"0": 1, "1": 1, "2": 0, "3+": 0, "bus": 1}
    assert s["span"]["bus"] == pytest.approx(200) and s["cpu"]["bus"] == pytest.approx(50)
    five = mod.summarize(np.array([r[:5] for r in rows], dtype=np.int64), [(0, 400 * us)])
    assert five["n"]["bus"] == 0 and five["n"]["1"] == 2
