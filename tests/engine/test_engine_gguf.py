"""GGUF copies run like the safetensors originals; quantized weights dequantize like the reference.

- F32 GGUF (llama.cpp names, stacked experts, Mixtral's permuted Q/K rows): the same logits and
  greedy tokens as transformers on the original, with experts on every tier.
- Q8_0 / Q4_0 GGUF: the same logits and tokens as transformers run on the weights transformers'
  own GGUF loader dequantizes (gguf-py) from the same file.
- K-quants (Q4_K, Q5_K, Q6_K; gguf-py cannot write them): one expert's slice, dequantized at load,
  equals gguf-py's dequantization of the whole stacked tensor at that expert.
- gpt-oss MXFP4 (GGUF experts, and the ``*_blocks`` / ``*_scales`` of its safetensors checkpoints).
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.engine.engine_helpers import (
    N_NEW,
    PROMPT,
    TEST_DEVICE,
    TEST_DTYPE,
    greedy_tokens,
    logits_tolerance,
    open_inventory,
    placements,
    reference_logits,
    reference_tokens,
    rel_err,
)
from tests.engine.test_engine_families import FAMILIES
from workbench.engine import Engine, model, packed, prefill_kernels
from workbench.engine.weights import WeightReader

# Sizes that fill whole 32-value quant blocks in every row, so that every matrix is quantized.
QUANT_SIZES = {"hidden_size": 64, "moe_intermediate_size": 32, "intermediate_size": 64}


def check(engine: Engine, model) -> None:
    ref = reference_logits(model, PROMPT)
    assert rel_err(engine.forward(torch.tensor(PROMPT), 0), ref) < logits_tolerance(model, PROMPT, ref)
    tokens = greedy_tokens(engine, PROMPT, N_NEW)
    if TEST_DTYPE == torch.float32:
        assert tokens == reference_tokens(model, PROMPT, N_NEW)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "llama4_text",
                                        "deepseek_v2", "deepseek_v3", "gpt_oss"])
def test_f32_gguf_matches_transformers_on_the_original(model_type, tiny_gguf, tiny_hf_model):
    # the families test's seed where seed 0's routing has a near-tie that bf16 rounding flips
    seed = {"seed": FAMILIES[model_type]["seed"]} if "seed" in FAMILIES[model_type] else {}
    inv = open_inventory(tiny_gguf(model_type, "F32", **seed))
    assert inv.format == "gguf"
    engine = Engine.load(inv, placements(inv)["mixed"], device=TEST_DEVICE, dtype=TEST_DTYPE, max_context=64)
    try:
        check(engine, tiny_hf_model(model_type, **seed))
    finally:
        engine.close()


def transformers_on_gguf(model, path):
    """A copy of ``model`` carrying the weights transformers' GGUF loader reads from ``path``."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    ref = copy.deepcopy(model)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=ref)["tensors"]
    params = dict(ref.state_dict())
    state = {k: v.reshape(params[k].shape) for k, v in tensors.items()}
    missing = ref.load_state_dict(state, strict=False)
    assert not missing.missing_keys and not missing.unexpected_keys
    return ref


@pytest.mark.parametrize(("model_type", "tensor_type"), [
    ("qwen3_moe", "Q8_0"), ("qwen3_moe", "Q4_0"), ("qwen2_moe", "Q8_0"),
])
def test_quantized_gguf_matches_transformers_on_dequantized_weights(model_type, tensor_type, tiny_gguf,
                                                                     tiny_hf_model, exact_cpu_dots, monkeypatch):
    # transformers' GGUF loader knows no dense layers in qwen2moe / qwen3moe files (nor does llama.cpp)
    sizes = dict(QUANT_SIZES, mlp_only_layers=[]) if model_type == "qwen3_moe" else \
        dict(QUANT_SIZES, decoder_sparse_step=1, shared_expert_intermediate_size=32)
    path = tiny_gguf(model_type, tensor_type, **sizes)
    inv = open_inventory(path)
    assert inv.dtype_mix().get(tensor_type, 0) > 0.9 * inv.total_bytes
    ref = transformers_on_gguf(tiny_hf_model(model_type, **sizes), path)
    for name in ("resident", "mixed", "compute"):
        # on the CPU, Triton's interpreter runs the kept blocks' kernels for the mixed placement only,
        # whose tiers cover the other two's (all resident, its steps took over a minute there)
        if TEST_DEVICE == "cpu":
            monkeypatch.setenv("TRITON_INTERPRET", "1" if name == "mixed" else "0")
        engine = Engine.load(inv, placements(inv)[name], device=TEST_DEVICE, dtype=TEST_DTYPE, max_context=64)
        if tensor_type == "Q8_0" and model_type == "qwen3_moe":  # experts stay in the file's blocks
            assert all(lx.kept_cpu is not None for lx in engine.experts.values() if lx.n_tier[1])
            assert all(lx.kept_res is not None for lx in engine.experts.values() if lx.n_tier[0])
        check(engine, ref)
        engine.close()


DEMO = Path(__file__).resolve().parents[2] / "resources" / "demo"

# Sizes in whole Q4_K super-blocks (256 values).
Q4_K_SIZES = {"hidden_size": 256, "moe_intermediate_size": 256, "intermediate_size": 256, "mlp_only_layers": []}


def check_dense_kept(engine: Engine, inv, kept: bool) -> None:
    """With ``kept``, the attention projections, embeddings and head stored as Q8_0 or a k-quant are
    ``Packed`` in the file's formats (q/k/v of one format fused into one, of several formats a
    ``Group``) and count as stored in the engine's memory report as in the estimate; other ones
    (and all without ``kept``) are tensors."""
    from workbench.core.memory import kept_in_blocks

    stored = {t.tensor.name: t.tensor.dtype.lower() for u in inv.units.values() for t in u.tensors}
    attn = engine.layers[0].attn
    names = {"q": "blk.0.attn_q.weight", "k": "blk.0.attn_k.weight", "v": "blk.0.attn_v.weight",
             "o": "blk.0.attn_output.weight"}
    mats = [(attn.w[r], names[r]) for r in names] + [(engine.embed, "token_embd.weight")]
    if "output.weight" in stored:
        mats.append((engine.lm_head, "output.weight"))
    for m, name in mats:
        in_blocks = kept and stored[name] in ("q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs")
        assert isinstance(m, packed.Packed) == in_blocks, name
        assert not in_blocks or m.fmt == stored[name]
    if kept and all(isinstance(attn.w[r], packed.Packed) for r in "qkv"):
        mixed = attn.w["q"].fmt != attn.w["v"].fmt
        assert isinstance(attn.fused[0], packed.Group if mixed else packed.Packed)
    if kept:  # the file's bytes, as the estimate counts them
        held = sum(m.nbytes for m, _ in mats if isinstance(m, packed.Packed))
        assert held == sum(t.nbytes for u in inv.units.values() for t in u.tensors
                           if t.tensor.name in {n for _, n in mats} and kept_in_blocks(t.tensor))


@pytest.mark.parametrize("tensor_type,sizes", [("Q8_0", dict(QUANT_SIZES, mlp_only_layers=[])), ("Q4_K", Q4_K_SIZES),
                                               ("Q4_K+Q6_K", Q4_K_SIZES), ("Q2_K+Q3_K", Q4_K_SIZES),
                                               ("IQ4_XS+Q5_K", Q4_K_SIZES)])  # every kept type once
def test_kept_blocks_compute_what_their_dequantized_copies_compute(tensor_type, sizes, tiny_gguf, monkeypatch,
                                                                   exact_cpu_dots):
    """Experts kept in the file's blocks (CPU decode: the fused kernel for the format, with its exact
    float dots; GPU decode: the Triton kernels; prompts: rows dequantized on use; moving tiers) give
    the logits and tokens of the same experts dequantized at load, resident and on the CPU."""
    inv = open_inventory(tiny_gguf("qwen3_moe", tensor_type, **sizes))
    p = placements(inv)
    monkeypatch.setattr(model, "FUSE_QKV", True)  # q, k and v as one matrix, as on CUDA
    if TEST_DEVICE == "cpu" and tensor_type != "Q8_0":
        # resident k-quant rows through the grouped kernel in Triton's interpreter: ~100 s a run here
        # (test_prefill_kernels checks that kernel); they are dequantized on use instead
        monkeypatch.setattr(prefill_kernels, "takes_blocks", lambda *args, **kwargs: False)
    runs = {}
    n = 4 if TEST_DEVICE == "cpu" else 8  # tokens; Triton's interpreter runs the resident steps here
    for keep in ("1", "0"):
        monkeypatch.setenv("WORKBENCH_KEEP_QUANTS", keep)
        engine = Engine.load(inv, p["resident"], device=TEST_DEVICE, dtype=torch.float32, max_context=64)
        assert all((lx.kept_res is not None) == (keep == "1") for lx in engine.experts.values())
        check_dense_kept(engine, inv, keep == "1" and packed.gpu_kernels.usable(torch.zeros(1, device=TEST_DEVICE)))
        runs[f"resident{keep}"] = (engine.forward(torch.tensor(PROMPT), 0), greedy_tokens(engine, PROMPT, n),
                                   engine.memory_report()["gpu:0"])
        engine.close()
        engine = Engine.load(inv, p["compute"], device=TEST_DEVICE, dtype=torch.float32, max_context=64)
        assert all((lx.kept_cpu is not None) == (keep == "1") for lx in engine.experts.values())
        logits = engine.forward(torch.tensor(PROMPT), 0)
        tokens = greedy_tokens(engine, PROMPT, n)
        if keep == "1":
            lx = next(iter(engine.experts.values()))
            main, _, down = tensor_type.lower().partition("+")
            assert lx.kept == (main, down or main)
            assert lx.nbytes["cpu"] < 0.6 * 4 * sum(inv.units[k].n_params for k in inv.expert_keys(lx.layer))
            engine.apply_placement(p["mixed"])  # Q8_0 rows move to the accelerator dequantized
            assert greedy_tokens(engine, PROMPT, n) == tokens
        runs[keep] = (logits, tokens)
        engine.close()
    assert rel_err(runs["1"][0], runs["0"][0]) < 1e-5
    assert runs["1"][1] == runs["0"][1]
    assert rel_err(runs["resident1"][0], runs["resident0"][0]) < 1e-5
    assert runs["resident1"][1] == runs["resident0"][1]
    assert runs["resident1"][2] < runs["resident0"][2]  # int8 blocks on the accelerator, not float32


@pytest.mark.parametrize("family,tensor_type,sizes", [
    ("qwen3_moe", "Q8_0", dict(QUANT_SIZES, mlp_only_layers=[])), ("qwen3_moe", "Q4_K+Q6_K", Q4_K_SIZES),
    ("qwen3_moe", "Q2_K+Q3_K", Q4_K_SIZES), ("qwen3_moe", "IQ4_XS", Q4_K_SIZES),
    ("gpt_oss", "MXFP4", {"hidden_size": 64, "intermediate_size": 64})])
def test_quantized_experts_on_the_int8_dots_stay_close_to_the_exact_ones(family, tensor_type, sizes, tiny_gguf):
    """Where the CPU has AVX512-VNNI or AVX2, Q8_0 and k-quant experts the CPU computes take the int8 dots by
    default (inputs rounded to int8 per 32 values, as llama.cpp rounds them): the logits of a prompt
    stay within a few percent of the exact float dots', and switching back gives those exactly."""
    from workbench.engine import cpu_kernel

    if not cpu_kernel.available() or not cpu_kernel.int8_dots(True):
        pytest.skip("the int8 dots need the fused CPU kernel and AVX-512 with VNNI, or AVX2")
    inv = open_inventory(tiny_gguf(family, tensor_type, **sizes))
    engine = Engine.load(inv, placements(inv)["compute"], device=TEST_DEVICE, dtype=torch.float32, max_context=64)
    try:
        main, _, down = tensor_type.lower().partition("+")
        assert next(iter(engine.experts.values())).kept == (main, down or main)
        int8 = engine.forward(torch.tensor(PROMPT), 0)
        cpu_kernel.int8_dots(False)
        exact = engine.forward(torch.tensor(PROMPT), 0)
        cpu_kernel.int8_dots(True)
        again = engine.forward(torch.tensor(PROMPT), 0)
    finally:
        cpu_kernel.int8_dots(True)
        engine.close()
    rows = sorted(rel_err(int8[i], exact[i]) for i in range(int8.shape[0]))
    assert 0 < rows[len(rows) // 2] < 3e-2
    if not tensor_type.startswith("Q2_K"):  # a 2-bit model's routers sit near ties at some positions,
        assert rel_err(int8, exact) < 5e-2  # where 1% moves an expert in or out of the top k
    assert torch.equal(again, int8)


def test_the_demo_model_in_q8_0_keeps_its_greedy_text_on_the_int8_dots(tmp_path, monkeypatch):
    """The trained demo model (real routing) written as Q8_0, every expert on the CPU: the int8 dots
    give the same 32 greedy tokens as the exact float dots, logits within 5e-2 (3.0% measured: the
    demo's hidden state is 192 values, 6 rounding blocks)."""
    from workbench.core.gguf_writer import write_gguf
    from workbench.engine import cpu_kernel, gpu_kernels

    if not cpu_kernel.available() or not cpu_kernel.int8_dots(True):
        pytest.skip("the int8 dots need the fused CPU kernel and AVX-512 with VNNI, or AVX2")
    if TEST_DEVICE == "cpu":  # the CPU experts are under test: no Triton interpreter for the rest (~2 s a token)
        monkeypatch.setattr(gpu_kernels, "usable", lambda t: False)
    inv = open_inventory(write_gguf(DEMO, tmp_path / "demo-q8_0.gguf", "Q8_0")[0])
    runs = {}
    try:
        for int8 in (True, False):
            cpu_kernel.int8_dots(int8)
            engine = Engine.load(inv, placements(inv)["compute"], device=TEST_DEVICE, dtype=torch.float32,
                                 max_context=64)
            assert all(lx.kept_cpu is not None for lx in engine.experts.values())
            runs[int8] = engine.forward(torch.tensor(PROMPT), 0), greedy_tokens(engine, PROMPT, 32)
            engine.close()
    finally:
        cpu_kernel.int8_dots(True)
    assert 0 < rel_err(runs[True][0], runs[False][0]) < 5e-2
    assert runs[True][1] == runs[False][1]


def test_mxfp4_gpt_oss_matches_transformers_on_gguf_dequantized_experts(tiny_model_dir, tiny_hf_model, tmp_path,
                                                                      exact_cpu_dots, monkeypatch):
    """gpt-oss experts in MXFP4, kept in their blocks (the CPU's read in place by the fused kernel with
    their biases and clamped SwiGLU, the accelerator's dequantized per step and expert, never a whole
    tier at once), in every placement: the reference carries gguf-py's dequantization of the file's
    expert stacks (read with gguf's own reader), put back into transformers' interleaved layout by hand."""
    import gguf
    from gguf.quants import dequantize

    from workbench.engine.experts import LayerExperts

    whole = []
    dequant = LayerExperts._dequant

    def spy(self, parts, rows=None):
        whole.append(rows is None)
        return dequant(self, parts, rows)

    monkeypatch.setattr(LayerExperts, "_dequant", spy)

    from workbench.core.gguf_writer import write_gguf

    sizes = {"hidden_size": 64, "intermediate_size": 64}
    path = write_gguf(tiny_model_dir("gpt_oss", **sizes), tmp_path / "gpt-oss.gguf", "F32", expert_type="MXFP4")[0]
    reader = gguf.GGUFReader(path)
    experts = [t for t in reader.tensors if "_exps." in t.name]
    assert {t.tensor_type.name for t in experts if t.name.endswith("weight")} == {"MXFP4"}
    stacks = {t.name: torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
              for t in experts}
    ref = copy.deepcopy(tiny_hf_model("gpt_oss", **sizes))
    with torch.no_grad():
        for layer, block in enumerate(ref.model.layers):
            g, u, d = (stacks[f"blk.{layer}.ffn_{p}_exps.weight"] for p in ("gate", "up", "down"))
            block.mlp.experts.gate_up_proj[:, :, ::2] = g.transpose(1, 2)  # [E, I, H] -> [E, H, I]
            block.mlp.experts.gate_up_proj[:, :, 1::2] = u.transpose(1, 2)
            block.mlp.experts.down_proj[:] = d.transpose(1, 2)  # [E, H, I] -> [E, I, H]
            gb, ub, db = (stacks[f"blk.{layer}.ffn_{p}_exps.bias"] for p in ("gate", "up", "down"))
            block.mlp.experts.gate_up_proj_bias[:, ::2] = gb
            block.mlp.experts.gate_up_proj_bias[:, 1::2] = ub
            block.mlp.experts.down_proj_bias[:] = db
    inv = open_inventory(path)
    for name, placement in placements(inv).items():
        engine = Engine.load(inv, placement, device=TEST_DEVICE, dtype=TEST_DTYPE, max_context=64)
        try:
            lx = next(iter(engine.experts.values()))
            if name != "stream":  # a streamed expert travels dequantized
                assert lx.kept == ("mxfp4", "mxfp4")
                assert lx.nbytes["cpu"] + lx.nbytes["accelerator"] < 0.2 * 4 * sum(
                    inv.units[k].n_params for k in inv.expert_keys(lx.layer))
            check(engine, ref)
            if name == "resident":  # without the Triton kernels (a machine without them): PyTorch's loop
                monkeypatch.setattr(prefill_kernels, "_disabled", ["PyTorch's loop under test"])
                check(engine, ref)
                monkeypatch.setattr(prefill_kernels, "_disabled", [])
        finally:
            engine.close()
    assert whole and not any(whole)  # the loop dequantizes experts as used, one or a few rows at a time


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "F16", "BF16"])
def test_expert_slice_dequantizes_like_gguf(qtype, tmp_path):
    import gguf
    from gguf.quants import dequantize

    from workbench.core.readers.gguf import read_gguf_header

    t = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[t]
    n_exp, rows, cols = 3, 4, 512
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(n_exp, rows, cols // block * size), dtype=np.uint8)
    if qtype in ("Q4_K", "Q5_K", "Q6_K", "Q8_0"):  # keep the f16 scales finite and small
        blocks = raw.reshape(-1, size)
        scale_at = {"Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [size - 2], "Q8_0": [0]}[qtype]
        for off in scale_at:
            blocks[:, off:off + 2] = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    if qtype in ("F16", "BF16"):
        raw[..., 1::2] &= 0x3F  # small finite values
    path = tmp_path / "experts.gguf"
    w = gguf.GGUFWriter(path, "qwen3moe")
    w.add_block_count(1)
    w.add_tensor("blk.0.ffn_up_exps.weight", raw, raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _, tensors = read_gguf_header(path)
    inv = type("Inv", (), {"tensors": tensors, "path": path, "format": "gguf"})()
    reader = WeightReader(inv)
    assert tensors["blk.0.ffn_up_exps.weight"].shape == (n_exp, rows, cols)
    whole = dequantize(raw.reshape(n_exp * rows, -1), t).reshape(n_exp, rows, cols)
    for e in range(n_exp):
        got = reader.tensor("blk.0.ffn_up_exps.weight", e).float().numpy()
        np.testing.assert_array_equal(got, whole[e].astype(np.float32))


def test_gpt_oss_mxfp4_safetensors_match_transformers_dequantization(tiny_model_dir, tiny_hf_model, tmp_path,
                                                                     exact_cpu_dots):
    """gpt-oss checkpoints store experts as MXFP4 ``*_blocks`` / ``*_scales``: the engine keeps them in
    MXFP4 blocks (repacked as GGUF lays them out) and computes what transformers computes on its own
    dequantization (``convert_moe_packed_tensors``), in every placement."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from workbench.core.memory import experts_as_stored

    sizes = {"hidden_size": 64, "intermediate_size": 64}
    folder = tmp_path / "gpt-oss-mxfp4"
    shutil.copytree(tiny_model_dir("gpt_oss", **sizes), folder)
    ref = copy.deepcopy(tiny_hf_model("gpt_oss", **sizes))
    tensors = load_file(folder / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    for layer, block in enumerate(ref.model.layers):
        prefix = f"model.layers.{layer}.mlp.experts."
        for name in ("gate_up_proj", "down_proj"):
            rows, cols = tensors[prefix + name].shape[2], tensors[prefix + name].shape[1]  # [E, in, out]
            n_exp = tensors[prefix + name].shape[0]
            blocks = torch.randint(0, 256, (n_exp, rows, cols // 32, 16), dtype=torch.uint8, generator=gen)
            scales = torch.randint(119, 123, (n_exp, rows, cols // 32), dtype=torch.uint8, generator=gen)
            del tensors[prefix + name]
            tensors[prefix + name + "_blocks"], tensors[prefix + name + "_scales"] = blocks, scales
            with torch.no_grad():  # transformers' layout: [E, in, out]
                getattr(block.mlp.experts, name).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    inv = open_inventory(folder)
    assert experts_as_stored(inv)  # the estimates count the blocks as the engine holds them
    for name, placement in placements(inv).items():
        engine = Engine.load(inv, placement, device=TEST_DEVICE, dtype=TEST_DTYPE, max_context=64)
        try:
            if name != "stream":
                assert next(iter(engine.experts.values())).kept == ("mxfp4", "mxfp4")
            check(engine, ref)
        finally:
            engine.close()


def target(params: dict, name: str) -> torch.Tensor:
    """The in-memory transformers parameter (or slice of the fused expert stacks) a file tensor fills."""
    if name in params:
        return params[name]
    head, expert, proj, _ = name.rsplit(".", 3)  # ...mlp.experts.{e}.{gate,up,down}_proj.weight
    e = int(expert)
    if proj == "down_proj":
        return params[f"{head}.down_proj"][e]
    gate_up = params[f"{head}.gate_up_proj"][e]
    half = gate_up.shape[0] // 2
    return gate_up[:half] if proj == "gate_proj" else gate_up[half:]


def test_fp8_block_scaled_checkpoint_matches_transformers_dequantization(tiny_model_dir, tiny_hf_model, tmp_path):
    """DeepSeek-V3 / Qwen3 FP8 checkpoints: e4m3 weights with ``weight_scale_inv`` per 16x16 block here
    (128x128 in the real ones, partial blocks at the edges); the reference carries transformers'
    own block dequantization of the same bytes."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    block = [16, 16]
    folder = tmp_path / "deepseek-fp8"
    shutil.copytree(tiny_model_dir("deepseek_v3"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": block,
                                     "activation_scheme": "dynamic"}
    (folder / "config.json").write_text(json.dumps(config))
    ref = copy.deepcopy(tiny_hf_model("deepseek_v3"))
    params = dict(ref.named_parameters())
    tensors = load_file(folder / "model.safetensors")
    for name in [n for n, t in tensors.items() if t.ndim == 2 and n.endswith(".weight")]:
        if any(s in name for s in ("embed_tokens", "lm_head", "mlp.gate.weight")):
            continue  # stay in high precision, as in the real checkpoints
        w = tensors[name]
        rows, cols = -(-w.shape[0] // block[0]), -(-w.shape[1] // block[1])
        padded = torch.zeros(rows * block[0], cols * block[1])
        padded[: w.shape[0], : w.shape[1]] = w
        amax = padded.view(rows, block[0], cols, block[1]).abs().amax(dim=(1, 3)).clamp(min=1e-12)
        scale_inv = amax / 448.0
        expanded = scale_inv.repeat_interleave(block[0], 0)[: w.shape[0]].repeat_interleave(block[1], 1)[:, : w.shape[1]]
        q = (w / expanded).to(torch.float8_e4m3fn)
        tensors[name], tensors[name[: -len("weight")] + "weight_scale_inv"] = q, scale_inv
        with torch.no_grad():
            target(params, name).copy_(_dequantize_fp8_weight(q, scale_inv, block, torch.float32))
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    inv = open_inventory(folder)
    assert "F8_E4M3" in inv.dtype_mix()
    engine = Engine.load(inv, placements(inv)["mixed"], device=TEST_DEVICE, dtype=TEST_DTYPE, max_context=64)
    check(engine, ref)
    engine.close()


@pytest.mark.parametrize("model_type", ["mixtral", "deepseek_v3", "qwen2_moe"])
def test_dense_weights_kept_in_blocks_compute_what_their_dequantized_copies_compute(model_type, tiny_gguf,
                                                                                      monkeypatch, exact_cpu_dots):
    """Q8_0 attention (Mixtral's permuted Q/K rows, DeepSeek's MLA projections, Qwen2's q/k/v biases),
    shared experts, embeddings and head kept in their blocks give the logits and greedy tokens of
    the same file dequantized at load."""
    sizes = dict(QUANT_SIZES, decoder_sparse_step=1, shared_expert_intermediate_size=32) \
        if model_type == "qwen2_moe" else QUANT_SIZES
    inv = open_inventory(tiny_gguf(model_type, "Q8_0", **sizes))
    monkeypatch.setattr(model, "FUSE_QKV", True)
    runs = {}
    for keep in ("1", "0"):
        monkeypatch.setenv("WORKBENCH_KEEP_QUANTS", keep)
        engine = Engine.load(inv, placements(inv)["mixed"], device=TEST_DEVICE, dtype=torch.float32, max_context=64)
        w = engine.layers[0].attn.w
        assert isinstance(w["o"], packed.Packed) == (keep == "1")
        if model_type == "qwen2_moe":
            shared = engine.layers[0].ffn.shared
            assert isinstance(shared.gate, packed.Packed) == (keep == "1")
        runs[keep] = (engine.forward(torch.tensor(PROMPT), 0), greedy_tokens(engine, PROMPT, 8),
                      engine.memory_report()["gpu:0"])
        engine.close()
    assert rel_err(runs["1"][0], runs["0"][0]) < 1e-5
    assert runs["1"][1] == runs["0"][1]
    assert runs["1"][2] < runs["0"][2]


def test_the_budget_counts_dense_weights_kept_in_blocks_as_stored(tiny_gguf, monkeypatch):
    """A Q8_0 file under a VRAM budget between what its dense weights take in blocks and dequantized:
    kept, the placement fits and loads within the budget; dequantized (``WORKBENCH_KEEP_DENSE=0``) it
    is refused before anything is allocated, with the numbers."""
    from workbench.core.errors import PlacementError

    inv = open_inventory(tiny_gguf("qwen3_moe", "Q8_0", **dict(QUANT_SIZES, mlp_only_layers=[])))
    p = placements(inv)["compute"]
    engine = Engine.load(inv, p, device=TEST_DEVICE, dtype=torch.float32, max_context=64)
    kept = engine.predicted["accelerator"]
    assert engine.memory_report()["gpu:0"] <= kept
    engine.close()
    monkeypatch.setenv("WORKBENCH_KEEP_DENSE", "0")
    engine = Engine.load(inv, p, device=TEST_DEVICE, dtype=torch.float32, max_context=64)
    dequantized = engine.predicted["accelerator"]
    assert all(not isinstance(w, packed.Packed) for w in engine.layers[0].attn.w.values())
    engine.close()
    assert dequantized > kept
    budget = (kept + dequantized) // 2
    with pytest.raises(PlacementError, match="the budget is"):
        Engine.load(inv, p, device=TEST_DEVICE, dtype=torch.float32, max_context=64, vram_budget=budget)
    monkeypatch.delenv("WORKBENCH_KEEP_DENSE")
    engine = Engine.load(inv, p, device=TEST_DEVICE, dtype=torch.float32, max_context=64, vram_budget=budget)
    assert isinstance(engine.layers[0].attn.w["o"], packed.Packed)
    assert engine.memory_report()["gpu:0"] <= budget
    engine.close()
