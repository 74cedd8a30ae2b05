"""Tiny random-init transformers models of every supported family, saved with ``save_pretrained``.

Shared by the inventory, engine and planning tests. Each config exercises the family's quirks
(shared experts, dense layers, q/k norm, MLA, interleaved MoE, sliding/chunked attention...).
"""

from __future__ import annotations

from pathlib import Path

FAMILY_CONFIGS: dict[str, dict] = {
    "mixtral": dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=96,
        max_position_embeddings=256, rope_theta=10000.0,
    ),
    "qwen2_moe": dict(
        hidden_size=32, intermediate_size=64, moe_intermediate_size=16, shared_expert_intermediate_size=24,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, num_experts=6,
        num_experts_per_tok=2, decoder_sparse_step=2, mlp_only_layers=[], norm_topk_prob=False,
        vocab_size=96, max_position_embeddings=256,
    ),
    "qwen3_moe": dict(
        hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
        mlp_only_layers=[1], norm_topk_prob=True, vocab_size=96, max_position_embeddings=256,
    ),
    "olmoe": dict(
        hidden_size=32, intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, num_experts=6, num_experts_per_tok=2, vocab_size=96,
        max_position_embeddings=256,
    ),
    "llama4_text": dict(
        hidden_size=32, intermediate_size=16, intermediate_size_mlp=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
        num_experts_per_tok=1, interleave_moe_layer_step=2, vocab_size=96, max_position_embeddings=256,
        attention_chunk_size=16,
    ),
    "deepseek_v2": dict(
        hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=6, n_shared_experts=2,
        num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, vocab_size=96, max_position_embeddings=256,
        n_group=1, topk_group=1, topk_method="greedy",
    ),
    "deepseek_v3": dict(
        hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, vocab_size=96, max_position_embeddings=256,
        n_group=2, topk_group=1,
    ),
    "gpt_oss": dict(
        hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, vocab_size=96,
        sliding_window=8, max_position_embeddings=256,
    ),
}
"""HF ``model_type`` -> config overrides. Llama 4's text model type is ``llama4_text``."""

DENSE_CONFIGS: dict[str, dict] = {
    "llama": dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=96, max_position_embeddings=256, tie_word_embeddings=True,
    ),
    "qwen3": dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=96, max_position_embeddings=256,
    ),
}
"""Dense models (no experts) the readers handle too; ``build_hf_model`` builds these as well."""


def build_hf_model(model_type: str, out_dir: Path, seed: int = 0, **overrides):
    """Build a random-init fp32 transformers model of ``model_type``, save it to ``out_dir``.

    Returns the transformers model (eval mode) so that tests can compare against it.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    kwargs = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, **(FAMILY_CONFIGS.get(model_type) or DENSE_CONFIGS[model_type]), **overrides}
    config = AutoConfig.for_model(model_type, **kwargs)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init leaves some tensors at exact constants (norms at 1, biases at 0); perturb them so
    # that a mix-up of tensors cannot go unnoticed.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.eval()
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    return model
