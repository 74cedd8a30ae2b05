import json
import subprocess
import sys

import pytest

from workbench.cli import main
from workbench.core.memory import estimate_memory, placement_cpu_moe
from workbench.core.placement import expert_grid
from workbench.core.project import load_project
from workbench.core.readers import open_model
from workbench.core.stats import ExpertStats


def _budget_for(inv, share):
    """A VRAM size (bytes) that holds the non-expert part (at a 4096-token context) and ``share`` of the
    routed experts."""
    fixed = estimate_memory(inv, placement_cpu_moe(inv), 4096).total("gpu:0")
    experts = sum(inv.units[k].nbytes for k in inv.expert_keys())
    return int(fixed + share * experts)


def test_plan_prints_the_prediction_and_saves_a_project(tiny_gguf, tmp_path, capsys):
    model = tiny_gguf("qwen3_moe")
    inv = open_model(model)
    stats = ExpertStats.for_spec(inv.spec)
    stats.add(__import__("numpy").arange(stats.n_layers * stats.n_experts, dtype=float).reshape(stats.shape))
    stats.save(tmp_path / "stats.json")
    vram = _budget_for(inv, 0.5)
    out = tmp_path / "p.json"
    rc = main(["plan", str(model), "--strategy", "frequency", "--vram", str(vram), "--profile", "bench-h200",
               "--stats", str(tmp_path / "stats.json"), "--ctx", "4096", "--layers", "-o", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    assert "decode" in text and "prefill" in text and "gpu:0" in text and "with expert stats" in text
    proj = load_project(out)
    assert proj.settings["strategy"] == "frequency" and proj.settings["ctx"] == 4096
    assert proj.hardware.name.startswith("Benchmark machine")
    assert proj.stats == stats
    grid = expert_grid(proj.placement, inv.spec.n_layers, inv.spec.n_experts)
    on = [(grid[layer] >= 0).sum() for layer in inv.spec.moe_layers]
    assert 0 < sum(on) < len(inv.expert_keys())
    for layer in inv.spec.moe_layers:  # the hottest (highest index here) experts of each layer first
        row = grid[layer]
        if 0 < (row >= 0).sum() < len(row):
            assert (row >= 0).nonzero()[0].min() > (row < 0).nonzero()[0].max()


def test_plan_all_json_and_budget_honoured(tiny_gguf, capsys):
    model = tiny_gguf("mixtral")
    inv = open_model(model)
    vram = _budget_for(inv, 0.3)
    rc = main(["plan", str(model), "--strategy", "all", "--vram", str(vram), "--margin", "0", "--ctx", "4096", "--json"])
    assert rc == 0
    got = json.loads(capsys.readouterr().out)
    assert "error" in got["all-gpu"]
    for strategy in ("cpu-moe", "n-cpu-moe", "uniform", "frequency", "balanced"):
        assert got[strategy]["memory"]["tiers"]["gpu:0"]["total"] <= vram
    assert got["balanced"]["decode_tps"] >= got["frequency"]["decode_tps"]


@pytest.mark.parametrize("argv, message", [
    (["--strategy", "balanced", "--vram", "lots"], "--vram: not a size"),
    (["--vram", "1M"], "even with every routed expert in RAM"),
    (["--profile", "no-such-machine"], "no-such-machine"),
    (["--stats", "/nonexistent/stats.json"], "no expert stats"),
])
def test_plan_errors_are_one_line(tiny_gguf, capsys, argv, message):
    rc = main(["plan", str(tiny_gguf("qwen3_moe")), *argv])
    err = capsys.readouterr().err
    assert rc == 2
    assert message in err and err.startswith("workbench plan: ") and err.count("\n") == 1


def test_export_command(tiny_gguf, tiny_model_dir, tmp_path, capsys):
    model = tiny_gguf("qwen3_moe")
    inv = open_model(model)
    proj = tmp_path / "g.json"
    assert main(["plan", str(model), "--strategy", "frequency", "--vram", str(_budget_for(inv, 0.4)),
                 "--ctx", "4096", "--profile", "bench-h200", "-o", str(proj)]) == 0
    capsys.readouterr()
    assert main(["export", str(proj), "--to", "llama.cpp"]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[-1].startswith("-ngl 99")
    assert "predicted decode" in text or "--n-cpu-moe" in text
    assert main(["export", str(proj), "--to", "ktransformers", "-o", str(tmp_path / "kt.txt")]) == 0
    assert (tmp_path / "kt.kt-frequency.json").exists()
    assert "--kt-gpu-experts-ratio" in (tmp_path / "kt.txt").read_text()
    assert main(["export", str(proj), "--to", "accelerate"]) == 2
    assert "Hugging Face folder" in capsys.readouterr().err
    hf = tiny_model_dir("qwen3_moe")
    inv_hf = open_model(hf)
    proj_hf = tmp_path / "h.json"
    assert main(["plan", str(hf), "--strategy", "n-cpu-moe", "--vram", str(_budget_for(inv_hf, 0.5)),
                 "--ctx", "4096", "-o", str(proj_hf)]) == 0
    capsys.readouterr()
    assert main(["export", str(proj_hf), "--to", "accelerate", "-o", str(tmp_path / "map.json")]) == 0
    dmap = json.loads((tmp_path / "map.json").read_text())
    assert dmap["model.layers.0.mlp.experts"] == "cpu" and dmap["lm_head"] == 0
    assert main(["export", str(tmp_path / "missing.json"), "--to", "llama.cpp"]) == 2


def test_plan_and_export_import_neither_torch_nor_qt(tiny_gguf, tmp_path):
    model = tiny_gguf("qwen3_moe")
    code = (
        "import sys\n"
        "from workbench.cli import main\n"
        f"assert main(['plan', {str(model)!r}, '--vram', '2G', '-o', {str(tmp_path / 'x.json')!r}]) == 0\n"
        f"assert main(['export', {str(tmp_path / 'x.json')!r}, '--to', 'llama.cpp']) == 0\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'PySide6', 'transformers')]\n"
        "assert not bad, bad\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_export_relinks_a_moved_model(tiny_gguf, tmp_path, capsys):
    import shutil

    model = tmp_path / "m.gguf"
    shutil.copy(tiny_gguf("qwen3_moe"), model)
    proj = tmp_path / "p.json"
    assert main(["plan", str(model), "--strategy", "cpu-moe", "--vram", "2G", "-o", str(proj)]) == 0
    moved = tmp_path / "moved.gguf"
    model.rename(moved)
    capsys.readouterr()
    assert main(["export", str(proj), "--to", "llama.cpp"]) == 2
    err = capsys.readouterr().err
    assert "moved or deleted" in err and "--relink" in err
    assert main(["export", str(proj), "--to", "llama.cpp", "--relink", str(moved)]) == 0
    assert "--n-cpu-moe" in capsys.readouterr().out
    assert main(["export", str(proj), "--to", "llama.cpp"]) == 0  # saved: no relink needed any more
    shutil.copy(tiny_gguf("mixtral"), moved)
    capsys.readouterr()
    assert main(["export", str(proj), "--to", "llama.cpp"]) == 2
    assert "changed since the project was saved" in capsys.readouterr().err
