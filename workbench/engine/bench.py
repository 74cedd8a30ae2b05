"""The benchmark runner: CPU expert formats and our engine over placements under a VRAM budget.

llama.cpp runs are in :mod:`workbench.engine.bench_llamacpp`; memory sampling in
:mod:`workbench.engine.bench_measure`.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from workbench.core.errors import WorkbenchError
from workbench.engine import cpu_formats as cf

log = logging.getLogger(__name__)


def expert_throughput(fmt: str, hidden: int, inter: int, *, n_experts: int = 64, tokens: int = 1,
                      repeats: int = 3, seed: int = 0) -> dict:
    """Time whole experts (fused gate+up, SiLU, down) in ``fmt``, cycling through ``n_experts``
    distinct ones so RAM feeds them. Returns µs per expert and GB/s of weight bytes."""
    g = torch.Generator().manual_seed(seed)
    gate, up = (torch.randn(inter, hidden, generator=g) * 0.02 for _ in range(2))
    down = torch.randn(hidden, inter, generator=g) * 0.02
    experts = [cf.ExpertFFN.from_float(gate.roll(i, 1), up.roll(i, 1), down.roll(i, 1), fmt)
               for i in range(n_experts)]
    x = torch.randn(tokens, hidden, generator=g)
    for e in experts[:4]:
        e(x)
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for e in experts:
            e(x)
        runs.append((time.perf_counter() - t0) / n_experts)
    t = float(np.median(runs))
    nbytes = experts[0].nbytes
    return {"format": fmt, "matrix": f"expert [{hidden}x{inter}] x3", "tokens": tokens,
            "threads": torch.get_num_threads(), "us_per_matrix": t * 1e6, "bytes_per_matrix": nbytes,
            "gbps": nbytes / t / 1e9, "bf16_equiv_gbps": 3 * hidden * inter * 2 / t / 1e9,
            "spread_us": [r * 1e6 for r in runs]}


def cpu_format_table(hidden: int, inter: int, formats: list[str], *, n_experts: int = 128,
                     tokens: int = 1) -> list[dict]:
    """Per format: the fused gate_up matrix [2I, H] alone and the whole expert, batch ``tokens``."""
    rows = []
    for fmt in formats:
        if fmt not in cf.available_formats(2 * inter, hidden):
            log.warning("format %s not available for this shape", fmt)
            continue
        r = cf.throughput(fmt, 2 * inter, hidden, n_mats=n_experts, tokens=tokens)
        r["matrix"] = f"gate_up [{2 * inter}, {hidden}]"
        rows.append(r)
        rows.append(expert_throughput(fmt, hidden, inter, n_experts=n_experts, tokens=tokens))
        log.info("%s: %.1f GB/s", fmt, r["gbps"])
    return rows


def run_command(args) -> int:
    raise WorkbenchError("`workbench bench run` needs the engine's fast path; not wired yet")
