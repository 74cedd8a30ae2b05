"""The engine-fitted kernel and host-point costs make the cost model predict the decode runs they
were fitted on, and the all-CPU run is predicted for comparison (here with the CPU as the engine's
accelerator, at a tiny expert shape)."""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from workbench.core.costmodel import BUS_SHARE, CostModel, model_bus_share
from workbench.core.hardware import preset
from workbench.core.memory import placement_all_gpu, placement_cpu_moe
from workbench.core.readers import open_model
from workbench.engine import calibrate_engine


@pytest.fixture(autouse=True)
def torch_paths_and_short_warm_up(monkeypatch):
    """The engine's PyTorch paths, not its Triton kernels in the interpreter (seconds a step; these
    tests check the fits, which take whatever the runs measure), and a few untimed steps before each
    timed run, not 0.3 s of them."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(calibrate_engine, "WARM_S", 0.02)


def test_fitted_costs_fit_the_measured_runs(monkeypatch):
    seen, calls, queued = {}, [], {}
    real = calibrate_engine._decode_times

    def record(inv, placement, device, steps=calibrate_engine.STEPS, packets=None):
        t, q = real(inv, placement, device, steps=4, packets=packets)
        calls.append(t)
        best = seen.get(id(placement), (inv, placement, t))[2]
        seen[id(placement)] = (inv, placement, min(t, best))  # the fit keeps a placement's faster run
        queued[id(placement)] = min(q, queued.get(id(placement), q))
        return t, q

    monkeypatch.setattr(calibrate_engine, "_decode_times", record)
    monkeypatch.setattr(calibrate_engine, "VOCAB", 256)
    monkeypatch.setattr(calibrate_engine, "MAX_EXPERTS", 32)  # a tiny expert shape would ask for the most
    monkeypatch.setattr(calibrate_engine, "_deep_resident_fit", lambda *a: None)  # no room: the 8-layer fit
    base = preset("bench-h200")
    fitted, info = calibrate_engine.fit_engine_costs(base, 64, 32, 2, n_heads=4, n_kv_heads=2, head_dim=16,
                                                     device="cpu")
    assert info["launch_s"] >= 0 and info["sync_s"] >= 0
    assert fitted.gpus[0].launch_s == info["launch_s"] and fitted.sync_s == info["sync_s"]
    from dataclasses import replace

    from workbench.core.costmodel import CostModel, EngineShape

    joint = info["cpu_rate"] != base.cpu_expert_throughput["bf16"]  # else only sync_s was fitted
    assert fitted.cpu_expert_throughput["bf16"] == info["cpu_rate"]
    assert len(seen) == 6  # all resident; a sixteenth, quarter, half, three quarters on the CPU; all on the CPU
    assert len(calls) == 1 + 5 * calibrate_engine.REPEATS  # the check run once, each fitted run kept at its fastest
    (inv, res, t_res), *hybrid, (_, cpu, t_cpu) = seen.values()
    q_res = queued[id(res)]  # the resident steps queued: the host's time per step is the difference
    assert 0 < q_res and info["resident_queued_s"] == q_res
    assert fitted.decode_step_s == info["step_s"] == max(0.0, t_res - q_res)
    assert (info["resident_s"], info["sixteenth_s"], info["quarter_s"], info["half_s"], info["three_quarters_s"],
            info["cpu_s"]) == (t_res, *(t for _, _, t in hybrid), t_cpu)

    def step_s(placement, prof=fitted):
        model = CostModel(inv, prof, engine=EngineShape(bus_share=0.0))
        return 1.0 / model.decode_tps(placement, kv_tokens=16 + calibrate_engine.STEPS)

    if info["launch_s"] > 0:  # the resident run pins the kernel cost (at its floor of 0 the model is slower)
        assert step_s(res) == pytest.approx(t_res, rel=0.02)
    else:
        assert step_s(res) >= t_res * 0.999
    def sse(sync, rate):
        prof = replace(fitted, sync_s=sync, cpu_expert_throughput={**fitted.cpu_expert_throughput, "bf16": rate})
        return sum((step_s(p, prof) / t - 1) ** 2 for _, p, t in hybrid)

    best = sse(info["sync_s"], info["cpu_rate"])
    from workbench.engine import cpu_kernel

    if cpu_kernel.available():  # the hybrid runs' steps were served (on this CPU accelerator too), and traced
        assert sum(info["packets"].values()) > 0 and set(info["packets"]) <= {0, 1, 2}  # top_k 2
    # at this tiny shape a pair costs next to nothing beside the packet's fixed cost: on a busy machine
    # the packets may pin no positive rate, and the joint fit below takes over
    if info["packet_rate"] is not None:  # the server's packets give the rate; the host point alone is fitted
        assert info["cpu_rate"] == info["packet_rate"] and info["packet_fixed_s"] >= 0
        for sync in (1.1, 0.9):
            assert best <= sse(info["sync_s"] * sync, info["cpu_rate"]) * (1 + 1e-6)
    elif not joint:  # the half run alone pins the host point
        if info["sync_s"] > 0:
            assert step_s(hybrid[2][1]) == pytest.approx(hybrid[2][2], rel=0.02)
    else:  # least squares: moving either fitted value makes the four runs' squared relative errors larger
        for sync, rate in ((1.1, 1), (0.9, 1), (1, 1.1), (1, 0.9)):
            assert best <= sse(info["sync_s"] * sync, info["cpu_rate"] * rate) * (1 + 1e-6)
    assert info["cpu_predicted_s"] == pytest.approx(step_s(cpu), rel=1e-9)  # the check run, as predicted


def test_two_resident_depths_part_the_kernels_from_the_hosts_time_per_step(monkeypatch):
    """The deeper model's extra step is its extra layers' kernels alone; what the shallower step
    takes beyond its kernels is the host's, once a step: runs made by the model with a known kernel
    cost and host time give them back, and the decode fit then uses them for the hybrid runs."""
    from workbench.core import synth
    from workbench.core.costmodel import EngineShape
    from workbench.core.memory import placement_all_gpu

    truth = replace(preset("bench-h200"), decode_step_s=3e-4)
    truth = replace(truth, gpus=(replace(truth.gpus[0], launch_s=1.9e-6),))

    def made(inv, placement, device, steps=calibrate_engine.STEPS, packets=None):
        return 1.0 / CostModel(inv, truth, engine=EngineShape(bus_share=0.0)).decode_tps(
            placement, kv_tokens=16 + calibrate_engine.STEPS)

    monkeypatch.setattr(calibrate_engine, "_decode_seconds", made)
    monkeypatch.setattr(calibrate_engine, "VOCAB", 256)
    shape = synth.SynthShape("calibration", "qwen3moe", 8, 64, 4, 2, 16, 32, 2, 32, 256, qk_norm=True)
    base = replace(truth, decode_step_s=0.0)

    def seconds(p, model):
        return 1.0 / CostModel(model, p, engine=EngineShape(bus_share=0.0)).decode_tps(
            placement_all_gpu(model), kv_tokens=16 + calibrate_engine.STEPS)

    def with_launch(v):
        return replace(base, gpus=(replace(base.gpus[0], launch_s=v),))

    deep = calibrate_engine._deep_resident_fit(shape, "cpu", 1e12, seconds, with_launch)
    assert deep["depths"] == calibrate_engine.DEPTHS
    assert deep["launch_s"] == pytest.approx(1.9e-6, rel=1e-6) and deep["step_s"] == pytest.approx(3e-4, rel=1e-6)
    per_layer = 2 * (3 * 64 * 32 * 2) + 64 * 16 * 2 * (2 * 4 + 2 * 2)
    room = 2 * 20 * per_layer  # half of it holds 20 layers: 10 and 20
    assert calibrate_engine._deep_resident_fit(shape, "cpu", room, seconds, with_launch)["depths"] == (10, 20)
    assert calibrate_engine._deep_resident_fit(shape, "cpu", 2 * 12 * per_layer, seconds, with_launch) is None


def test_the_host_fit_keeps_the_cpu_rate_within_the_hosts_ram_read():
    """Runs that a faster-than-RAM CPU rate would fit best get the RAM's rate and the host point
    refitted at it."""
    def model(placement, sync, u):
        return 1e-3 + 8 * (sync + placement * u)

    runs = [(b, model(b, 1e-3, 1 / 400e9)) for b in (37.5e6, 75e6, 112.5e6)]
    assert calibrate_engine._fit_host(model, runs, 1 / 4e10)[1] == pytest.approx(400e9, rel=1e-6)
    sync, rate = calibrate_engine._fit_host(model, runs, 1 / 4e10, u_min=1 / 100e9)
    assert rate == pytest.approx(100e9, rel=1e-9)
    assert sync == pytest.approx(np.mean([(t - 1e-3) / 8 - b / 100e9 for b, t in runs]), rel=0.2)
    assert sync < 1e-3  # the rate's slower bytes come out of the host point


def test_host_fit_recovers_known_costs():
    """Runs made by the model itself with known host-point and CPU-rate values give them back;
    with noise, least squares over three runs lands near them; one equation repeated pins nothing."""
    def model(placement, sync, u):  # per step: 8 hybrid layers, CPU bytes per layer by placement
        return 1e-3 + 8 * (sync + placement * u)

    truth_sync, truth_rate = 3e-4, 7e10
    runs = [(b, model(b, truth_sync, 1 / truth_rate)) for b in (37.5e6, 75e6, 112.5e6)]
    sync, rate = calibrate_engine._fit_host(model, runs, 1 / 4e10)
    assert sync == pytest.approx(truth_sync, rel=1e-6) and rate == pytest.approx(truth_rate, rel=1e-6)
    noisy = [(b, t * f) for (b, t), f in zip(runs, (1.01, 0.99, 1.005))]
    sync, rate = calibrate_engine._fit_host(model, noisy, 1 / 4e10)
    assert sync == pytest.approx(truth_sync, rel=0.3) and rate == pytest.approx(truth_rate, rel=0.05)
    assert calibrate_engine._fit_host(model, [runs[0], runs[0]], 1 / 4e10)[0] is None  # one equation twice
    assert calibrate_engine._fit_host(model, runs[:1], 1 / 4e10)[0] is None


def test_kept_block_rates_are_fitted_to_the_resident_runs_in_their_format(monkeypatch):
    """Each kept format's GPU rate is the one at which the model predicts the engine's decode of
    the calibration model written in that format; a format whose block does not divide the shape
    keeps its measured rate."""
    from dataclasses import replace

    from workbench.core import synth
    from workbench.core.costmodel import CostModel, EngineShape

    runs = []
    real = calibrate_engine._decode_seconds

    def record(inv, placement, device, steps=calibrate_engine.STEPS, packets=None):
        t = real(inv, placement, device, steps=2, packets=packets)
        runs.append((inv, placement, t))
        return t

    monkeypatch.setattr(calibrate_engine, "_decode_seconds", record)
    monkeypatch.setattr(calibrate_engine, "VOCAB", 256)
    monkeypatch.setattr(calibrate_engine, "REPEATS", 1)
    base = preset("bench-h200")
    rates = {"q8_0": 1.5e12, "q4_k": 6e11}
    base = replace(base, gpus=(replace(base.gpus[0], expert_throughput=rates),))
    shape = synth.SynthShape("calibration", "qwen3moe", 2, 256, 4, 2, 64, 8, 2, 256, 256, qk_norm=True)
    fitted, info = calibrate_engine.fit_kept_rates(base, shape, device="cpu")
    n = calibrate_engine.REPEATS
    assert set(info) == {"q8_0", "q4_k"} and len(runs) == 2 * n
    for i, fmt in enumerate(("q8_0", "q4_k")):
        inv, placement, _ = runs[i * n]
        t = min(r[2] for r in runs[i * n:(i + 1) * n])  # the fastest of the format's runs
        assert info[fmt]["resident_s"] == t and info[fmt]["measured_rate"] == rates[fmt]
        assert fitted.gpus[0].expert_throughput[fmt] == info[fmt]["rate"]
        model = CostModel(inv, fitted, engine=EngineShape(bus_share=0.0))
        predicted = 1.0 / model.decode_tps(placement, kv_tokens=16 + calibrate_engine.STEPS)
        if info[fmt]["rate"] != rates[fmt]:
            assert predicted == pytest.approx(t, rel=0.02)
        else:  # no positive solution: the launches alone already take longer than the run
            assert predicted >= t
    narrow = synth.SynthShape("calibration", "qwen3moe", 2, 128, 4, 2, 32, 8, 2, 64, 256, qk_norm=True)
    runs.clear()
    fitted, info = calibrate_engine.fit_kept_rates(base, narrow, device="cpu")
    assert set(info) == {"q8_0"} and fitted.gpus[0].expert_throughput["q4_k"] == rates["q4_k"]
    asked = []  # only the formats asked for (``workbench calibrate --kept-fits``); the runs' times as measured above
    monkeypatch.setattr(calibrate_engine, "_decode_seconds",
                        lambda inv, placement, device, steps=0, packets=None: asked.append(inv.spec) or runs[0][2])
    fitted, info = calibrate_engine.fit_kept_rates(base, shape, device="cpu", formats=("q8_0",))
    assert set(info) == {"q8_0"} and len(asked) == n and fitted.gpus[0].expert_throughput["q4_k"] == rates["q4_k"]


def test_a_kept_rate_is_fitted_to_two_depths_whose_difference_leaves_out_the_hosts_pace(monkeypatch):
    """Runs made by the model at a known Q8_0 rate, with the 8-layer model's step paced by the host
    (time the model leaves out) and a fixed host time on every step: the two depths' difference gives
    the rate back; the 8-layer run alone (no room for the depths) reads the host's time as slow bytes."""
    from workbench.core import synth
    from workbench.core.costmodel import EngineShape

    base = preset("bench-h200")
    base = replace(base, gpus=(replace(base.gpus[0], expert_throughput={"q8_0": 1.5e12}),))
    truth = replace(base, gpus=(replace(base.gpus[0], expert_throughput={"q8_0": 1.2e12}),))

    def made(inv, placement, device, steps=calibrate_engine.STEPS, packets=None):
        paced = 3e-4 if inv.spec.n_layers == calibrate_engine.LAYERS else 0.0
        return 2e-4 + paced + 1.0 / CostModel(inv, truth, engine=EngineShape(bus_share=0.0)).decode_tps(
            placement, kv_tokens=16 + calibrate_engine.STEPS)

    monkeypatch.setattr(calibrate_engine, "_decode_seconds", made)
    monkeypatch.setattr(calibrate_engine, "VOCAB", 256)
    shape = synth.SynthShape("calibration", "qwen3moe", calibrate_engine.LAYERS, 256, 4, 2, 64, 8, 2, 256, 256,
                             qk_norm=True)
    fitted, info = calibrate_engine.fit_kept_rates(base, shape, device="cpu", formats=("q8_0",), room=1e12)
    assert info["q8_0"]["depths"] == calibrate_engine.DEPTHS and len(info["q8_0"]["deep_s"]) == 2
    assert fitted.gpus[0].expert_throughput["q8_0"] == info["q8_0"]["rate"] == pytest.approx(1.2e12, rel=1e-6)
    assert calibrate_engine.resident_runs(info["q8_0"]).endswith(" ms for 16 / 32 layers")
    paced, info = calibrate_engine.fit_kept_rates(base, shape, device="cpu", formats=("q8_0",))
    assert "depths" not in info["q8_0"] and info["q8_0"]["rate"] < 0.9 * 1.2e12
    assert calibrate_engine.resident_runs(info["q8_0"]).endswith(f" ms for {calibrate_engine.LAYERS} layers")


def test_the_routing_cost_per_expert_comes_from_a_wide_model_against_the_narrow_one(monkeypatch):
    """Runs made by the model with a known routing cost per expert and a fixed host time on every
    step: the wide model (more experts than picked) against the narrow one of the same depth gives
    the cost back; without room for the wide model, none."""
    from workbench.core import synth
    from workbench.core.costmodel import EngineShape

    base = preset("bench-h200")
    truth = replace(base, gpus=(replace(base.gpus[0], route_s_per_expert=9e-8),))

    def made(inv, placement, device, steps=calibrate_engine.STEPS, packets=None):
        return 2e-4 + 1.0 / CostModel(inv, truth, engine=EngineShape(bus_share=0.0)).decode_tps(
            placement, kv_tokens=16 + calibrate_engine.STEPS)

    def seconds(inv):
        return 1.0 / CostModel(inv, base, engine=EngineShape(bus_share=0.0)).decode_tps(
            placement_all_gpu(inv), kv_tokens=16 + calibrate_engine.STEPS)

    monkeypatch.setattr(calibrate_engine, "_decode_seconds", made)
    monkeypatch.setattr(calibrate_engine, "VOCAB", 256)
    monkeypatch.setattr(calibrate_engine, "WIDE_EXPERTS", 24)
    shape = synth.SynthShape("calibration", "qwen3moe", calibrate_engine.LAYERS, 128, 4, 2, 32, 8, 2, 128, 256,
                             qk_norm=True)
    deep = calibrate_engine._deep_resident_fit(shape, "cpu", 1e12, lambda p, m: 1.0 / CostModel(
        m, p, engine=EngineShape(bus_share=0.0)).decode_tps(placement_all_gpu(m), kv_tokens=16 + calibrate_engine.STEPS),
        lambda v: replace(base, gpus=(replace(base.gpus[0], launch_s=v),)))
    assert deep is not None
    wide = calibrate_engine._wide_fit(shape, "cpu", 1e12, deep, seconds)
    assert wide["experts"] == 24 and wide["depth"] == calibrate_engine.DEPTHS[0]
    assert wide["route_s_per_expert"] == pytest.approx(9e-8, rel=1e-3)
    assert wide["wide_s"] - wide["narrow_s"] > wide["depth"] * 22 * 9e-8  # more than the cost: the router's bytes
    monkeypatch.setattr(calibrate_engine.synth, "write_gguf", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    assert calibrate_engine._wide_fit(shape, "cpu", 1e12, deep, seconds) is None  # the calibration goes on without it
    one_expert = 3 * 128 * 128 * 2
    room = 2 * calibrate_engine.DEPTHS[0] * 3 * one_expert
    assert calibrate_engine._wide_fit(shape, "cpu", room, deep, seconds) is None  # no room


def test_a_quarter_of_the_calibration_experts_is_eight_times_the_l3(monkeypatch):
    from workbench.engine import calibrate

    layers = calibrate_engine.LAYERS
    expert = 3 * 2048 * 768 * 2  # bf16 bytes of one expert at the Qwen3-30B-A3B shape
    monkeypatch.setattr(calibrate, "l3_bytes", lambda: 300 * 2**20)  # the H200 host
    n = calibrate_engine.calibration_experts(2048, 768, 8)
    assert n % 32 == 0 and 0.25 * n * layers * expert >= 8 * 300 * 2**20 > 0.25 * (n - 32) * layers * expert
    monkeypatch.setattr(calibrate, "l3_bytes", lambda: 0)  # unknown caches: the floor
    assert calibrate_engine.calibration_experts(2048, 768, 8) == calibrate_engine.EXPERTS
    assert calibrate_engine.calibration_experts(2048, 768, 40) == 40  # at least top-k
    monkeypatch.setattr(calibrate, "l3_bytes", lambda: 2**40)
    assert calibrate_engine.calibration_experts(2048, 768, 8) == calibrate_engine.MAX_EXPERTS
    # no more than half the room the whole model must fit in (GPU free memory, host RAM available)
    room = 16 * 2**30
    n = calibrate_engine.calibration_experts(2048, 768, 8, room=room)
    assert n % 32 == 0 and n * layers * expert <= room / 2 < (n + 32) * layers * expert
    assert calibrate_engine.calibration_experts(2048, 768, 8, room=2**20) == calibrate_engine.EXPERTS  # the floor


@pytest.mark.parametrize("cpu_sync", [0.0, 300e-6])
def test_the_prompt_fit_makes_the_model_predict_its_prompts(monkeypatch, cpu_sync):
    """The host lane comes from the engine thread's records of its hybrid prompt layers; the host time
    beyond the lanes, the CPU share's slowdown and the prompt's copy rate from three prompts (an
    eighth and all of the experts on the CPU, all of them in a short prompt) in bf16 and again in
    Q8_0: measured times and records built from known values give those values back, and they
    reach the predictions and nothing else of the profile."""
    from workbench.engine.hostclock import HostLayer

    monkeypatch.setattr(calibrate_engine, "VOCAB", 256)
    monkeypatch.setattr(calibrate_engine, "LAYERS", 2)
    monkeypatch.setattr(calibrate_engine, "REPEATS", 0)  # the times come from the model here
    monkeypatch.setattr(calibrate_engine, "PROMPT_TOKENS", 128)  # 32 tokens an expert: all travel
    monkeypatch.setattr(calibrate_engine, "SHORT_PROMPT_TOKENS", 32)  # 8 an expert: the CPU keeps some
    base = replace(preset("bench-h200"), bus_read_rate=30e9)  # the bus timed: a balanced share of its own
    layer_s, scale, rate = 700e-6, 1.6, 0.8 * base.h2d_pinned
    lane = dict(prompt_host_layer_s=100e-6, prompt_host_cpu_s=50e-6, prompt_host_batch_s=20e-6,
                prompt_host_copy_s=2e-6)
    resident = {"bf16": 4e-3, "q8_0": 6e-3, "q4_k": 9e-3}  # longer than the tiny model's resident layers take: they show
    truth = replace(base, prompt_sync_s=layer_s, prompt_cpu_scale=scale, prompt_h2d=rate, prompt_cpu_sync_s=cpu_sync,
                    prompt_resident_layer_s=1e-3, prompt_resident_layer_by_format=resident, **lane)
    real, seen = calibrate_engine._prompt_seconds, []

    def as_modelled(inv, placement, device, pair_reads, lengths, clock=None, bus_share=None):  # a host the model predicts
        assert bus_share == model_bus_share(inv, base) != BUS_SHARE  # the engine's, balanced for this machine
        if len(seen) < 3:  # the engine runs the bf16 ones all the same (Q8_0's kernels: Triton's interpreter here)
            real(inv, placement, device, pair_reads, lengths)
        seen.append(lengths)
        for i in range(4 if clock is not None else 0):  # what the engine thread would record, at the known costs
            batches, copies, share = i + len(seen), 2 * (i + len(seen)) + i % 3, bool(i % 2)
            busy = (lane["prompt_host_layer_s"] + lane["prompt_host_cpu_s"] * share
                    + lane["prompt_host_batch_s"] * batches + lane["prompt_host_copy_s"] * copies)
            clock.layers.append(HostLayer(i, busy + (1.0 if i == 0 else 0.0), 0.0, 0.0, 8, batches, copies, share,
                                          i == 0))  # a forward's first layer holds the embedding: left out
        if clock is not None and cpu_sync and "q8_0" not in str(inv.path):  # a layer that waited for the CPU
            first = CostModel(inv, replace(truth, prompt_cpu_sync_s=0.0)).predict(
                placement_cpu_moe(inv), lengths[0] + 8, prompt_tokens=lengths[0]).prefill_layers[0]
            busy = lane["prompt_host_layer_s"] + lane["prompt_host_cpu_s"]
            lead = first.pre + first.sync + cpu_sync
            clock.layers.append(HostLayer(5, busy, 0.0, lead - busy + 1e-3, 0, 0, 0, True, False, cpu_run_s=1e-3))
        return [t / CostModel(inv, truth).predict(placement, t + 8, prompt_tokens=t).prefill_tps for t in lengths]

    monkeypatch.setattr(calibrate_engine, "_prompt_seconds", as_modelled)
    fitted, info = calibrate_engine.fit_prompt_costs(base, 512, 256, 2, n_heads=8, n_kv_heads=2, head_dim=64,
                                                     device="cpu", experts=8,  # experts big enough for the bus
                                                     resident_formats=("q4_k", "q8_0", "f16"))
    # Q4_K's prompt all on the GPU alone; Q8_0's runs as before; F16 is no block format synth writes
    assert seen == [(128,), (128, 32), (128,)] * 2 + [(128,)] and len(info["runs"]) == 9
    assert [r["name"] for r in info["runs"]][3:] == ["an eighth on the CPU, Q8_0", "all on the CPU, Q8_0",
                                                     "all on the CPU, short, Q8_0", "all on the GPU",
                                                     "all on the GPU, Q8_0", "all on the GPU, Q4_K"]
    assert fitted.prompt_resident_layer_by_format == pytest.approx(resident, rel=0.02)
    assert resident["bf16"] < fitted.prompt_resident_layer_s < resident["q4_k"]  # all at once: for other formats
    assert info["prompt_resident_layer_by_format"] == fitted.prompt_resident_layer_by_format
    for name, value in lane.items():
        assert getattr(fitted, name) == pytest.approx(value, rel=1e-6), name
    assert info["host_lane"] == pytest.approx(lane, rel=1e-6) and info["host_layers"] == 16 + 2 * (cpu_sync > 0)
    assert fitted.prompt_sync_s == pytest.approx(layer_s, rel=0.02)
    assert fitted.prompt_cpu_scale == pytest.approx(scale, rel=0.05)
    assert fitted.prompt_h2d == pytest.approx(rate, rel=0.05)
    assert fitted.prompt_cpu_sync_s == pytest.approx(cpu_sync, rel=0.02, abs=1e-9)
    assert info["prompt_cpu_sync_s"] == fitted.prompt_cpu_sync_s
    for run in info["runs"]:
        assert run["predicted_s"] == pytest.approx(run["measured_s"], rel=0.01)
    assert fitted.sync_s == base.sync_s and fitted.cpu_expert_throughput == base.cpu_expert_throughput
    from workbench.core.hardware import HardwareProfile

    back = HardwareProfile.from_json(fitted.to_json())
    names = ("prompt_sync_s", "prompt_cpu_scale", "prompt_h2d", "prompt_resident_layer_s",
             "prompt_resident_layer_by_format", *lane)
    assert [getattr(back, n) for n in names] == [getattr(fitted, n) for n in names]


def test_a_gpu_too_small_for_the_resident_prompt_keeps_its_resident_layer_time(monkeypatch):
    """The all-resident prompts run out of GPU memory: the other six still fit their values, and
    ``prompt_resident_layer_s`` stays the profile's."""
    import torch

    from workbench.core.memory import placement_all_gpu

    monkeypatch.setattr(calibrate_engine, "VOCAB", 256)
    monkeypatch.setattr(calibrate_engine, "LAYERS", 2)
    base = replace(preset("bench-h200"), prompt_resident_layer_s=1e-3)

    def timed(inv, placement, device, pair_reads, lengths, clock=None, bus_share=None):
        if placement.to_json() == placement_all_gpu(inv).to_json():
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return [t / CostModel(inv, base).predict(placement, t + 8, prompt_tokens=t).prefill_tps for t in lengths]

    monkeypatch.setattr(calibrate_engine, "_prompt_seconds", timed)
    fitted, info = calibrate_engine.fit_prompt_costs(base, 512, 256, 2, n_heads=8, n_kv_heads=2, head_dim=64,
                                                     device="cpu", experts=8)
    assert len(info["runs"]) == 6 and not any("GPU" in r["name"] for r in info["runs"])
    assert fitted.prompt_resident_layer_s == info["prompt_resident_layer_s"] == 1e-3
    assert fitted.prompt_resident_layer_by_format == info["prompt_resident_layer_by_format"] == {}


def test_the_host_lane_fit_keeps_its_costs_at_least_zero():
    """Records whose best fit has a negative cost per copy get that cost 0 and the others fitted
    without it; no records give no host lane."""
    from workbench.engine.hostclock import HostLayer

    recs = [HostLayer(i, 1e-3 + 1e-4 * b - 1e-6 * 3 * b, 0.0, 0.0, 8, b, 3 * b, False, False) for i, b in
            enumerate((1, 2, 3, 4))]
    lane = calibrate_engine.fit_host_lane(recs)
    assert lane["prompt_host_copy_s"] == 0 and lane["prompt_host_cpu_s"] == 0
    assert lane["prompt_host_layer_s"] + 4 * lane["prompt_host_batch_s"] == pytest.approx(1e-3 + 4 * 97e-6)
    assert calibrate_engine.fit_host_lane([]) == dict.fromkeys(calibrate_engine.HOST_LANE, 0.0)


def test_the_simplex_search_finds_the_least_point_of_a_kinked_function_within_its_bounds():
    """A time that is a max of lanes (not smooth where they meet), values of different scales: its
    least point is found; one outside the bounds gives the nearest point inside them."""
    def f(x):
        t = max(x[0] + 1e-3 * x[1], 2e-3)  # the host time and a lane scaled by x[1], or a floor
        return ((t - 5e-3) / 1e-3) ** 2 + (x[1] - 1.7) ** 2 + ((x[2] - 40e9) / 10e9) ** 2

    x, fx = calibrate_engine._least_point(f, (0.0, 1.0, 50e9), (1e-3, 0.5, 5e9),
                                          ((0.0, 1.0), (1.0, 5.0), (10e9, 100e9)), 1000, 1e-14)
    assert x == pytest.approx((3.3e-3, 1.7, 40e9), rel=1e-3) and fx < 1e-6
    x, _ = calibrate_engine._least_point(lambda v: (v[0] + 2.0) ** 2, (0.5,), (0.25,), ((0.0, 1.0),))
    assert x == (0.0,)


def test_the_prompt_fit_keeps_its_costs_at_least_zero():
    """A cost the least squares would make negative is 0, and the other is fitted alone."""
    a = np.array([[8.0, 0.0], [8.0, 0.0], [8.0, 8.0]])
    assert calibrate_engine._least_squares_at_least_zero(a, a @ np.array([1e-3, 5e-4])) == pytest.approx((1e-3, 5e-4))
    layer, cpu = calibrate_engine._least_squares_at_least_zero(a, np.array([8e-3, 8e-3, 4e-3]))
    assert cpu == 0 and layer == pytest.approx((8e-3 * 8 * 2 + 4e-3 * 8) / (3 * 64))
    assert calibrate_engine._least_squares_at_least_zero(np.array([[8.0, 0.0], [8.0, 0.0]]),
                                                         np.array([-1e-3, -2e-3])) == (0.0, 0.0)


def test_the_sm_clock_is_read_through_nvml_on_cuda_only(monkeypatch):
    """Each timed decode run logs the GPU's SM clock (a GPU still at idle clocks runs slow steps)."""
    class Stub:
        available = True

        def query(self, fn, *args, default=None):
            return {"nvmlDeviceGetHandleByIndex": "h", "nvmlDeviceGetClockInfo": 1980}[fn] if fn else default

    monkeypatch.setattr(calibrate_engine, "_nvml", lambda: Stub())
    assert calibrate_engine._sm_clock_mhz("cpu") is None
    monkeypatch.setattr(calibrate_engine.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(calibrate_engine.torch.cuda, "current_device", lambda: 0)
    assert calibrate_engine._sm_clock_mhz("cuda") == 1980
    Stub.available = False
    assert calibrate_engine._sm_clock_mhz("cuda") is None


def test_a_kept_formats_cpu_rate_is_fitted_to_runs_with_experts_on_the_cpu(monkeypatch):
    """Where the CPU holds a kept format too, runs of the calibration model in that format with a
    sixteenth and half of the experts on the CPU fit the CPU's rate for it: runs the model itself
    made at a known rate give that rate back (the GPU rate from the resident run as before)."""
    from workbench.core import synth
    from workbench.core.costmodel import CostModel, EngineShape

    base = preset("bench-h200")
    truth_gpu, truth_cpu = 1.2e12, 2.1e10
    base = replace(base, gpus=(replace(base.gpus[0], expert_throughput={"q8_0": 1.5e12}),),
                   cpu_expert_throughput={**base.cpu_expert_throughput, "q8_0": 6e10})
    truth = replace(base, gpus=(replace(base.gpus[0], expert_throughput={"q8_0": truth_gpu}),),
                    cpu_expert_throughput={**base.cpu_expert_throughput, "q8_0": truth_cpu})
    seen = []

    def made(inv, placement, device, steps=0, packets=None):  # what the engine would measure if the model were right
        seen.append(placement)
        model = CostModel(inv, truth, engine=EngineShape(bus_share=0.0))
        return 1.0 / model.decode_tps(placement, kv_tokens=16 + calibrate_engine.STEPS)

    monkeypatch.setattr(calibrate_engine, "_decode_seconds", made)
    shape = synth.SynthShape("calibration", "qwen3moe", 2, 256, 4, 2, 64, 32, 4, 256, 256, qk_norm=True)
    fitted, info = calibrate_engine.fit_kept_rates(base, shape, device="cpu", formats=("q8_0",))
    assert fitted.gpus[0].expert_throughput["q8_0"] == pytest.approx(truth_gpu, rel=1e-3)
    assert fitted.cpu_expert_throughput["q8_0"] == info["q8_0"]["cpu_rate"] == pytest.approx(truth_cpu, rel=0.01)
    assert info["q8_0"]["cpu_measured_rate"] == 6e10 and len(info["q8_0"]["hybrid_s"]) == 2
    n = calibrate_engine.REPEATS
    assert len(seen) == 3 * n  # the resident run and the two with experts on the CPU, each REPEATS times
    assert fitted.cpu_expert_throughput["bf16"] == base.cpu_expert_throughput["bf16"]  # the others as they were


def test_a_kept_formats_cpu_rate_stays_within_the_hosts_ram_read(monkeypatch):
    """Runs that a CPU faster than the host's RAM read would fit best, and a kernel figure above it
    too (caches flatter a small timing), give the RAM's rate: experts come from RAM no faster."""
    from workbench.core import synth
    from workbench.core.costmodel import CostModel, EngineShape

    base = preset("bench-h200")  # host RAM read 88 GB/s
    base = replace(base, gpus=(replace(base.gpus[0], expert_throughput={"q8_0": 1.5e12}),),
                   cpu_expert_throughput={**base.cpu_expert_throughput, "q8_0": 2e11})
    truth = replace(base, cpu_expert_throughput={**base.cpu_expert_throughput, "q8_0": 3e11})

    def made(inv, placement, device, steps=0, packets=None):
        return 1.0 / CostModel(inv, truth, engine=EngineShape(bus_share=0.0)).decode_tps(
            placement, kv_tokens=16 + calibrate_engine.STEPS)

    monkeypatch.setattr(calibrate_engine, "_decode_seconds", made)
    shape = synth.SynthShape("calibration", "qwen3moe", 2, 256, 4, 2, 64, 32, 4, 256, 256, qk_norm=True)
    fitted, info = calibrate_engine.fit_kept_rates(base, shape, device="cpu", formats=("q8_0",))
    assert fitted.cpu_expert_throughput["q8_0"] == info["q8_0"]["cpu_rate"] == base.host_read_bandwidth


def test_the_decode_fit_takes_the_kernel_cost_and_host_step_from_the_two_depths(monkeypatch):
    real = calibrate_engine._decode_times
    monkeypatch.setattr(calibrate_engine, "_decode_times", lambda inv, p, device, steps=4, packets=None: real(inv, p, device, 4, packets))
    monkeypatch.setattr(calibrate_engine, "VOCAB", 256)
    monkeypatch.setattr(calibrate_engine, "MAX_EXPERTS", 32)
    deep = {"depths": (16, 32), "resident_s": [1e-3, 2e-3], "launch_s": 2.5e-6, "step_s": 1.5e-4}
    monkeypatch.setattr(calibrate_engine, "_deep_resident_fit", lambda *a: deep)
    wide = {"experts": 32, "depth": 16, "wide_s": 1.2e-3, "narrow_s": 1e-3, "route_s_per_expert": 5e-8}
    monkeypatch.setattr(calibrate_engine, "_wide_fit", lambda *a: wide)
    fitted, info = calibrate_engine.fit_engine_costs(preset("bench-h200"), 64, 32, 2, n_heads=4, n_kv_heads=2,
                                                     head_dim=16, device="cpu")
    assert fitted.gpus[0].launch_s == info["launch_s"] == 2.5e-6
    assert fitted.decode_step_s == info["step_s"] == 1.5e-4 and info["deep"] is deep
    assert fitted.gpus[0].route_s_per_expert == 5e-8 and info["wide"] is wide  # before the host point's fit


def test_the_cpu_lead_is_the_time_outside_the_cpus_run_of_layers_that_waited_for_it():
    from workbench.engine.hostclock import HostLayer

    def layer(busy, wait, cpu_wait, run, share=True, first=False):
        return HostLayer(1, busy, wait, cpu_wait, 0, 0, 0, share, first, cpu_run_s=run)

    records = [layer(2e-3, 1e-4, 5e-3, 6e-3), layer(2.5e-3, 0.0, 4e-3, 5e-3),  # 1.1 and 1.5 ms outside the run
               layer(3e-3, 0.0, 0.0, 2e-3),  # did not wait: the host was the long lane
               layer(9e-3, 0.0, 5e-3, 6e-3, first=True), layer(2e-3, 0.0, 0.0, 0.0, share=False),
               layer(2e-3, 0.0, 4e-3, 4.7e-3)]  # 1.3 ms
    assert calibrate_engine.cpu_lead(records) == pytest.approx(1.3e-3)
    assert calibrate_engine.cpu_lead(records[2:5]) is None


def test_the_prompt_refit_reports_the_time_outside_the_cpus_run(monkeypatch):
    from workbench.engine import calibrate

    base = preset("bench-h200")
    fit = {"runs": [{"name": "all on the CPU", "tokens": 512, "measured_s": 0.178, "predicted_s": 0.18}],
           "host_lane": dict.fromkeys(calibrate_engine.HOST_LANE, 1e-4), "host_layers": 12, "prompt_sync_s": 0.0,
           "prompt_cpu_sync_s": 1.9e-3, "cpu_lead_s": 2.6e-3, "prompt_cpu_scale": 1.2, "prompt_h2d": 5e10,
           "prompt_resident_layer_s": 1.4e-3, "prompt_resident_layer_by_format": {}}
    fitted = replace(base, prompt_cpu_sync_s=1.9e-3)
    monkeypatch.setattr(calibrate_engine, "fit_prompt_costs", lambda *a, **k: (fitted, fit))
    said = []
    out = calibrate.refit_prompt(base, 2048, 768, 8, said.append)
    assert out.prompt_cpu_sync_s == 1.9e-3 and out.provenance["prompt_cpu_sync_s"] == "fitted to the engine"
    assert "+1900 us with a CPU share (outside the CPU's run: 2600 us)" in said[0]


def test_the_servers_packets_give_a_fixed_cost_and_the_rate_of_one_tokens_experts():
    """Packets of 1, 2 and 3 pairs at 20 µs plus 50 µs a pair (5 MB experts: 100 GB/s), one of them
    held up 5 ms, empty ones and a count seen too seldom (7 pairs) left out; one pair count alone, or
    none, pins nothing."""
    counts = [1, 2, 3, 0] * 5 + [7, 7]
    rows = [[0, s, 1_000_000 * s, 1_000_000 * s + 20_000 + 50_000 * n + (1 if n < 7 else 3) * 1000, n]
            for s, n in enumerate(counts)]
    rows[0][3] += 5_000_000
    fixed, rate = calibrate_engine.packet_rate(np.array(rows, dtype=np.int64), 5e6)
    assert fixed == pytest.approx(21e-6) and rate == pytest.approx(1e11)
    one = np.array([r for r in rows if r[4] in (0, 2)], dtype=np.int64)
    assert calibrate_engine.packet_rate(one, 5e6) is None
    assert calibrate_engine.packet_rate(np.zeros((0, 5), dtype=np.int64), 5e6) is None


def test_the_host_point_alone_is_fitted_to_runs_made_with_a_known_one(monkeypatch):
    """Runs the model makes at a host point of 300 µs (above what the tiny layers' GPU lane hides),
    the CPU's rate given: the one-value fit gives 300 µs back; runs faster than any host point
    allows give 0."""
    from workbench.core import synth
    from workbench.core.costmodel import EngineShape

    shape = synth.SynthShape("calibration", "qwen3moe", 8, 64, 4, 2, 16, 32, 2, 32, 256, qk_norm=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "c.gguf"
        synth.write_gguf(path, shape, coverage_target=None, sparse=True)
        inv = open_model(path)
        runs_at = [calibrate_engine._upper_on_cpu(inv, share) for share in calibrate_engine.HYBRID_SHARES]
    base = preset("bench-h200")

    def model(placement, sync):
        return 1.0 / CostModel(inv, replace(base, sync_s=sync), engine=EngineShape(bus_share=0.0)).decode_tps(
            placement, kv_tokens=16 + calibrate_engine.STEPS)

    runs = [(p, model(p, 300e-6)) for p in runs_at]
    assert model(runs_at[0], 300e-6) > model(runs_at[0], 0.0)
    assert calibrate_engine._fit_sync(model, runs) == pytest.approx(300e-6, rel=1e-3)
    fast = [(p, 0.5 * model(p, 0.0)) for p in runs_at]
    assert calibrate_engine._fit_sync(model, fast) == 0.0


def test_a_kept_formats_hand_off_is_fitted_to_its_runs_where_the_server_traced_them(monkeypatch):
    """Runs made by the model with a Q8_0 hand-off of 70 µs (bf16's stays 50) and packets traced at
    10 µs plus 5 MB a pair at 90 GB/s: the Q8_0 CPU rate is the packets', its hand-off 70 µs back."""
    from workbench.core import synth
    from workbench.core.costmodel import EngineShape

    base = preset("bench-h200")
    base = replace(base, sync_s=5e-5, gpus=(replace(base.gpus[0], expert_throughput={"q8_0": 1.5e12}),),
                   cpu_expert_throughput={**base.cpu_expert_throughput, "q8_0": 6e10})
    truth = replace(base, sync_by_format={"q8_0": 7e-4}, cpu_expert_throughput={**base.cpu_expert_throughput,
                                                                                "q8_0": 9e10})
    per_pair = 5e6 / 9e10

    def made(inv, placement, device, steps=0, packets=None):
        if packets is not None:
            packets.append(np.array([[0, s, 10 ** 6 * s, 10 ** 6 * s + int(1e9 * (1e-5 + n * per_pair)), n]
                                     for s, n in enumerate([1, 2, 3] * 5)], dtype=np.int64))
        return 1.0 / CostModel(inv, truth, engine=EngineShape(bus_share=0.0)).decode_tps(
            placement, kv_tokens=16 + calibrate_engine.STEPS)

    monkeypatch.setattr(calibrate_engine, "_decode_seconds", made)
    monkeypatch.setattr(calibrate_engine, "packet_rate",
                        lambda rec, nbytes, real=calibrate_engine.packet_rate: real(rec, 5e6))
    shape = synth.SynthShape("calibration", "qwen3moe", 2, 256, 4, 2, 64, 32, 4, 256, 256, qk_norm=True)
    fitted, info = calibrate_engine.fit_kept_rates(base, shape, device="cpu", formats=("q8_0",))
    assert fitted.cpu_expert_throughput["q8_0"] == pytest.approx(9e10, rel=1e-3)
    assert info["q8_0"]["packet_fixed_s"] == pytest.approx(1e-5, rel=1e-3)
    assert fitted.sync_by_format["q8_0"] == pytest.approx(7e-4, rel=1e-3) and fitted.sync_s == 5e-5
