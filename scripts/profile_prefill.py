#!/usr/bin/env python3
"""Where does a hybrid prompt's time go? One load, then the same prompt under several bus/CPU splits.

Loads a GGUF with the routed experts of the first ``--n-cpu-moe`` MoE layers on the CPU (the rest
resident), then times a ``--prompt``-token prefill (median of ``--repeats``) with the bus share's
prefill split as the engine sets it and with the split forced: everything over the bus, everything
on the CPU. For the default split it also times the host-side phases of each hybrid layer
(``wait``: the routing sync, ``fetch``: queueing the bus's copies and kernels, ``cpu``: the CPU's
pairs, ``finish``: waiting for them) and writes a torch profile's top operations and its timeline
(``prefill_trace.json.gz``, Chrome's trace format: copies, kernels and host calls of one prompt).

    python scripts/profile_prefill.py --model /dev/shm/wb/s1.gguf --device cuda --n-cpu-moe 17 --out $OUT/prefill
    python scripts/profile_prefill.py            # locally: a small synthetic model, CPU accelerator
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
import time
from collections import defaultdict
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from profile_decode import n_cpu_moe_placement, small_model  # noqa: E402
from profile_decode import timed as timed_by  # noqa: E402

from workbench.core.costmodel import CostModel, model_prompt_pair_reads  # noqa: E402
from workbench.core.hardware import HardwareProfile, preset  # noqa: E402
from workbench.core.project import load_project  # noqa: E402
from workbench.core.readers import open_model  # noqa: E402
from workbench.engine import Engine  # noqa: E402
from workbench.engine import experts as experts_mod  # noqa: E402
from workbench.engine.bench import predicted_host_ms  # noqa: E402
from workbench.engine.hostclock import HostClock  # noqa: E402

PHASES: dict[str, float] = defaultdict(float)


def instrument() -> None:
    """Time the host-side pieces of a hybrid layer's prompt step into ``PHASES`` (seconds)."""
    def add(name: str, seconds: float) -> None:
        PHASES[name] += seconds

    timed = partial(timed_by, add)
    le = experts_mod.LayerExperts
    le.host_part = timed("host_point", le.host_part)
    le._run_fetched = timed("fetch", le._run_fetched)
    le._start_cpu = timed("cpu", le._start_cpu)
    le._grouped_cpu = timed("cpu_gemm", le._grouped_cpu)
    experts_mod.HostStaging.wait = timed("wait", experts_mod.HostStaging.wait)
    from workbench.engine import cpu_kernel
    cpu_kernel.wait = timed("cpu_wait", cpu_kernel.wait)


def prefill_s(engine: Engine, toks: torch.Tensor, repeats: int) -> float:
    """Median seconds of a whole-prompt forward, synchronized."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        engine.forward(toks, 0, last_only=True).argmax().item()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def host_lane(engine: Engine, toks: torch.Tensor, repeats: int, inv, placement, profile: HardwareProfile) -> dict:
    """The engine thread's own records of the prompt's hybrid layers (``hostclock.HostClock``; a
    forward's first hybrid layer left out), means per layer, beside what the cost model predicts for
    them with ``profile`` (its host lane, and the layer's other lanes)."""
    clock = HostClock()
    engine.record_host(clock)
    try:
        s = prefill_s(engine, toks, repeats)
    finally:
        engine.record_host(None)
    pred = CostModel(inv, profile).predict(placement, len(toks) + 8, prompt_tokens=len(toks))
    hybrid = {r.layer for r in clock.layers if not r.first}
    layers = [c for c in pred.prefill_layers if c.layer in hybrid]
    n = max(1, len(layers))
    out = {"prefill_s": s, **clock.summary(),
           "predicted_host_ms": predicted_host_ms(pred),
           "predicted_other_ms": 1e3 * sum(c.pre + max(c.gpu, c.cpu, c.bus) + c.sync for c in layers) / n,
           "predicted_prefill_s": len(toks) / pred.prefill_tps}
    print("host clock per hybrid layer: " + ", ".join(f"{k} {v:.3g}" for k, v in out.items()))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF file (default: a small synthetic model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--n-cpu-moe", type=int, default=None, help="MoE layers on the CPU (default: 2/3 of them)")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="folder for prefill.json and the torch profile table")
    ap.add_argument("--placement", default=None, help="a project file's placement instead of --n-cpu-moe")
    ap.add_argument("--profile", default="bench-h200",
                    help="hardware profile (preset or calibration JSON) whose prompt cost per further token "
                         "the engine's split uses, as `workbench bench run` sets it")
    args = ap.parse_args(argv)

    inv = open_model(str(small_model(args.model)))
    n = args.n_cpu_moe if args.n_cpu_moe is not None else (2 * len(inv.spec.moe_layers)) // 3
    placement = load_project(args.placement).placement if args.placement else n_cpu_moe_placement(inv, n)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    engine = Engine.load(inv, placement, device=args.device, dtype=dtype, max_context=args.prompt + 16)
    profile = HardwareProfile.load(args.profile) if Path(args.profile).is_file() else preset(args.profile)
    engine.set_prompt_pair_reads(model_prompt_pair_reads(inv, profile))
    out_dir = Path(args.out) if args.out else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
    result = {"model": inv.path.name, "placement": args.placement or f"n-cpu-moe {n}", "prompt": args.prompt,
              "prompt_pair_reads": engine.prompt_pair_reads}
    try:
        toks = torch.randint(0, engine.vocab_size, (args.prompt,))
        share = engine._bus
        prefill_s(engine, toks, 1)  # warm-up: kernels compiled and tuned
        splits = {"engine": None}
        if share is not None:
            fraction, fetch = share.fraction, share.fetch_tokens
            splits.update({"all bus": (1.0, 1), "all CPU": (0.0, 10**9), "fetch >= 16 only": (0.0, 16)})
        for name, split in splits.items():
            if split is not None:
                share.fraction, share.fetch_tokens = split
            copied = share.copied if share is not None else 0
            s = prefill_s(engine, toks, args.repeats)
            sent = ((share.copied - copied) / args.repeats) if share is not None else 0
            if share is not None:
                share.fraction, share.fetch_tokens = fraction, fetch
            result[name] = {"prefill_s": s, "tok_s": args.prompt / s, "experts_sent": sent}
            print(f"{name:18s} {1e3 * s:8.1f} ms  {args.prompt / s:8.1f} tok/s  {sent:7.0f} experts over the bus")
        result["host_clock"] = host_lane(engine, toks, args.repeats, inv, placement, profile)
        instrument()
        PHASES.clear()
        s = prefill_s(engine, toks, args.repeats)
        phases = {k: 1e3 * v / args.repeats for k, v in PHASES.items()}
        result["phases_ms"] = phases
        print(f"host phases per prompt (ms, total {1e3 * s:.1f}): " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()))
        if out_dir:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if args.device == "cuda":
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            with torch.profiler.profile(activities=acts) as prof:
                prefill_s(engine, toks, 1)
            sort = "self_cuda_time_total" if args.device == "cuda" else "self_cpu_time_total"
            trace = out_dir / "prefill_trace.json"
            prof.export_chrome_trace(str(trace))  # the copies, kernels and host calls on one timeline
            with open(trace, "rb") as src, gzip.open(str(trace) + ".gz", "wb") as dst:
                dst.write(src.read())
            trace.unlink()
            (out_dir / "prefill_profile.txt").write_text(
                prof.key_averages().table(sort_by=sort, row_limit=30) + "\n"
                + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    finally:
        engine.close()
    if out_dir:
        (out_dir / "prefill.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
