"""``workbench plan MODEL --strategy S --vram SIZE``: plan a placement and predict what it does.

Reads headers only and imports neither torch nor Qt. Prints bytes per device and the predicted
decode and prefill tokens/s; ``-o PROJECT.json`` saves the placement as a project file (model
reference, hardware profile, stats and the planning settings) for ``workbench export`` and the GUI.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from workbench.core.costmodel import CostModel
from workbench.core.errors import WorkbenchError
from workbench.core.fmt import bytes2human, parse_size
from workbench.core.hardware import HardwareProfile, preset
from workbench.core.memory import KV_DTYPES, default_ctx
from workbench.core.placement import Budget
from workbench.core.planner import STRATEGIES, Planner
from workbench.core.project import Project
from workbench.core.readers import open_model
from workbench.core.stats import ExpertStats

DEFAULT_PROFILE = "rtx4090+ddr5-2ch"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="Hugging Face model folder or GGUF file")
    parser.add_argument("--strategy", default="balanced", choices=[*STRATEGIES, "all"],
                        help="how to place the experts (balanced); 'all' compares every strategy")
    parser.add_argument("--vram", metavar="SIZE", help="VRAM of each GPU, e.g. 24G (default: the profile's)")
    parser.add_argument("--margin", metavar="SIZE", default="0", help="VRAM to keep free on each GPU, e.g. 1G (0)")
    parser.add_argument("--host-ram", metavar="SIZE", help="host RAM the model may use (default: the profile's)")
    parser.add_argument("--profile", metavar="NAME|FILE", default=DEFAULT_PROFILE,
                        help=f"hardware preset (e.g. rtx4090+ddr5-2ch, bench-h200) or a profile JSON "
                             f"from `workbench calibrate -o` ({DEFAULT_PROFILE})")
    parser.add_argument("--stats", metavar="FILE", help="expert stats JSON (or a project file holding stats)")
    parser.add_argument("--ctx", type=int, default=None, metavar="N",
                        help="context length to budget for (default: 4096 or the model's own, if shorter)")
    parser.add_argument("--kv-dtype", default="f16", choices=sorted(KV_DTYPES), help="KV cache type (f16)")
    parser.add_argument("--prompt", type=int, default=512, metavar="N", help="prompt tokens for prefill (512)")
    parser.add_argument("--stream-slots", type=int, default=0, metavar="N",
                        help="stream RAM experts through a GPU cache of N slots per layer instead of "
                             "computing them on the CPU (0)")
    parser.add_argument("--layers", action="store_true", help="also print the per-layer breakdown")
    parser.add_argument("--json", action="store_true", help="print the prediction as JSON")
    parser.add_argument("-o", "--output", metavar="PROJECT.json", help="save the plan as a project file")


def load_profile(text: str) -> HardwareProfile:
    """A profile from a JSON file (``workbench calibrate -o``, or a project) or a preset name."""
    if text.endswith(".json") or Path(text).is_file():
        return HardwareProfile.load(text)
    return preset(text)


def _size(text: str | None, what: str) -> int | None:
    if text is None:
        return None
    try:
        n = parse_size(text)
    except ValueError as e:
        raise WorkbenchError(f"{what}: {e}") from None
    return n


def _profile_and_budget(args) -> tuple[HardwareProfile, Budget]:
    profile = load_profile(args.profile)
    if not profile.gpus:
        raise WorkbenchError(f"the profile {args.profile!r} has no GPU: pick one with a GPU "
                             "(e.g. rtx4090+ddr5-2ch) or calibrate on a machine with one")
    vram = _size(args.vram, "--vram")
    if vram is not None:
        profile = profile.with_gpus(tuple(replace(g, vram_bytes=vram) for g in profile.gpus))
    margin = _size(args.margin, "--margin") or 0
    host = _size(args.host_ram, "--host-ram")
    return profile, Budget.from_profile(profile, margin=margin, host_bytes=host)


def run(args) -> int:
    if (args.ctx is not None and args.ctx < 1) or args.prompt < 1:
        raise WorkbenchError("--ctx and --prompt take a token count >= 1")
    inv = open_model(args.model)
    if args.ctx is None:
        args.ctx = default_ctx(inv.spec)
    if not inv.spec.is_moe:
        raise WorkbenchError(f"{args.model} is not a Mixture-of-Experts model: there are no experts to place")
    profile, budget = _profile_and_budget(args)
    stats = ExpertStats.load(args.stats) if args.stats else None
    try:
        cost = CostModel(inv, profile, stats)
    except ValueError as e:
        raise WorkbenchError(str(e)) from None
    mode = "stream" if args.stream_slots > 0 else "compute"
    planner = Planner(cost, budget, ctx=args.ctx, kv_dtype=args.kv_dtype, prompt_tokens=args.prompt,
                      cpu_mode=mode, stream_slots=args.stream_slots)
    header = (f"{inv.path.name}: {inv.spec.n_layers} layers x {inv.spec.n_experts} experts, "
              f"{bytes2human(inv.total_bytes)}; {profile.name}, "
              + ", ".join(f"gpu:{i} {bytes2human(b)}" for i, b in enumerate(budget.gpu_bytes))
              + (f" (margin {bytes2human(budget.margin)})" if budget.margin else "")
              + f"; context {args.ctx}; " + ("with expert stats" if stats else "no expert stats: uniform routing"))
    if args.strategy == "all":
        return _compare(planner, header, args)
    plan = planner.plan(args.strategy)
    if args.json:
        print(json.dumps({"strategy": plan.strategy, "notes": plan.notes, "n_cpu_moe": plan.n_cpu_moe,
                          "placement": plan.placement.to_json(), "prediction": plan.prediction.to_json()}))
    else:
        print(header)
        print(f"strategy {plan.strategy} (planned in {plan.seconds * 1000:.0f} ms)")
        for note in plan.notes:
            print(f"  {note}")
        print()
        print(plan.prediction.table(per_layer=args.layers))
    if args.output:
        settings = {"ctx": args.ctx, "kv_dtype": args.kv_dtype, "margin": budget.margin,
                    "prompt_tokens": args.prompt, "strategy": plan.strategy}
        Project.for_model(inv, plan.placement, profile, stats, settings).save(args.output)
        if not args.json:
            print(f"\nsaved {args.output}")
    return 0


def _compare(planner: Planner, header: str, args) -> int:
    from workbench.core.errors import PlacementError

    rows = []
    for strategy in STRATEGIES:
        try:
            plan = planner.plan(strategy)
        except PlacementError as e:
            rows.append((strategy, None, str(e)))
            continue
        rows.append((strategy, plan, ""))
    if args.json:
        print(json.dumps({s: (p.prediction.to_json() if p else {"error": err}) for s, p, err in rows}))
        return 0
    print(header)
    print(f"{'strategy':<10} {'gpu:0':>10} {'cpu':>10} {'decode tok/s':>13} {'prefill tok/s':>14}")
    for strategy, plan, err in rows:
        if plan is None:
            print(f"{strategy:<10} does not fit: {err}")
            continue
        m = plan.prediction.memory
        print(f"{strategy:<10} {bytes2human(m.total('gpu:0')):>10} {bytes2human(m.total('cpu')):>10} "
              f"{plan.prediction.decode_tps:13.2f} {plan.prediction.prefill_tps:14.1f}")
    if args.output:
        raise WorkbenchError("-o saves one plan: pick a --strategy")
    return 0
