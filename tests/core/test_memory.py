"""Memory estimate on hand-built inventories (exact arithmetic) and placement helpers."""

from __future__ import annotations

from pathlib import Path

import pytest

from workbench.core.inventory import Inventory
from workbench.core.memory import (
    HOST_BASELINE_BYTES,
    estimate_memory,
    experts_as_stored,
    gpu_runtime_overhead,
    held_bytes,
    kv_bytes_per_token,
    placement_all_gpu,
    placement_cpu_moe,
    placement_n_cpu_moe,
)
from workbench.core.placement import CPU_COMPUTE, CPU_STREAM, Assignment
from workbench.core.spec import ModelSpec
from workbench.core.units import TensorInfo, TensorRef, Unit, UnitKey


def _inventory(spec: ModelSpec, expert_bytes: int = 1000) -> Inventory:
    """One tensor per unit; routed experts in one stacked tensor per layer."""
    tensors: dict[str, TensorInfo] = {}
    units: dict[UnitKey, Unit] = {}

    def add(key: UnitKey, name: str, nbytes: int, stacked: int = 0) -> None:
        shape = (stacked, nbytes // stacked) if stacked else (nbytes,)
        t = tensors.setdefault(name, TensorInfo(name, shape, "BF16", nbytes, Path("x"), 0))
        units[key] = Unit(key, [TensorRef(t, key.expert if stacked else None)])

    add(UnitKey(None, "embed"), "embed", 500)
    add(UnitKey(None, "norm"), "norm", 10)
    add(UnitKey(None, "lm_head"), "lm_head", 500)
    for layer in range(spec.n_layers):
        add(UnitKey(layer, "attn"), f"{layer}.attn", 300)
        if layer in spec.moe_layers:
            add(UnitKey(layer, "router"), f"{layer}.router", 20)
            for e in range(spec.n_experts):
                add(UnitKey(layer, "expert", e), f"{layer}.exps", expert_bytes * spec.n_experts, spec.n_experts)
            if spec.n_shared_experts:
                add(UnitKey(layer, "shared"), f"{layer}.shexp", 700)
        else:
            add(UnitKey(layer, "dense_mlp"), f"{layer}.mlp", 2000)
    return Inventory(Path("x"), "test", spec.family, spec, {}, tensors, units)


GQA = ModelSpec(
    family="qwen3_moe", n_layers=4, hidden_size=64, vocab_size=100, n_heads=8, n_kv_heads=2, head_dim=16,
    n_experts=4, n_experts_active=2, expert_ffn=32, dense_ffn=128, moe_layers=(0, 2, 3),
    layer_window=(None, None, None, None),
)


def test_all_gpu_weights_and_kv_exact():
    inv = _inventory(GQA)
    est = estimate_memory(inv, ctx=1000, kv_dtype="f16")
    assert list(est.tiers) == ["gpu:0", "cpu"]
    g = est.tiers["gpu:0"]
    assert g.weights_total == inv.total_bytes
    assert g.weights["expert"] == 3 * 4 * 1000
    assert g.weights["dense_mlp"] == 2000
    # K and V: 2 kv heads x 16 dims x 2 (K,V) x 2 bytes, 1000 tokens, 4 layers
    assert g.kv_cache == 4 * 1000 * 2 * 2 * 16 * 2
    assert g.stream_cache == 0
    assert g.overhead == gpu_runtime_overhead(inv, 1000)
    assert g.total == g.weights_total + g.kv_cache + g.overhead
    cpu = est.tiers["cpu"]
    assert cpu.weights_total == 0 and cpu.kv_cache == 0 and cpu.overhead == HOST_BASELINE_BYTES


def test_kv_dtypes_and_bad_dtype():
    inv = _inventory(GQA)
    assert kv_bytes_per_token(inv, 0, "f32") == 2 * 2 * 16 * 4
    assert kv_bytes_per_token(inv, 0, "q8_0") == 64 // 32 * 34
    assert kv_bytes_per_token(inv, 0, "q4_0") == 64 // 32 * 18
    with pytest.raises(ValueError, match="q3_x"):
        estimate_memory(inv, kv_dtype="q3_x")
    with pytest.raises(ValueError):
        estimate_memory(inv, ctx=0)


def test_cpu_moe_moves_routed_experts_only():
    inv = _inventory(GQA)
    est = estimate_memory(inv, placement_cpu_moe(inv), ctx=16)
    assert est.tiers["cpu"].weights["expert"] == 3 * 4 * 1000
    assert est.tiers["cpu"].weights_total == 3 * 4 * 1000
    assert est.tiers["gpu:0"].weights["expert"] == 0
    assert est.tiers["gpu:0"].weights["router"] == 3 * 20
    assert est.tiers["gpu:0"].weights_total + est.tiers["cpu"].weights_total == inv.total_bytes


def test_n_cpu_moe_counts_layers_like_llama_cpp():
    inv = _inventory(GQA)
    # layers 0 and 1: layer 1 is dense, so only layer 0's experts move
    p = placement_n_cpu_moe(inv, 2)
    assert {k.layer for k, a in p.assignments.items()} == {0}
    assert all(a == CPU_COMPUTE for a in p.assignments.values())
    assert estimate_memory(inv, p).tiers["cpu"].weights["expert"] == 4 * 1000
    assert placement_n_cpu_moe(inv, 0) == placement_all_gpu(inv)
    assert placement_n_cpu_moe(inv, 99) == placement_cpu_moe(inv)
    with pytest.raises(ValueError):
        placement_n_cpu_moe(inv, -1)


def test_sliding_window_bounds_kv():
    spec = ModelSpec(**{**GQA.to_json(), "moe_layers": (0, 2, 3), "layer_window": (8, None, 8, None)})
    inv = _inventory(spec)
    per_tok = kv_bytes_per_token(inv, 0)
    assert estimate_memory(inv, ctx=100).tiers["gpu:0"].kv_cache == (8 + 100 + 8 + 100) * per_tok
    assert estimate_memory(inv, ctx=4).tiers["gpu:0"].kv_cache == 4 * 4 * per_tok


def test_mla_latent_kv():
    spec = ModelSpec(
        family="deepseek_v3", n_layers=3, hidden_size=64, vocab_size=100, n_heads=8, n_kv_heads=8,
        head_dim=24, n_experts=4, n_experts_active=2, n_shared_experts=1, expert_ffn=16, shared_ffn=16,
        dense_ffn=64, moe_layers=(1, 2), layer_window=(None,) * 3, kv_lora_rank=32, qk_rope_head_dim=8,
    )
    inv = _inventory(spec)
    est = estimate_memory(inv, ctx=10, kv_dtype="bf16")
    assert est.tiers["gpu:0"].kv_cache == 3 * 10 * (32 + 8) * 2
    assert est.tiers["gpu:0"].weights["shared"] == 2 * 700


def test_kv_follows_attn_tier_and_stream_cache():
    inv = _inventory(GQA, expert_bytes=1000)
    p = placement_all_gpu(inv)
    p.set(UnitKey(1, "attn"), Assignment("gpu:1"))
    p.move(inv.expert_keys(2), CPU_STREAM)
    p.set(UnitKey(3, "expert", 1), CPU_STREAM)
    p.stream_slots = 3
    est = estimate_memory(inv, p, ctx=10)
    assert list(est.tiers) == ["gpu:0", "gpu:1", "cpu"]
    per_layer = 10 * kv_bytes_per_token(inv, 0)
    assert est.tiers["gpu:1"].kv_cache == per_layer
    assert est.tiers["gpu:1"].weights == {**dict.fromkeys(est.tiers["gpu:1"].weights, 0), "attn": 300}
    assert est.tiers["gpu:0"].kv_cache == 3 * per_layer
    # streamed experts live in RAM; 3 slots x 1000 bytes for each of layers 2 and 3
    assert est.tiers["cpu"].weights["expert"] == 5 * 1000
    assert est.tiers["gpu:0"].stream_cache == 2 * 3 * 1000
    assert est.total("gpu:7") == 0
    j = est.to_json()
    assert j["tiers"]["gpu:0"]["stream_cache"] == 6000 and j["ctx"] == 10


@pytest.mark.parametrize(
    ("model_type", "tokens_per_layer", "values_per_token"),
    [
        ("llama4_text", (16, 16, 16, 100), 2 * 2 * 8),  # chunked layers keep 16 tokens, NoPE layer all
        ("gpt_oss", (8, 100), 2 * 2 * 8),  # sliding window 8 on even layers
        ("deepseek_v3", (100, 100, 100), 16 + 8),  # MLA latent + rope key
        ("qwen3_moe", (100,) * 4, 2 * 2 * 8),
    ],
)
def test_kv_cache_of_real_inventories(model_type, tokens_per_layer, values_per_token, tiny_model_dir, tiny_gguf):
    from workbench.core.readers import open_model

    for path in (tiny_model_dir(model_type), tiny_gguf(model_type, "Q8_0")):
        inv = open_model(path)
        est = estimate_memory(inv, placement_cpu_moe(inv), ctx=100, kv_dtype="f16")
        assert est.tiers["gpu:0"].kv_cache == sum(tokens_per_layer) * values_per_token * 2
        kept = experts_as_stored(inv)  # the tiny Q8_0 files' experts mix F16 rows in: held in bfloat16
        experts = sum(held_bytes(k, inv.units[k], kept) for k in inv.expert_keys())
        assert est.tiers["cpu"].weights["expert"] == experts
        dense = sum(held_bytes(k, u) for k, u in inv.units.items() if k.kind != "expert")
        assert est.tiers["gpu:0"].weights_total == dense
        if inv.format == "gguf":  # Q8_0 projections held in their blocks (the tiny DeepSeek's k_b / v_b are F16)
            attn = inv.units[UnitKey(0, "attn")]
            assert held_bytes(attn.key, attn) == attn.nbytes
        else:
            assert kept and dense + experts == inv.total_bytes


def test_which_gguf_tensors_stay_in_their_blocks():
    """Projections, embeddings and head in Q8_0, a k-quant (Q2_K to Q6_K) or IQ4_XS stay as stored; DeepSeek's kv_b (split and
    absorbed), routers, other quantized types and float tensors do not count as kept."""
    from pathlib import Path

    from workbench.core.memory import engine_bytes, kept_in_blocks
    from workbench.core.units import TensorInfo, TensorRef, Unit

    def info(name, dtype, shape=(64, 256), nbytes=9216):
        return TensorInfo(name, shape, dtype, nbytes, Path("m.gguf"), 0)

    for name in ("blk.3.attn_q.weight", "blk.0.attn_output.weight", "token_embd.weight", "output.weight",
                 "blk.1.ffn_down_shexp.weight", "blk.0.ffn_gate.weight", "blk.2.attn_kv_a_mqa.weight"):
        assert kept_in_blocks(info(name, "Q4_K"))
    assert all(kept_in_blocks(info("blk.0.attn_q.weight", t)) for t in ("Q2_K", "Q3_K", "Q5_K", "Q6_K", "Q8_0", "IQ4_XS"))
    assert not kept_in_blocks(info("blk.0.attn_kv_b.weight", "Q8_0"))
    assert not kept_in_blocks(info("blk.0.ffn_gate_inp.weight", "Q8_0"))
    assert not kept_in_blocks(info("blk.0.attn_q.weight", "IQ3_S"))
    assert not kept_in_blocks(info("blk.0.attn_q.weight", "BF16"))
    unit = Unit(UnitKey(0, "attn"), [TensorRef(info("blk.0.attn_q.weight", "Q4_K")),
                                     TensorRef(info("blk.0.attn_kv_b.weight", "Q8_0", nbytes=17408))])
    params = 64 * 256
    assert held_bytes(unit.key, unit) == 9216 + 2 * params
    assert engine_bytes(unit.key, unit, 4) == 9216 + 4 * params
    assert engine_bytes(unit.key, unit, 4, dense_as_stored=False) == 8 * params


def test_experts_the_engine_dequantizes_count_as_bfloat16(tiny_gguf):
    """A GGUF whose experts the engine cannot read in place (a type it does not keep; gpt-oss's biased,
    clamped experts in Q8_0, whose kernel takes no biases) is estimated and predicted with bf16
    experts, as the engine holds them; kept types (gpt-oss's MXFP4 too) and float files as stored.
    The estimate agrees with the engine's own rule (``engine.keeps_blocks``)."""
    from workbench.core.costmodel import CostModel
    from workbench.core.readers import open_model
    from workbench.engine.engine import keeps_blocks
    from workbench.engine.model import ModelArgs

    from .profiles import h200_profile

    dims = dict(hidden_size=256, moe_intermediate_size=256, intermediate_size=256)
    cases = [("qwen3_moe", "Q3_K+Q4_K", dims, True), ("qwen3_moe", "IQ4_XS", dims, True),
             ("qwen3_moe", "Q4_0", dims, False), ("qwen3_moe", "Q8_0", dims, True), ("qwen3_moe", "Q8_0", {}, False),  # rows of 16: F16
             ("gpt_oss", "Q8_0", {}, False), ("gpt_oss", "MXFP4", {"hidden_size": 64, "intermediate_size": 64}, True),
             ("qwen3_moe", "F16", {}, True)]
    for family, ttype, sizes, kept in cases:
        inv = open_model(tiny_gguf(family, ttype, **sizes))
        assert experts_as_stored(inv) == kept, (family, ttype)
        if ttype != "F16":
            assert keeps_blocks(inv, ModelArgs.from_config(inv.family, inv.config), None) == kept, (family, ttype)
        experts = [inv.units[k] for k in inv.expert_keys()]
        est = estimate_memory(inv).tiers["gpu:0"].weights["expert"]
        assert est == sum(u.nbytes if kept else 2 * u.n_params for u in experts)
        cm = CostModel(inv, h200_profile())
        assert cm.expert_bytes.sum() == est
