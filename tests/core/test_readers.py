"""Readers against the real thing: transformers' models, safetensors' and gguf-py's own readers."""

from __future__ import annotations

import numpy as np
import pytest

from tests.tiny_models import DENSE_CONFIGS, FAMILY_CONFIGS
from workbench.core.readers import open_model
from workbench.core.readers.gguf import GGUFStringArray, read_gguf_header
from workbench.core.units import UnitKey

MODEL_TYPES = [*FAMILY_CONFIGS, *DENSE_CONFIGS]


def _file_param_count(model) -> int:
    """Parameters plus persistent buffers (DeepSeek-V3's e_score_correction_bias), tied ones once."""
    seen, n = set(), 0
    for t in model.state_dict().values():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            n += t.numel()
    return n


def _check_units(inv) -> None:
    """Every tensor is owned once: whole by one unit, or one slice per expert adding up to it."""
    owned: dict[str, int] = {}
    for unit in inv.units.values():
        for ref in unit.tensors:
            owned[ref.tensor.name] = owned.get(ref.tensor.name, 0) + ref.nbytes
    assert owned == {name: t.nbytes for name, t in inv.tensors.items()}
    assert sum(u.nbytes for u in inv.units.values()) == inv.total_bytes
    s = inv.spec
    assert len(inv.expert_keys()) == s.n_experts * len(s.moe_layers)
    for layer in range(s.n_layers):
        assert UnitKey(layer, "attn") in inv.units
        assert (UnitKey(layer, "router") in inv.units) == (layer in s.moe_layers)
        assert (UnitKey(layer, "shared") in inv.units) == (layer in s.moe_layers and s.n_shared_experts > 0)
        assert (UnitKey(layer, "dense_mlp") in inv.units) == (layer not in s.moe_layers)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_hf_folder_matches_transformers(model_type, tiny_model_dir, tiny_hf_model):
    from safetensors import safe_open

    folder = tiny_model_dir(model_type)
    model = tiny_hf_model(model_type)
    inv = open_model(folder)
    assert inv.format == "safetensors"
    assert inv.params_total == _file_param_count(model)
    with safe_open(folder / "model.safetensors", "np") as f:
        real = {n: f.get_tensor(n) for n in f.keys()}
    assert inv.total_bytes == sum(a.nbytes for a in real.values())
    for name, t in inv.tensors.items():
        assert t.shape == real[name].shape
        raw = np.fromfile(t.file, dtype=np.float32, count=t.nbytes // 4, offset=t.offset)
        np.testing.assert_array_equal(raw.reshape(t.shape), real[name])
    _check_units(inv)
    cfg = model.config
    s = inv.spec
    assert s.n_layers == cfg.num_hidden_layers and s.hidden_size == cfg.hidden_size
    assert s.n_experts_active == getattr(cfg, "num_experts_per_tok", 0)
    if model_type in DENSE_CONFIGS:
        assert inv.family == "dense" and not s.is_moe and s.dense_layers == tuple(range(s.n_layers))
    if model_type == "qwen2_moe":
        assert s.moe_layers == (1, 3) and s.n_shared_experts == 1 and s.shared_ffn == 24
    if model_type == "qwen3_moe":
        assert s.dense_layers == (1,)
    if model_type == "llama4_text":
        assert s.moe_layers == tuple(cfg.moe_layers) == (1, 3)
        assert s.layer_window == (16, 16, 16, None)
    if model_type == "gpt_oss":
        assert s.layer_window == (8, None)
    if model_type.startswith("deepseek"):
        assert s.moe_layers == (1, 2) and s.kv_lora_rank == 16 and s.qk_rope_head_dim == 8


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("tensor_type", ["F32", "Q8_0"])
def test_gguf_matches_gguf_py_and_hf(model_type, tensor_type, tiny_gguf, tiny_model_dir, tiny_hf_model):
    from gguf import GGUFReader

    path = tiny_gguf(model_type, tensor_type)
    inv = open_model(path)
    hf = open_model(tiny_model_dir(model_type))
    assert inv.format == "gguf" and inv.family == hf.family
    assert inv.spec == hf.spec  # the synthesised config describes the same model
    assert inv.params_total == hf.params_total == _file_param_count(tiny_hf_model(model_type))
    reader = GGUFReader(str(path))
    assert inv.total_bytes == sum(int(t.n_bytes) for t in reader.tensors)
    assert set(inv.tensors) == {t.name for t in reader.tensors}
    for t in reader.tensors:
        mine = inv.tensors[t.name]
        assert mine.shape == tuple(int(d) for d in reversed(t.shape))
        assert mine.dtype == t.tensor_type.name and mine.nbytes == int(t.n_bytes)
        assert mine.offset == int(t.data_offset)
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        want = field.contents()
        got = inv.metadata[name]
        if isinstance(got, GGUFStringArray):
            got = got.materialize()
        if hasattr(got, "tolist"):
            got = got.tolist()
        assert got == pytest.approx(want) if isinstance(want, float) else got == want, name
    if tensor_type == "Q8_0":
        assert "Q8_0" in inv.dtype_mix()
        assert all(r.tensor.dtype == "Q8_0" for k in inv.expert_keys() for r in inv.units[k].tensors
                   if r.tensor.shape[-1] % 32 == 0 and r.tensor.name.endswith(".weight"))
    _check_units(inv)


def test_sharded_safetensors_equal_single(tiny_model_dir, tiny_hf_model, tmp_path):
    model = tiny_hf_model("qwen3_moe")
    model.save_pretrained(tmp_path, max_shard_size="60KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    sharded, single = open_model(tmp_path), open_model(tiny_model_dir("qwen3_moe"))
    assert len(sharded.files) > 1
    assert sharded.total_bytes == single.total_bytes and sharded.params_total == single.params_total
    assert {n: (t.shape, t.dtype) for n, t in sharded.tensors.items()} == {
        n: (t.shape, t.dtype) for n, t in single.tensors.items()}
    assert sharded.fingerprint == single.fingerprint
    for entry in ("model.safetensors.index.json", "config.json", sorted(tmp_path.glob("*.safetensors"))[1].name):
        assert open_model(tmp_path / entry).fingerprint == single.fingerprint  # any file of the folder opens it


def test_split_gguf_equal_single(tiny_model_dir, tmp_path):
    from workbench.core.gguf_writer import write_gguf

    src = tiny_model_dir("mixtral")
    parts = write_gguf(src, tmp_path / "m.gguf", "Q8_0", split_max_tensors=10)
    single = write_gguf(src, tmp_path / "one.gguf", "Q8_0")[0]
    assert len(parts) > 2 and parts[1].name.endswith(f"-00002-of-{len(parts):05d}.gguf")
    a, b = open_model(parts[1]), open_model(single)
    assert a.files == parts
    assert a.total_bytes == b.total_bytes and a.spec == b.spec
    assert {n: (t.shape, t.dtype, t.nbytes) for n, t in a.tensors.items()} == {
        n: (t.shape, t.dtype, t.nbytes) for n, t in b.tensors.items()}
    # each part's data is where its own header says
    for t in a.tensors.values():
        assert t.file in parts


def test_fingerprint_tracks_content(tiny_model_dir, tiny_gguf):
    a = open_model(tiny_gguf("olmoe", "F32"))
    assert a.fingerprint == open_model(tiny_gguf("olmoe", "F32")).fingerprint
    assert a.fingerprint != open_model(tiny_gguf("olmoe", "Q8_0")).fingerprint
    assert a.fingerprint != open_model(tiny_model_dir("olmoe")).fingerprint


def test_gguf_header_only_offsets(tiny_gguf):
    meta, tensors = read_gguf_header(tiny_gguf("qwen2_moe", "F32"))
    t = tensors["blk.1.ffn_up_exps.weight"]
    assert t.shape == (6, 16, 32) and t.nbytes == 6 * 16 * 32 * 4
    assert meta["general.architecture"] == "qwen2moe" and meta["qwen2moe.expert_count"] == 6


def test_llama4_multimodal_checkpoint_reads_its_text_model(tmp_path, tiny_model_dir):
    """Llama 4 Scout ships as Llama4ForConditionalGeneration: the text model under language_model.*,
    plus a vision tower that text inference (and this inventory) leaves out."""
    import torch
    from transformers import AutoConfig, Llama4ForConditionalGeneration

    from workbench.core.gguf_writer import write_gguf

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=28,
                  patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)
    config = AutoConfig.for_model("llama4", text_config=FAMILY_CONFIGS["llama4_text"], vision_config=vision)
    torch.manual_seed(0)
    Llama4ForConditionalGeneration(config).save_pretrained(tmp_path / "mm")
    inv, text_only = open_model(tmp_path / "mm"), open_model(tiny_model_dir("llama4_text"))
    assert inv.family == "llama4" and inv.spec == text_only.spec
    assert inv.params_total == text_only.params_total and inv.total_bytes == text_only.total_bytes
    assert all(n.startswith(("vision_model.", "multi_modal_projector.")) for n in inv.metadata["workbench.skipped_tensors"])
    _check_units(inv)
    gg = open_model(write_gguf(tmp_path / "mm", tmp_path / "mm.gguf")[0])
    assert gg.spec == text_only.spec and "output.weight" in gg.tensors
    assert gg.params_total == text_only.params_total


def test_every_metadata_value_type(tmp_path):
    import gguf

    path = tmp_path / "kv.gguf"
    w = gguf.GGUFWriter(path, "qwen3moe")
    values = {
        "t.u8": (7, gguf.GGUFValueType.UINT8), "t.i8": (-7, gguf.GGUFValueType.INT8),
        "t.u16": (700, gguf.GGUFValueType.UINT16), "t.i16": (-700, gguf.GGUFValueType.INT16),
        "t.u32": (70000, gguf.GGUFValueType.UINT32), "t.i32": (-70000, gguf.GGUFValueType.INT32),
        "t.u64": (1 << 40, gguf.GGUFValueType.UINT64), "t.i64": (-(1 << 40), gguf.GGUFValueType.INT64),
        "t.f32": (0.5, gguf.GGUFValueType.FLOAT32), "t.f64": (0.25, gguf.GGUFValueType.FLOAT64),
        "t.bool": (True, gguf.GGUFValueType.BOOL), "t.str": ("héllo", gguf.GGUFValueType.STRING),
    }
    for key, (value, vtype) in values.items():
        w.add_key_value(key, value, vtype)
    w.add_array("t.ints", list(range(100_000)))
    w.add_array("t.floats", [0.5, 1.5])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.strs", [f"s{i}" for i in range(1000)])
    w.add_array("t.nested", [[1, 2], [3, 4, 5]])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    meta, tensors = read_gguf_header(path)
    assert tensors == {}
    for key, (value, _) in values.items():
        assert meta[key] == value, key
    assert meta["t.ints"] == list(range(100_000)) and meta["t.floats"] == [0.5, 1.5]
    assert meta["t.bools"] == [True, False, True] and meta["t.nested"] == [[1, 2], [3, 4, 5]]
    strs = meta["t.strs"]
    assert isinstance(strs, GGUFStringArray) and len(strs) == 1000 and strs[999] == "s999" and list(strs)[:2] == ["s0", "s1"]


def test_mxfp4_safetensors_count_parameters(tmp_path, tiny_model_dir):
    """gpt-oss checkpoints store experts as MXFP4 bytes (``*_blocks`` U8 [E, R, G, 16] + ``*_scales``
    U8 [E, R, G]): parameters are counted from the blocks (32 per block), not from the bytes."""
    from safetensors.numpy import load_file, save_file

    src = tiny_model_dir("gpt_oss", intermediate_size=32)  # whole blocks of 32 on both projections
    tensors = load_file(src / "model.safetensors")
    rng = np.random.default_rng(0)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, k, r = tensors.pop(name).shape  # [E, in, out] -> blocks over the input dimension
        tensors[name + "_blocks"] = rng.integers(0, 256, (e, r, k // 32, 16), dtype=np.uint8)
        tensors[name + "_scales"] = rng.integers(118, 130, (e, r, k // 32), dtype=np.uint8)
    folder = tmp_path / "mxfp4"
    folder.mkdir()
    (folder / "config.json").write_text((src / "config.json").read_text())
    save_file(tensors, folder / "model.safetensors")
    inv, ref = open_model(folder), open_model(src)
    assert inv.params_total == ref.params_total
    expert_bytes = [sum(i.units[k].nbytes for k in i.expert_keys()) for i in (inv, ref)]
    assert expert_bytes[0] < 0.3 * expert_bytes[1]  # 4.25 bits instead of 32 (biases stay F32)
    for key in inv.expert_keys():
        assert inv.units[key].n_params == ref.units[key].n_params
    _check_units(inv)


def test_folder_of_gguf_files(tmp_path, tiny_gguf, tiny_model_dir):
    from workbench.core.errors import ModelFormatError
    from workbench.core.gguf_writer import write_gguf

    parts = write_gguf(tiny_model_dir("olmoe"), tmp_path / "m.gguf", split_max_tensors=8)
    assert open_model(tmp_path).files == parts  # one model (a split set) in the folder: that one
    (tmp_path / "other.gguf").write_bytes(tiny_gguf("olmoe", "Q8_0").read_bytes())
    with pytest.raises(ModelFormatError, match="several GGUF models"):
        open_model(tmp_path)


def test_config_variants_of_released_checkpoints():
    """Config shapes as released (older transformers): Llama 4 without layer_types, Qwen2-MoE with a
    sliding window it does not use, DeepSeek-V3 with moe_layer_freq."""
    from workbench.core.readers.hf_config import spec_from_config

    scout = {"model_type": "llama4", "text_config": {
        "model_type": "llama4_text", "num_hidden_layers": 8, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 100, "num_local_experts": 16,
        "num_experts_per_tok": 1, "intermediate_size": 32, "intermediate_size_mlp": 64,
        "interleave_moe_layer_step": 1, "attention_chunk_size": 8192, "no_rope_layers": []}}
    s = spec_from_config(scout)
    assert s.family == "llama4" and s.moe_layers == tuple(range(8))
    assert s.layer_window == (8192, 8192, 8192, None) * 2
    qwen2 = {"model_type": "qwen2_moe", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
             "vocab_size": 100, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
             "shared_expert_intermediate_size": 32, "sliding_window": 4096, "use_sliding_window": False}
    assert spec_from_config(qwen2).layer_window == (None, None)
    ds = {"model_type": "deepseek_v3", "num_hidden_layers": 6, "hidden_size": 64, "num_attention_heads": 4,
          "vocab_size": 100, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
          "n_shared_experts": 1, "first_k_dense_replace": 1, "moe_layer_freq": 2, "kv_lora_rank": 32,
          "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16}
    s = spec_from_config(ds)
    assert s.moe_layers == (2, 4) and s.kv_values_per_token(0) == 40 and s.head_dim == 24
