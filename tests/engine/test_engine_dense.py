"""Dense models (family ``dense``: Llama, Mistral, Qwen2, Qwen3) run like transformers, also from GGUF."""

from __future__ import annotations

import pytest
import torch

from tests.engine.engine_helpers import (
    PROMPT,
    TEST_DEVICE,
    TEST_DTYPE,
    greedy_tokens,
    logits_tolerance,
    open_inventory,
    reference_logits,
    reference_tokens,
    rel_err,
)
from workbench.core.errors import ModelFormatError
from workbench.engine import Engine

BASE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=96, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
            pad_token_id=0)
DENSE = {
    # Llama 3 RoPE scaling (long-context frequencies) with a short original context so it matters
    "llama": dict(rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 16}),
    "mistral": dict(sliding_window=8),  # the 52 positions of the test cross the window
    "qwen2": {},
    "qwen3": dict(head_dim=8),
}


def build(model_type: str, folder, extra: dict | None = None):
    """A tiny random-init dense model saved to ``folder``; ``extra`` replaces ``DENSE[model_type]``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**BASE, **(DENSE[model_type] if extra is None else extra)})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.eval().save_pretrained(folder)
    return model


@pytest.fixture(scope="module", params=list(DENSE))
def dense(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, build(request.param, folder), folder


def test_dense_model_matches_transformers(dense):
    model_type, model, folder = dense
    inv = open_inventory(folder)
    assert inv.family == "dense"
    engine = Engine.load(inv, None, device=TEST_DEVICE, dtype=TEST_DTYPE, max_context=64)
    ref = reference_logits(model, PROMPT)
    assert rel_err(engine.forward(torch.tensor(PROMPT), 0), ref) < logits_tolerance(model, PROMPT, ref)
    if TEST_DTYPE == torch.float32:
        assert greedy_tokens(engine, PROMPT, 32) == reference_tokens(model, PROMPT, 32)
    assert engine.routing_counts().sum() == 0
    engine.close()


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_dense_gguf_with_permuted_qk_matches_transformers(model_type, tmp_path):
    """llama.cpp's llama architecture (Llama, Mistral) permutes Q/K rows; Qwen's do not. (Plain RoPE:
    llama.cpp keeps Llama 3 scaling as a ``rope_freqs`` tensor, which the workbench writer does not
    write; see test_engine_llamacpp_gguf for files from llama.cpp's converter.)"""
    from workbench.core.gguf_writer import write_gguf

    model = build(model_type, tmp_path / "hf", {"head_dim": 8} if model_type == "qwen3" else {})
    path = write_gguf(tmp_path / "hf", tmp_path / f"{model_type}.gguf", "F32")[0]
    inv = open_inventory(path)
    engine = Engine.load(inv, None, device=TEST_DEVICE, dtype=TEST_DTYPE, max_context=64)
    ref = reference_logits(model, PROMPT)
    assert rel_err(engine.forward(torch.tensor(PROMPT), 0), ref) < logits_tolerance(model, PROMPT, ref)
    if TEST_DTYPE == torch.float32:
        assert greedy_tokens(engine, PROMPT, 32) == reference_tokens(model, PROMPT, 32)
    engine.close()


def test_dense_models_the_engine_does_not_run_are_refused():
    from workbench.engine.families import ModelArgs

    with pytest.raises(ModelFormatError, match="does not run dense olmo2"):
        ModelArgs.from_config("dense", {**BASE, "num_hidden_layers": 2, "model_type": "olmo2"})
