#!/usr/bin/env python3
"""Where does a hybrid MoE layer's decode time go? Host-side phases of every host point, per token.

Loads a GGUF under the planner's placement for a budget (or an ``n-cpu-moe``-like one), decodes a
few steps after a prompt, and times on the host (``time.perf_counter``), per hybrid layer and token:

- ``wait``: blocked on the layer's routing event (the GPU finishing attention and router);
- ``bus``: enqueueing the bus share's copies and kernels;
- ``cpu``: the fused CPU kernel call (the CPU experts themselves; with a bus share only starting
  them on the kernel's own thread), ``cpu_wait``: waiting for that background run after the bus's
  copies are queued;
- ``other``: the rest of the host point (routing read, index work, result copy and add);
- ``outside``: the step's time outside host points and waits (graph launches, sampling, Python).
``host_point`` is ``cpu + cpu_wait + bus + other``; ``total`` is ``outside + wait + host_point``.

    python scripts/profile_hybrid.py --model /dev/shm/s1.gguf --device cuda --budget 12GiB --strategy n-cpu-moe
    python scripts/profile_hybrid.py            # locally: a small synthetic model, CPU accelerator

Prints a table and writes JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from profile_decode import n_cpu_moe_placement, planned_placements, small_model, timed_steps  # noqa: E402
from profile_decode import timed as timed_by  # noqa: E402

from workbench.core.fmt import parse_size  # noqa: E402
from workbench.core.project import load_project  # noqa: E402
from workbench.core.readers import open_model  # noqa: E402
from workbench.engine import Engine, bus, cpu_kernel  # noqa: E402
from workbench.engine import experts as experts_mod  # noqa: E402


class Phases:
    """Host-time accumulators per phase, reset per step."""

    def __init__(self):
        self.step: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []

    def add(self, name: str, seconds: float) -> None:
        self.step[name] += seconds

    def end_step(self, total: float) -> None:
        s = self.step
        s["other"] = max(0.0, s.get("host_point", 0.0) - s.get("cpu", 0.0) - s.get("cpu_wait", 0.0) - s.get("bus", 0.0))
        s["outside"] = max(0.0, total - s.get("host_point", 0.0) - s.get("wait", 0.0))
        self.step["total"] = total
        self.steps.append(dict(self.step))
        self.step = defaultdict(float)


def instrument(ph: Phases) -> None:
    """Wrap the host point's pieces with timers (module-level functions and methods)."""
    timed = partial(timed_by, ph.add)
    le = experts_mod.LayerExperts
    le.host_part = timed("host_point", le.host_part)
    experts_mod.HostStaging.wait = timed("wait", experts_mod.HostStaging.wait)
    bus.BusShare.run = timed("bus", bus.BusShare.run)
    for name in ("moe_decode", "moe_decode_q8", "moe_decode_q4k"):
        setattr(cpu_kernel, name, timed("cpu", getattr(cpu_kernel, name)))
    cpu_kernel.wait = timed("cpu_wait", cpu_kernel.wait)  # a background run's rest, after the bus is queued


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF file (default: a small synthetic model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--budget", default=None, help="plan under this VRAM budget (else n-cpu-moe on 2/3 of layers)")
    ap.add_argument("--margin", default="512MiB")
    ap.add_argument("--strategy", default="n-cpu-moe")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--json", default=None)
    ap.add_argument("--placement", default=None, help="a project file's placement instead of planning one")
    args = ap.parse_args(argv)

    inv = open_model(str(small_model(args.model)))
    if args.placement:  # e.g. one `workbench bench run --save-placements` ran
        placement = load_project(args.placement).placement
    elif args.budget:
        placement = planned_placements(inv, [args.strategy], parse_size(args.budget), parse_size(args.margin),
                                       args.prompt, args.steps, "bench-h200")[args.strategy]
    else:
        placement = n_cpu_moe_placement(inv, (2 * len(inv.spec.moe_layers)) // 3)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    engine = Engine.load(inv, placement, device=args.device, dtype=dtype, max_context=args.prompt + args.steps + 16)
    if args.device != "cuda":
        engine.decode_mode = "static"  # the decode graphs' pieces, run eagerly
    ph = Phases()
    instrument(ph)
    try:
        timed_steps(engine, args.prompt, args.steps, warmed=ph.step.clear,  # the prompt's and warm-up's phases
                    each=lambda t0, t1: ph.end_step((t1 - t0) * 1e-9))
        hybrid = sum(1 for lx in engine.experts.values() if lx.needs_host)
        srv = engine._decoder.server if engine._decoder is not None else None
        print(f"decode server: {len(srv.layers) if srv else 0} of {hybrid} hybrid layers served"
              + (f", {srv.served} packets, {srv.bus_pairs} pairs over the bus" if srv else ""))
    finally:
        engine.close()
    keys = ["total", "outside", "host_point", "wait", "cpu", "cpu_wait", "bus", "other"]
    med = {k: statistics.median(s.get(k, 0.0) for s in ph.steps) for k in keys}
    print(f"{inv.path.name}: {hybrid} hybrid layers, {args.steps} steps, medians per token (ms) and per hybrid layer (us)")
    for k in keys:
        per_layer = 1e6 * med[k] / max(1, hybrid) if k not in ("total", "outside") else float("nan")
        print(f"  {k:11s} {1e3 * med[k]:8.2f} ms   {per_layer:8.0f} us/layer")
    if args.json:
        Path(args.json).write_text(json.dumps({"hybrid_layers": hybrid, "median_s": med, "steps": ph.steps}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
