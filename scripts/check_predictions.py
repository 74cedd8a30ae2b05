#!/usr/bin/env python3
"""Predict the placements a `workbench bench run` ran, with this checkout's cost model and a given
hardware profile, against the decode tokens/s that run measured.

`bench run --save-placements DIR` saves each run's placement with the routing counts its planner saw
(`bench_device.sh` stage `placements` brings them back as one archive). This re-predicts them
offline, e.g. after the cost model changed, on a local copy of the benchmark file (same shape:
`workbench bench write --sparse` writes one without its weights' disk space; the routing
statistics come from the saved projects):

    python scripts/check_predictions.py --model /tmp/s1.gguf --profile h200.json \\
        --bench engine_s1_skew.json --placements placements/engine_s1_skew [--ctx 576 --prompt 512] \\
        [--bus-share 0.45] [--set bus_read_rate=31e9] [--set gpu.expert_throughput.q8_0=1.7e12]

Each run is predicted at the bus share its engine recorded (``engine_paths.bus_share``; runs from
before that record: ``--bus-share``, else the model's own).

Prints markdown tables: placement, measured decode and prefill, predicted then and now, error now;
then each run's hybrid prompt layers as the engine recorded them beside the model's lanes.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workbench.core.costmodel import CostModel, EngineShape  # noqa: E402
from workbench.core.hardware import HardwareProfile  # noqa: E402
from workbench.core.project import load_project  # noqa: E402
from workbench.core.readers import open_model  # noqa: E402
from workbench.engine.bench import predicted_decode_lanes, predicted_prompt_lanes  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a GGUF of the benchmark's shape (weights are not read)")
    ap.add_argument("--profile", required=True, help="hardware profile JSON (workbench calibrate)")
    ap.add_argument("--bench", required=True, help="the run's JSON (workbench bench run --json)")
    ap.add_argument("--placements", required=True, help="the run's --save-placements folder")
    ap.add_argument("--ctx", type=int, default=576, help="prompt + generated tokens of the run")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--bus-share", type=float, default=None,
                    help="decode's bus share of runs that did not record theirs (runs before the balanced share: 0.45)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="a profile number to predict with instead, e.g. bus_read_rate=31e9, cpu_expert_throughput.q8_0=104e9 "
                         "or the first GPU's gpu.expert_throughput.q8_0=1.7e12 (repeatable)")
    args = ap.parse_args(argv)

    inv = open_model(args.model)
    prof = HardwareProfile.load(args.profile)
    for item in args.set:
        name, _, value = item.partition("=")
        field, _, key = name.partition(".")
        if field == "gpu":  # the first GPU's, e.g. gpu.expert_throughput.q8_0=1.7e12 or gpu.launch_s=1.3e-6
            g = prof.gpus[0]
            gfield, _, gkey = key.partition(".")
            g = replace(g, **{gfield: {**getattr(g, gfield), gkey: float(value)} if gkey else float(value)})
            prof = replace(prof, gpus=(g,) + tuple(prof.gpus[1:]))
        elif key:  # a rate by format, e.g. cpu_expert_throughput.q8_0=104e9
            prof = replace(prof, **{field: {**getattr(prof, field), key: float(value)}})
        else:
            prof = replace(prof, **{field: float(value)})
    runs = json.loads(Path(args.bench).read_text())["runs"]
    print("| placement | measured decode tok/s | predicted in the run | predicted now | error now "
          "| measured prefill tok/s | predicted in the run | predicted now | error now |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    worst = worst_prompt = 0.0
    lanes = []
    projects = {run["strategy"]: load_project(p) for run in runs
                if (p := Path(args.placements) / f"{run['strategy']}.json").exists()}
    for run in runs:
        if not run.get("decode_tps") or run["strategy"] not in projects:
            continue
        project = projects[run["strategy"]]
        # a run planned blind (the first, n-cpu-moe) was saved without routing counts and predicted in
        # the bench with its own; the next saved project's counts include them
        later = [p.stats for p in projects.values() if p.stats is not None]
        share = (run.get("engine_paths") or {}).get("bus_share", args.bus_share)  # as the run's engine split
        engine = None if share is None else EngineShape(bus_share=share)
        cost = CostModel(inv, prof, project.stats or (later[0] if later else None), engine=engine)
        pred = cost.predict(project.placement, args.ctx, prompt_tokens=args.prompt)
        err = (pred.decode_tps - run["decode_tps"]) / run["decode_tps"]
        perr = (pred.prefill_tps - run["prefill_tps"]) / run["prefill_tps"]
        worst, worst_prompt = max(worst, abs(err)), max(worst_prompt, abs(perr))

        def cell(v) -> str:
            return f"{v:.1f}" if v else ""

        print(f"| {run['label']} | {run['decode_tps']:.1f} | {cell(run.get('predicted_decode_tps'))} "
              f"| {pred.decode_tps:.1f} | {100 * err:+.1f}% | {run['prefill_tps']:.1f} "
              f"| {cell(run.get('predicted_prefill_tps'))} | {pred.prefill_tps:.1f} | {100 * perr:+.1f}% |")
        lanes.append((run, predicted_prompt_lanes(pred), predicted_decode_lanes(pred)))
    print("\nA prompt's hybrid layers, ms each: the engine's records (busy, waiting for the CPU, the CPU's run) "
          "against the model's lanes now")
    print("| placement | layers | busy | CPU wait | CPU run | model host | model cpu | model bus | model gpu "
          "| model total | resident layers, model total |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for run, lane, _ in lanes:
        h, m, r = run.get("prompt_host") or {}, lane["hybrid"], lane["resident"]
        print(f"| {run['label']} | {m['layers']} | {h.get('busy_ms', 0):.2f} | {h.get('cpu_wait_ms', 0):.2f} "
              f"| {h.get('cpu_run_ms', 0):.2f} | {m['host']:.2f} | {m['cpu']:.2f} | {m['bus']:.2f} | {m['gpu']:.2f} "
              f"| {m['total']:.2f} | {r['layers']} × {r['total']:.2f} |")
    print("\nA decode step's hybrid layers, µs each, as the model has them now (spread: what tokens that give the "
          "CPU more than the mean add)")
    print("| placement | layers | pre | gpu | cpu | bus | sync | spread | total | resident layers, total | other |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for run, _, dec in lanes:
        h, r = dec["hybrid"], dec["resident"]
        print(f"| {run['label']} | {h['layers']} | " + " | ".join(f"{h[k]:.1f}" for k in
              ("pre", "gpu", "cpu", "bus", "sync", "spread", "total")) + f" | {r['layers']} × {r['total']:.1f} | {dec['other']:.1f} |")
    print(f"\nlargest error now: decode {100 * worst:.1f}%, prompt {100 * worst_prompt:.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
