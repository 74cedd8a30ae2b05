"""GGUF metadata (llama.cpp keys) -> a Hugging Face style config dict, per architecture.

The engine builds every model from an HF config, so a GGUF file gets one synthesised from its
``{arch}.*`` keys and its tensor list (which layers carry a router, whether ``output.weight`` exists).
"""

from __future__ import annotations

from ..errors import ModelFormatError
from ..units import TensorInfo

GGUF_ARCHES = {
    "llama": "mixtral",  # "llama" when it has no experts
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "olmoe": "olmoe",
    "llama4": "llama4_text",
    "deepseek2": "deepseek_v3",  # deepseek_v2 when its gating function is softmax
    "gpt-oss": "gpt_oss",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
}
"""GGUF ``general.architecture`` -> HF ``model_type`` of the synthesised config."""

LLAMA4_CHUNK_KEY = "llama4.attention.chunk_size"
"""Workbench extension key: Llama 4's chunked-attention size (llama.cpp assumes 8192 and writes none)."""
LLAMA4_DEFAULT_CHUNK = 8192


def _max_int(v) -> int:
    if isinstance(v, (list, tuple)) or hasattr(v, "tolist"):
        return int(max(list(v)))
    return int(v)


def config_from_gguf(meta: dict, tensors: dict[str, TensorInfo]) -> dict:
    """An HF ``config.json``-like dict for a GGUF file's metadata and tensors. Missing or ill-typed
    keys are a ModelFormatError."""
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or arch not in GGUF_ARCHES:
        raise ModelFormatError(
            f"unknown GGUF architecture {arch!r}: supported are {', '.join(GGUF_ARCHES)}"
        )
    try:
        return _config(meta, tensors, arch)
    except ModelFormatError:
        raise
    except (TypeError, ValueError, KeyError, ZeroDivisionError, AttributeError, OverflowError) as e:
        raise ModelFormatError(f"GGUF metadata of this {arch} model has a missing or invalid value ({e})") from None


def _config(meta: dict, tensors: dict[str, TensorInfo], arch: str) -> dict:
    def get(key: str, default=None):
        return meta.get(f"{arch}.{key}", default)

    if get("block_count") is None or get("embedding_length") is None or get("attention.head_count") is None:
        raise ModelFormatError(f"GGUF ({arch}) lacks block_count, embedding_length or attention.head_count")
    n_layers = int(get("block_count"))
    hidden = int(get("embedding_length"))
    n_heads = _max_int(get("attention.head_count"))
    n_kv = _max_int(get("attention.head_count_kv", n_heads))
    n_experts = int(get("expert_count", 0) or 0)
    model_type = GGUF_ARCHES[arch]
    if arch == "llama" and n_experts == 0:
        model_type = "llama"
    if arch == "deepseek2" and int(get("expert_gating_func", 1) or 1) != 2:
        model_type = "deepseek_v2"
    vocab = get("vocab_size")
    if vocab is None:
        tokens = meta.get("tokenizer.ggml.tokens")
        emb = tensors.get("token_embd.weight")
        vocab = len(tokens) if tokens is not None else (emb.shape[0] if emb else 0)
    router_layers = sorted(
        int(n.split(".")[1]) for n in tensors if n.endswith("ffn_gate_inp.weight") and n.startswith("blk.")
    )
    c: dict = {
        "model_type": model_type,
        "num_hidden_layers": n_layers,
        "hidden_size": hidden,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": int(get("attention.key_length", hidden // n_heads)),
        "vocab_size": int(vocab),
        "max_position_embeddings": int(get("context_length", 4096)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "intermediate_size": _max_int(get("feed_forward_length", 0) or 0),
    }
    for key, hf in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                    ("padding_token_id", "pad_token_id")):
        if f"tokenizer.ggml.{key}" in meta:
            c[hf] = int(meta[f"tokenizer.ggml.{key}"])
    if n_experts:
        c["num_experts_per_tok"] = int(get("expert_used_count", 1))
    expert_ffn = int(get("expert_feed_forward_length", 0) or 0) or c["intermediate_size"]
    rope = {"rope_type": "default", "rope_theta": c["rope_theta"]}

    if model_type == "mixtral":
        c.update(num_local_experts=n_experts, intermediate_size=expert_ffn, sliding_window=None)
    elif model_type in ("qwen2_moe", "qwen3_moe"):
        c.update(num_experts=n_experts, moe_intermediate_size=expert_ffn, decoder_sparse_step=1,
                 mlp_only_layers=[i for i in range(n_layers) if i not in set(router_layers)],
                 norm_topk_prob=bool(get("expert_weights_norm", model_type == "qwen3_moe")))
        if model_type == "qwen2_moe":
            shexp = tensors.get(f"blk.{router_layers[0]}.ffn_up_shexp.weight") if router_layers else None
            c["shared_expert_intermediate_size"] = int(
                get("expert_shared_feed_forward_length", 0) or (shexp.shape[0] if shexp else 0))
            c["qkv_bias"] = "blk.0.attn_q.bias" in tensors
    elif model_type == "olmoe":
        c.update(num_experts=n_experts, intermediate_size=expert_ffn, norm_topk_prob=False)
    elif model_type == "llama4_text":
        step = int(get("interleave_moe_layer_step", 1) or 1)
        chunk = int(meta.get(LLAMA4_CHUNK_KEY, LLAMA4_DEFAULT_CHUNK))
        no_rope = [0 if (i + 1) % 4 == 0 else 1 for i in range(n_layers)]
        c.update(num_local_experts=n_experts, intermediate_size=expert_ffn,
                 intermediate_size_mlp=c["intermediate_size"], interleave_moe_layer_step=step,
                 moe_layers=router_layers, attention_chunk_size=chunk, no_rope_layers=no_rope,
                 layer_types=["chunked_attention" if r else "full_attention" for r in no_rope],
                 use_qk_norm=True, attn_temperature_tuning=True, floor_scale=8192, attn_scale=0.1)
    elif model_type in ("deepseek_v2", "deepseek_v3"):
        rope_dim = int(get("rope.dimension_count"))
        kv_lora = int(get("attention.kv_lora_rank"))
        k_len = get("attention.key_length_mla")
        v_len = get("attention.value_length_mla")
        if k_len is None:  # older converters: key_length is per-head q/k length, value_length v's
            k_len, v_len = get("attention.key_length"), get("attention.value_length")
        n_group = int(get("expert_group_count", 1) or 1)
        c.update(
            n_routed_experts=n_experts, n_shared_experts=int(get("expert_shared_count", 0) or 0),
            moe_intermediate_size=expert_ffn, first_k_dense_replace=int(get("leading_dense_block_count", 0)),
            kv_lora_rank=kv_lora, q_lora_rank=get("attention.q_lora_rank"), qk_rope_head_dim=rope_dim,
            qk_nope_head_dim=int(k_len) - rope_dim, v_head_dim=int(v_len), head_dim=rope_dim,
            num_key_value_heads=n_heads, routed_scaling_factor=float(get("expert_weights_scale", 1.0)),
            norm_topk_prob=bool(get("expert_weights_norm", False)), n_group=n_group,
            topk_group=int(get("expert_group_used_count", 1) or 1),
        )
        if model_type == "deepseek_v2":
            c["topk_method"] = "group_limited_greedy" if n_group > 1 else "greedy"
        else:
            c["rope_interleave"] = True
    elif model_type == "gpt_oss":
        window = int(get("attention.sliding_window", 128))
        c.update(num_local_experts=n_experts, intermediate_size=expert_ffn, sliding_window=window,
                 layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)],
                 attention_bias=True, swiglu_limit=7.0)
    if get("rope.scaling.type") == "yarn":
        rope.update(rope_type="yarn", factor=float(get("rope.scaling.factor", 1.0)),
                    original_max_position_embeddings=int(get("rope.scaling.original_context_length", 4096)),
                    beta_fast=float(get("rope.scaling.yarn_beta_fast", 32.0)),
                    beta_slow=float(get("rope.scaling.yarn_beta_slow", 1.0)))
        if model_type == "gpt_oss":
            rope["truncate"] = False  # gpt-oss's YaRN keeps fractional correction dims
    c["rope_parameters"] = rope
    return c
