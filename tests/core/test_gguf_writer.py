"""GGUF writer: every HF tensor comes back exactly after undoing llama.cpp's transforms; names, keys,
quantization and tokenizer as llama.cpp writes them."""

from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest

from tests.tiny_models import DENSE_CONFIGS, FAMILY_CONFIGS
from workbench.core.gguf_writer import write_gguf
from workbench.core.naming import hf_role
from workbench.core.readers import open_model


def _hf_tensors(folder) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(folder / "model.safetensors")


def _gguf_tensors(path) -> tuple[gguf.GGUFReader, dict[str, np.ndarray]]:
    r = gguf.GGUFReader(str(path))
    out = {}
    for t in r.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type) if t.tensor_type not in (0, 1) else np.array(t.data)
        out[t.name] = data.astype(np.float32).reshape(tuple(int(d) for d in reversed(t.shape)))
    return r, out


def _unpermute(w: np.ndarray, n: int) -> np.ndarray:
    return w.reshape(n, w.shape[0] // n // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


HF_TO_GGUF = {
    "embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.sinks": "attn_sinks.weight",
    "self_attn.q_a_proj.weight": "attn_q_a.weight", "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight", "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "feed_forward.router.weight": "ffn_gate_inp.weight", "mlp.router.weight": "ffn_gate_inp.weight",
    "mlp.router.bias": "ffn_gate_inp.bias", "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}


def _expected_gguf_name(arch: str, hf: str) -> str:
    """The llama.cpp name of an HF tensor that is copied as is (or only permuted)."""
    if hf == "lm_head.weight":
        return "output.weight"
    rest = hf.removeprefix("model.")
    if not rest.startswith("layers."):
        return HF_TO_GGUF[rest]
    _, layer, tail = rest.split(".", 2)
    if tail in HF_TO_GGUF:
        name = HF_TO_GGUF[tail]
        if arch == "gpt-oss" and tail == "post_attention_layernorm.weight":
            name = "post_attention_norm.weight"
        return f"blk.{layer}.{name}"
    for shared in ("mlp.shared_expert.", "mlp.shared_experts.", "feed_forward.shared_expert."):
        if tail.startswith(shared):
            return f"blk.{layer}.ffn_{tail[len(shared):].split('_')[0]}_shexp.weight"
    for dense in ("mlp.", "feed_forward."):
        if tail.startswith(dense) and tail.count(".") == 2:
            return f"blk.{layer}.ffn_{tail[len(dense):].split('_')[0]}.weight"
    raise AssertionError(f"test table lacks {hf}")


def _check_roundtrip(model_type: str, hf: dict[str, np.ndarray], gg: dict[str, np.ndarray], arch: str,
                     config: dict, atol: float) -> None:
    """Rebuild every HF tensor from the GGUF ones (undoing each transform) and compare."""
    used: set[str] = set()
    n_heads, n_kv = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]

    def take(name):
        used.add(name)
        return gg[name]

    for name, want in hf.items():
        role = hf_role(name)
        layer = role.layer
        if role.expert is not None:
            proj = {"w1": "gate", "w2": "down", "w3": "up"}.get(name.split(".")[-2], name.split(".")[-2][:-5])
            got = take(f"blk.{layer}.ffn_{proj}_exps.weight")[role.expert]
        elif role.stacked:
            base = f"blk.{layer}.ffn_{{}}_exps.{{}}"
            if name.endswith("gate_up_proj_bias"):
                got = np.empty_like(want)
                got[:, ::2], got[:, 1::2] = take(base.format("gate", "bias")), take(base.format("up", "bias"))
            elif name.endswith("down_proj_bias"):
                got = take(base.format("down", "bias"))
            elif name.endswith("gate_up_proj"):
                gate, up = take(base.format("gate", "weight")), take(base.format("up", "weight"))
                if arch == "gpt-oss":
                    got = np.empty((gate.shape[0], 2 * gate.shape[1], gate.shape[2]), np.float32)
                    got[:, ::2], got[:, 1::2] = gate, up
                else:
                    got = np.concatenate([gate, up], axis=1)
                got = got.transpose(0, 2, 1)
            else:
                got = take(base.format("down", "weight")).transpose(0, 2, 1)
        elif name.endswith("kv_b_proj.weight"):
            k_b, v_b = take(f"blk.{layer}.attn_k_b.weight"), take(f"blk.{layer}.attn_v_b.weight")
            got = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(want.shape)
        else:
            got = take(_expected_gguf_name(arch, name))
            if arch == "llama" and ".q_proj." in name:
                got = _unpermute(got, n_heads)
            elif arch == "llama" and ".k_proj." in name:
                got = _unpermute(got, n_kv)
        got = np.asarray(got).reshape(want.shape)
        np.testing.assert_allclose(got, want, atol=atol, rtol=0, err_msg=name)
    assert used == set(gg), f"GGUF tensors not from HF: {set(gg) - used}"


ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "olmoe": "olmoe",
        "llama4_text": "llama4", "deepseek_v2": "deepseek2", "deepseek_v3": "deepseek2", "gpt_oss": "gpt-oss",
        "llama": "llama", "qwen3": "qwen3"}


@pytest.mark.parametrize("model_type", [*FAMILY_CONFIGS, *DENSE_CONFIGS])
def test_f32_roundtrip_undoes_llama_cpp_transforms(model_type, tiny_model_dir, tiny_gguf):
    folder = tiny_model_dir(model_type)
    config = json.loads((folder / "config.json").read_text())
    reader, gg = _gguf_tensors(tiny_gguf(model_type, "F32"))
    arch = ARCH[model_type]
    assert reader.fields["general.architecture"].contents() == arch
    _check_roundtrip(model_type, _hf_tensors(folder), gg, arch, config, atol=0)
    # llama.cpp knows every name we write for the arch (our dense layers in qwen MoE archs aside)
    known = set()
    for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH[[k.name for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch][0]]]:
        for layer in range(config["num_hidden_layers"]):
            known.add(gguf.TENSOR_NAMES[t].format(bid=layer))
    for name in gg:
        base = name.rsplit(".", 1)[0]
        if not (arch in ("qwen2moe", "qwen3moe") and base.split(".")[-1] in ("ffn_gate", "ffn_up", "ffn_down")):
            assert base in known, f"{name} is not a llama.cpp tensor of {arch}"


def test_metadata_keys_as_llama_cpp(tiny_gguf):
    def fields(mt):
        r = gguf.GGUFReader(str(tiny_gguf(mt, "F32")))
        return {k: f.contents() for k, f in r.fields.items()}

    f = fields("qwen2_moe")
    assert f["qwen2moe.expert_count"] == 6 and f["qwen2moe.expert_used_count"] == 2
    assert f["qwen2moe.expert_feed_forward_length"] == 16
    assert f["qwen2moe.expert_shared_feed_forward_length"] == 24
    f = fields("deepseek_v3")
    assert f["deepseek2.attention.head_count_kv"] == 1 and f["deepseek2.attention.kv_lora_rank"] == 16
    assert f["deepseek2.attention.key_length"] == 16 + 8 and f["deepseek2.attention.value_length"] == 16
    assert f["deepseek2.attention.key_length_mla"] == 16 and f["deepseek2.attention.value_length_mla"] == 8
    assert f["deepseek2.leading_dense_block_count"] == 1 and f["deepseek2.expert_shared_count"] == 1
    assert f["deepseek2.expert_gating_func"] == int(gguf.ExpertGatingFuncType.SIGMOID)
    assert f["deepseek2.expert_weights_scale"] == pytest.approx(2.5) and f["deepseek2.expert_group_count"] == 2
    f = fields("llama4_text")
    assert f["llama4.interleave_moe_layer_step"] == 2 and f["llama4.feed_forward_length"] == 64
    assert f["llama4.expert_feed_forward_length"] == 16 and f["llama4.attention.chunk_size"] == 16
    f = fields("gpt_oss")
    assert f["gpt-oss.attention.sliding_window"] == 8 and f["gpt-oss.expert_count"] == 4
    assert f["gpt-oss.rope.scaling.type"] == "yarn" and f["gpt-oss.rope.scaling.factor"] == pytest.approx(32)
    f = fields("mixtral")
    assert f["llama.expert_count"] == 4 and f["llama.rope.dimension_count"] == 8


@pytest.mark.parametrize(("tensor_type", "atol"), [("Q8_0", 2e-3), ("Q4_0", 3e-2), ("F16", 1e-3), ("BF16", 2e-3)])
def test_quantized_copies_dequantize_close(tensor_type, atol, tiny_model_dir, tiny_gguf):
    folder = tiny_model_dir("qwen3_moe")
    config = json.loads((folder / "config.json").read_text())
    reader, gg = _gguf_tensors(tiny_gguf("qwen3_moe", tensor_type))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.ffn_up_exps.weight"] == tensor_type and types["blk.0.attn_q.weight"] == tensor_type
    assert types["blk.0.ffn_gate_inp.weight"] == "F32" and types["blk.0.attn_norm.weight"] == "F32"
    _check_roundtrip("qwen3_moe", _hf_tensors(folder), gg, "qwen3moe", config, atol=atol)


def test_rows_not_filling_blocks_fall_back_to_f16(tiny_model_dir, tmp_path):
    out = write_gguf(tiny_model_dir("mixtral"), tmp_path / "m.gguf", "Q8_0", expert_type="Q4_0")[0]
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(out)).tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == "Q4_0"  # rows of 32
    assert types["blk.0.ffn_down_exps.weight"] == "F16"  # rows of 48: not whole blocks of 32
    assert types["blk.0.attn_q.weight"] == "Q8_0"


def test_tokenizer_written_like_llama_cpp(tiny_model_dir, tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir("qwen3_moe", vocab_size=320), folder)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["It is a truth universally acknowledged, that a single man"] * 20, trainer)
    tok.save(str(folder / "tokenizer.json"))
    template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "eos_token": "<|im_end|>", "bos_token": None, "pad_token": "<pad>"}))
    out = write_gguf(folder, tmp_path / "t.gguf")[0]
    f = {k: v.contents() for k, v in gguf.GGUFReader(str(out)).fields.items()}
    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    tokens = f["tokenizer.ggml.tokens"]
    assert len(tokens) == 320 and len(vocab) < 320  # padded to the model's vocab_size
    assert all(tokens[i] == text for text, i in vocab.items())
    assert f["tokenizer.ggml.model"] == "gpt2" and f["tokenizer.ggml.pre"] == "gpt-2"
    assert f["tokenizer.ggml.token_type"][2] == int(gguf.TokenType.CONTROL)
    assert f["tokenizer.ggml.token_type"][319] == int(gguf.TokenType.UNUSED)
    merges = json.loads((folder / "tokenizer.json").read_text())["model"]["merges"]
    assert len(merges) > 10
    assert f["tokenizer.ggml.merges"] == [m if isinstance(m, str) else " ".join(m) for m in merges]
    assert f["tokenizer.ggml.eos_token_id"] == 2 and f["tokenizer.chat_template"] == template
    # the engine's GGUF tokenizer, fed from our lazy metadata, encodes like the source tokenizer.json
    from workbench.core.readers import open_model
    from workbench.engine.tokenizer import from_gguf

    meta = open_model(out).metadata
    fields = {k: (list(v) if not isinstance(v, (str, int, float)) else v) for k, v in meta.items()
              if k.startswith("tokenizer.")}
    text = "It is a truth universally acknowledged<|im_end|> that a man"
    assert from_gguf(out, fields).encode(text, add_special_tokens=False) == tok.encode(text).ids


@pytest.mark.parametrize(("tensor_type", "rel"), [("Q2_K", 0.4), ("Q3_K", 0.2), ("Q4_K", 0.12), ("Q5_K", 0.06),
                                                  ("Q6_K", 0.03), ("IQ4_XS", 0.12)])
def test_k_quants(tensor_type, rel, tiny_model_dir, tiny_gguf):
    """K-quant blocks (256 values) need 256-wide rows: a tiny model of hidden size 256."""
    dims = dict(hidden_size=256, moe_intermediate_size=256, intermediate_size=256)
    folder = tiny_model_dir("qwen3_moe", **dims)
    reader, gg = _gguf_tensors(tiny_gguf("qwen3_moe", tensor_type, **dims))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.ffn_up_exps.weight"] == types["blk.0.ffn_down_exps.weight"] == tensor_type
    assert types["blk.0.attn_output.weight"] == "F16"  # rows of 32 values
    hf = _hf_tensors(folder)
    for e in range(8):
        want = hf[f"model.layers.0.mlp.experts.{e}.up_proj.weight"]
        got = gg["blk.0.ffn_up_exps.weight"][e]
        assert np.abs(got - want).mean() / np.abs(want).mean() < rel
        assert np.abs(got - want).max() < 0.6 * np.abs(want).max()
    inv = open_model(tiny_gguf("qwen3_moe", tensor_type, **dims))
    assert inv.params_total == open_model(folder).params_total
    assert inv.total_bytes == sum(int(t.n_bytes) for t in reader.tensors)


def test_kquant_layout_of_known_block():
    """A ramp decodes within a quantization step, so every value sits where ggml reads it."""
    from workbench.core.kquants import quantize_k

    x = np.linspace(-1, 1, 512, dtype=np.float32).reshape(1, 512)  # 2 blocks; any misplaced value is far off
    for t, atol in (("Q2_K", 0.08), ("Q3_K", 0.06), ("Q4_K", 0.04), ("Q5_K", 0.02), ("Q6_K", 0.02), ("IQ4_XS", 0.1)):
        y = gguf.quants.dequantize(quantize_k(x, t), gguf.GGMLQuantizationType[t])
        np.testing.assert_allclose(y, x, atol=atol, err_msg=t)


def test_biases_stay_f32(tiny_gguf):
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(tiny_gguf("gpt_oss", "Q8_0"))).tensors}
    assert types["blk.0.ffn_gate_exps.bias"] == types["blk.0.attn_q.bias"] == types["blk.0.ffn_gate_inp.bias"] == "F32"
    assert types["blk.0.ffn_gate_exps.weight"] == "Q8_0"


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_fused_hf_experts_convert_like_per_expert_ones(model_type, tiny_model_dir, tiny_gguf, tmp_path):
    """A checkpoint saved with fused experts ([E, 2I, H] gate first, [E, H, I]) gives the same GGUF."""
    import re

    from safetensors.numpy import load_file, save_file

    src = tiny_model_dir(model_type)
    tensors = load_file(src / "model.safetensors")
    per_expert = re.compile(r"(model\.layers\.\d+\.(?:mlp|block_sparse_moe))\.experts\.(\d+)\.(\w+)\.weight")
    groups: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name in [n for n in tensors if per_expert.fullmatch(n)]:
        prefix, e, proj = per_expert.fullmatch(name).groups()
        groups.setdefault((prefix, {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}.get(proj, proj)), {})[int(e)] = tensors.pop(name)
    for prefix in {p for p, _ in groups}:
        stack = {proj: np.stack([w[e] for e in sorted(w)]) for (p, proj), w in groups.items() if p == prefix}
        fused = prefix.replace("block_sparse_moe", "mlp")  # transformers 5 names Mixtral's MoE block mlp
        if fused != prefix:
            tensors[f"{fused}.gate.weight"] = tensors.pop(f"{prefix}.gate.weight")
        tensors[f"{fused}.experts.gate_up_proj"] = np.concatenate([stack["gate_proj"], stack["up_proj"]], axis=1)
        tensors[f"{fused}.experts.down_proj"] = stack["down_proj"]
    folder = tmp_path / "fused"
    folder.mkdir()
    (folder / "config.json").write_text((src / "config.json").read_text())
    save_file(tensors, folder / "model.safetensors")
    _, want = _gguf_tensors(tiny_gguf(model_type, "F32"))
    _, got = _gguf_tensors(write_gguf(folder, tmp_path / "fused.gguf")[0])
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert open_model(folder).params_total == open_model(src).params_total


def test_pre_tokenizer_names_match_the_engine_regexes():
    """The ``tokenizer.ggml.pre`` we write names the split regexes the tokenizer.json uses, as the
    engine's GGUF tokenizer reads them back."""
    from workbench.core.gguf_writer import _pre_tokenizer_name
    from workbench.engine.tokenizer import PRE_TOKENIZER_SPLITS

    for name in ("llama-bpe", "qwen2", "gpt-4o", "deepseek-v3", "gpt-2"):
        splits = PRE_TOKENIZER_SPLITS[name]
        if name == "gpt-2":  # GPT-2 style: ByteLevel with its built-in regex, no Split
            pre = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
        else:
            pre = {"type": "Sequence", "pretokenizers": [
                *({"type": "Split", "pattern": {"Regex": p}, "behavior": "Isolated"} for p in splits),
                {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}]}
        got = _pre_tokenizer_name({"pre_tokenizer": pre})
        assert PRE_TOKENIZER_SPLITS[got] == splits, (name, got)
