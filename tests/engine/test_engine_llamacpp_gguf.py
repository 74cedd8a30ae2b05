"""GGUF files written by llama.cpp's own ``convert_hf_to_gguf.py`` run like the originals.

Opt-in: set ``WORKBENCH_LLAMACPP_DIR`` to a llama.cpp source tree (its ``convert_hf_to_gguf.py`` and
``gguf-py``); skipped otherwise (CI has no llama.cpp). The converter runs in a subprocess with two
patches that only concern the tokenizer: the tiny models borrow the demo model's byte-level BPE
``tokenizer.json``, which llama.cpp does not know by hash, so it is declared ``gpt-2``; and there is
no SentencePiece model to try first.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.engine.engine_helpers import (
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
from workbench.engine import Engine

LLAMACPP = os.environ.get("WORKBENCH_LLAMACPP_DIR")
DEMO = Path(__file__).resolve().parents[2] / "resources" / "demo"
pytestmark = pytest.mark.skipif(not LLAMACPP, reason="set WORKBENCH_LLAMACPP_DIR to a llama.cpp source tree")

DRIVER = '''
import runpy, sys
LC = sys.argv.pop(1)
sys.path[:0] = [LC, LC + "/gguf-py"]
import conversion.base as base
for cls in vars(base).values():
    if isinstance(cls, type) and "get_vocab_base_pre" in vars(cls):
        cls.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
def no_sentencepiece(self):
    raise FileNotFoundError("no tokenizer.model")
base.TextModel._set_vocab_sentencepiece = no_sentencepiece
sys.argv = [LC + "/convert_hf_to_gguf.py", *sys.argv[1:]]
runpy.run_path(LC + "/convert_hf_to_gguf.py", run_name="__main__")
'''

SIZES = {"vocab_size": 4096, "hidden_size": 64}  # the borrowed tokenizer's vocabulary; whole quant blocks
FAMILIES = {
    "mixtral": {"intermediate_size": 64},  # llama arch: Q/K rows permuted by the converter
    "qwen2_moe": {"moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "intermediate_size": 64,
                  "decoder_sparse_step": 1},
    "olmoe": {"intermediate_size": 32},
    "llama4_text": {"intermediate_size": 64, "intermediate_size_mlp": 128, "attention_chunk_size": 8192},
    "deepseek_v2": {"moe_intermediate_size": 32, "intermediate_size": 64},
    # real DeepSeek-V3 configs name their router; llama.cpp writes the sigmoid gating only then
    "deepseek_v3": {"moe_intermediate_size": 32, "intermediate_size": 64, "scoring_func": "sigmoid",
                    "topk_method": "noaux_tc"},
    "gpt_oss": {"intermediate_size": 64},
}
PROMPT = [5, 100, 37, 999, 2048, 17, 300, 42, 7, 1500, 64, 81]


def convert(hf_dir: Path, out: Path, outtype: str) -> Path:
    folder = out.parent / (hf_dir.name + "-with-tokenizer")
    if not folder.exists():
        shutil.copytree(hf_dir, folder)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(DEMO / name, folder / name)
    driver = out.parent / "convert_driver.py"
    driver.write_text(DRIVER)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(driver), LLAMACPP, str(folder), "--outfile", str(out),
                           "--outtype", outtype], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_llamacpp_converted_gguf_matches_transformers(model_type, tiny_model_dir, tiny_hf_model, tmp_path):
    overrides = {**SIZES, **FAMILIES[model_type]}
    hf_dir = tiny_model_dir(model_type, **overrides)
    model = tiny_hf_model(model_type, **overrides)
    path = convert(hf_dir, tmp_path / f"{model_type}-llamacpp-f32.gguf", "f32")
    inv = open_inventory(path)
    ref = reference_logits(model, PROMPT)
    for name in ("resident", "mixed"):
        engine = Engine.load(inv, placements(inv)[name], device=TEST_DEVICE, dtype=TEST_DTYPE, max_context=64)
        assert rel_err(engine.forward(torch.tensor(PROMPT), 0), ref) < logits_tolerance(model, PROMPT, ref)
        if TEST_DTYPE == torch.float32:
            assert greedy_tokens(engine, PROMPT, 32) == reference_tokens(model, PROMPT, 32)
        engine.close()


def test_llamacpp_llama3_rope_freqs(tmp_path):
    """A dense Llama with Llama 3 RoPE scaling: llama.cpp stores it as ``rope_freqs`` factors."""
    from tests.engine.test_engine_dense import DENSE, build

    model = build("llama", tmp_path / "llama", {**DENSE["llama"], "vocab_size": 4096, "hidden_size": 64})
    path = convert(tmp_path / "llama", tmp_path / "llama-llamacpp-f32.gguf", "f32")
    inv = open_inventory(path)
    assert "rope_freqs.weight" in inv.tensors
    engine = Engine.load(inv, None, device=TEST_DEVICE, dtype=TEST_DTYPE, max_context=64)
    ref = reference_logits(model, PROMPT)
    assert rel_err(engine.forward(torch.tensor(PROMPT), 0), ref) < logits_tolerance(model, PROMPT, ref)
    engine.close()


def test_llamacpp_q8_0_of_the_demo_model_keeps_its_greedy_text(tmp_path):
    """The trained demo model converted to Q8_0 by llama.cpp: logits within 1e-2 of the f16
    original run in fp32 and the same 32 greedy tokens (its routing is real, not random)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32).eval()
    path = convert(DEMO, tmp_path / "demo-llamacpp-q8_0.gguf", "q8_0")
    inv = open_inventory(path)
    assert inv.dtype_mix().get("Q8_0", 0) > 0.8 * inv.total_bytes
    engine = Engine.load(inv, placements(inv)["mixed"], device=TEST_DEVICE, dtype=TEST_DTYPE, max_context=64)
    assert rel_err(engine.forward(torch.tensor(PROMPT), 0), reference_logits(model, PROMPT)) < 1e-2
    assert greedy_tokens(engine, PROMPT, 32) == reference_tokens(model, PROMPT, 32)
    engine.close()

