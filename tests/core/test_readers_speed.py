"""A 100+ GB checkpoint opens from its headers in under 2 s (sparse files: no data on disk)."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from workbench.core.readers import open_model

# Qwen3-30B-A3B-like, widened so that the experts alone pass 100 GB
LAYERS, EXPERTS, HIDDEN, FFN, VOCAB = 48, 128, 2048, 1536, 151_936


def _sparse(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def _hf_100gb(folder: Path) -> int:
    folder.mkdir()
    config = dict(model_type="qwen3_moe", hidden_size=HIDDEN, intermediate_size=6144, moe_intermediate_size=FFN,
                  num_hidden_layers=LAYERS, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                  num_experts=EXPERTS, num_experts_per_tok=8, vocab_size=VOCAB, max_position_embeddings=40960)
    (folder / "config.json").write_text(json.dumps(config))
    header, offset = {}, 0

    def add(name, shape):
        nonlocal offset
        n = 2
        for d in shape:
            n *= d
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n

    add("model.embed_tokens.weight", (VOCAB, HIDDEN))
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        add(p + "input_layernorm.weight", (HIDDEN,))
        add(p + "post_attention_layernorm.weight", (HIDDEN,))
        for proj, shape in (("q", (4096, HIDDEN)), ("k", (512, HIDDEN)), ("v", (512, HIDDEN)), ("o", (HIDDEN, 4096))):
            add(p + f"self_attn.{proj}_proj.weight", shape)
        add(p + "self_attn.q_norm.weight", (128,))
        add(p + "self_attn.k_norm.weight", (128,))
        add(p + "mlp.gate.weight", (EXPERTS, HIDDEN))
        for e in range(EXPERTS):
            add(p + f"mlp.experts.{e}.gate_proj.weight", (FFN, HIDDEN))
            add(p + f"mlp.experts.{e}.up_proj.weight", (FFN, HIDDEN))
            add(p + f"mlp.experts.{e}.down_proj.weight", (HIDDEN, FFN))
    add("model.norm.weight", (HIDDEN,))
    add("lm_head.weight", (VOCAB, HIDDEN))
    raw = json.dumps(header).encode()
    st = folder / "model.safetensors"
    st.write_bytes(struct.pack("<Q", len(raw)) + raw)
    _sparse(st, 8 + len(raw) + offset)
    return offset


def _gguf_100gb(path: Path) -> int:
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(path, "qwen3moe")
    w.add_block_count(LAYERS)
    w.add_embedding_length(HIDDEN)
    w.add_head_count(32)
    w.add_head_count_kv(4)
    w.add_key_length(128)
    w.add_expert_count(EXPERTS)
    w.add_expert_used_count(8)
    w.add_expert_feed_forward_length(FFN)
    w.add_context_length(40960)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"tok{i}" for i in range(VOCAB)])
    w.add_token_types([1] * VOCAB)
    w.add_token_merges([f"t{i} k{i}" for i in range(VOCAB)])
    q8 = gguf.GGMLQuantizationType.Q8_0
    f32 = np.dtype(np.float32)

    def add(name, shape, qtype=q8):
        if qtype is None:
            w.add_tensor_info(name, shape, f32, int(np.prod(shape)) * 4)
        else:
            byte_shape = (*shape[:-1], shape[-1] // 32 * 34)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qtype)

    add("token_embd.weight", (VOCAB, HIDDEN))
    for i in range(LAYERS):
        add(f"blk.{i}.attn_norm.weight", (HIDDEN,), None)
        add(f"blk.{i}.ffn_norm.weight", (HIDDEN,), None)
        for name, shape in (("attn_q", (4096, HIDDEN)), ("attn_k", (512, HIDDEN)), ("attn_v", (512, HIDDEN)),
                            ("attn_output", (HIDDEN, 4096))):
            add(f"blk.{i}.{name}.weight", shape)
        add(f"blk.{i}.attn_q_norm.weight", (128,), None)
        add(f"blk.{i}.attn_k_norm.weight", (128,), None)
        add(f"blk.{i}.ffn_gate_inp.weight", (EXPERTS, HIDDEN), None)
        # F16 experts, so that the file passes 100 GB
        for name, shape in (("gate", (EXPERTS, FFN, HIDDEN)), ("up", (EXPERTS, FFN, HIDDEN)),
                            ("down", (EXPERTS, HIDDEN, FFN))):
            w.add_tensor_info(f"blk.{i}.ffn_{name}_exps.weight", shape, np.dtype(np.float16), int(np.prod(shape)) * 2)
    add("output_norm.weight", (HIDDEN,), None)
    add("output.weight", (VOCAB, HIDDEN))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    data = sum(ti.nbytes for ti in w.tensors[0].values())  # each a multiple of the 32-byte alignment
    header = path.stat().st_size
    start = (header + 31) // 32 * 32
    _sparse(path, start + data)
    return data


@pytest.mark.parametrize("kind", ["safetensors", "gguf"])
def test_100gb_model_opens_in_under_2s(kind, tmp_path):
    target = tmp_path / ("model" if kind == "safetensors" else "big.gguf")
    data_bytes = _hf_100gb(target) if kind == "safetensors" else _gguf_100gb(target)
    assert data_bytes > 100e9
    t0 = time.perf_counter()
    inv = open_model(target)
    elapsed = time.perf_counter() - t0
    assert inv.total_bytes == data_bytes
    assert len(inv.expert_keys()) == LAYERS * EXPERTS
    assert elapsed < 2.0, f"{kind}: {elapsed:.2f} s"
    if kind == "gguf":
        tokens = inv.metadata["tokenizer.ggml.tokens"]
        assert len(tokens) == VOCAB and tokens[12345] == "tok12345"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "workbench", "inspect", str(target), "--json"],
                          capture_output=True, text=True, timeout=60)
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["total_bytes"] == data_bytes and out["n_experts"] == EXPERTS
    assert len(out["units"]) == len(inv.units)
    assert elapsed < 4.0, f"workbench inspect --json (with interpreter start): {elapsed:.2f} s"


def _deepseek_v3_header(folder: Path) -> int:
    """DeepSeek-V3 as released: FP8 weights with block scales, 3 dense layers, 58 MoE layers of 256
    experts, and the multi-token-prediction layer 61. 92k tensors, 687 GB, a 13 MB header."""
    L, E, H, I, FF, V = 61, 256, 7168, 2048, 18432, 129280  # noqa: E741
    folder.mkdir()
    config = dict(model_type="deepseek_v3", num_hidden_layers=L, hidden_size=H, intermediate_size=FF,
                  moe_intermediate_size=I, num_attention_heads=128, num_key_value_heads=128, n_routed_experts=E,
                  n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=3, kv_lora_rank=512,
                  q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, vocab_size=V,
                  max_position_embeddings=163840, num_nextn_predict_layers=1)
    (folder / "config.json").write_text(json.dumps(config))
    header, offset = {}, 0

    def add(name, shape, dtype="F8_E4M3"):
        nonlocal offset
        n = {"F8_E4M3": 1, "BF16": 2, "F32": 4}[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n

    def linear(name, rows, cols):
        add(name + ".weight", (rows, cols))
        add(name + ".weight_scale_inv", ((rows + 127) // 128, (cols + 127) // 128), "F32")

    add("model.embed_tokens.weight", (V, H), "BF16")
    for i in range(L + 1):
        p = f"model.layers.{i}."
        add(p + "input_layernorm.weight", (H,), "BF16")
        add(p + "post_attention_layernorm.weight", (H,), "BF16")
        linear(p + "self_attn.q_a_proj", 1536, H)
        add(p + "self_attn.q_a_layernorm.weight", (1536,), "BF16")
        linear(p + "self_attn.q_b_proj", 128 * 192, 1536)
        linear(p + "self_attn.kv_a_proj_with_mqa", 576, H)
        add(p + "self_attn.kv_a_layernorm.weight", (512,), "BF16")
        linear(p + "self_attn.kv_b_proj", 128 * 256, 512)
        linear(p + "self_attn.o_proj", H, 128 * 128)
        if i < 3:
            linear(p + "mlp.gate_proj", FF, H)
            linear(p + "mlp.up_proj", FF, H)
            linear(p + "mlp.down_proj", H, FF)
            continue
        add(p + "mlp.gate.weight", (E, H), "BF16")
        add(p + "mlp.gate.e_score_correction_bias", (E,), "F32")
        for e in [*range(E), "shared"]:
            q = p + ("mlp.shared_experts." if e == "shared" else f"mlp.experts.{e}.")
            linear(q + "gate_proj", I, H)
            linear(q + "up_proj", I, H)
            linear(q + "down_proj", H, I)
        if i == L:
            for name in ("enorm", "hnorm", "shared_head.norm"):
                add(p + name + ".weight", (H,), "BF16")
            add(p + "eh_proj.weight", (H, 2 * H), "BF16")
            add(p + "shared_head.head.weight", (V, H), "BF16")
    add("model.norm.weight", (H,), "BF16")
    add("lm_head.weight", (V, H), "BF16")
    raw = json.dumps(header).encode()
    st = folder / "model.safetensors"
    st.write_bytes(struct.pack("<Q", len(raw)) + raw)
    _sparse(st, 8 + len(raw) + offset)
    return len(header)


def test_deepseek_v3_as_released(tmp_path):
    from workbench.commands.inspect import params_active

    n_tensors = _deepseek_v3_header(tmp_path / "ds")
    t0 = time.perf_counter()
    inv = open_model(tmp_path / "ds")
    elapsed = time.perf_counter() - t0
    assert inv.family == "deepseek_v3" and inv.spec.moe_layers == tuple(range(3, 61))
    assert round(inv.params_total / 1e9, 1) == 671.0  # scales are not parameters; the MTP layer is left out
    assert round(params_active(inv) / 1e9, 1) == 37.6
    skipped = inv.metadata["workbench.skipped_tensors"]
    assert all(name.startswith("model.layers.61.") for name in skipped)
    assert len(inv.tensors) + len(skipped) == n_tensors
    # 7x the 100 GB case; the bound catches quadratic slips (one made this 16 s)
    assert elapsed < 6.0, f"{n_tensors} tensors in {elapsed:.2f} s"
