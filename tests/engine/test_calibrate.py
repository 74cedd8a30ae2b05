"""Calibration on the CPU with a tiny expert shape and a short time budget."""

import json
import math
import threading
import time

import pytest
import torch

from workbench.cli import main
from workbench.core.errors import WorkbenchError
from workbench.core.hardware import HardwareProfile
from workbench.engine import cpu_formats, cpu_kernel
from workbench.engine.calibrate import CalibrationCancelled, calibrate, format_table

HIDDEN, FFN = 64, 32


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_cpu_calibration_in_budget_with_progress():
    seen = []
    t = time.perf_counter()
    prof = calibrate(
        HIDDEN,
        FFN,
        budget_s=1.5,
        progress=lambda f, m: seen.append((f, m)),
        weight_bytes=4 << 20,
        use_cuda=False,
    )
    wall = time.perf_counter() - t
    assert wall < 6.0  # 1.5 s budget; generous for a shared 2-core machine
    prof.validate()
    fractions = [f for f, _ in seen]
    assert fractions == sorted(fractions) and fractions[0] == 0.0 and fractions[-1] == 1.0
    assert any("host RAM read" in m for _, m in seen) and seen[-1][1].startswith("done")
    expected = set(format_table())
    assert {"bf16", "f32"} <= expected
    if "int8" in expected and cpu_kernel.available() and HIDDEN % 32 == 0 and FFN % 32 == 0:
        expected.add("q8_0")  # GGUF Q8_0 experts, timed with the fused Q8_0 kernel
    if "int4" in expected and cpu_kernel.available() and HIDDEN % 256 == 0 and FFN % 256 == 0:
        expected.add("q4_k")
    assert set(prof.cpu_expert_throughput) == expected
    assert all(v > 1e6 for v in prof.cpu_expert_throughput.values())
    assert prof.host_read_bandwidth > 1e8 and prof.cpu_flops > 1e7
    assert prof.gpus == () and math.isnan(prof.h2d_pinned)
    assert prof.provenance["h2d_pinned"] == "absent" and prof.provenance["host_read_bandwidth"] == "measured"
    assert "no CUDA here" in prof.source and f"{HIDDEN} x {FFN}" in prof.source
    back = HardwareProfile.from_json(json.loads(json.dumps(prof.to_json(), allow_nan=False)))
    assert back.to_json() == prof.to_json()


def test_preset_supplies_the_gpu_side_without_cuda():
    prof = calibrate(
        HIDDEN,
        FFN,
        budget_s=0.6,
        preset="rtx4090+ddr5-2ch",
        formats=["bf16"],
        weight_bytes=1 << 20,
        use_cuda=False,
    )
    assert list(prof.cpu_expert_throughput) == ["bf16"]
    assert prof.gpus[0].name == "NVIDIA GeForce RTX 4090" and prof.h2d_pinned > 1e10
    assert (
        prof.provenance["gpus"] == "preset:rtx4090+ddr5-2ch"
        and prof.provenance["cpu_expert_throughput"] == "measured"
    )
    assert prof.host_ram_bytes < 2**50 and prof.name.startswith("NVIDIA GeForce RTX 4090 + ")


def test_cancel_stops_quickly():
    stop = threading.Event()
    timer = threading.Timer(0.3, stop.set)
    timer.start()
    t = time.perf_counter()
    with pytest.raises(CalibrationCancelled):
        calibrate(HIDDEN, FFN, budget_s=20, cancel=stop, weight_bytes=1 << 20, use_cuda=False)
    assert time.perf_counter() - t < 2.0
    timer.join()
    with pytest.raises(CalibrationCancelled):  # a callable works too
        calibrate(HIDDEN, FFN, budget_s=20, cancel=lambda: True, weight_bytes=1 << 20, use_cuda=False)


def test_bad_arguments():
    with pytest.raises(WorkbenchError, match="unknown CPU weight format"):
        calibrate(HIDDEN, FFN, formats=["fp3"], use_cuda=False)
    with pytest.raises(WorkbenchError, match="unknown kept format"):
        calibrate(HIDDEN, FFN, kquants=("q4_k", "q1_k"), use_cuda=False)
    with pytest.raises(WorkbenchError, match="positive"):
        calibrate(0, FFN, use_cuda=False)


def test_measures_the_engines_own_kernels():
    table = format_table()
    assert list(table) == cpu_formats.available_formats()
    w = torch.randn(64, 128).to(torch.bfloat16)
    for name, fmt in table.items():
        packed = fmt.pack(w)
        assert isinstance(packed, cpu_formats.PackedLinear) and packed.fmt == name
        assert fmt.supports(64, 128) == cpu_formats.supports(name, 64, 128)


def test_cli_json_and_output_file(tmp_path, capsys):
    out = tmp_path / "hw.json"
    rc = main(
        [
            "calibrate",
            "--json",
            "--hidden",
            str(HIDDEN),
            "--ffn",
            str(FFN),
            "--budget",
            "0.6",
            "--formats",
            "bf16,f32",
            "--cpu-only",
            "-o",
            str(out),
        ]
    )
    assert rc == 0
    printed = json.loads(capsys.readouterr().out)
    assert set(printed["cpu_expert_throughput"]) == {"bf16", "f32"}
    assert HardwareProfile.load(out).to_json() == printed
    assert main(["calibrate", "--hidden", "0"]) == 2
    assert "out of range" in capsys.readouterr().err
    assert main(["calibrate", "--kept-fits", "q5_k", "--cpu-only"]) == 2
    assert "--kept-fits takes q8_0, q4_k or none" in capsys.readouterr().err


def test_cli_takes_the_expert_shape_from_a_model(tiny_model_dir, capsys):
    from workbench.core.readers import open_model

    path = tiny_model_dir("qwen3_moe")
    spec = open_model(path).spec
    rc = main(["calibrate", "--model", str(path), "--json", "--budget", "0.5", "--formats", "bf16", "--cpu-only"])
    assert rc == 0
    prof = json.loads(capsys.readouterr().out)
    assert f"expert {spec.hidden_size} x {spec.expert_ffn}" in prof["source"]
    assert main(["calibrate", "--model", str(path / "missing")]) == 2


def test_cli_refits_the_prompt_only_on_cuda(tmp_path, capsys, monkeypatch):
    """``--refit-prompt`` times the engine's prompts: without CUDA it says so (exit 2), and a missing
    profile is named."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    prof = tmp_path / "p.json"
    from workbench.core.hardware import preset

    preset("bench-h200").save(prof)
    assert main(["calibrate", "--refit-prompt", str(prof)]) == 2
    assert "no CUDA GPU here" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert main(["calibrate", "--refit-prompt", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err


@pytest.mark.skipif(not cpu_kernel.available(), reason="the fused CPU kernel does not build here")
def test_kept_quant_formats_are_timed_with_their_fused_kernels():
    """Q8_0 and Q4_K experts (kept as blocks by the engine) get their own CPU rates for the cost model,
    and so do the other kept formats asked for (``kquants``: k-quants, IQ4_XS, MXFP4); the rest are rated as Q4_K."""
    prof = calibrate(256, 256, budget_s=2.0, weight_bytes=4 << 20, use_cuda=False, formats=["bf16", "int8", "int4"],
                     kquants=("q4_k", "q3_k", "iq4_xs", "mxfp4"))
    for fmt in ("q8_0", "q4_k", "q3_k", "iq4_xs", "mxfp4"):
        if fmt == "q8_0" and "int8" not in format_table() or fmt != "q8_0" and "int4" not in format_table():
            continue
        assert prof.cpu_expert_throughput[fmt] > 1e6 and prof.cpu_prompt_flops[fmt] > 1e6, fmt
    assert "q2_k" not in prof.cpu_expert_throughput


def test_a_prompts_further_tokens_per_expert_are_timed_on_each_fused_kernel():
    """``cpu_prompt_flops``: what the fused kernels do with a prompt's further tokens per expert,
    beyond the expert's read; the engine's prompt split reads it through the cost model."""
    from workbench.core.costmodel import prompt_pair_reads

    if not cpu_kernel.available():
        pytest.skip("no fused CPU kernel here")
    prof = calibrate(256, 256, budget_s=2.0, weight_bytes=4 << 20, use_cuda=False, formats=["bf16", "int8", "int4"])
    prof.validate()
    expect = {"bf16"} | ({"q8_0"} if "int8" in format_table() else set()) | ({"q4_k"} if "int4" in format_table()
                                                                            else set())
    assert set(prof.cpu_prompt_flops) == expect and prof.provenance["cpu_prompt_flops"] == "measured"
    for fmt, flops in prof.cpu_prompt_flops.items():
        assert 1e8 < flops <= 1e15, fmt
        bytes_per = {"bf16": 2, "q8_0": 34 / 32, "q4_k": 144 / 256}[fmt]
        pair = prompt_pair_reads(prof, fmt.upper(), 3 * 256 * 256, 3 * 256 * 256 * bytes_per)
        assert pair is not None and pair > 0
    back = HardwareProfile.from_json(json.loads(json.dumps(prof.to_json())))
    assert back.cpu_prompt_flops == prof.cpu_prompt_flops
    assert HardwareProfile.from_json({**prof.to_json(), "cpu_prompt_flops": None}).cpu_prompt_flops == {}


def test_the_host_read_buffer_is_larger_than_the_caches():
    """The L3 size comes from /sys, every instance once; the host read uses eight times that at least."""
    from workbench.engine.calibrate import l3_bytes

    l3 = l3_bytes()
    assert l3 >= 0
    if l3:
        assert 1 << 20 <= l3 <= 16 << 30  # a plausible last-level cache


@pytest.mark.parametrize("l3", [0, 1 << 40])
def test_the_host_read_is_at_least_what_the_fused_kernel_read_from_ram(monkeypatch, l3):
    """A sum that read slowly this time (1 MB/s here) does not pull the RAM figure below the fused
    kernel's own read of a pool larger than the caches; a pool the caches could hold proves nothing."""
    from workbench.engine import calibrate as cal

    if not cpu_kernel.available():
        pytest.skip("no fused CPU kernel here")
    monkeypatch.setattr(cal, "_host_read", lambda run, nbytes: 1e6)
    monkeypatch.setattr(cal, "l3_bytes", lambda: l3)
    prof = calibrate(HIDDEN, FFN, budget_s=0.6, formats=["bf16"], weight_bytes=1 << 20, use_cuda=False)
    fused = prof.cpu_expert_throughput["bf16"]
    assert fused > 1e7
    if l3 == 0:  # no cache to flatter the pool
        assert prof.host_read_bandwidth == pytest.approx(fused)
    else:
        assert prof.host_read_bandwidth == 1e6


def test_repeat_gives_the_median_or_the_fastest_call():
    """The host read takes the fastest pass (``best``); other steps the median of the calls' own times."""
    from workbench.engine.calibrate import _repeat, _Run

    run = _Run(10.0, None, None, [("host", 1.0)])
    times = iter([0.5, 0.1, 0.3, 0.9, 0.2])
    assert _repeat(run, lambda: next(times), 0.0, min_reps=5) == 0.3
    times = iter([0.5, 0.1, 0.3, 0.9, 0.2])
    assert _repeat(run, lambda: next(times), 0.0, min_reps=5, best=True) == 0.1


def test_the_profile_text_shows_the_prompt_rates_when_measured():
    import dataclasses

    from workbench.commands.calibrate import format_profile
    from workbench.core.hardware import preset

    base = preset("bench-h200")
    assert "in a prompt" not in format_profile(dataclasses.replace(base, cpu_prompt_flops={}))
    text = format_profile(dataclasses.replace(base, cpu_prompt_flops={"bf16": 2.5e11, "q8_0": 1.2e11},
                                              provenance={**base.provenance, "cpu_prompt_flops": "measured"}))
    assert "in a prompt (each further token per expert, FLOP/s): bf16 250 G; q8_0 120 G;  [measured]" in text


@pytest.mark.parametrize("fmt", ["bf16", "q8_0", "q4_k"])
def test_the_stack_server_computes_what_the_fused_kernel_computes(fmt):
    """``served.StackServer`` (calibration's way onto the decode server's team) gives one token's
    experts as the fused kernel called here does, for fewer selections than its packet holds too."""
    from workbench.engine.calibrate import random_stacks, run_fused
    from workbench.engine.served import StackServer

    if not cpu_kernel.available():
        pytest.skip("no fused CPU kernel here")
    stacks = random_stacks(fmt, 6, 256, 256)
    x = torch.randn(256, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with StackServer(fmt, stacks, 256, 256, k=4, threads=2) as srv:
        for rows, weights in (([4, 0, 5, 1], [0.4, 0.3, 0.2, 0.1]), ([3], [1.0])):
            got = srv(x, rows, weights).clone()
            want = run_fused(fmt, stacks, x, torch.tensor(rows), torch.tensor(weights))
            assert got.abs().sum() > 0
            torch.testing.assert_close(got, want.reshape(-1).float(), rtol=1e-5, atol=1e-6)


def test_the_decode_rate_is_timed_on_the_decode_servers_team_when_asked(monkeypatch):
    """With ``served`` (calibration on a GPU machine) a fused kernel's decode rate comes from packets
    through ``served.StackServer``; the prompt's rate still from the kernel called here."""
    from workbench.engine import served
    from workbench.engine.calibrate import _cpu_fused_q8, _Run

    if not cpu_kernel.available():
        pytest.skip("no fused CPU kernel here")
    packets = []
    real_call = served.StackServer.__call__
    monkeypatch.setattr(served.StackServer, "__call__", lambda self, *a: packets.append(a[1]) or real_call(self, *a))
    run = _Run(4.0, None, None, [("cpu:int8", 1.0)])
    rate, flops = _cpu_fused_q8(run, "cpu:int8", 256, 256, 4, 4 << 20, served=True)
    assert packets and all(len(list(r)) == 4 for r in packets)
    assert rate > 1e6 and flops > 1e6
    packets.clear()
    rate, flops = _cpu_fused_q8(run, "cpu:int8", 256, 256, 4, 4 << 20, served=False)
    assert not packets and rate > 1e6


def test_a_decode_server_that_fails_leaves_the_pools_timing(monkeypatch, caplog):
    """Calibration goes on when the decode server's team cannot time a kernel: one warning, the
    rate from torch's pool."""
    from workbench.engine import served
    from workbench.engine.calibrate import _cpu_fused_q8, _Run

    if not cpu_kernel.available():
        pytest.skip("no fused CPU kernel here")

    def broken(self, *a):
        raise RuntimeError("the decode server gave no result in 10 s")

    monkeypatch.setattr(served.StackServer, "__call__", broken)
    run = _Run(2.0, None, None, [("cpu:int8", 1.0)])
    with caplog.at_level("WARNING"):
        rate, flops = _cpu_fused_q8(run, "cpu:int8", 256, 256, 4, 4 << 20, served=True)
    assert rate > 1e6 and flops > 1e6
    assert sum("gave no timing" in r.message for r in caplog.records) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the bus's in-place reads need CUDA")
def test_the_bus_reads_experts_in_place_at_most_at_the_copy_rate():
    """The bus share's kernels read page-locked host experts in place at a rate of PCIe's order:
    positive, below the GPU's own memory and at most a little above the pinned copy rate."""
    from workbench.engine import calibrate as cal
    from workbench.engine import gpu_kernels

    if not gpu_kernels.available():
        pytest.skip("no Triton kernels")
    run = cal._Run(2.0, None, None, [("gpu0", 1.0)])
    dev = torch.device("cuda", 0)
    rate = cal._gpu_bus_read(run, dev, 2048, 768, 256 << 20, 0.2)
    h2d, _, _ = cal._gpu_copies(run, dev, 64 << 20, 0.2)
    assert 0.2 * h2d < rate < 1.5 * h2d


def test_the_gpu_timings_random_q4k_blocks_decode_to_finite_values():
    """Random bytes as Q4_K blocks hold NaN or infinite scales in about one block of 16, and the
    kernels' check then leaves every candidate unchecked; the timing's blocks get finite scales and
    keep their random values."""
    from workbench.engine import blocks
    from workbench.engine.calibrate import finite_q4k

    g = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (4, 64, 2 * 144), generator=g, dtype=torch.uint8)
    before = blocks.dequantize("q4_k", [raw.reshape(-1, 2 * 144)], 512, torch.float32)
    assert not torch.isfinite(before).all()  # the seed gives non-finite scales, as random bytes do
    kept = raw.clone()
    out = finite_q4k(raw)
    assert out is raw
    values = blocks.dequantize("q4_k", [raw.reshape(-1, 2 * 144)], 512, torch.float32)
    assert torch.isfinite(values).all() and values.abs().max() > 0
    assert torch.equal(raw.view(4, 64, 2, 144)[..., 4:], kept.view(4, 64, 2, 144)[..., 4:])
