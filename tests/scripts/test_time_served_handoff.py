"""scripts/time_served_handoff.py: the decode server driven from the host, every layer's packet giving
the CPU its picks or only a share of them (the rest empty)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from workbench.engine import cpu_kernel
from workbench.engine.calibrate import random_stacks

pytestmark = pytest.mark.skipif(not cpu_kernel.available(), reason="needs the fused CPU kernel (a C++ compiler)")

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "time_served_handoff.py"


def test_sparse_layers_time_the_packets_with_picks_apart_from_the_empty_ones():
    spec = importlib.util.spec_from_file_location("time_served_handoff", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    w = random_stacks("bf16", 6, 64, 96)
    dense = mod.measure("bf16", 4, 6, 64, 96, 4, 1, 6, 1, w, every=1.0)
    assert dense["round_trip_s"] > 0 and dense["errors"] == 0 and dense["empty_trip_s"] is None
    sparse = mod.measure("bf16", 4, 6, 64, 96, 4, 1, 8, 1, w, every=0.5, gap_s=1e-5)
    assert sparse["round_trip_s"] > 0 and sparse["errors"] == 0 and sparse["every"] == 0.5
    assert sparse["empty_trip_s"] is not None and sparse["empty_trip_s"] > 0
