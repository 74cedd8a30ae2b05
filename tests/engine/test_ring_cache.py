"""Windowed attention layers keep a ring of their last positions (``model.KVCache``): the engine's
KV memory equals what ``core.memory`` predicts, going back past what a ring holds is refused with a
clear message, and the generator then prefills again and still computes what transformers does."""

from __future__ import annotations

import pytest
import torch

from tests.engine.engine_helpers import (
    N_NEW,
    PROMPT,
    TEST_DEVICE,
    TEST_DTYPE,
    greedy_tokens,
    open_inventory,
    reference_tokens,
)
from workbench.core.errors import WorkbenchError
from workbench.core.memory import estimate_memory, placement_all_gpu
from workbench.engine import Engine
from workbench.engine.generate import Generator
from workbench.engine.sampling import SamplingParams


@pytest.fixture(scope="module")
def gpt_oss(tiny_model_dir, tiny_hf_model):
    return open_inventory(tiny_model_dir("gpt_oss")), tiny_hf_model("gpt_oss")


def test_kv_memory_is_what_the_estimate_predicts(gpt_oss):
    inv, _ = gpt_oss
    engine = Engine.load(inv, device=TEST_DEVICE, dtype=torch.float32, max_context=96)
    try:
        rings = [c.size for c in engine.caches if c.ring]
        assert rings and all(size < 96 for size in rings)  # the sliding layers keep their window only
        est = estimate_memory(inv, placement_all_gpu(inv), ctx=96, kv_dtype="f32")
        assert engine.memory_breakdown()["gpu:0"]["kv_cache"] == est.tiers["gpu:0"].kv_cache
    finally:
        engine.close()


def test_going_back_past_the_ring_is_refused_and_the_generator_prefills_again(gpt_oss):
    inv, model = gpt_oss
    engine = Engine.load(inv, device=TEST_DEVICE, dtype=TEST_DTYPE, max_context=96)
    try:
        greedy_tokens(engine, PROMPT, N_NEW)  # positions 0..50 written; the 8-slot rings hold 43..50
        with pytest.raises(WorkbenchError, match="keep only the last 8 positions"):
            engine.forward(torch.tensor(PROMPT[12:]), 12)
        assert engine.resumable(0) and engine.resumable(len(PROMPT) + N_NEW - 1)
        gen = Generator(engine, eos_ids=[])
        greedy = SamplingParams(temperature=0.0)
        gen.generate(PROMPT, max_new_tokens=4, sampling=greedy)
        other = PROMPT[:15] + [6, 12, 14]  # shares 15 tokens, then differs: the rings cannot go back
        result = gen.generate(other, max_new_tokens=N_NEW, sampling=greedy)
        assert result.timings.reused_tokens == 0
        if TEST_DTYPE == torch.float32:
            assert result.tokens == reference_tokens(model, other, N_NEW)
    finally:
        engine.close()
