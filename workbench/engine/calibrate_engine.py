"""Fit the cost model's per-kernel and per-host-point costs to the engine's own decode steps.

The machine-level figures (bandwidths, the fused CPU kernel's rate) leave out what the engine
adds on top: the GPU time of a layer's ~40 small kernels in its CUDA graphs beyond their bytes, and
the host work of a hybrid layer (event wait, routing read, CPU kernel call, result copy). This step
writes a small synthetic MoE model at the calibration's expert shape (8 layers, 16 experts, a small
vocabulary), runs the engine's decode on CUDA with every expert resident and with every expert on
the CPU, and solves the cost model's ``launch_s`` (from the resident run) and ``sync_s`` (from the
CPU run) so that it predicts both runs exactly. The model then carries them to other placements.
"""

from __future__ import annotations

import logging
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from workbench.core import synth
from workbench.core.costmodel import CostModel
from workbench.core.hardware import HardwareProfile
from workbench.core.memory import placement_all_gpu, placement_cpu_moe
from workbench.core.readers import open_model

log = logging.getLogger(__name__)

LAYERS, EXPERTS, VOCAB, STEPS = 8, 16, 2048, 24


def _decode_seconds(inv, placement, device: str, steps: int = STEPS) -> float:
    """Median seconds per decode step of the engine under ``placement`` (after a 16-token prompt)."""
    from .engine import Engine

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    engine = Engine.load(inv, placement, device=device, dtype=dtype, max_context=16 + 2 * steps + 8)
    try:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, VOCAB, (16 + 2 * steps,), generator=g)
        engine.forward(ids[:16], 0, last_only=True)
        times = []
        for i in range(2 * steps):  # the first steps capture the graphs
            t = time.perf_counter()
            engine.forward(ids[16 + i:17 + i], 16 + i)[-1].argmax().item()
            times.append(time.perf_counter() - t)
        return statistics.median(times[steps:])
    finally:
        engine.close()


def _solve(cost_at, measured: float, lo: float = 0.0, step: float = 1e-5) -> float:
    """The value ``v >= lo`` of a parameter at which the model's seconds per token ``cost_at(v)``
    (linear in ``v``) equal ``measured``."""
    a, b = cost_at(lo), cost_at(lo + step)
    slope = (b - a) / step
    if slope <= 0:
        return lo
    return max(lo, lo + (measured - a) / slope)


def fit_engine_costs(prof: HardwareProfile, hidden: int, ffn: int, top_k: int,
                     n_heads: int = 32, n_kv_heads: int = 4, head_dim: int = 128,
                     device: str = "cuda") -> tuple[HardwareProfile, dict]:
    """``prof`` with ``gpus[0].launch_s`` and ``sync_s`` fitted to the engine, and the measurements
    ``{"resident_s", "cpu_s", "launch_s", "sync_s"}`` (seconds per decode step / fitted).
    ``device``: the engine's accelerator (``cuda``; ``cpu`` only exercises the fit in tests)."""
    shape = synth.SynthShape("calibration", "qwen3moe", LAYERS, hidden, n_heads, n_kv_heads, head_dim,
                             EXPERTS, min(top_k, EXPERTS), ffn, VOCAB, qk_norm=True)
    with tempfile.TemporaryDirectory(prefix="workbench-calibration-") as tmp:
        path = Path(tmp) / "calibration.gguf"
        synth.write_gguf(path, shape, coverage_target=None)
        inv = open_model(path)
        res, cpu = placement_all_gpu(inv), placement_cpu_moe(inv)
        t_res = _decode_seconds(inv, res, device)
        t_cpu = _decode_seconds(inv, cpu, device)

    def with_costs(launch: float, sync: float) -> HardwareProfile:
        gpus = (replace(prof.gpus[0], launch_s=launch),) + tuple(prof.gpus[1:])
        return replace(prof, gpus=gpus, sync_s=sync)

    def seconds(p: HardwareProfile, placement) -> float:
        return 1.0 / CostModel(inv, p).decode_tps(placement, kv_tokens=16 + STEPS)

    launch = _solve(lambda v: seconds(with_costs(v, prof.sync_s), res), t_res, step=1e-6)
    sync = _solve(lambda v: seconds(with_costs(launch, v), cpu), t_cpu, step=1e-5)
    fitted = with_costs(launch, sync)
    info = {"resident_s": t_res, "cpu_s": t_cpu, "launch_s": launch, "sync_s": sync}
    log.info("engine decode: %.2f ms all resident, %.2f ms all on the CPU (%d layers); fitted launch %.2f us, "
             "host point %.0f us", t_res * 1e3, t_cpu * 1e3, LAYERS, launch * 1e6, sync * 1e6)
    return fitted, info
