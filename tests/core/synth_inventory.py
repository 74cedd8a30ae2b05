"""Synthetic Inventory objects (headers only, no file) for planning tests, with llama.cpp GGUF names.

``synth_inventory(94, 256)`` is a Qwen3-235B-like layout in a fraction of a millisecond per unit; the
tensors point at a file that does not exist, which is fine for anything that reads headers only.
"""

from __future__ import annotations

from pathlib import Path

from workbench.core.inventory import Inventory
from workbench.core.spec import ModelSpec
from workbench.core.units import TensorInfo, TensorRef, Unit, UnitKey

_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "Q8_0": 34 / 32, "Q4_K": 144 / 256, "Q5_K": 176 / 256, "Q6_K": 210 / 256}


def synth_inventory(
    n_layers: int = 4,
    n_experts: int = 8,
    top_k: int = 2,
    hidden: int = 256,
    expert_ffn: int = 128,
    vocab: int = 1024,
    n_heads: int = 8,
    n_kv_heads: int = 2,
    head_dim: int = 32,
    dense_layers: tuple[int, ...] = (),
    shared_ffn: int = 0,
    expert_dtype: str = "BF16",
    dtype: str = "BF16",
    fused_gate_up: bool = False,
) -> Inventory:
    """An MoE model of ``n_layers`` layers x ``n_experts`` routed experts with exact byte sizes."""
    path = Path("/nonexistent/synthetic.gguf")
    tensors: dict[str, TensorInfo] = {}
    units: dict[UnitKey, Unit] = {}
    offset = 0

    def tensor(name: str, shape: tuple[int, ...], dt: str = dtype) -> TensorInfo:
        nonlocal offset
        n = 1
        for d in shape:
            n *= d
        t = TensorInfo(name, shape, dt, int(n * _BYTES[dt]), path, offset)
        offset += t.nbytes
        tensors[name] = t
        return t

    def unit(key: UnitKey, *refs: TensorRef) -> None:
        units.setdefault(key, Unit(key)).tensors.extend(refs)

    unit(UnitKey(None, "embed"), TensorRef(tensor("token_embd.weight", (vocab, hidden))))
    q, kv = n_heads * head_dim, n_kv_heads * head_dim
    moe_layers = tuple(layer for layer in range(n_layers) if layer not in dense_layers)
    for layer in range(n_layers):
        b = f"blk.{layer}."
        unit(UnitKey(layer, "attn"),
             TensorRef(tensor(b + "attn_q.weight", (q, hidden))),
             TensorRef(tensor(b + "attn_k.weight", (kv, hidden))),
             TensorRef(tensor(b + "attn_v.weight", (kv, hidden))),
             TensorRef(tensor(b + "attn_output.weight", (hidden, q))))
        unit(UnitKey(layer, "norm"),
             TensorRef(tensor(b + "attn_norm.weight", (hidden,), "F32")),
             TensorRef(tensor(b + "ffn_norm.weight", (hidden,), "F32")))
        if layer in dense_layers:
            unit(UnitKey(layer, "dense_mlp"),
                 *(TensorRef(tensor(b + f"ffn_{p}.weight", (4 * hidden, hidden) if p != "down" else (hidden, 4 * hidden)))
                   for p in ("gate", "up", "down")))
            continue
        unit(UnitKey(layer, "router"), TensorRef(tensor(b + "ffn_gate_inp.weight", (n_experts, hidden), "F32")))
        if fused_gate_up:
            stacked = [tensor(b + "ffn_gate_up_exps.weight", (n_experts, 2 * expert_ffn, hidden), expert_dtype)]
        else:
            stacked = [tensor(b + f"ffn_{p}_exps.weight", (n_experts, expert_ffn, hidden), expert_dtype)
                       for p in ("gate", "up")]
        stacked.append(tensor(b + "ffn_down_exps.weight", (n_experts, hidden, expert_ffn), expert_dtype))
        for e in range(n_experts):
            unit(UnitKey(layer, "expert", e), *(TensorRef(t, e) for t in stacked))
        if shared_ffn:
            unit(UnitKey(layer, "shared"),
                 *(TensorRef(tensor(b + f"ffn_{p}_shexp.weight", (shared_ffn, hidden) if p != "down" else (hidden, shared_ffn)))
                   for p in ("gate", "up", "down")))
    unit(UnitKey(None, "norm"), TensorRef(tensor("output_norm.weight", (hidden,), "F32")))
    unit(UnitKey(None, "lm_head"), TensorRef(tensor("output.weight", (vocab, hidden))))

    spec = ModelSpec(
        family="qwen3_moe", n_layers=n_layers, hidden_size=hidden, vocab_size=vocab, n_heads=n_heads,
        n_kv_heads=n_kv_heads, head_dim=head_dim, n_experts=n_experts, n_experts_active=top_k,
        n_shared_experts=1 if shared_ffn else 0, expert_ffn=expert_ffn, shared_ffn=shared_ffn,
        dense_ffn=4 * hidden if dense_layers else 0, moe_layers=moe_layers,
        layer_window=(None,) * n_layers, max_context=32768,
    )
    return Inventory(path, "gguf", "qwen3_moe", spec, {"model_type": "qwen3_moe"}, tensors, units,
                     [path], {}, fingerprint=f"synthetic-{n_layers}x{n_experts}-{hidden}-{expert_ffn}")


def dirichlet_stats(inv: Inventory, seed: int = 0, alpha: float = 0.2, tokens: float = 1e5):
    """ExpertStats whose per-layer frequencies are Dirichlet(alpha) draws (small alpha = skewed),
    ``tokens`` selections per MoE layer."""
    import numpy as np

    from workbench.core.stats import ExpertStats

    rng = np.random.default_rng(seed)
    s = ExpertStats.for_spec(inv.spec)
    counts = np.zeros(s.shape)
    for layer in inv.spec.moe_layers:
        counts[layer] = rng.dirichlet(np.full(s.n_experts, alpha)) * tokens
    s.add(counts)
    return s
