"""The engine computes what transformers computes, per family and per placement.

For each family: a tiny random-init transformers model (fp32); the engine's whole-prompt logits are
within 1e-4 relative of transformers' (1e-2 in bf16 on CUDA) and its 32 greedy tokens equal
transformers' ``generate(do_sample=False)`` with every routed expert resident, all computed on the
CPU, all streamed through fewer cache slots than a layer has experts, and a random mix.
Set ``WORKBENCH_TEST_DEVICE=cuda`` to run the same tests with the accelerator on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.engine_helpers import (
    N_NEW,
    PROMPT,
    TEST_DEVICE,
    TEST_DTYPE,
    decode_step_engine,
    greedy_tokens,
    logits_tolerance,
    open_inventory,
    placements,
    reference_logits,
    reference_tokens,
    rel_err,
)
from workbench.engine import Engine

FAMILIES = {
    "mixtral": {},
    "qwen2_moe": {},
    "qwen3_moe": {},
    "olmoe": {},
    # floor_scale 4 so that attention temperature tuning changes the NoPE layer from position 3 on;
    # the 20-token prompt crosses the 16-token attention chunk.
    "llama4_text": {"floor_scale": 4},
    # group-limited greedy routing: 6 experts in 2 groups, only the best group's experts chosen
    "deepseek_v2": {"n_group": 2, "topk_group": 1, "topk_method": "group_limited_greedy"},
    # seed 9 (build_hf_model's seed): the seed-0 model's routing has a near-tie that bf16 rounding
    # flips (see test_fixture_routing_margins)
    "deepseek_v3": {"seed": 9},
    # sliding window of 8 on even layers, attention sinks, clamped SwiGLU with biases, YaRN RoPE
    "gpt_oss": {},
}


class Case:
    def __init__(self, model, folder):
        self.model = model
        self.inventory = open_inventory(folder)
        self.logits = reference_logits(self.model, PROMPT)
        self.tolerance = logits_tolerance(self.model, PROMPT, self.logits)
        self.tokens = reference_tokens(self.model, PROMPT, N_NEW)


@pytest.fixture(scope="module", params=list(FAMILIES))
def case(request, tiny_model_dir, tiny_hf_model):
    overrides = FAMILIES[request.param]
    return Case(tiny_hf_model(request.param, **overrides), tiny_model_dir(request.param, **overrides))


def assert_greedy_like_reference(case: Case, tokens: list[int]) -> None:
    """fp32: the tokens equal transformers'. bf16: every chosen token is transformers' top token or
    within twice the logit tolerance of it (checked by running transformers on the engine's own
    continuation), since a near-tie may go the other way in bf16."""
    if TEST_DTYPE == torch.float32:
        assert tokens == case.tokens
        return
    ref = reference_logits(case.model, PROMPT + tokens)[len(PROMPT) - 1:-1]  # [N_NEW, V]
    chosen = ref.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    gap = (ref.max(dim=1).values - chosen) / ref.abs().max()
    assert float(gap.max()) < 2 * case.tolerance, f"a token {float(gap.max()):.3f} below the reference's best"


@pytest.mark.parametrize("placement", ["resident", "compute", "stream", "mixed"])
def test_logits_and_greedy_tokens_match_transformers(case, placement):
    p = placements(case.inventory)[placement]
    engine = Engine.load(case.inventory, p, device=TEST_DEVICE, dtype=TEST_DTYPE, max_context=128)
    try:
        logits = engine.forward(torch.tensor(PROMPT), 0)
        assert logits.dtype == torch.float32 and logits.shape == (len(PROMPT), engine.vocab_size)
        assert rel_err(logits, case.logits) < case.tolerance
        assert_greedy_like_reference(case, greedy_tokens(engine, PROMPT, N_NEW))
        if placement == "stream":
            hits_fetches = engine.stream_stats()
            assert hits_fetches and all(f > 0 for _, f in hits_fetches.values())
    finally:
        engine.close()


def test_prefill_in_pieces_equals_whole_prompt(case):
    """Writing the KV cache in several calls gives the same logits as one call."""
    engine = Engine.load(case.inventory, placements(case.inventory)["mixed"], device=TEST_DEVICE,
                         dtype=TEST_DTYPE, max_context=64)
    whole = engine.forward(torch.tensor(PROMPT), 0)
    parts = [engine.forward(torch.tensor(PROMPT[:7]), 0), engine.forward(torch.tensor(PROMPT[7:12]), 7),
             engine.forward(torch.tensor(PROMPT[12:]), 12)]
    assert rel_err(torch.cat(parts), whole) < (1e-5 if TEST_DTYPE == torch.float32 else case.tolerance)
    engine.close()


def test_llama4_multimodal_checkpoint_names(tiny_model_dir, tiny_hf_model, tmp_path):
    """Llama 4 Scout/Maverick checkpoints nest the text model: ``language_model.model.layers...``,
    ``language_model.lm_head.weight`` and a config with ``text_config``."""
    import json

    from safetensors.torch import load_file, save_file

    src = tiny_model_dir("llama4_text", floor_scale=4)
    folder = tmp_path / "llama4-multimodal"
    folder.mkdir()
    text = json.loads((src / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({"model_type": "llama4", "text_config": text,
                                                    "architectures": ["Llama4ForConditionalGeneration"]}))
    tensors = load_file(src / "model.safetensors")
    save_file({"language_model." + k: v for k, v in tensors.items()}, folder / "model.safetensors",
              metadata={"format": "pt"})
    inv = open_inventory(folder)
    model = tiny_hf_model("llama4_text", floor_scale=4)
    ref = reference_logits(model, PROMPT)
    engine = Engine.load(inv, placements(inv)["mixed"], device=TEST_DEVICE, dtype=TEST_DTYPE, max_context=64)
    assert rel_err(engine.forward(torch.tensor(PROMPT), 0), ref) < logits_tolerance(model, PROMPT, ref)
    engine.close()


@pytest.mark.parametrize("placement", ["stream", "mixed"])
def test_static_decode_steps_match_transformers(case, placement):
    """The fixed-shape decode pieces that CUDA graphs capture (``graphs.DecodeStep``: token and
    position in device tensors, the whole KV cache under a mask, routing staged through host
    buffers) give transformers' greedy tokens; on CUDA the steps are captured and replayed."""
    engine = decode_step_engine(case.inventory, placements(case.inventory)[placement])
    try:
        assert_greedy_like_reference(case, greedy_tokens(engine, PROMPT, N_NEW))
        assert engine._decoder is not None
    finally:
        engine.close()


def test_gpt_oss_cpu_experts_run_in_the_fused_kernel(tiny_model_dir, monkeypatch):
    """gpt-oss's CPU-tier experts (biases, clamped SwiGLU) go through the fused CPU kernel, prompt and
    decode, and give the logits of the same experts resident (PyTorch's ops)."""
    from workbench.engine import cpu_kernel

    if not cpu_kernel.available():
        pytest.skip(f"fused CPU kernel unavailable here: {cpu_kernel.unavailable_reason()}")
    inv = open_inventory(tiny_model_dir("gpt_oss"))
    p = placements(inv)
    calls = []
    real = cpu_kernel.moe_decode

    def spy(*args, **kwargs):
        calls.append((kwargs.get("act"), kwargs.get("b13") is not None))
        return real(*args, **kwargs)

    runs = {}
    for name in ("resident", "compute"):
        engine = Engine.load(inv, p[name], device=TEST_DEVICE, dtype=torch.float32, max_context=64)
        try:
            monkeypatch.setattr(cpu_kernel, "moe_decode", spy)
            runs[name] = (engine.forward(torch.tensor(PROMPT), 0), greedy_tokens(engine, PROMPT, 4))
            monkeypatch.setattr(cpu_kernel, "moe_decode", real)
        finally:
            engine.close()
        assert bool(calls) == (name == "compute")
    assert all(act[0] == "clamped_swiglu" and biased for act, biased in calls)
    assert rel_err(runs["compute"][0], runs["resident"][0]) < 1e-5
    assert runs["compute"][1] == runs["resident"][1]
