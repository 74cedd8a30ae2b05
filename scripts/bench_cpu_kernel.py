#!/usr/bin/env python3
"""Time the fused CPU decode kernel against the engine's torch-ops path, in GB/s of expert weights.

One call = one token's routed experts of one layer on the CPU tier: ``rows`` distinct random experts
out of ``E`` (a 1.2 GB pool at the Qwen3-30B-A3B shape, larger than any cache, as in decode where
each layer reads other weights), a fresh random ``x``. Bytes per call: ``rows * 3 * H * I *
element size``. The two paths alternate call by call so that they see the same machine state:

- ``kernel``: ``cpu_kernel.moe_decode(x, w13, w2, rows, weights)``;
- ``torch``: the five ops per expert of ``LayerExperts._run_cpu`` today (``F.linear`` gate+up,
  ``silu``, ``mul_``, ``F.linear`` down, ``add_`` with the weight).

A ``RAM read`` row gives the ceiling at each thread count: ``sum()`` over the expert pool viewed as
float32. The first-build time is measured in a fresh build directory (``--cached`` uses the user's
cache instead, timing a load).

    python scripts/bench_cpu_kernel.py                       # 128 experts, 200 calls, all cores
    python scripts/bench_cpu_kernel.py --threads 4 8 16 --calls 400
    python scripts/bench_cpu_kernel.py --experts 16 --calls 20 --threads 1 2   # a quick local check
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from workbench.engine import cpu_kernel


def torch_ops(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, rows: torch.Tensor,
              weights: torch.Tensor) -> torch.Tensor:
    """The engine's decode loop of ``_run_cpu``: ``x [1, H]`` -> ``[1, H]`` in ``x.dtype``."""
    out = torch.zeros_like(x)
    i = w2.shape[2]
    for r, wt in zip(rows.tolist(), weights.tolist()):
        h = F.linear(x, w13[r])  # [1, 2I]
        out.add_(F.linear(F.silu(h[:, :i]).mul_(h[:, i:]), w2[r]), alpha=wt)
    return out


def random_pool(e: int, h: int, i: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``w13 [E, 2I, H]``, ``w2 [E, H, I]`` of N(0, 1/fan_in) values, filled expert by expert."""
    w13 = torch.empty(e, 2 * i, h, dtype=dtype)
    w2 = torch.empty(e, h, i, dtype=dtype)
    for k in range(e):
        w13[k].normal_(std=h**-0.5)
        w2[k].normal_(std=i**-0.5)
    return w13, w2


def time_build(cached: bool) -> tuple[bool, float]:
    """Build (or load) the kernel; seconds it took."""
    with tempfile.TemporaryDirectory(prefix="wb-cpu-kernel-") as tmp:
        if not cached:
            os.environ[cpu_kernel.ENV_BUILD_DIR] = tmp
        t0 = time.perf_counter()
        ok = cpu_kernel.available()
        return ok, time.perf_counter() - t0


def ram_read(w13: torch.Tensor, w2: torch.Tensor, repeats: int = 5) -> float:
    """GB/s of ``sum()`` over both pools viewed as float32 (median of ``repeats``)."""
    views = [w.view(-1).view(torch.float32) if w.dtype != torch.float32 else w.view(-1) for w in (w13, w2)]
    nbytes = sum(v.numel() * 4 for v in views)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for v in views:
            v.sum()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def run(threads: int, w13: torch.Tensor, w2: torch.Tensor, n: int, calls: int, seed: int,
        kernel: bool) -> dict[str, list[float]]:
    """Seconds per call of each path at ``threads`` intra-op threads, calls alternating."""
    torch.set_num_threads(threads)
    e, h = w13.shape[0], w13.shape[2]
    gen = torch.Generator().manual_seed(seed)
    paths = ["kernel", "torch"] if kernel else ["torch"]
    warmup = 5
    times: dict[str, list[float]] = {p: [] for p in paths}
    for c in range(warmup + calls):
        for p in paths:
            rows = torch.randperm(e, generator=gen)[:n]
            weights = torch.rand(n, generator=gen)
            weights /= weights.sum()
            x = torch.randn(1, h, generator=gen).to(w13.dtype)
            t0 = time.perf_counter()
            if p == "kernel":
                cpu_kernel.moe_decode(x[0], w13, w2, rows, weights)
            else:
                torch_ops(x, w13, w2, rows, weights)
            if c >= warmup:
                times[p].append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048, help="H (default: Qwen3-30B-A3B's 2048)")
    parser.add_argument("--ffn", type=int, default=768, help="I, the expert FFN width (default 768)")
    parser.add_argument("--experts", type=int, default=128, help="E, experts in the pool (default 128: 1.2 GB)")
    parser.add_argument("--rows", type=int, default=8, help="selected experts per call (default 8)")
    parser.add_argument("--calls", type=int, default=200, help="timed calls per path and thread count")
    parser.add_argument("--threads", type=int, nargs="+", default=[os.cpu_count() or 1],
                        help="torch.set_num_threads values (default: all cores)")
    parser.add_argument("--dtype", choices=("bf16", "f16", "f32"), default="bf16")
    parser.add_argument("--cached", action="store_true", help="use the user's build cache (times a load)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.rows > args.experts:
        parser.error("--rows must not exceed --experts")

    ok, build_s = time_build(args.cached)
    what = "load from the cache" if args.cached else "first build"
    print(f"kernel {what}: {build_s:.1f} s" if ok else f"kernel unavailable ({cpu_kernel.unavailable_reason()}): "
          "timing the torch path only")
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[args.dtype]
    h, i, n = args.hidden, args.ffn, args.rows
    t0 = time.perf_counter()
    w13, w2 = random_pool(args.experts, h, i, dtype)
    pool = w13.numel() * w13.element_size() + w2.numel() * w2.element_size()
    per_call = n * 3 * h * i * w13.element_size()
    print(f"pool: {args.experts} experts, H={h}, I={i}, {args.dtype}, {pool / 1e9:.2f} GB (made in "
          f"{time.perf_counter() - t0:.1f} s); {n} experts per call = {per_call / 1e6:.1f} MB; "
          f"{args.calls} calls; torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"{torch.backends.cpu.get_cpu_capability()}")
    print()
    print("| threads | path | median µs/call | p10–p90 µs | GB/s (median) | vs torch |")
    print("| --- | --- | --- | --- | --- | --- |")
    for t in args.threads:
        times = run(t, w13, w2, n, args.calls, args.seed, ok)
        med = {p: statistics.median(v) for p, v in times.items()}
        for p, v in times.items():
            q = statistics.quantiles(v, n=10)
            ratio = f"{med['torch'] / med[p]:.2f}x" if p != "torch" else "1.00x"
            print(f"| {t} | {p} | {med[p] * 1e6:,.0f} | {q[0] * 1e6:,.0f}–{q[-1] * 1e6:,.0f} | "
                  f"{per_call / med[p] / 1e9:.1f} | {ratio} |")
        print(f"| {t} | RAM read (sum) | | | {ram_read(w13, w2):.1f} | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
