"""Per-family model arguments from an HF-style config.

``ModelArgs.from_config`` turns a ``config.json`` dict (or the one an Inventory synthesises for a
GGUF file) into the numbers and switches the decoder needs; ``layouts.FamilyWeights`` finds the
weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from workbench.core.errors import ModelFormatError

SUPPORTED = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "llama4", "deepseek_v2", "deepseek_v3", "gpt_oss",
             "dense")
DENSE_TYPES = ("llama", "mistral", "qwen2", "qwen3")
"""Dense model types the engine runs (family ``dense``; OLMo's post-norm layers are not run)."""


@dataclass
class RopeArgs:
    """Rotary embedding: ``kind`` default|linear|llama3|yarn; ``interleaved`` rotates (x[2i], x[2i+1])
    pairs (Llama 4, DeepSeek, llama.cpp "normal" rope) instead of the two halves (NeoX, most HF
    models); ``pairs_out_as_halves`` writes the rotated even then odd values (DeepSeek V3 in HF)."""

    theta: float = 10000.0
    kind: str = "default"
    interleaved: bool = False
    pairs_out_as_halves: bool = False
    params: dict = field(default_factory=dict)


@dataclass
class ModelArgs:
    """Everything the decoder needs to know about the architecture (sizes are element counts)."""

    family: str
    n_layers: int
    hidden: int
    vocab: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_eps: float
    rope: RopeArgs
    max_position: int
    moe_layers: tuple[int, ...]
    n_experts: int
    top_k: int
    expert_ffn: int
    dense_ffn: int
    shared_ffn: int = 0
    norm_topk_prob: bool = True
    router: str = "softmax_topk"  # | sigmoid_topk_scale_input (llama4) | sigmoid_group_bias (deepseek_v3)
    # | topk_softmax (gpt_oss: softmax over the top-k logits)
    n_group: int = 1  # DeepSeek group-limited routing: experts in n_group groups, topk_group kept
    topk_group: int = 1
    group_limited: bool = False  # deepseek_v2 topk_method == "group_limited_greedy"
    routed_scaling: float = 1.0
    router_bias: bool = False
    expert_act: str = "silu"  # | "clamped_swiglu" (gpt_oss, with swiglu = (alpha, limit))
    swiglu: tuple[float, float] = (1.702, 7.0)
    expert_bias: bool = False
    sinks: bool = False
    mla: dict | None = None  # q_lora_rank, kv_lora_rank, nope, rope, v, scale (DeepSeek MLA)
    shared_gate: bool = False  # qwen2_moe: sigmoid(shared_expert_gate(x)) * shared(x)
    qk_norm: str | None = None  # None | "head" (per head, RMS) | "full" (whole projection) | "l2"
    clip_qkv: float | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    use_rope: tuple[bool, ...] = ()
    chunk: tuple[int | None, ...] = ()  # per layer: chunked-attention size (Llama 4)
    window: tuple[int | None, ...] = ()  # per layer: sliding window (keys with q - k < window)
    temperature_tuning: tuple[float, float] | None = None  # (attn_scale, floor_scale) on NoPE layers
    tie_word_embeddings: bool = False

    @classmethod
    def from_config(cls, family: str, config: dict) -> ModelArgs:
        """Read ``config`` (HF ``config.json`` dict) of ``family``; unsupported families are refused."""
        if family not in SUPPORTED:
            raise ModelFormatError(
                f"the engine does not run the {family} family yet (it runs {', '.join(SUPPORTED)})"
            )
        c = dict(config.get("text_config") or config) if family == "llama4" else dict(config)
        n_layers = int(c["num_hidden_layers"])
        hidden = int(c["hidden_size"])
        n_heads = int(c["num_attention_heads"])
        head_dim = int(c.get("head_dim") or hidden // n_heads)
        rp = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
        theta = float(rp.get("rope_theta", c.get("rope_theta", 10000.0)))
        kind = rp.get("rope_type", rp.get("type", "default")) or "default"
        rope = RopeArgs(theta=theta, kind=kind, interleaved=family == "llama4", params=rp)
        common = dict(
            family=family, n_layers=n_layers, hidden=hidden, vocab=int(c["vocab_size"]), n_heads=n_heads,
            n_kv_heads=int(c.get("num_key_value_heads") or n_heads), head_dim=head_dim,
            rms_eps=float(c.get("rms_norm_eps", 1e-6)), rope=rope,
            max_position=int(c.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            use_rope=(True,) * n_layers, chunk=(None,) * n_layers, window=(None,) * n_layers,
        )
        n_exp = int(c.get("num_experts") or c.get("num_local_experts") or c.get("n_routed_experts") or 0)
        if family == "dense":
            return cls._dense(c, common)
        if family == "mixtral":
            window = c.get("sliding_window")
            return cls(
                **{**common, "window": (window,) * n_layers},
                moe_layers=tuple(range(n_layers)), n_experts=n_exp,
                top_k=int(c["num_experts_per_tok"]), expert_ffn=int(c["intermediate_size"]), dense_ffn=0,
                norm_topk_prob=True,
            )
        if family in ("qwen2_moe", "qwen3_moe"):
            step = int(c.get("decoder_sparse_step", 1) or 1)
            only = set(c.get("mlp_only_layers") or [])
            moe = tuple(i for i in range(n_layers) if i not in only and n_exp > 0 and (i + 1) % step == 0)
            windows = list(common["window"])
            if c.get("use_sliding_window") and c.get("sliding_window"):
                types = c.get("layer_types") or []
                windows = [c["sliding_window"] if t == "sliding_attention" else None for t in types] or windows
            q2 = family == "qwen2_moe"
            return cls(
                **{**common, "window": tuple(windows)},
                moe_layers=moe, n_experts=n_exp, top_k=int(c["num_experts_per_tok"]),
                expert_ffn=int(c["moe_intermediate_size"]), dense_ffn=int(c["intermediate_size"]),
                shared_ffn=int(c.get("shared_expert_intermediate_size") or 0) if q2 else 0,
                shared_gate=q2 and bool(c.get("shared_expert_intermediate_size")),
                norm_topk_prob=bool(c.get("norm_topk_prob", False)),
                qk_norm=None if q2 else "head", qkv_bias=bool(c.get("qkv_bias", True)) if q2 else
                bool(c.get("attention_bias", False)), o_bias=False if q2 else bool(c.get("attention_bias", False)),
            )
        if family == "olmoe":
            bias = bool(c.get("attention_bias", False))
            return cls(
                **common, moe_layers=tuple(range(n_layers)), n_experts=n_exp,
                top_k=int(c["num_experts_per_tok"]), expert_ffn=int(c["intermediate_size"]), dense_ffn=0,
                norm_topk_prob=bool(c.get("norm_topk_prob", False)), qk_norm="full",
                clip_qkv=c.get("clip_qkv"), qkv_bias=bias, o_bias=bias,
            )
        if family in ("deepseek_v2", "deepseek_v3"):
            return cls._deepseek(family, c, common, n_exp)
        if family == "gpt_oss":
            types = c.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                             for i in range(n_layers)]
            window = c.get("sliding_window")
            return cls(
                **{**common, "window": tuple(window if t == "sliding_attention" else None for t in types)},
                moe_layers=tuple(range(n_layers)), n_experts=n_exp, top_k=int(c["num_experts_per_tok"]),
                expert_ffn=int(c["intermediate_size"]), dense_ffn=0, router="topk_softmax", router_bias=True,
                expert_act="clamped_swiglu", expert_bias=True, sinks=True,
                swiglu=(float(c.get("swiglu_alpha", 1.702)), float(c.get("swiglu_limit", 7.0))),
                qkv_bias=bool(c.get("attention_bias", True)), o_bias=bool(c.get("attention_bias", True)),
            )
        # llama4 (text part)
        moe = c.get("moe_layers")
        if moe is None:
            step = int(c.get("interleave_moe_layer_step", 1))
            moe = list(range(step - 1, n_layers, step))
        nope = c.get("no_rope_layers") or [
            int((i + 1) % int(c.get("no_rope_layer_interval", 4)) != 0) for i in range(n_layers)
        ]
        use_rope = tuple(bool(x) for x in nope)
        chunk_size = c.get("attention_chunk_size")
        chunk = tuple(chunk_size if (r and chunk_size) else None for r in use_rope)
        tuning = None
        if c.get("attn_temperature_tuning", True):
            tuning = (float(c.get("attn_scale", 0.1)), float(c.get("floor_scale", 8192)))
        bias = bool(c.get("attention_bias", False))
        return cls(
            **{**common, "use_rope": use_rope, "chunk": chunk},
            moe_layers=tuple(moe), n_experts=n_exp, top_k=int(c["num_experts_per_tok"]),
            expert_ffn=int(c["intermediate_size"]), dense_ffn=int(c.get("intermediate_size_mlp") or 0),
            shared_ffn=int(c["intermediate_size"]), router="sigmoid_topk_scale_input",
            qk_norm="l2" if c.get("use_qk_norm", True) else None, qkv_bias=bias, o_bias=bias,
            temperature_tuning=tuning,
        )

    @classmethod
    def _dense(cls, c: dict, common: dict) -> ModelArgs:
        model_type = c.get("model_type")
        if model_type not in DENSE_TYPES:
            raise ModelFormatError(f"the engine does not run dense {model_type} models (it runs "
                                   f"{', '.join(DENSE_TYPES)})")
        if c.get("mlp_bias"):
            raise ModelFormatError(f"the engine does not run {model_type} models with MLP biases")
        n_layers = common["n_layers"]
        window = c.get("sliding_window") if model_type == "mistral" or c.get("use_sliding_window") else None
        windows = (window,) * n_layers
        if window and c.get("layer_types"):
            windows = tuple(window if t == "sliding_attention" else None for t in c["layer_types"])
        bias = bool(c.get("attention_bias", False))
        return cls(
            **{**common, "window": windows}, moe_layers=(), n_experts=0, top_k=0, expert_ffn=0,
            dense_ffn=int(c["intermediate_size"]), qk_norm="head" if model_type == "qwen3" else None,
            qkv_bias=True if model_type == "qwen2" else bias, o_bias=False if model_type == "qwen2" else bias,
        )

    @classmethod
    def _deepseek(cls, family: str, c: dict, common: dict, n_exp: int) -> ModelArgs:
        n_layers = common["n_layers"]
        first_dense = int(c.get("first_k_dense_replace") or 0)
        nope, rope_dim, v = int(c["qk_nope_head_dim"]), int(c["qk_rope_head_dim"]), int(c["v_head_dim"])
        scale = (nope + rope_dim) ** -0.5
        rp = common["rope"].params
        if common["rope"].kind != "default" and rp.get("mscale_all_dim"):
            m = 0.1 * float(rp["mscale_all_dim"]) * math.log(float(rp["factor"])) + 1.0 \
                if float(rp["factor"]) > 1 else 1.0
            scale *= m * m
        v3 = family == "deepseek_v3"
        common["rope"].interleaved = not v3 or bool(c.get("rope_interleave", True))
        common["rope"].pairs_out_as_halves = v3 and common["rope"].interleaved
        mla = {"q_lora_rank": c.get("q_lora_rank"), "kv_lora_rank": int(c["kv_lora_rank"]), "nope": nope,
               "rope": rope_dim, "v": v, "scale": scale}
        return cls(
            **{**common, "head_dim": rope_dim, "n_kv_heads": common["n_heads"]},
            moe_layers=tuple(range(first_dense, n_layers)), n_experts=n_exp, top_k=int(c["num_experts_per_tok"]),
            expert_ffn=int(c["moe_intermediate_size"]), dense_ffn=int(c["intermediate_size"]),
            shared_ffn=int(c["moe_intermediate_size"]) * int(c.get("n_shared_experts") or 0),
            router="sigmoid_group_bias" if v3 else "softmax_topk",
            norm_topk_prob=bool(c.get("norm_topk_prob", True)) if v3 else False,
            n_group=int(c.get("n_group") or 1), topk_group=int(c.get("topk_group") or 1),
            group_limited=not v3 and c.get("topk_method") == "group_limited_greedy",
            routed_scaling=float(c.get("routed_scaling_factor") or 1.0), mla=mla,
        )
