"""A synthetic Inventory of L layers x E experts with chosen byte sizes (no files behind it).

Used where the window's behaviour, not the weights, is under test (e.g. the 94 x 256 grid)."""

from __future__ import annotations

from pathlib import Path

from workbench.core.inventory import Inventory
from workbench.core.spec import ModelSpec
from workbench.core.units import TensorInfo, TensorRef, Unit, UnitKey


def synthetic_inventory(n_layers: int = 4, n_experts: int = 8, expert_bytes: int = 2**20,
                        attn_bytes: int = 4 * 2**20, embed_bytes: int = 8 * 2**20) -> Inventory:
    """Every layer MoE; routed experts of each layer in one stacked tensor (GGUF-like)."""
    spec = ModelSpec(
        family="qwen3_moe", n_layers=n_layers, hidden_size=256, vocab_size=1000, n_heads=4, n_kv_heads=2,
        head_dim=64, n_experts=n_experts, n_experts_active=2, expert_ffn=128,
        moe_layers=tuple(range(n_layers)), layer_window=(None,) * n_layers, max_context=4096,
    )
    tensors: dict[str, TensorInfo] = {}
    units: dict[UnitKey, Unit] = {}

    def add(key: UnitKey, name: str, nbytes: int, stacked: int = 0, dtype: str = "BF16") -> None:
        shape = (stacked, nbytes // stacked // 2) if stacked else (nbytes // 2,)
        t = tensors.setdefault(name, TensorInfo(name, shape, dtype, nbytes, Path("synthetic"), 0))
        units.setdefault(key, Unit(key)).tensors.append(TensorRef(t, key.expert if stacked else None))

    add(UnitKey(None, "embed"), "token_embd.weight", embed_bytes)
    add(UnitKey(None, "norm"), "output_norm.weight", 512)
    add(UnitKey(None, "lm_head"), "output.weight", embed_bytes)
    for layer in range(n_layers):
        add(UnitKey(layer, "attn"), f"blk.{layer}.attn_qkv.weight", attn_bytes)
        add(UnitKey(layer, "router"), f"blk.{layer}.ffn_gate_inp.weight", n_experts * 512, dtype="F32")
        for e in range(n_experts):
            for proj in ("gate", "up", "down"):
                add(UnitKey(layer, "expert", e), f"blk.{layer}.ffn_{proj}_exps.weight",
                    expert_bytes // 3 * n_experts, n_experts, dtype="Q4_K")
    return Inventory(Path("synthetic"), "gguf", spec.family, spec, {}, tensors, units, fingerprint="synthetic")
