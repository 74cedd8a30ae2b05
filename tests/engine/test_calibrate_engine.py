"""The engine-fitted kernel and host-point costs make the cost model predict the decode runs they
were fitted on, and the all-CPU run is predicted for comparison (here with the CPU as the engine's
accelerator, at a tiny expert shape)."""

from __future__ import annotations

import pytest

from workbench.core.hardware import preset
from workbench.engine import calibrate_engine


def test_fitted_costs_reproduce_both_measured_runs(monkeypatch):
    seen, calls = {}, []
    real = calibrate_engine._decode_seconds

    def record(inv, placement, device, steps=calibrate_engine.STEPS):
        t = real(inv, placement, device, steps=6)
        calls.append(t)
        best = seen.get(id(placement), (inv, placement, t))[2]
        seen[id(placement)] = (inv, placement, min(t, best))  # the fit keeps a placement's faster run
        return t

    monkeypatch.setattr(calibrate_engine, "_decode_seconds", record)
    monkeypatch.setattr(calibrate_engine, "VOCAB", 256)
    base = preset("bench-h200")
    fitted, info = calibrate_engine.fit_engine_costs(base, 64, 32, 2, n_heads=4, n_kv_heads=2, head_dim=16,
                                                     device="cpu")
    assert info["launch_s"] >= 0 and info["sync_s"] >= 0
    assert fitted.gpus[0].launch_s == info["launch_s"] and fitted.sync_s == info["sync_s"]
    from workbench.core.costmodel import CostModel, EngineShape

    joint = info["cpu_rate"] != base.cpu_expert_throughput["bf16"]  # else only sync_s was fitted
    assert fitted.cpu_expert_throughput["bf16"] == info["cpu_rate"]
    assert len(seen) == 4  # all resident, a quarter and half on the CPU, all on the CPU
    assert len(calls) == 2 + 2 * calibrate_engine.REPEATS
    (inv, res, t_res), (_, quarter, t_quarter), (_, half, t_half), (_, cpu, t_cpu) = seen.values()
    assert (info["resident_s"], info["quarter_s"], info["half_s"], info["cpu_s"]) == (t_res, t_quarter, t_half, t_cpu)

    def step_s(placement):
        model = CostModel(inv, fitted, engine=EngineShape(bus_share=0.0))
        return 1.0 / model.decode_tps(placement, kv_tokens=16 + calibrate_engine.STEPS)

    # each fitted value pins a run; one held at its floor of 0 leaves the model slower than the run
    pinned = [(info["launch_s"] > 0, res, t_res), (info["sync_s"] > 0, half, t_half)]
    if joint:
        pinned.append((True, quarter, t_quarter))
    for free, placement, measured in pinned:
        if free:
            assert step_s(placement) == pytest.approx(measured, rel=0.02)
        else:
            assert step_s(placement) >= measured * 0.999
    assert info["cpu_predicted_s"] == pytest.approx(step_s(cpu), rel=1e-9)  # the check run, as predicted


def test_host_fit_recovers_known_costs():
    """Two runs made by the model itself with known host-point and CPU-rate values give them back."""
    def model(placement, sync, u):  # per step: 8 hybrid layers, CPU bytes per layer by placement
        return 1e-3 + 8 * (sync + placement * u)

    truth_sync, truth_rate = 3e-4, 7e10
    runs = [(b, model(b, truth_sync, 1 / truth_rate)) for b in (75e6, 37.5e6)]
    sync, rate = calibrate_engine._fit_host(model, runs[0], runs[1], 1 / 4e10)
    assert sync == pytest.approx(truth_sync, rel=1e-6) and rate == pytest.approx(truth_rate, rel=1e-6)
    assert calibrate_engine._fit_host(model, runs[0], runs[0], 1 / 4e10)[0] is None  # one equation twice
