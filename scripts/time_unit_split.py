#!/usr/bin/env python3
"""Time the decode server's CPU part of a unit split: one-expert packets of S1's expert shape (bf16,
H 2048, I 768) computed for their first ``units`` intermediate units in place in whole stacks
(``Server.set_units``), against the same units as contiguous stacks of their own.

    python scripts/time_unit_split.py [--threads 2] [--units 768,384]

Prints the median packet time (µs) of each. On the 2-core test host (BENCHMARKS.md, eighteenth stop)
384 units took ~610 µs in place against ~260 µs as stacks of their own and ~500 µs for all 768.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workbench.engine import cpu_kernel  # noqa: E402

E, H, FFN, K = 16, 2048, 768, 8


def serve(stacks: list[torch.Tensor], ffn: int, units: int, threads: int, packets: int = 200) -> float:
    """Median µs of ``packets`` one-expert packets served with ``units`` of ``ffn`` units."""
    bufs = [torch.zeros(2 * K + H), torch.zeros(1, dtype=torch.int64), torch.zeros(H), torch.zeros(1, dtype=torch.int64)]
    srv = cpu_kernel.server(threads, spin_us=2000, own_team=True)
    index = srv.add_layer(0, stacks, 0, 0, ffn, K, *bufs, *cpu_kernel.act_args(("silu",)))
    srv.set_units(index, units)
    srv.start()
    packet, flag_in, _, flag_out = bufs
    rng = np.random.default_rng(0)
    times = []
    try:
        for step in range(1, packets + 1):
            packet[:K] = -1.0
            packet[0], packet[K] = float(rng.integers(0, E)), 0.5
            packet[2 * K:] = torch.from_numpy(rng.standard_normal(H).astype(np.float32))
            t0 = time.perf_counter_ns()
            flag_in.fill_(step)
            while int(flag_out[0]) != step:
                pass
            times.append(time.perf_counter_ns() - t0)
    finally:
        srv.stop()
    return float(np.median(times[packets // 10:])) / 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--units", default="768,384")
    args = ap.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(E, 2 * FFN, H, generator=g) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(E, H, FFN, generator=g) * 0.02).to(torch.bfloat16)
    for u in (int(v) for v in args.units.split(",")):
        cut = [torch.cat([w13[:, :u], w13[:, FFN:FFN + u]], 1).contiguous(), w2[:, :, :u].contiguous()]
        print(f"units {u}: in place {serve([w13, w2], FFN, u, args.threads):.0f} µs, "
              f"as stacks of their own {serve(cut, u, u, args.threads):.0f} µs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
