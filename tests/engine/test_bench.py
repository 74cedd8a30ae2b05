"""The benchmark runner end to end on CPU with a tiny synthetic model."""

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from workbench.cli import main
from workbench.core import synth
from workbench.core.hardware import preset
from workbench.core.memory import CUDA_CONTEXT_BYTES
from workbench.core.placement import CPU_COMPUTE
from workbench.core.project import load_project
from workbench.core.readers import open_model
from workbench.engine import bench, bench_llamacpp
from workbench.engine.bench_measure import PeakSampler, markdown_table

TINY = synth.shape("tiny")
BUDGET_MIB = (CUDA_CONTEXT_BYTES >> 20) + 9
"""A budget that leaves the tiny model's routed experts partly on the CPU: the CUDA context's
allowance plus 9 MiB."""


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "tiny.gguf"
    synth.write_gguf(path, TINY, coverage_target=0.5)
    return path


def test_strategies_run_end_to_end_on_cpu(model, one_torch_thread, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the engine's PyTorch paths, not its kernels interpreted
    runs = bench.run_strategies(str(model), ["n-cpu-moe", "frequency"], budget_bytes=BUDGET_MIB * 2**20,
                                profile=preset("bench-h200"), device="cpu", dtype=torch.float32,
                                prompt=16, gen=4, repeats=2, all_gpu=True)
    assert [r.strategy for r in runs] == ["all-gpu", "n-cpu-moe", "frequency"]
    for r in runs:
        assert r.ok, r.error
        assert len(r.decode_samples) == 2 and r.decode_tps > 0 and r.prefill_tps > 0 and 0 < r.ttft_s
        assert len(r.prefill_samples) == len(r.ttft_samples) == bench.PROMPT_SAMPLES  # prompts alone after the repeats
        assert r.predicted_decode_tps > 0 and r.roofline_decode_tps > 0 and r.roofline_fraction > 0
        assert r.peak_host_bytes > 0
        # the RAM speed read just before the run, and a second prediction at it
        assert r.host_read_gbs > 0 and r.at_read_decode_tps > 0
        # routing measured by the engine follows the file's design (top 10% serve ~50%)
        assert np.mean(r.coverage) == pytest.approx(0.5, abs=0.2)
    nmoe = runs[1]
    assert nmoe.label.startswith("n-cpu-moe ") and nmoe.roofline["cpu_bytes"] > 0
    # the engine thread's records of the timed prompts' layers that need the host (on a CPU
    # accelerator every MoE layer does), a forward's first left out
    host = nmoe.prompt_host
    assert host["layers"] > 0 and host["busy_ms"] > 0 and host["cpu_share"] > 0
    assert host["cpu_run_ms"] >= host["cpu_wait_ms"] >= 0
    # beside them, the model's lanes of the same layers: hybrid ones (CPU-tier experts) and the others
    lanes = host["predicted_lanes_ms"]
    assert lanes["hybrid"]["layers"] + lanes["resident"]["layers"] == len(nmoe.engine_paths["tiers"])
    assert lanes["hybrid"]["layers"] > 0 and lanes["hybrid"]["cpu"] > 0
    assert lanes["hybrid"]["total"] >= max(lanes["hybrid"][k] for k in ("cpu", "bus", "gpu", "host"))
    # and the model's decode lanes (µs): a hybrid layer's mean total is its lanes, hand-off and spread
    dec = nmoe.predicted_decode_lanes_us
    assert dec["hybrid"]["layers"] + dec["resident"]["layers"] == len(nmoe.engine_paths["tiers"])
    h = dec["hybrid"]
    assert h["total"] >= (h["pre"] + max(h["gpu"], h["cpu"], h["bus"]) + h["sync"] + h["spread"]) * (1 - 1e-9)
    assert dec["other"] > 0 and 1e6 / nmoe.predicted_decode_tps == pytest.approx(
        h["total"] * h["layers"] + dec["resident"]["total"] * dec["resident"]["layers"] + dec["other"], rel=1e-6)
    # the frequency plan saw the n-cpu-moe run's routing counts: it keeps hot experts off the CPU
    assert runs[2].roofline["cpu_bytes"] < nmoe.roofline["cpu_bytes"]
    # the first runs were planned before any routing was seen: predicted again with their own counts
    # (skewed: the hot experts' tokens share one read, so the prompt comes out faster than uniform)
    for r in runs[:1]:
        assert r.predicted_from.startswith("routing counts of this run")
        assert r.uniform_prefill_tps > 0 and r.predicted_prefill_tps != r.uniform_prefill_tps
    assert runs[2].predicted_from.startswith("routing counts of the runs before") and runs[2].uniform_prefill_tps is None


def test_cli_writes_json_and_table(model, tmp_path, capsys):
    out = tmp_path / "run.json"
    rc = main(["bench", "run", "--model", str(model), "--device", "cpu", "--dtype", "f32", "--budget", f"{BUDGET_MIB}MiB",
               "--strategies", "n-cpu-moe", "-p", "8", "-n", "2", "-r", "1", "--json", str(out),
               "--save-placements", str(tmp_path / "placements")])
    assert rc == 0
    d = json.loads(out.read_text())
    saved = load_project(tmp_path / "placements" / "n-cpu-moe.json").placement  # what the run ran
    on_cpu = {str(k.layer) for k in open_model(str(model)).expert_keys() if saved.get(k) == CPU_COMPUTE}
    assert on_cpu == {layer for layer, t in d["runs"][0]["engine_paths"]["tiers"].items() if t[1]}
    assert d["runs"][0]["decode_tps"] > 0 and d["runs"][0]["prediction_error"] is not None
    r0 = d["runs"][0]  # the prompt's prediction is checked as the decode's is
    assert r0["prefill_prediction_error"] == pytest.approx(
        (r0["predicted_prefill_tps"] - r0["prefill_tps"]) / r0["prefill_tps"])
    paths = d["runs"][0]["engine_paths"]
    assert paths["bus_experts"] == 0 and paths["kept"] == {}  # bf16 file, no GPU: neither
    assert paths["cpu_huge_pages"] is not None and 0 <= paths["cpu_huge_pages"] <= 1  # the run has a CPU tier
    assert paths["dropped_candidates"] == []  # kernel candidates the run's checks found wrong: none here
    tiers = paths["tiers"]  # n-cpu-moe: whole layers' experts on the CPU, the others resident
    assert all(t[2] == 0 and 0 in t[:2] for t in tiers.values()) and any(t[1] for t in tiers.values())
    cpu_layers = {layer for layer, t in tiers.items() if t[1]}
    assert set(paths["cpu_selected"]) == cpu_layers  # each selects top_k CPU experts per token there
    top_k = open_model(str(model)).spec.n_experts_active
    assert all(v == pytest.approx(top_k) for v in paths["cpu_selected"].values())
    table = capsys.readouterr().out
    assert "| placement |" in table and "| predicted prefill | prefill error % |" in table


def test_run_reports_a_placement_that_does_not_fit(model):
    runs = bench.run_strategies(str(model), ["n-cpu-moe"], budget_bytes=10 * 2**20, profile=preset("bench-h200"),
                                device="cpu", dtype=torch.float32, prompt=8, gen=2, repeats=1)
    assert not runs[0].ok and "budget" in runs[0].error


def test_write_and_cpu_formats_commands(tmp_path, capsys):
    out = tmp_path / "m.gguf"
    assert main(["bench", "write", "-o", str(out), "--shape", "tiny", "--layers", "1"]) == 0
    assert out.stat().st_size > 0 and "top 10% experts serve" in capsys.readouterr().out
    assert main(["bench", "reskew", str(out), "--uniform"]) == 0
    js = tmp_path / "cf.json"
    assert main(["bench", "cpu-formats", "--shape", "tiny", "--formats", "int8,bf16", "--experts", "8",
                 "--threads", "2", "--pool", "1,2", "--json", str(js)]) == 0
    rows = json.loads(js.read_text())["rows"]
    assert [r["format"] for r in rows] == ["int8"] * 4 + ["bf16"] * 4 and all(r["gbps"] > 0 for r in rows)
    assert rows[3]["matrix"] == "2 experts, 2 x 1 threads"  # the tiny shape picks 2
    assert torch.get_num_threads() == 2


def test_peak_sampler_sees_host_memory_grow():
    with PeakSampler(interval=0.005) as s:
        base = s.peaks.host_rss
        a = np.ones(64 * 2**20 // 8)  # 64 MiB, touched
        s.sample()
        del a
    assert s.peaks.host_rss >= base + 48 * 2**20 and s.peaks.samples >= 2


def test_ot_variants_match_the_intended_tensors():
    names = [t.name for t in synth.tensor_list(synth.shape("s1"))]
    for cfg, expect in zip(bench_llamacpp.ot_variants(16), ({"up", "down"}, {"down"})):
        pats = [p.split("=")[0] for p in cfg.args[cfg.args.index("-ot") + 1].split(";")]
        hit = [n for n in names if any(re.search(p, n) for p in pats)]
        full = {n for n in hit if int(n.split(".")[1]) < 15}
        assert len(full) == 15 * 3 and all("_exps" in n for n in hit)
        part = {n.split(".")[2].split("_")[1] for n in hit if n.startswith("blk.15.")}
        assert part == expect
        assert not any(n.startswith(("blk.16.", "blk.1.ffn_gate_inp")) for n in hit)


def test_markdown_and_llama_output_parsing():
    t = markdown_table([{"a": 1.23456, "b": None, "c": 12345.6}], [("A", "a"), ("B", "b"), ("C", "c")])
    assert t.splitlines()[2] == "| 1.23 | – | 12,345.6 |"
    raw = 'load log\n[{"n_prompt": 512, "n_gen": 0, "avg_ts": 200.0}]\n'
    assert bench_llamacpp.parse_output(raw)[0]["avg_ts"] == 200.0


LLAMA_BENCH = Path(os.environ.get("WORKBENCH_LLAMA_BENCH", ".llamacpp/bin-cpu/llama-bench"))


@pytest.mark.skipif(not LLAMA_BENCH.is_file() and not shutil.which(str(LLAMA_BENCH)),
                    reason="no llama-bench build (scripts/build_llamacpp.sh cpu)")
def test_llama_bench_runs_our_file(model):
    cfgs = [bench_llamacpp.n_cpu_moe(1), *bench_llamacpp.ot_variants(2)]
    res = bench_llamacpp.run_configs(LLAMA_BENCH, model, cfgs, prompt=16, gen=4, repeats=1, threads=1)
    for r in res:
        assert r.ok, r.error
        assert r.prefill_tps > 0 and r.decode_tps > 0 and r.peak_host_bytes > 0


def test_compare_picks_the_best_within_budget_on_both_sides():
    gib = 2**30
    ours = [bench.EngineRun("all-gpu", "all-gpu", ok=True, decode_tps=300.0, prefill_tps=5000.0, peak_gpu_bytes=30 * gib),
            bench.EngineRun("n-cpu-moe 16", "n-cpu-moe", ok=True, decode_tps=40.0, prefill_tps=200.0,
                            peak_gpu_bytes=11 * gib),
            bench.EngineRun("frequency", "frequency", ok=True, decode_tps=90.0, prefill_tps=400.0,
                            peak_gpu_bytes=13 * gib)]  # faster but over the budget: not counted
    llama = [bench_llamacpp.LlamaResult("--n-cpu-moe 16", ["-ngl", "99", "--n-cpu-moe", "16"], ok=True,
                                        decode_tps=45.0, prefill_tps=210.0, peak_gpu_bytes=11.6 * gib),
             bench_llamacpp.LlamaResult("--n-cpu-moe 14", ["-ngl", "99", "--n-cpu-moe", "14"], ok=True,
                                        decode_tps=62.0, prefill_tps=255.0, peak_gpu_bytes=13.9 * gib),
             bench_llamacpp.LlamaResult("all on GPU", ["-ngl", "99"], ok=True, decode_tps=400.0,
                                        prefill_tps=7000.0, peak_gpu_bytes=29.5 * gib)]
    r = bench.compare(ours, llama, 12 * gib)
    assert r["ours"] == "n-cpu-moe 16" and r["llama.cpp"] == "--n-cpu-moe 16"
    assert r["decode_ratio"] == pytest.approx(40 / 45) and r["prefill_ratio"] == pytest.approx(200 / 210)
    assert r["all_gpu_decode_ratio"] == pytest.approx(0.75)


@pytest.mark.skipif(not LLAMA_BENCH.is_file(), reason="no llama-bench build (scripts/build_llamacpp.sh cpu)")
def test_side_by_side_command(model, tmp_path):
    out = tmp_path / "side.json"
    assert main(["bench", "run", "--model", str(model), "--device", "cpu", "--dtype", "f32", "--budget", f"{BUDGET_MIB}MiB",
                 "--strategies", "n-cpu-moe", "-p", "8", "-n", "2", "-r", "1", "--llama-bench", str(LLAMA_BENCH),
                 "--llama-n-cpu-moe", "1", "--threads", "1", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["llama_cpp"][0]["ok"] and d["runs"][0]["ok"]


def test_engine_paths_name_the_kept_formats(tiny_gguf):
    from workbench.core.placement import Placement
    from workbench.core.readers import open_model
    from workbench.engine import Engine
    from workbench.engine.bench import engine_paths

    inv = open_model(tiny_gguf("qwen3_moe", "Q4_K+Q6_K", hidden_size=256, moe_intermediate_size=256,
                               intermediate_size=256, mlp_only_layers=[]))
    engine = Engine.load(inv, Placement(), device="cpu", dtype=torch.float32, max_context=16)
    try:
        paths = engine_paths(engine)
    finally:
        engine.close()
    assert paths["bus_experts"] == 0 and set(paths["kept"].values()) == {"q4_k+q6_k"}
    assert paths["served_layers"] == [] and paths["served_bus_pairs"] == 0  # no decode step yet


def test_planner_leaves_room_for_what_the_engine_dequantizes(tiny_gguf, monkeypatch):
    """A Q8_0 file: the planner counts units at file size; the engine keeps the experts' blocks and,
    on CUDA, the projections', embeddings' and head's too (nothing extra), else dequantizes the
    non-expert ones to bf16 (or the experts too when told not to keep them)."""
    from workbench.core.readers import open_model
    from workbench.engine.bench import dequantized_extra_bytes

    inv = open_model(tiny_gguf("qwen3_moe", "Q8_0", hidden_size=64, moe_intermediate_size=32, intermediate_size=64,
                               mlp_only_layers=[]))
    quant = [(k, u) for k, u in inv.units.items() if any(t.tensor.dtype == "Q8_0" for t in u.tensors)]
    others = sum(2 * u.n_params - u.nbytes for k, u in quant if k.kind != "expert")
    experts = sum(2 * u.n_params - u.nbytes for k, u in quant if k.kind == "expert")
    assert others > 0 and experts > 0
    assert dequantized_extra_bytes(inv, torch.bfloat16) == 0
    assert dequantized_extra_bytes(inv, torch.bfloat16, dense_kept=False) == others
    monkeypatch.setenv("WORKBENCH_KEEP_QUANTS", "0")
    assert dequantized_extra_bytes(inv, torch.bfloat16, dense_kept=False) == others + experts


def test_the_roofline_reads_each_layers_attention_before_its_experts(model):
    """A token's layers come one after another, and a layer's experts wait for its attention: the
    roofline adds the layers' reads up, with only a layer's expert reads on different devices at once."""
    from workbench.core.costmodel import CostModel
    from workbench.core.memory import placement_all_gpu, placement_n_cpu_moe

    inv, prof = open_model(str(model)), preset("bench-h200")
    cm = CostModel(inv, prof)
    gpu_bw, cpu_bw = prof.gpus[0].mem_bandwidth, prof.host_read_bandwidth
    all_gpu = bench.roofline(cm, placement_all_gpu(inv), prof)
    assert all_gpu["cpu_bytes"] == 0 and all_gpu["bound"] == "gpu"
    assert 1 / all_gpu["tps"] == pytest.approx(all_gpu["gpu_bytes"] / gpu_bw)  # one device: every byte in turn
    # one layer's experts on the CPU: while the CPU reads them the GPU has nothing of that layer to read
    hybrid = bench.roofline(cm, placement_n_cpu_moe(inv, 1), prof)
    assert hybrid["cpu_bytes"] > 0 and hybrid["gpu_bytes"] + hybrid["cpu_bytes"] == pytest.approx(all_gpu["gpu_bytes"])
    serial = hybrid["gpu_bytes"] / gpu_bw + hybrid["cpu_bytes"] / cpu_bw
    assert 1 / hybrid["tps"] == pytest.approx(serial)
    assert 1 / hybrid["tps"] > max(hybrid["seconds"].values())  # more than the devices side by side
    assert hybrid["serial_s"] > 0 and hybrid["bound"] == "cpu"
    # half of every layer's experts on the CPU: they and the GPU's half are read at once
    grid_half = placement_all_gpu(inv)
    for key in inv.expert_keys():
        if key.expert % 2:
            grid_half.set(key, CPU_COMPUTE)
    half = bench.roofline(cm, grid_half, prof)
    per_layer = half["cpu_bytes"] / cpu_bw  # the CPU's halves are the slower lane in every layer
    assert 1 / half["tps"] == pytest.approx(half["serial_s"] + per_layer)
