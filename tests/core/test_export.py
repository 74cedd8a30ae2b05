import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workbench.core.costmodel import CostModel
from workbench.core.errors import WorkbenchError
from workbench.core.export import (
    export,
    export_accelerate,
    export_ktransformers,
    export_llama_cpp,
    kt_gpu_mask,
    layer_approximation,
    llama_cpp_overrides,
)
from workbench.core.memory import placement_n_cpu_moe
from workbench.core.placement import CPU_COMPUTE, CPU_STREAM, Assignment, Placement, expert_grid
from workbench.core.readers import open_model
from workbench.core.units import UnitKey

from .profiles import h200_profile
from .synth_inventory import synth_inventory

FAMILIES = ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss", "qwen2_moe"]


def _gpu_expert_bytes(inv, p):
    return sum(inv.units[k].nbytes for k in inv.expert_keys() if p.get(k).tier.startswith("gpu"))


def _random_placement(inv, seed, share=0.5, others=False):
    """Experts on the CPU with probability ``share``; with ``others``, some experts on gpu:1 and some
    non-expert units (attention, shared experts, lm_head) on the CPU or gpu:1 too."""
    rng = np.random.default_rng(seed)
    p = Placement()
    for key in inv.expert_keys():
        r = rng.random()
        if r < share:
            p.set(key, CPU_COMPUTE)
        elif others and r < share + 0.2:
            p.set(key, Assignment("gpu:1"))
    if others:
        for key in inv.units:
            if key.kind in ("attn", "shared", "lm_head", "dense_mlp") and rng.random() < 0.3:
                p.set(key, CPU_COMPUTE if rng.random() < 0.5 else Assignment("gpu:1"))
    return p


def _check_overrides(inv, args, approx):
    """Every -ot pattern, searched (as llama.cpp's std::regex_search does) over the model's real tensor
    names, selects exactly the tensors of the units the approximation puts on that buffer."""
    names = list(inv.tensors)
    claimed: set[str] = set()
    for pattern, buf in llama_cpp_overrides(args):
        hits = {n for n in names if pattern.search(n)}
        want = set()
        for key, unit in inv.units.items():
            tier = approx.get(key).tier
            if (buf == "CPU" and tier == "cpu") or (buf.startswith("CUDA") and tier == f"gpu:{buf[4:]}"):
                if key.kind != "embed":
                    want |= {ref.tensor.name for ref in unit.tensors}
        assert hits <= want, (pattern.pattern, sorted(hits - want))
        assert not hits & claimed
        claimed |= hits
    return claimed


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31), share=st.floats(0.0, 1.0), others=st.booleans())
def test_ot_patterns_select_exactly_the_intended_gguf_tensors(family, tiny_gguf, seed, share, others):
    inv = open_model(tiny_gguf(family))
    p = _random_placement(inv, seed, share, others=others)
    if UnitKey(None, "lm_head") in inv.units:  # tied embeddings have none
        p.set(UnitKey(None, "lm_head"), CPU_COMPUTE)
    out = export_llama_cpp(inv, p)
    approx = out.approximation or p
    claimed = _check_overrides(inv, out.text, approx)
    want = {ref.tensor.name for k, u in inv.units.items()
            if approx.get(k).tier != "gpu:0" and k.kind != "embed" for ref in u.tensors}
    if "--n-cpu-moe" in out.text:
        n = int(out.text.split("--n-cpu-moe ")[1].split()[0])
        shaped = placement_n_cpu_moe(inv, n)
        assert all(approx.get(k) == shaped.get(k) for k in inv.expert_keys())
        want -= {ref.tensor.name for k in inv.expert_keys() if approx.get(k).tier == "cpu"
                 for ref in inv.units[k].tensors}
    assert claimed == want
    assert _gpu_expert_bytes(inv, approx) <= _gpu_expert_bytes(inv, p)


def test_layer_shaped_placement_exports_n_cpu_moe(tiny_gguf):
    inv = open_model(tiny_gguf("qwen3_moe"))
    for n in range(inv.spec.n_layers + 1):
        out = export_llama_cpp(inv, placement_n_cpu_moe(inv, n))
        assert out.approximation is None
        assert "-ot" not in out.text
        # layer 1 is dense: --n-cpu-moe 1 and 2 differ by nothing, the smallest N is exported
        expect = min(k for k in range(n + 1) if placement_n_cpu_moe(inv, k) == placement_n_cpu_moe(inv, n))
        assert (f"--n-cpu-moe {expect}" in out.text) == (expect > 0)
        assert out.text.startswith("-ngl 99")


def test_single_experts_are_approximated_per_layer_with_a_predicted_cost():
    inv = synth_inventory(6, 8, hidden=256, expert_ffn=128)
    p = Placement()
    for layer in range(6):  # layer l keeps l+1 experts on the GPU
        p.move([UnitKey(layer, "expert", e) for e in range(layer + 1, 8)], CPU_COMPUTE)
    out = export_llama_cpp(inv, p, CostModel(inv, h200_profile()))
    approx, choice = layer_approximation(inv, p)
    assert out.approximation == approx
    # GPU bytes of 21 experts allow two whole layers: the ones with most GPU experts (5, 4)
    assert sorted(layer for layer, g in choice.items() if g >= 0) == [4, 5]
    assert any("per-layer approximation" in n for n in out.notes)
    assert any("predicted decode" in n for n in out.notes)
    assert "--n-cpu-moe 4" in out.text and "-ot" not in out.text  # layers 0-3 on the CPU is that shape
    assert export_llama_cpp(inv, approx).approximation is None
    q = Placement()
    for layer in range(6):  # now the early layers hold the most GPU experts
        q.move([UnitKey(layer, "expert", e) for e in range(6 - layer, 8)], CPU_COMPUTE)
    out = export_llama_cpp(inv, q)
    assert r'-ot "blk\.(2|3|4|5)\.ffn_(down|gate|up)_exps\.weight=CPU"' in out.text
    assert "--n-cpu-moe" not in out.text


def test_second_gpu_and_streams():
    inv = synth_inventory(4, 4, fused_gate_up=True)
    p = Placement(stream_slots=2)
    p.move(inv.expert_keys(0), CPU_STREAM)
    p.move(inv.expert_keys(3), Assignment("gpu:1"))
    out = export_llama_cpp(inv, p)
    assert r'-ot "blk\.(0)\.ffn_(down|gate_up)_exps\.weight=CPU"' in out.text or "--n-cpu-moe 1" in out.text
    assert r'blk\.(3)\.ffn_(down|gate_up)_exps\.weight=CUDA1' in out.text
    assert any("does not stream" in n for n in out.notes)
    assert out.text.startswith("-ngl 99 -ts 1,0 ")
    _check_overrides(inv, out.text, out.approximation or p)


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 2**31), st.floats(0.0, 1.0), st.booleans())
def test_ktransformers_frequency_file_reproduces_the_placement(seed, share, with_stats):
    torch = pytest.importorskip("torch")
    from workbench.core.stats import ExpertStats

    inv = synth_inventory(5, 16, dense_layers=(0,))
    p = _random_placement(inv, seed, share)
    stats = None
    if with_stats:
        stats = ExpertStats.for_spec(inv.spec)
        stats.add(np.random.default_rng(seed).integers(0, 50, size=stats.shape) * np.array([[0]] + [[1]] * 4))
    out = export_ktransformers(inv, p, stats, name="m")
    counts = json.loads(out.files["m.kt-frequency.json"])["logical_count"]
    ratio = float(out.text.split("--kt-gpu-experts-ratio ")[1].split()[0])
    want = expert_grid(p, 5, 16) >= 0
    want[0] = False  # the dense layer has no experts
    assert np.array_equal(kt_gpu_mask(np.array(counts), ratio, 4), want)
    # what KTransformers does with the converted .pt: sum over dim 0, top-N over all layers
    t = torch.tensor(counts)
    freq = t.sum(dim=0).float()
    n = int(4 * 16 * ratio)
    top = torch.topk(freq.view(-1), k=n, largest=True, sorted=False).indices
    mask = torch.zeros(freq.numel(), dtype=torch.bool)
    mask[top] = True
    assert np.array_equal(mask.view(5, 16).numpy(), want)
    assert "torch.save" in " ".join(out.notes)


@pytest.mark.parametrize("family, overrides", [("qwen3_moe", {}), ("mixtral", {}), ("deepseek_v3", {}),
                                               ("gpt_oss", {}), ("olmoe", {"tie_word_embeddings": True})])
def test_accelerate_device_map_covers_every_parameter_once(family, overrides, tiny_model_dir, tiny_hf_model):
    inv = open_model(tiny_model_dir(family, **overrides))
    p = _random_placement(inv, 0, 0.6)
    if UnitKey(None, "lm_head") in inv.units:  # tied embeddings have none
        p.set(UnitKey(None, "lm_head"), CPU_COMPUTE)
    out = export_accelerate(inv, p)
    dmap = json.loads(out.text)
    model = tiny_hf_model(family, **overrides)
    modules = {name for name, _ in model.named_modules()}
    assert set(dmap) <= modules, sorted(set(dmap) - modules)
    for name in model.state_dict():
        covering = [k for k in dmap if name == k or name.startswith(k + ".")]
        assert len(covering) == 1, (name, covering)
    approx = out.approximation or p
    for layer in inv.spec.moe_layers:
        tier = approx.get(inv.expert_keys(layer)[0]).tier
        key = next(k for k in dmap if k.endswith(f"layers.{layer}.mlp.experts"))
        assert dmap[key] == (0 if tier == "gpu:0" else "cpu")
    assert set(dmap.values()) <= {0, "cpu"}


def test_accelerate_refuses_gguf_and_unknown_target(tiny_gguf):
    inv = open_model(tiny_gguf("qwen3_moe"))
    with pytest.raises(WorkbenchError, match="Hugging Face folder"):
        export(inv, Placement(), "accelerate")
    with pytest.raises(WorkbenchError, match="unknown export target"):
        export(inv, Placement(), "vllm")


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3"])
def test_ot_patterns_from_a_hf_folder_match_the_converted_gguf(family, tiny_model_dir, tiny_gguf):
    """A project on the Hugging Face folder exports patterns for llama.cpp's converter names: checked
    against the GGUF written from that very folder."""
    hf = open_model(tiny_model_dir(family))
    gg = open_model(tiny_gguf(family))
    moe = list(hf.spec.moe_layers)
    p = Placement()
    for layer in moe[::2]:
        p.move(hf.expert_keys(layer), CPU_COMPUTE)
    out = export_llama_cpp(hf, p)
    cpu_layers = set(moe[::2])
    want = {ref.tensor.name for layer in cpu_layers for k in gg.expert_keys(layer) for ref in gg.units[k].tensors}
    got = set()
    for pattern, buf in llama_cpp_overrides(out.text):
        assert buf == "CPU"
        got |= {n for n in gg.tensors if pattern.search(n)}
    if "--n-cpu-moe" in out.text:
        assert cpu_layers == {moe[0]}
    else:
        assert got == want


def test_streamed_layers_and_an_all_cpu_default_export_exactly():
    inv = synth_inventory(4, 4)
    p = Placement(stream_slots=2)
    p.move([k for k in inv.expert_keys() if k.layer < 2], CPU_STREAM)
    out = export_llama_cpp(inv, p)
    assert out.approximation is None and "--n-cpu-moe 2" in out.text
    everything_cpu = Placement(default=CPU_COMPUTE)
    out = export_llama_cpp(inv, everything_cpu)
    assert "--n-cpu-moe 4" in out.text and out.approximation is None
    for pattern, buf in llama_cpp_overrides(out.text):  # attention, norms, router, lm_head by exact name
        assert buf == "CPU"
        hits = {n for n in inv.tensors if pattern.search(n)}
        assert "output.weight" in hits and "blk.0.attn_q.weight" in hits and "token_embd.weight" not in hits
