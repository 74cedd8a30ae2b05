"""``workbench inspect``: JSON contract, readable summary, no torch or Qt imported."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from workbench.core.memory import experts_as_stored, held_bytes, kv_bytes_per_token
from workbench.core.readers import open_model


def _run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workbench", "inspect", *map(str, args)],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_json_contract(fmt, tiny_model_dir, tiny_gguf):
    path = tiny_model_dir("qwen3_moe") if fmt == "hf" else tiny_gguf("qwen3_moe", "Q8_0")
    proc = _run(path, "--json", "--ctx", 1000, "--kv-dtype", "q8_0")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    inv = open_model(path)
    assert out["family"] == "qwen3_moe" and out["n_layers"] == 4
    assert (out["n_experts"], out["n_experts_active"], out["n_shared_experts"]) == (8, 2, 0)
    assert out["moe_layers"] == [0, 2, 3] and out["dense_layers"] == [1]
    assert out["params_total"] == inv.params_total == 62560
    expert_params = 3 * 16 * 32  # gate, up [16, 32] and down [32, 16]
    assert out["params_active"] == out["params_total"] - 3 * (8 - 2) * expert_params
    assert out["total_bytes"] == inv.total_bytes == sum(u["bytes"] for u in out["units"])
    assert {(u["layer"], u["kind"], u["expert"]) for u in out["units"]} == {
        (k.layer, k.kind, k.expert) for k in inv.units}
    mem = out["memory"]
    assert mem["ctx"] == 1000 and mem["kv_dtype"] == "q8_0"
    assert mem["tiers"]["gpu:0"]["kv_cache"] == 4 * 1000 * kv_bytes_per_token(inv, 0, "q8_0")
    kept = experts_as_stored(inv)  # the tiny Q8_0 file: down rows of 16 stay F16, so experts go bf16
    assert mem["tiers"]["gpu:0"]["weights_total"] == sum(held_bytes(k, u, kept) for k, u in inv.units.items())


def test_cpu_moe_and_n_cpu_moe(tiny_model_dir):
    path = tiny_model_dir("qwen3_moe")
    inv = open_model(path)
    experts = sum(inv.units[k].nbytes for k in inv.expert_keys())
    out = json.loads(_run(path, "--json", "--cpu-moe").stdout)
    assert out["memory"]["tiers"]["cpu"]["weights"]["expert"] == experts
    assert out["memory"]["tiers"]["gpu:0"]["weights"]["expert"] == 0
    out = json.loads(_run(path, "--json", "--n-cpu-moe", 1).stdout)
    assert out["memory"]["tiers"]["cpu"]["weights"]["expert"] == experts // 3  # layer 0 of MoE layers 0, 2, 3


def test_text_summary(tiny_gguf):
    proc = _run(tiny_gguf("deepseek_v3", "Q8_0"))
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    for needle in ("family      deepseek_v3", "3: 2 MoE, 1 dense (0)", "8 routed per layer, 2 active per token, 1 shared",
                   "MLA latent 16 + rope 8", "Q8_0", "memory estimate: all on gpu:0", "gpu:0", "cpu"):
        assert needle in text, needle
    assert len([line for line in text.splitlines() if line[:1].isdigit()]) == 3  # one row per layer


def test_imports_neither_torch_nor_qt(tiny_gguf, tiny_model_dir):
    code = ("import sys; from workbench.cli import main; "
            "[main(['inspect', p, '--json']) for p in sys.argv[1:]]; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "{'torch', 'PySide6', 'pyqtgraph', 'superqt', 'transformers'}); "
            "print('LOADED', bad, file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", code, str(tiny_gguf("mixtral", "F32")), str(tiny_model_dir("mixtral"))],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "LOADED []" in proc.stderr


def test_bad_arguments(tiny_model_dir):
    proc = _run(tiny_model_dir("olmoe"), "--ctx", 0)
    assert proc.returncode == 2 and proc.stderr.strip() == "workbench inspect: --ctx must be at least 1, got 0"


def test_output_cut_short_by_a_pipe(tiny_gguf):
    """`workbench inspect ... | head` ends quietly: here the reader is gone before anything is written."""
    cmd = f"set -o pipefail; '{sys.executable}' -m workbench inspect '{tiny_gguf('qwen2_moe', 'F32')}' | true"
    proc = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stderr == ""


def test_default_context_is_the_models_own_when_shorter_than_4096(tiny_model_dir):
    # The tiny models know 256 positions: the estimate budgets for those, not for 4096.
    proc = _run(tiny_model_dir("qwen3_moe"), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["memory"]["ctx"] == 256
    proc = _run(tiny_model_dir("qwen3_moe"), "--json", "--ctx", 8192)
    assert json.loads(proc.stdout)["memory"]["ctx"] == 8192


def test_the_command_turns_on_expandable_cuda_segments_unless_the_user_chose(tmp_path, monkeypatch):
    """PyTorch's allocator grows its segments in place (less NVML-visible memory than cached blocks
    of every prompt size; BENCHMARKS.md 2026-12-04); a value the user set is left alone."""
    import os

    from workbench.cli import main

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "placeholder")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    assert main(["inspect", str(tmp_path / "missing.gguf")]) == 2  # a clear refusal, and the setting made
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:256")
    main(["inspect", str(tmp_path / "missing.gguf")])
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:256"


def test_experts_dequantized_at_load_are_named(tiny_gguf):
    """A GGUF whose experts the engine cannot keep in their blocks (gpt-oss's biased experts) says so,
    with the bytes it will hold; a kept one does not."""
    out = _run(tiny_gguf("gpt_oss", "Q8_0")).stdout
    assert "note: the engine dequantizes the routed experts (" in out and "to bf16 at load" in out
    dims = dict(hidden_size=256, moe_intermediate_size=256, intermediate_size=256)
    assert "dequantizes the routed experts" not in _run(tiny_gguf("qwen3_moe", "Q3_K+Q4_K", **dims)).stdout
