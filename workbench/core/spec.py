"""ModelSpec: the architecture numbers every layer of the product needs, whatever the file format."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

FAMILIES = (
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "llama4",
    "deepseek_v2",
    "deepseek_v3",
    "gpt_oss",
)
"""The Mixture-of-Experts families the workbench reads (dense models are read too: family ``dense``)."""


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of a decoder-only (MoE) transformer.

    Sizes are element counts. ``moe_layers`` lists the decoder layers whose MLP is routed experts;
    other layers have a dense MLP of ``dense_ffn``. ``layer_window[l]`` is ``None`` for full
    attention or the number of past tokens layer ``l`` keeps (sliding window or chunked attention),
    which bounds its KV cache. For MLA (DeepSeek) ``kv_lora_rank`` and ``qk_rope_head_dim`` are
    set and the KV cache holds ``kv_lora_rank + qk_rope_head_dim`` values per token and layer.
    """

    family: str
    n_layers: int
    hidden_size: int
    vocab_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_experts: int = 0
    n_experts_active: int = 0
    n_shared_experts: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0
    dense_ffn: int = 0
    moe_layers: tuple[int, ...] = ()
    layer_window: tuple[int | None, ...] = ()
    max_context: int = 4096
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    tie_word_embeddings: bool = False
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def dense_layers(self) -> tuple[int, ...]:
        moe = set(self.moe_layers)
        return tuple(layer for layer in range(self.n_layers) if layer not in moe)

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0 and bool(self.moe_layers)

    def kv_values_per_token(self, layer: int) -> int:
        """Values (not bytes) one token adds to layer ``layer``'s KV cache."""
        if self.kv_lora_rank is not None:
            return self.kv_lora_rank + (self.qk_rope_head_dim or 0)
        return 2 * self.n_kv_heads * self.head_dim

    def to_json(self) -> dict:
        d = asdict(self)
        d["moe_layers"] = list(self.moe_layers)
        d["layer_window"] = list(self.layer_window)
        return d

    @classmethod
    def from_json(cls, d: dict) -> ModelSpec:
        d = dict(d)
        d["moe_layers"] = tuple(d.get("moe_layers", ()))
        d["layer_window"] = tuple(d.get("layer_window", ()))
        return cls(**d)
