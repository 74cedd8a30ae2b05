"""The naming table: HF and llama.cpp tensor names -> units, for every family."""

from __future__ import annotations

from pathlib import Path

import pytest

from workbench.core.errors import ModelFormatError
from workbench.core.naming import TensorRole, assign_units, gguf_role, hf_role
from workbench.core.units import TensorInfo, UnitKey

R = TensorRole
HF_TABLE = [
    ("model.embed_tokens.weight", R(None, "embed")),
    ("lm_head.weight", R(None, "lm_head")),
    ("model.norm.weight", R(None, "norm")),
    ("model.layers.3.input_layernorm.weight", R(3, "norm")),
    ("model.layers.3.post_attention_layernorm.weight", R(3, "norm")),
    ("model.layers.3.self_attn.q_proj.weight", R(3, "attn")),
    ("model.layers.3.self_attn.k_proj.bias", R(3, "attn")),
    ("model.layers.3.self_attn.q_norm.weight", R(3, "attn")),
    ("model.layers.3.self_attn.sinks", R(3, "attn")),  # gpt-oss
    ("model.layers.3.self_attn.kv_a_proj_with_mqa.weight", R(3, "attn")),  # DeepSeek MLA
    ("model.layers.3.self_attn.kv_b_proj.weight_scale_inv", R(3, "attn")),  # DeepSeek-V3 FP8 scales
    # routers
    ("model.layers.3.mlp.gate.weight", R(3, "router")),
    ("model.layers.3.mlp.gate.e_score_correction_bias", R(3, "router")),
    ("model.layers.3.block_sparse_moe.gate.weight", R(3, "router")),
    ("model.layers.3.feed_forward.router.weight", R(3, "router")),
    ("model.layers.3.mlp.router.weight", R(3, "router")),
    ("model.layers.3.mlp.router.bias", R(3, "router")),
    # shared experts
    ("model.layers.3.mlp.shared_expert.gate_proj.weight", R(3, "shared")),
    ("model.layers.3.mlp.shared_expert_gate.weight", R(3, "shared")),
    ("model.layers.3.mlp.shared_experts.down_proj.weight", R(3, "shared")),
    ("model.layers.3.feed_forward.shared_expert.up_proj.weight", R(3, "shared")),
    # per-expert tensors
    ("model.layers.3.mlp.experts.17.gate_proj.weight", R(3, "expert", 17)),
    ("model.layers.3.mlp.experts.0.down_proj.weight", R(3, "expert", 0)),
    ("model.layers.3.mlp.experts.255.up_proj.weight_scale_inv", R(3, "expert", 255)),
    ("model.layers.3.block_sparse_moe.experts.7.w1.weight", R(3, "expert", 7)),
    ("model.layers.3.block_sparse_moe.experts.7.w2.weight", R(3, "expert", 7)),
    # fused / stacked tensors
    ("model.layers.3.mlp.experts.gate_up_proj", R(3, "expert", stacked=True)),
    ("model.layers.3.mlp.experts.gate_up_proj_bias", R(3, "expert", stacked=True)),
    ("model.layers.3.mlp.experts.down_proj_blocks", R(3, "expert", stacked=True)),  # gpt-oss MXFP4
    ("model.layers.3.mlp.experts.down_proj_scales", R(3, "expert", stacked=True)),
    ("model.layers.3.feed_forward.experts.down_proj", R(3, "expert", stacked=True)),
    ("model.layers.3.block_sparse_moe.experts.gate_up_proj", R(3, "expert", stacked=True)),
    ("language_model.model.layers.3.feed_forward.experts.gate_up_proj", R(3, "expert", stacked=True)),
    # dense MLPs
    ("model.layers.0.mlp.gate_proj.weight", R(0, "dense_mlp")),
    ("model.layers.0.feed_forward.down_proj.weight", R(0, "dense_mlp")),
    ("language_model.model.embed_tokens.weight", R(None, "embed")),
    ("language_model.lm_head.weight", R(None, "lm_head")),
    # unknown
    ("model.layers.3.mystery.weight", None),
    ("vision_model.patch_embedding.weight", None),
    ("model.layers.3.mlp.experts.x.up_proj.weight", None),
]

GGUF_TABLE = [
    ("token_embd.weight", R(None, "embed")),
    ("output_norm.weight", R(None, "norm")),
    ("output.weight", R(None, "lm_head")),
    ("rope_freqs.weight", R(None, "embed")),
    ("blk.5.attn_norm.weight", R(5, "norm")),
    ("blk.5.ffn_norm.weight", R(5, "norm")),
    ("blk.5.post_attention_norm.weight", R(5, "norm")),
    ("blk.5.attn_q.weight", R(5, "attn")),
    ("blk.5.attn_q.bias", R(5, "attn")),
    ("blk.5.attn_k_norm.weight", R(5, "attn")),
    ("blk.5.attn_kv_a_mqa.weight", R(5, "attn")),
    ("blk.5.attn_k_b.weight", R(5, "attn")),
    ("blk.5.attn_sinks.weight", R(5, "attn")),
    ("blk.5.ffn_gate_inp.weight", R(5, "router")),
    ("blk.5.ffn_gate_inp.bias", R(5, "router")),
    ("blk.5.exp_probs_b.bias", R(5, "router")),
    ("blk.5.ffn_gate_inp_shexp.weight", R(5, "shared")),
    ("blk.5.ffn_up_shexp.weight", R(5, "shared")),
    ("blk.5.ffn_gate_exps.weight", R(5, "expert", stacked=True)),
    ("blk.5.ffn_down_exps.weight", R(5, "expert", stacked=True)),
    ("blk.5.ffn_up_exps.bias", R(5, "expert", stacked=True)),
    ("blk.5.ffn_gate_up_exps.weight", R(5, "expert", stacked=True)),
    ("blk.5.ffn_gate.weight", R(5, "dense_mlp")),
    ("blk.5.ffn_down.weight", R(5, "dense_mlp")),
    ("blk.5.ffn_gate.3.weight", R(5, "expert", 3)),  # Mixtral GGUFs of 2023, one tensor per expert
    ("blk.5.ffn_down.0.weight", R(5, "expert", 0)),
    ("blk.5.mystery.weight", None),
    ("mystery.weight", None),
]


@pytest.mark.parametrize(("name", "role"), HF_TABLE)
def test_hf_names(name, role):
    assert hf_role(name) == role


@pytest.mark.parametrize(("name", "role"), GGUF_TABLE)
def test_gguf_names(name, role):
    assert gguf_role(name) == role


def _t(name: str, shape: tuple[int, ...]) -> TensorInfo:
    n = 4
    for d in shape:
        n *= d
    return TensorInfo(name, shape, "F32", n, Path("x"), 0)


def test_assign_units_shares_stacked_tensors_out():
    tensors = {t.name: t for t in [_t("blk.0.ffn_up_exps.weight", (4, 8, 16)), _t("blk.0.attn_q.weight", (16, 16)),
                                   _t("token_embd.weight", (10, 16))]}
    units, skipped = assign_units(tensors, "gguf", n_layers=1, n_experts=4)
    assert skipped == []
    refs = [units[UnitKey(0, "expert", e)].tensors[0] for e in range(4)]
    assert [r.offset for r in refs] == [0, 512, 1024, 1536] and all(r.nbytes == 512 for r in refs)
    assert units[UnitKey(0, "expert", 3)].n_params == 8 * 16


def test_assign_units_errors_name_the_tensor():
    with pytest.raises(ModelFormatError, match="blk.0.mystery.weight"):
        assign_units({"blk.0.mystery.weight": _t("blk.0.mystery.weight", (2,))}, "gguf", 1, 4)
    with pytest.raises(ModelFormatError, match="should stack 4 experts"):
        assign_units({"blk.0.ffn_up_exps.weight": _t("blk.0.ffn_up_exps.weight", (3, 8, 16))}, "gguf", 1, 4)
    name = "model.layers.0.mlp.experts.9.up_proj.weight"
    with pytest.raises(ModelFormatError, match="expert 9"):
        assign_units({name: _t(name, (8, 16))}, "safetensors", 1, 4)


def test_layers_past_the_model_are_skipped():
    name = "model.layers.3.mlp.experts.0.up_proj.weight"  # DeepSeek-V3's MTP layer sits at index n_layers
    mtp = "model.layers.3.eh_proj.weight"
    vision = "vision_model.model.layers.0.mlp.fc1.weight"  # Llama 4 Scout's vision tower
    tensors = {n: _t(n, (8, 16)) for n in (name, mtp, vision, "multi_modal_projector.linear_1.weight")}
    units, skipped = assign_units(tensors, "safetensors", n_layers=3, n_experts=4)
    assert units == {} and skipped == list(tensors)
