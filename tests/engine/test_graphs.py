"""Decode steps as captured CUDA graphs (``graphs.DecodeStep``) stay right when the engine's lazily
grown buffers grow after the capture (a longer prompt after the first decode steps), and the routing
counts they add up are exact. On the CPU the same fixed-shape pieces run eagerly."""

from __future__ import annotations

import numpy as np
import torch

from tests.engine.engine_helpers import (
    N_NEW,
    PROMPT,
    TEST_DTYPE,
    decode_step_engine,
    greedy_tokens,
    open_inventory,
    placements,
    reference_tokens,
)


def test_longer_prompt_after_captured_steps_and_exact_counts(tiny_model_dir, tiny_hf_model):
    inv = open_inventory(tiny_model_dir("qwen3_moe"))
    model = tiny_hf_model("qwen3_moe")
    engine = decode_step_engine(inv, placements(inv)["mixed"], max_context=80)
    try:
        greedy_tokens(engine, PROMPT[:3], 4)  # captures the decode step with a 3-token prefill behind it
        engine.reset_routing_counts()
        tokens = greedy_tokens(engine, PROMPT, N_NEW)  # a longer prefill grows the per-call buffers
        if TEST_DTYPE == torch.float32:
            assert tokens == reference_tokens(model, PROMPT, N_NEW)
        counts = engine.routing_counts()
        k = inv.spec.n_experts_active
        picks = (len(PROMPT) + N_NEW - 1) * k  # the last token is sampled, never fed back
        moe = list(inv.spec.moe_layers)
        assert (counts >= 0).all()
        assert np.all(counts[moe].sum(axis=1) == picks)
    finally:
        engine.close()
