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
