"""Hugging Face ``config.json`` -> family and ModelSpec (also used for GGUF, via a synthesised config)."""

from __future__ import annotations

from ..errors import ModelFormatError
from ..spec import FAMILIES, ModelSpec

MODEL_TYPES: dict[str, str] = {
    "mixtral": "mixtral",
    "qwen2_moe": "qwen2_moe",
    "qwen3_moe": "qwen3_moe",
    "olmoe": "olmoe",
    "llama4": "llama4",
    "llama4_text": "llama4",
    "deepseek_v2": "deepseek_v2",
    "deepseek_v3": "deepseek_v3",
    "gpt_oss": "gpt_oss",
}
"""HF ``model_type`` -> workbench family of the Mixture-of-Experts models."""

DENSE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "olmo", "olmo2")
"""Dense decoder-only model types read too (family ``dense``)."""


def text_config(config: dict) -> dict:
    """The language model part of a config (Llama 4's multimodal config nests it in ``text_config``)."""
    if config.get("model_type") == "llama4" and isinstance(config.get("text_config"), dict):
        return {"model_type": "llama4_text", **config["text_config"]}
    return config


def family_of(config: dict) -> str:
    """Workbench family of an HF config; an unknown ``model_type`` is a ModelFormatError naming it."""
    model_type = text_config(config).get("model_type")
    if not isinstance(model_type, str):
        model_type = repr(model_type)
    if model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    if model_type in DENSE_MODEL_TYPES:
        return "dense"
    supported = ", ".join([*FAMILIES, *(f"{t} (dense)" for t in DENSE_MODEL_TYPES)])
    raise ModelFormatError(f"unknown architecture {model_type!r}: supported are {supported}")


def _first(c: dict, *keys, default=None):
    for k in keys:
        if c.get(k) is not None:
            return c[k]
    return default


def _moe_layers(family: str, c: dict, n_layers: int, n_experts: int) -> tuple[int, ...]:
    if family == "dense" or n_experts == 0:
        return ()
    if family in ("qwen2_moe", "qwen3_moe"):
        step = int(c.get("decoder_sparse_step") or 1)
        dense = set(c.get("mlp_only_layers") or ())
        return tuple(i for i in range(n_layers) if i not in dense and (i + 1) % step == 0)
    if family == "llama4":
        if c.get("moe_layers") is not None:
            return tuple(int(i) for i in c["moe_layers"])
        step = int(c.get("interleave_moe_layer_step") or 1)
        return tuple(range(step - 1, n_layers, step))
    if family in ("deepseek_v2", "deepseek_v3"):
        first = int(c.get("first_k_dense_replace") or 0)
        freq = int(c.get("moe_layer_freq") or 1)
        return tuple(i for i in range(n_layers) if i >= first and i % freq == 0)
    return tuple(range(n_layers))


def _layer_window(c: dict, n_layers: int) -> tuple[int | None, ...]:
    types = c.get("layer_types")
    if isinstance(types, list) and len(types) == n_layers:
        out: list[int | None] = []
        for t in types:
            if t == "sliding_attention" and c.get("sliding_window"):
                out.append(int(c["sliding_window"]))
            elif t == "chunked_attention" and c.get("attention_chunk_size"):
                out.append(int(c["attention_chunk_size"]))
            else:
                out.append(None)
        return tuple(out)
    if c.get("model_type") in ("llama4", "llama4_text") and c.get("attention_chunk_size"):
        # configs written before layer_types: RoPE layers use chunked attention, every 4th is global
        interval = int(c.get("no_rope_layer_interval") or 4)
        rope = c.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n_layers)]
        return tuple(int(c["attention_chunk_size"]) if rope[i] else None for i in range(n_layers))
    window = c.get("sliding_window")
    if window and c.get("use_sliding_window", True):
        return (int(window),) * n_layers
    return (None,) * n_layers


_BAD_VALUE = (TypeError, ValueError, KeyError, ZeroDivisionError, AttributeError, OverflowError)


def spec_from_config(config: dict) -> ModelSpec:
    """The ModelSpec of an HF config dict (every family of ``MODEL_TYPES`` and the dense types).
    Missing or ill-typed values are a ModelFormatError."""
    family = family_of(config)
    try:
        spec = _spec(config, family)
    except ModelFormatError:
        raise
    except _BAD_VALUE as e:
        raise ModelFormatError(f"config.json of this {family} model has a missing or invalid value ({e})") from None
    for name in ("n_layers", "hidden_size", "vocab_size", "n_heads", "n_kv_heads", "head_dim"):
        if not 0 < getattr(spec, name) < 1 << 24:
            raise ModelFormatError(f"config.json gives {name} = {getattr(spec, name)}, which no model has")
    if spec.is_moe and not 0 < spec.n_experts_active <= spec.n_experts:
        raise ModelFormatError(f"config.json: {spec.n_experts_active} active experts of {spec.n_experts}")
    return spec


def _spec(config: dict, family: str) -> ModelSpec:
    c = text_config(config)
    n_layers = int(c["num_hidden_layers"])
    hidden = int(c["hidden_size"])
    n_heads = int(c["num_attention_heads"])
    vocab = int(c["vocab_size"])
    n_kv = int(_first(c, "num_key_value_heads", default=n_heads))
    head_dim = int(_first(c, "head_dim", default=hidden // n_heads))
    n_experts = int(_first(c, "num_experts", "num_local_experts", "n_routed_experts", default=0))
    if family == "dense":
        n_experts = 0
    active = int(_first(c, "num_experts_per_tok", "experts_per_token", default=0)) if n_experts else 0
    expert_ffn = dense_ffn = shared_ffn = n_shared = 0
    kv_lora = rope_dim = None
    inter = int(c.get("intermediate_size") or 0)
    if family in ("qwen2_moe", "qwen3_moe"):
        expert_ffn, dense_ffn = int(c.get("moe_intermediate_size") or 0), inter
        shared_ffn = int(c.get("shared_expert_intermediate_size") or 0)
        n_shared = 1 if shared_ffn else 0
    elif family == "llama4":
        expert_ffn, shared_ffn, n_shared = inter, inter, 1
        dense_ffn = int(c.get("intermediate_size_mlp") or inter)
    elif family in ("deepseek_v2", "deepseek_v3"):
        expert_ffn, dense_ffn = int(c.get("moe_intermediate_size") or 0), inter
        n_shared = int(c.get("n_shared_experts") or 0)
        shared_ffn = expert_ffn if n_shared else 0
        kv_lora, rope_dim = int(c["kv_lora_rank"]), int(c["qk_rope_head_dim"])
        head_dim = int(c.get("qk_nope_head_dim", 0)) + rope_dim
        n_kv = n_heads
    elif family == "dense":
        dense_ffn = inter
    else:  # mixtral, olmoe, gpt_oss: every layer routed, no shared expert
        expert_ffn = inter
    extra = {k: c[k] for k in ("q_lora_rank", "qk_nope_head_dim", "v_head_dim", "norm_topk_prob",
                               "routed_scaling_factor", "model_type") if k in c}
    return ModelSpec(
        family=family,
        n_layers=n_layers,
        hidden_size=hidden,
        vocab_size=vocab,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        n_experts=n_experts,
        n_experts_active=active,
        n_shared_experts=n_shared,
        expert_ffn=expert_ffn,
        shared_ffn=shared_ffn,
        dense_ffn=dense_ffn,
        moe_layers=_moe_layers(family, c, n_layers, n_experts),
        layer_window=_layer_window(c, n_layers),
        max_context=int(c.get("max_position_embeddings") or 4096),
        kv_lora_rank=kv_lora,
        qk_rope_head_dim=rope_dim,
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        extra=extra,
    )
