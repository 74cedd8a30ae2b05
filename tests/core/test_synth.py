"""Synthetic GGUF models: layout llama.cpp expects, streamed tiles, routing skew as designed."""

from dataclasses import replace

import numpy as np
import pytest
from gguf import GGUFReader, quants

from workbench.core import synth
from workbench.core.errors import WorkbenchError

TINY = replace(synth.shape("s1", 2), hidden=256, n_heads=4, n_kv_heads=2, head_dim=64, n_experts=20,
               n_active=2, expert_ffn=256, vocab=1000)


def _tensors(path):
    return {t.name: t for t in GGUFReader(path).tensors}


@pytest.mark.parametrize("wtype", synth.WEIGHT_TYPES)
def test_file_has_llama_cpp_layout(tmp_path, wtype):
    info = synth.write_gguf(tmp_path / "m.gguf", TINY, wtype=wtype)
    r = GGUFReader(info.path)
    fields = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    assert fields["general.architecture"] == "qwen3moe"
    assert fields["qwen3moe.expert_count"] == 20 and fields["qwen3moe.expert_used_count"] == 2
    assert fields["qwen3moe.expert_feed_forward_length"] == 256
    assert fields["tokenizer.ggml.model"] == "none" and fields["qwen3moe.vocab_size"] == 1000
    t = {x.name: x for x in r.tensors}
    assert len(t) == len(synth.tensor_list(TINY, wtype))
    gate = t["blk.1.ffn_gate_exps.weight"]
    assert list(gate.shape) == [256, 256, 20]  # ggml order [H, I, E]
    assert gate.tensor_type.name == wtype.upper()
    assert t["blk.0.ffn_gate_inp.weight"].tensor_type.name == "F32"
    assert t["token_embd.weight"].tensor_type.name == "BF16"
    assert info.nbytes == info.path.stat().st_size


def test_weights_are_finite_with_the_chosen_spread_and_differ_between_experts(tmp_path):
    for wtype in synth.WEIGHT_TYPES:
        info = synth.write_gguf(tmp_path / f"{wtype}.gguf", TINY, wtype=wtype)
        g = _tensors(info.path)["blk.0.ffn_up_exps.weight"]
        w = quants.dequantize(g.data, g.tensor_type).reshape(20, 256, 256)
        assert np.isfinite(w).all()
        assert 0.01 < w.std() < 0.04  # designed 0.02
        assert not np.array_equal(w[0], w[1])
        assert not np.array_equal(w[0, 0], w[0, 1])


def test_mxfp4_files_hold_their_experts_alone_in_mxfp4(tmp_path):
    """As gpt-oss's GGUF files: routed experts MXFP4, the attention and head bf16; the engine keeps
    the experts in their blocks."""
    from workbench.core.memory import experts_as_stored
    from workbench.core.readers import open_model

    info = synth.write_gguf(tmp_path / "mx.gguf", TINY, wtype="mxfp4")
    t = _tensors(info.path)
    assert {t[f"blk.0.ffn_{p}_exps.weight"].tensor_type.name for p in ("gate", "up", "down")} == {"MXFP4"}
    assert t["blk.0.attn_q.weight"].tensor_type.name == "BF16" and t["output.weight"].tensor_type.name == "BF16"
    assert info.nbytes == info.path.stat().st_size
    assert experts_as_stored(open_model(info.path))


def test_rows_that_do_not_fit_a_block_fall_back():
    s = replace(TINY, expert_ffn=96)  # down rows of 96: not a multiple of 256
    fmt = {t.name: t.gtype for t in synth.tensor_list(s, "q4_k")}
    assert fmt["blk.0.ffn_down_exps.weight"] == "q8_0"
    assert fmt["blk.0.ffn_up_exps.weight"] == "q4_k"


def test_routing_skew_as_designed_and_uniform_after_reskew(tmp_path):
    big = replace(TINY, n_experts=40, n_active=4)
    path = tmp_path / "m.gguf"
    info = synth.write_gguf(path, big, coverage_target=0.5)
    assert info.design_coverage == pytest.approx(0.5, abs=0.03)
    counts = [_route_shape(path, big, layer) for layer in range(2)]
    for c in counts:
        assert synth.coverage(c) == pytest.approx(0.5, abs=0.06)
    assert np.argmax(counts[0]) != np.argmax(counts[1]) or set(np.argsort(-counts[0])[:4]) != set(
        np.argsort(-counts[1])[:4])  # hot experts differ between layers
    synth.rewrite_routers(path, coverage_target=None)
    for layer in range(2):
        assert synth.coverage(_route_shape(path, big, layer)) < 0.2  # uniform: ~0.1


def _route_shape(path, s, layer, n_tokens=4000):
    t = _tensors(path)
    emb = (t["token_embd.weight"].data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    emb = emb.reshape(s.vocab, s.hidden)
    toks = np.random.default_rng(0).integers(0, s.vocab, n_tokens)
    x = emb[toks] / np.sqrt((emb[toks] ** 2).mean(1, keepdims=True))
    logits = x @ np.asarray(t[f"blk.{layer}.ffn_gate_inp.weight"].data).T
    top = np.argsort(-logits, axis=1)[:, : s.n_active]
    return np.bincount(top.ravel(), minlength=s.n_experts)


def test_per_layer_coverage(tmp_path):
    big = replace(TINY, n_experts=40, n_active=4)
    path = tmp_path / "m.gguf"
    info = synth.write_gguf(path, big, coverage_target=[0.7, None])
    assert info.betas[0] > 0 and info.betas[1] == 0
    assert synth.coverage(_route_shape(path, big, 0)) == pytest.approx(0.7, abs=0.06)
    assert synth.coverage(_route_shape(path, big, 1)) < 0.2
    meta = GGUFReader(path).fields
    assert meta["workbench.synth.coverage_targets"].contents() == pytest.approx([0.7, -1.0])
    synth.rewrite_routers(path, coverage_target=[None, 0.5])
    assert GGUFReader(path).fields["workbench.synth.coverage_targets"].contents() == pytest.approx([-1.0, 0.5])
    assert synth.coverage(_route_shape(path, big, 1)) == pytest.approx(0.5, abs=0.06)
    with pytest.raises(WorkbenchError, match="not a GGUF file"):
        synth.rewrite_routers(__file__, coverage_target=None)
    with pytest.raises(WorkbenchError, match="per-layer coverages"):
        synth.write_gguf(path, big, coverage_target=[0.5])


def test_coverage_and_calibration():
    assert synth.coverage(np.array([[10, 0, 0, 0, 0, 0, 0, 0, 0, 10]]))[0] == pytest.approx(0.5)
    assert synth.coverage(np.ones(10)) == pytest.approx(0.1)
    b = synth.calibrate_beta(0.5, 128, 8)
    assert synth.simulate_coverage(b, 128, 8, seed=3) == pytest.approx(0.5, abs=0.03)
    with pytest.raises(WorkbenchError, match="coverage"):
        synth.calibrate_beta(1.5, 128, 8)
    with pytest.raises(WorkbenchError, match=r"\[0.\d+, 0.50\)"):
        synth.calibrate_beta(0.6, 20, 4)  # 2 hot experts can serve at most 2 of 4 picks


def test_shapes_and_bad_names():
    for name in synth.SHAPES:
        s = synth.shape(name)
        spec = s.spec()
        assert spec.n_experts == s.n_experts and spec.moe_layers == tuple(range(s.n_layers))
        assert synth.tensor_list(s)  # every shape lays out
    assert synth.shape("s1").n_layers == 24 and synth.shape("s1", 3).n_layers == 3
    with pytest.raises(WorkbenchError, match="unknown synthetic shape"):
        synth.shape("gpt-5")
    with pytest.raises(WorkbenchError, match="unknown weight type"):
        synth.tensor_list(TINY, "iq2_xxs")
    s1 = synth.shape("s1")
    experts = sum(t.nbytes for t in synth.tensor_list(s1) if "exps" in t.name)
    assert experts == 24 * 128 * 3 * 768 * 2048 * 2


def test_other_architectures_write(tmp_path):
    for name, arch in (("mixtral-8x7b", "llama"), ("deepseek-v2-lite-like", "qwen2moe")):
        s = replace(synth.shape(name, 1), hidden=256, n_heads=4, n_kv_heads=2, head_dim=64,
                    expert_ffn=256, vocab=500, shared_ffn=256 if arch == "qwen2moe" else 0)
        info = synth.write_gguf(tmp_path / f"{name}.gguf", s, coverage_target=0.4 if arch == "llama" else 0.5)
        t = _tensors(info.path)
        assert "blk.0.ffn_gate_exps.weight" in t
        assert ("blk.0.ffn_up_shexp.weight" in t) == (arch == "qwen2moe")


def test_sparse_file_has_the_same_header_and_routers_and_no_weights(tmp_path):
    """``sparse``: the same tensors at the same offsets and the same routers, the tiled weights zeros
    (holes): what the offline predictions read, without the disk space."""
    full = synth.write_gguf(tmp_path / "full.gguf", TINY, wtype="q4_k")
    hole = synth.write_gguf(tmp_path / "hole.gguf", TINY, wtype="q4_k", sparse=True)
    assert hole.nbytes == full.nbytes == hole.path.stat().st_size
    a, b = _tensors(full.path), _tensors(hole.path)
    assert {n: (t.data_offset, t.n_bytes) for n, t in a.items()} == {n: (t.data_offset, t.n_bytes) for n, t in b.items()}
    assert np.array_equal(a["blk.1.ffn_gate_inp.weight"].data, b["blk.1.ffn_gate_inp.weight"].data)
    assert not np.asarray(b["blk.1.ffn_up_exps.weight"].data).any()
    assert np.asarray(a["blk.1.ffn_up_exps.weight"].data).any()
