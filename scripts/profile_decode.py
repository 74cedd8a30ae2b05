#!/usr/bin/env python3
"""Profile our engine's decode step under hybrid placements: where does the time of one token go?

Builds (or takes) a synthetic MoE GGUF, loads it under an ``n-cpu-moe``-like placement (the routed
experts of the first layers on the CPU) and a ``frequency``-like one (each layer's hot experts on the
accelerator, the rest on the CPU), then for each: times decode steps, counts host syncs per token,
and writes a cProfile and a torch.profiler summary.

    # locally (no GPU: the accelerator is "cpu", the same hybrid code paths run)
    python scripts/profile_decode.py --out /tmp/prof
    # on the GPU machine, with a bench file and the planner's placements under a budget
    python scripts/profile_decode.py --model /dev/shm/wb/s1.gguf --device cuda --budget 12GiB --out $OUT

Host syncs are counted as calls of ``Tensor.cpu / item / tolist / numpy / nonzero`` (cProfile call
counts; on CPU these are not real syncs, but they are where a CUDA run would wait) and, on CUDA, as
the warnings of ``torch.cuda.set_sync_debug_mode("warn")``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import logging
import pstats
import statistics
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path

import torch

from workbench.core import synth
from workbench.core.placement import CPU_COMPUTE, Placement
from workbench.core.readers import open_model
from workbench.core.units import UnitKey

log = logging.getLogger("profile_decode")

MID = synth.SynthShape("mid", "qwen3moe", 8, 1024, 16, 4, 64, 64, 8, 512, 8192, qk_norm=True)
"""A mid-size model for local profiling: hidden 1024, 64 experts (8 active), 8 layers, ~400 MB bf16."""

SYNC_NAMES = ("cpu", "item", "tolist", "numpy", "nonzero", "synchronize", "_local_scalar_dense")


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(add, name: str, fn):
    """``fn`` wrapped so that each call adds its host seconds under ``name``: ``add(name, seconds)``."""
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            add(name, time.perf_counter() - t)
    return wrapper


def small_model(path: str | None) -> Path:
    """``path``, or (None) a 4-layer cut of ``MID`` written once to /tmp/wb_profile (local runs)."""
    if path is not None:
        return Path(path)
    out = Path("/tmp/wb_profile/mid_4.gguf")
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        from dataclasses import replace

        synth.write_gguf(out, replace(MID, n_layers=4), coverage_target=0.5)
    return out


def n_cpu_moe_placement(inv, n: int) -> Placement:
    """Routed experts of the first ``n`` MoE layers computed on the CPU, everything else resident."""
    p = Placement()
    for layer in inv.spec.moe_layers[:n]:
        p.move(inv.expert_keys(layer), CPU_COMPUTE)
    return p


def frequency_placement(inv, counts, gpu_fraction: float) -> Placement:
    """Per layer, the ``gpu_fraction`` most selected experts (by ``counts [L, E]``) resident, the rest
    computed on the CPU."""
    p = Placement()
    E = inv.spec.n_experts
    keep = max(1, round(gpu_fraction * E))
    for layer in inv.spec.moe_layers:
        hot = set(torch.as_tensor(counts[layer]).argsort(descending=True)[:keep].tolist())
        for e in range(E):
            if e not in hot:
                p.set(UnitKey(layer, "expert", e), CPU_COMPUTE)
    return p


def planned_placements(inv, strategies: list[str], budget: int, margin: int, prompt: int, gen: int,
                       profile: str, counts=None) -> dict[str, Placement]:
    """The planner's placements under ``budget`` (as ``workbench bench run`` makes them)."""
    from workbench.core.costmodel import CostModel
    from workbench.core.placement import Budget
    from workbench.core.planner import Planner
    from workbench.core.stats import ExpertStats
    from workbench.engine.bench import load_profile

    spec = inv.spec
    stats = None
    if counts is not None:
        stats = ExpertStats(spec.n_layers, spec.n_experts, spec.n_experts_active)
        stats.add(counts)
    cost = CostModel(inv, load_profile(profile), stats)
    planner = Planner(cost, Budget((budget,), margin=margin), ctx=prompt + gen, prompt_tokens=prompt)
    return {s: planner.plan(s).placement for s in strategies}


def timed_steps(engine, prompt: int, steps: int, warm: int = 4, each=None, warmed=None) -> list[tuple[int, int]]:
    """A ``prompt``-token prompt of random ids, ``warm`` untimed one-token steps (the graphs' capture),
    then ``steps`` timed ones, each waited for as a generation does: ``(start, end)`` of each on
    ``time.monotonic_ns``'s clock (ns). ``warmed()`` is called before the first timed step,
    ``each(start, end)`` after each."""
    toks = torch.randint(0, engine.vocab_size, (prompt + warm + steps + 1,))
    engine.forward(toks[:prompt], 0, last_only=True).argmax().item()
    pos, out = prompt, []
    for i in range(warm + steps):
        if i == warm and warmed is not None:
            warmed()
        t0 = time.monotonic_ns()
        engine.forward(toks[pos:pos + 1], pos).argmax().item()
        t1 = time.monotonic_ns()
        if i >= warm:
            out.append((t0, t1))
            if each is not None:
                each(t0, t1)
        pos += 1
    return out


def count_syncs(stats: pstats.Stats) -> dict[str, int]:
    """Calls of host-sync-like tensor methods in a cProfile run."""
    out: dict[str, int] = {}
    for (_file, _line, name), (_cc, nc, *_rest) in stats.stats.items():
        if "torch" not in name and "Event" not in name:  # numpy's tolist/nonzero are no syncs
            continue
        for s in SYNC_NAMES:
            if f"'{s}'" in name or name.endswith(f".{s}") or name == s:
                out[s] = out.get(s, 0) + nc
    return out


def profile_placement(engine, label: str, *, prompt: int, steps: int, out: Path | None,
                      torch_prof: bool = True) -> dict:
    """Time ``steps`` decode steps after a ``prompt``-token prefill; cProfile and torch.profiler them."""
    dev = engine.device
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, engine.vocab_size, (prompt,), generator=g)
    toks = torch.randint(0, engine.vocab_size, (3 * steps + 4,), generator=g)
    engine.forward(ids, 0)
    pos = prompt
    for i in range(4):  # warm-up
        engine.forward(toks[i:i + 1], pos).argmax().item()
        pos += 1
    times = []
    for i in range(steps):
        _sync(dev)
        t0 = time.perf_counter()
        engine.forward(toks[4 + i:5 + i], pos)[-1].argmax().item()
        times.append(time.perf_counter() - t0)
        pos += 1
    res = {"label": label, "step_ms_median": 1e3 * statistics.median(times),
           "step_ms_min": 1e3 * min(times), "decode_tps": 1.0 / statistics.median(times)}
    # cProfile: Python-level time and sync-like calls per token
    pr = cProfile.Profile()
    pr.enable()
    for i in range(steps):
        engine.forward(toks[4 + steps + i:5 + steps + i], pos)[-1].argmax().item()
        pos += 1
    pr.disable()
    st = pstats.Stats(pr)
    syncs = count_syncs(st)
    n_layers = len(engine.layers)
    res["sync_like_calls_per_token"] = {k: v / steps for k, v in syncs.items()}
    res["sync_like_calls_per_token_per_layer"] = sum(syncs.values()) / steps / n_layers
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(25)
    res["cprofile_top"] = buf.getvalue()
    if dev.type == "cuda":  # real syncs, as torch sees them
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(steps):
                engine.forward(toks[4 + 2 * steps + i:5 + 2 * steps + i], pos)[-1].argmax()
                pos += 1
        torch.cuda.set_sync_debug_mode(0)
        res["cuda_syncs_per_token"] = len(caught) / steps
        where: dict[str, int] = {}
        for w in caught:
            key = f"{Path(w.filename).name}:{w.lineno}"
            where[key] = where.get(key, 0) + 1
        res["cuda_sync_sites"] = dict(sorted(where.items(), key=lambda kv: -kv[1]))
    if torch_prof:
        acts = [torch.profiler.ProfilerActivity.CPU]
        if dev.type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        n = min(steps, 4)
        with torch.profiler.profile(activities=acts) as tp:
            for i in range(n):
                engine.forward(toks[i:i + 1], pos)[-1].argmax().item()
                pos += 1
        ka = tp.key_averages()
        res["torch_profile_cpu"] = ka.table(sort_by="self_cpu_time_total", row_limit=25)
        if dev.type == "cuda":
            res["torch_profile_cuda"] = ka.table(sort_by="self_cuda_time_total", row_limit=25)
        if out is not None:
            trace = out / f"trace_{label}.json"
            tp.export_chrome_trace(str(trace))
            if dev.type == "cuda":
                res["kernel_timeline"] = kernel_timeline(json.loads(trace.read_text()), n)
                trace.unlink()  # large; the timeline's summary is what is read
    return res


def kernel_timeline(trace: dict, steps: int) -> dict:
    """The GPU's side of ``steps`` decode steps from a torch.profiler chrome trace: per step, the
    kernels' count, their summed time (busy, µs), the idle time between one kernel's end and the
    next one's start (gaps, µs, only those under 1 ms: a longer one is the host between steps), and
    per kernel name its launches per step, mean and summed µs per step (busiest first)."""
    ks = sorted((e for e in trace.get("traceEvents", []) if e.get("cat") == "kernel" and "dur" in e),
                key=lambda e: e["ts"])
    busy = sum(e["dur"] for e in ks)
    gaps = [b["ts"] - (a["ts"] + a["dur"]) for a, b in zip(ks, ks[1:])]
    by: dict[str, list[float]] = {}
    for e in ks:
        by.setdefault(e["name"][:90], []).append(e["dur"])
    rows = sorted(((name, len(d) / steps, statistics.mean(d), sum(d) / steps) for name, d in by.items()),
                  key=lambda r: -r[3])
    return {"kernels_per_step": len(ks) / steps, "busy_us_per_step": busy / steps,
            "gap_us_per_step": sum(g for g in gaps if 0 <= g < 1000) / steps,
            "by_name": [{"name": r[0], "per_step": r[1], "mean_us": r[2], "us_per_step": r[3]} for r in rows]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF file (default: write the mid-size synthetic model)")
    ap.add_argument("--shape", default="mid", help="synthetic shape without --model: mid or one of synth.SHAPES")
    ap.add_argument("--layers", type=int, default=None, help="layers of the synthetic model (the shape's)")
    ap.add_argument("--weights", default="bf16", choices=synth.WEIGHT_TYPES, help="synthetic weights' format")
    ap.add_argument("--experts", type=int, default=None,
                    help="experts a layer of the synthetic model (the shape's), its routing uniform: S1 at 8 "
                         "against 128 shows what picking 8 of many costs each kernel")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "f32"))
    ap.add_argument("--budget", default=None, help="use the planner's placements under this VRAM budget")
    ap.add_argument("--margin", default="0")
    ap.add_argument("--strategies", default="n-cpu-moe,frequency")
    ap.add_argument("--profile", default="bench-h200")
    ap.add_argument("--cpu-layers", type=int, default=None, help="n-cpu-moe-like: CPU layers (2/3 of them)")
    ap.add_argument("--gpu-fraction", type=float, default=0.25, help="frequency-like: experts kept resident")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--cpu-format", default=None, help="CPU expert format (cpu_formats.FORMATS)")
    ap.add_argument("--cpu-workers", type=int, default=1, help="experts computed at once with --cpu-format")
    ap.add_argument("--no-torch-profile", action="store_true")
    ap.add_argument("--out", default=None, help="folder for profile.json, profile.md and traces")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from workbench.core.fmt import parse_size
    from workbench.engine import Engine

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    path = args.model
    if path is None:
        s = MID if args.shape == "mid" else synth.SHAPES[args.shape]
        s = replace(s, n_layers=args.layers) if args.layers else s
        s = replace(s, n_experts=args.experts) if args.experts else s
        path = Path("/tmp/wb_profile") / f"{s.name}_{s.n_layers}_{s.n_experts}_{args.weights}.gguf"
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            t0 = time.perf_counter()
            synth.write_gguf(path, s, coverage_target=None if args.experts else 0.5, wtype=args.weights)
            log.info("wrote %s in %.1f s", path, time.perf_counter() - t0)
    inv = open_model(str(path))
    dev = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[args.dtype]
    strategies = [s for s in args.strategies.split(",") if s]
    ctx = args.prompt + 4 * args.steps + 8
    results = []
    counts = None
    for strat in strategies:
        if args.budget:
            placement = planned_placements(inv, [strat], parse_size(args.budget), parse_size(args.margin),
                                           512, 128, args.profile, counts)[strat]
        elif strat == "n-cpu-moe":
            n = args.cpu_layers if args.cpu_layers is not None else (2 * len(inv.spec.moe_layers)) // 3
            placement = n_cpu_moe_placement(inv, n)
        elif strat == "frequency":
            if counts is None:  # routing statistics from an all-resident pass
                e = Engine.load(inv, None, device=dev, dtype=dtype, max_context=ctx, vram_budget=None)
                e.forward(torch.randint(0, e.vocab_size, (min(64, ctx),)), 0)
                counts = e.routing_counts()
                e.close()
            placement = frequency_placement(inv, counts, args.gpu_fraction)
        elif strat == "all-gpu":
            placement = Placement()
        else:
            raise SystemExit(f"unknown strategy {strat!r} without --budget")
        t0 = time.perf_counter()
        engine = Engine.load(inv, placement, device=dev, dtype=dtype, max_context=ctx, vram_budget=None,
                             cpu_format=args.cpu_format, cpu_workers=args.cpu_workers)
        load_s = time.perf_counter() - t0
        try:
            r = profile_placement(engine, strat, prompt=args.prompt, steps=args.steps, out=out,
                                  torch_prof=not args.no_torch_profile)
            counts = engine.routing_counts() if counts is None else counts
        finally:
            engine.close()
        r["load_s"] = load_s
        results.append(r)
        log.info("%s: %.2f ms/token (%.1f tok/s), sync-like calls per token per layer %.1f",
                 strat, r["step_ms_median"], r["decode_tps"], r["sync_like_calls_per_token_per_layer"])
    md = []
    for r in results:
        md.append(f"## {r['label']}: {r['step_ms_median']:.2f} ms per decode step "
                  f"({r['decode_tps']:.1f} tok/s), load {r['load_s']:.1f} s\n")
        md.append(f"sync-like calls per token: {json.dumps(r['sync_like_calls_per_token'])}\n")
        if "cuda_syncs_per_token" in r:
            md.append(f"CUDA syncs per token: {r['cuda_syncs_per_token']:.1f} at {json.dumps(r['cuda_sync_sites'])}\n")
        tl_ = r.get("kernel_timeline")
        if tl_:
            md.append(f"### GPU timeline: {tl_['kernels_per_step']:.0f} kernels per step, busy "
                      f"{tl_['busy_us_per_step']:.1f} µs, gaps {tl_['gap_us_per_step']:.1f} µs\n")
            md.append("| kernel | per step | mean µs | µs per step |\n| --- | --- | --- | --- |")
            md += [f"| `{k['name']}` | {k['per_step']:.1f} | {k['mean_us']:.2f} | {k['us_per_step']:.1f} |"
                   for k in tl_["by_name"][:30]]
            md.append("")
        for key in ("torch_profile_cpu", "torch_profile_cuda", "cprofile_top"):
            if key in r:
                md.append(f"### {key}\n\n```\n{r[key]}\n```\n")
    text = "\n".join(md)
    if out is not None:
        (out / "profile.json").write_text(json.dumps(results, indent=1))
        (out / "profile.md").write_text(text)
    print("\n".join(f"{r['label']}: {r['step_ms_median']:.2f} ms/token ({r['decode_tps']:.1f} tok/s), "
                    f"sync-like calls/token/layer {r['sync_like_calls_per_token_per_layer']:.1f}"
                    + (f", CUDA syncs/token {r['cuda_syncs_per_token']:.1f}" if "cuda_syncs_per_token" in r else "")
                    for r in results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
