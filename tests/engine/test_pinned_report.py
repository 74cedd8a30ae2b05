"""The engine reports its page-locked host memory to host telemetry while loaded on CUDA, and stops
when closed (on the CPU there is nothing pinned and nothing registered)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.engine.engine_helpers import TEST_DEVICE, open_inventory, placements
from workbench.engine import Engine
from workbench.telemetry import host


def test_pinned_memory_is_reported_while_loaded(tiny_model_dir):
    inv = open_inventory(tiny_model_dir("qwen3_moe"))
    engine = Engine.load(inv, placements(inv)["stream"], device=TEST_DEVICE, dtype=torch.float32, max_context=32)
    try:
        engine.forward(torch.tensor([1, 2, 3]), 0)
        if TEST_DEVICE == "cpu":
            assert engine.pinned_bytes() == 0
            pytest.skip("nothing is pinned without CUDA")
        stream = sum(lx.w13[2].numel() * lx.w13[2].element_size() + lx.w2[2].numel() * lx.w2[2].element_size()
                     for lx in engine.experts.values() if lx.w13[2] is not None)
        assert host.pinned_bytes() >= stream > 0
    finally:
        engine.close()
    assert math.isnan(host.pinned_bytes())
