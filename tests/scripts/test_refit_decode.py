"""scripts/refit_decode.py: step times the cost model itself made with known costs give them back."""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest

from workbench.core import synth
from workbench.core.costmodel import CostModel, EngineShape
from workbench.core.hardware import HardwareProfile, preset
from workbench.core.memory import placement_all_gpu, placement_cpu_moe
from workbench.core.readers import open_model
from workbench.engine import calibrate_engine as ce

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "refit_decode.py"


def test_logged_steps_made_by_the_model_give_its_costs_back(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("refit_decode", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    base = preset("bench-h200")
    truth = replace(base, sync_s=7e-5, decode_step_s=1.5e-4, gpus=(replace(base.gpus[0], launch_s=2.5e-6),),
                    cpu_expert_throughput={**base.cpu_expert_throughput, "bf16": 7e10})  # below the RAM's 88 GB/s
    experts = 32
    shape = synth.SynthShape("calibration", "qwen3moe", ce.LAYERS, 2048, 32, 4, 128, experts, 8, 768, ce.VOCAB,
                             qk_norm=True)
    path = tmp_path / "cal.gguf"
    synth.write_gguf(path, shape, coverage_target=None, sparse=True)
    inv = open_model(path)
    model = CostModel(inv, truth, engine=EngineShape(bus_share=0.0))
    runs = [placement_all_gpu(inv)] + [ce._upper_on_cpu(inv, s) for s in ce.HYBRID_SHARES] + [placement_cpu_moe(inv)]
    ms = [1e3 / model.decode_tps(p, kv_tokens=16 + ce.STEPS) for p in runs]
    queued = ms[0] - truth.decode_step_s * 1e3
    out = tmp_path / "refit.json"
    monkeypatch.setattr(ce, "_decode_times", ce._decode_times)  # the script patches the module; undone after
    monkeypatch.setattr(ce, "_fit_cpu_rate", ce._fit_cpu_rate)
    monkeypatch.setattr(ce, "_deep_resident_fit", ce._deep_resident_fit)
    monkeypatch.setattr(ce, "calibration_experts", ce.calibration_experts)
    monkeypatch.setattr(ce, "packet_rate", ce.packet_rate)
    monkeypatch.setattr(ce, "_wide_fit", ce._wide_fit)
    monkeypatch.setattr(synth, "write_gguf", synth.write_gguf)
    assert mod.main(["--profile", str(_saved(base, tmp_path)), "--experts", str(experts),
                     "--steps", ",".join(f"{t:.6f}" for t in ms), "--queued", f"{queued:.6f}", "-o", str(out)]) == 0
    fitted = HardwareProfile.load(out)
    assert fitted.decode_step_s == pytest.approx(truth.decode_step_s, rel=1e-3)
    assert fitted.gpus[0].launch_s == pytest.approx(truth.gpus[0].launch_s, rel=1e-2)
    assert fitted.sync_s == pytest.approx(truth.sync_s, rel=0.05)
    assert fitted.cpu_expert_throughput["bf16"] == pytest.approx(7e10, rel=0.05)
    # the packets' rate given (as a trace measured it): the host point alone comes back
    assert mod.main(["--profile", str(_saved(base, tmp_path)), "--experts", str(experts), "--packets", "10,70",
                     "--steps", ",".join(f"{t:.6f}" for t in ms), "--queued", f"{queued:.6f}", "-o", str(out)]) == 0
    fitted = HardwareProfile.load(out)
    assert fitted.cpu_expert_throughput["bf16"] == 7e10
    assert fitted.sync_s == pytest.approx(truth.sync_s, rel=0.02)


def _saved(profile: HardwareProfile, folder: Path) -> Path:
    path = folder / "profile.json"
    profile.save(path)
    return path


def test_logged_deep_resident_steps_give_the_kernel_cost_and_host_step_back(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("refit_decode", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    base = preset("bench-h200")
    truth = replace(base, sync_s=7e-5, decode_step_s=3e-4, gpus=(replace(base.gpus[0], launch_s=1.9e-6),))
    deep = []
    for d in ce.DEPTHS:
        shape = synth.SynthShape("calibration", "qwen3moe", d, 2048, 32, 4, 128, 8, 8, 768, ce.VOCAB, qk_norm=True)
        path = tmp_path / f"calibration-{d}-layers.gguf"
        synth.write_gguf(path, shape, coverage_target=None, sparse=True)
        inv = open_model(path)
        deep.append(1e3 / CostModel(inv, truth, engine=EngineShape(bus_share=0.0)).decode_tps(
            placement_all_gpu(inv), kv_tokens=16 + ce.STEPS))
    for name in ("_decode_times", "_fit_cpu_rate", "calibration_experts", "_deep_resident_fit", "packet_rate",
                 "_wide_fit"):
        monkeypatch.setattr(ce, name, getattr(ce, name))  # the script patches the module; undone after
    monkeypatch.setattr(synth, "write_gguf", synth.write_gguf)
    out = tmp_path / "refit.json"
    steps = "0.9,1.8,3.5,5.3,6.7,8.9"  # the 8-layer runs: only the host point and CPU rate come from them
    assert mod.main(["--profile", str(_saved(base, tmp_path)), "--experts", "32", "--steps", steps,
                     "--deep", ",".join(f"{t:.6f}" for t in deep), "-o", str(out)]) == 0
    fitted = HardwareProfile.load(out)
    assert fitted.gpus[0].launch_s == pytest.approx(1.9e-6, rel=1e-3)
    assert fitted.decode_step_s == pytest.approx(3e-4, rel=1e-3)


def test_logged_wide_steps_give_the_routing_cost_back_at_the_logged_expert_count(tmp_path, monkeypatch):
    """The wide fit's two steps as a GPU host logged them, at the experts its room gave (``--wide-experts``),
    not at what this machine's room would give: the routing cost per expert comes back."""
    spec = importlib.util.spec_from_file_location("refit_decode", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    base = preset("bench-h200")
    gpu = replace(base.gpus[0], launch_s=1.9e-6, route_s_per_expert=6e-8)
    truth = replace(base, sync_s=7e-5, decode_step_s=3e-4, gpus=(gpu,))

    def step_ms(depth: int, experts: int) -> float:
        shape = synth.SynthShape("calibration", "qwen3moe", depth, 2048, 32, 4, 128, experts, 8, 768, ce.VOCAB,
                                 qk_norm=True)
        path = tmp_path / f"m-{depth}-{experts}.gguf"
        synth.write_gguf(path, shape, coverage_target=None, sparse=True)
        inv = open_model(path)
        return 1e3 / CostModel(inv, truth, engine=EngineShape(bus_share=0.0)).decode_tps(
            placement_all_gpu(inv), kv_tokens=16 + ce.STEPS)

    deep = [step_ms(d, 8) for d in ce.DEPTHS]
    wide, narrow = step_ms(ce.DEPTHS[0], 96), deep[0]  # the narrow model is the shallower deep one
    for name in ("_decode_times", "_fit_cpu_rate", "calibration_experts", "_deep_resident_fit", "packet_rate",
                 "_wide_fit", "WIDE_EXPERTS"):
        monkeypatch.setattr(ce, name, getattr(ce, name))  # the script patches the module; undone after
    monkeypatch.setattr(synth, "write_gguf", synth.write_gguf)
    monkeypatch.setattr(ce, "calibration_room", lambda *a: 8e9)  # this machine: room for the deep models, not 96 experts
    out = tmp_path / "refit.json"
    args = ["--profile", str(_saved(base, tmp_path)), "--experts", "32", "--steps", "0.9,1.8,3.5,5.3,6.7,8.9",
            "--deep", ",".join(f"{t:.6f}" for t in deep), "--wide", f"{wide:.6f},{narrow:.6f}", "-o", str(out)]
    assert mod.main(args) == 0  # without it: the same difference spread over the fewer experts this room holds
    assert HardwareProfile.load(out).gpus[0].route_s_per_expert > 2 * 6e-8
    assert mod.main(args + ["--wide-experts", "96"]) == 0
    assert HardwareProfile.load(out).gpus[0].route_s_per_expert == pytest.approx(6e-8, rel=0.02)
