"""``workbench bench``: benchmark placements (and llama.cpp) on a synthetic MoE model.

Sub-commands:
  write        write a synthetic model (S1 by default) as GGUF with a chosen routing skew
  reskew       give an existing synthetic file new router weights (e.g. skewed -> uniform)
  llamacpp     run llama.cpp's llama-bench over placements under a VRAM budget
  cpu-formats  measure the CPU expert formats (GB/s of weight bytes at an expert's shape)
  run          run our engine over placements/strategies under a VRAM budget

Results print as markdown tables; ``--json FILE`` keeps every figure.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from workbench.core import synth
from workbench.core.errors import WorkbenchError
from workbench.core.fmt import bytes2human, parse_size

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", metavar="WHAT", required=True)

    w = sub.add_parser("write", help="write a synthetic model as GGUF")
    w.add_argument("-o", "--output", required=True, help="GGUF file to write")
    _shape_args(w)
    w.add_argument("--coverage", default="0.5", metavar="C[,C...]",
                   help="share of each layer's selections served by its top 10%% experts (0.5), "
                        "or one value per layer")
    w.add_argument("--uniform", action="store_true", help="uniform routing (no skew)")
    w.add_argument("--weights", default="bf16", choices=synth.WEIGHT_TYPES, help="weight format (bf16)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--sparse", action="store_true",
                   help="leave the weights as holes (zeros, no disk space): for offline memory estimates and "
                        "predictions (scripts/check_predictions.py), not for running")

    r = sub.add_parser("reskew", help="give a synthetic file new router weights in place")
    r.add_argument("path")
    r.add_argument("--coverage", default="0.5", metavar="C[,C...]")
    r.add_argument("--uniform", action="store_true")

    ll = sub.add_parser("llamacpp", help="run llama-bench over placements")
    ll.add_argument("--binary", default=".llamacpp/bin/llama-bench", help="llama-bench executable")
    ll.add_argument("--model", required=True, help="GGUF file")
    ll.add_argument("--budget", default="12GiB", help="GPU memory budget (12GiB)")
    ll.add_argument("--n-cpu-moe", default="16", metavar="LIST",
                    help="comma-separated --n-cpu-moe values to run (16: the 12 GiB budget on S1)")
    ll.add_argument("--ot-around", type=int, default=None, metavar="N",
                    help="also run -ot variants between --n-cpu-moe N-1 and N")
    ll.add_argument("--all-gpu", action="store_true", help="also run everything on the GPU")
    ll.add_argument("--llama-args", default="", metavar="ARGS",
                    help="extra llama-bench arguments for every configuration; write it as "
                         "--llama-args='-lm none' (with '=')")
    ll.add_argument("-p", "--prompt", type=int, default=512)
    ll.add_argument("-n", "--gen", type=int, default=128)
    ll.add_argument("-r", "--repeats", type=int, default=3)
    ll.add_argument("-t", "--threads", type=int, default=16)
    ll.add_argument("--time-limit", type=float, default=None, metavar="S",
                    help="skip configurations that would start later than S seconds from now")
    ll.add_argument("--json", metavar="FILE", help="write all results as JSON")
    ll.add_argument("--label", default="", help="name of this run in the tables (e.g. 'S1 skewed')")

    c = sub.add_parser("cpu-formats", help="measure CPU expert formats")
    _shape_args(c)
    c.add_argument("--formats", default="bf16,int8,int4,f32")
    c.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    c.add_argument("--experts", type=int, default=128, help="distinct experts cycled through (128)")
    c.add_argument("--tokens", type=int, default=1)
    c.add_argument("--pool", default="", metavar="LIST",
                   help="also time a layer's selected experts with ExpertPool workers, e.g. 1,2,4,8")
    c.add_argument("--json", metavar="FILE")

    e = sub.add_parser("run", help="run our engine over placements")
    e.add_argument("--model", required=True, help="GGUF file (a synthetic one: `workbench bench write`)")
    e.add_argument("--budget", default="12GiB")
    e.add_argument("--margin", default="0", metavar="SIZE",
                   help="VRAM the planner keeps free under the budget (the budget check itself uses the "
                        "measured NVML peak against --budget)")
    e.add_argument("--strategies", default="n-cpu-moe,frequency,balanced",
                   help="comma-separated placement strategies of the planner")
    e.add_argument("--all-gpu", action="store_true", help="also run everything on the GPU")
    e.add_argument("-p", "--prompt", type=int, default=512)
    e.add_argument("-n", "--gen", type=int, default=128)
    e.add_argument("-r", "--repeats", type=int, default=3)
    e.add_argument("--device", default="cuda", help="cuda or cpu (cpu: every tier on the CPU)")
    e.add_argument("--dtype", default="bf16", choices=("bf16", "f32"), help="compute dtype (bf16)")
    e.add_argument("--profile", default="bench-h200",
                   help="hardware profile for predictions: preset name or calibration JSON (bench-h200)")
    e.add_argument("--time-limit", type=float, default=None, metavar="S",
                   help="skip placements that would start later than S seconds from now")
    e.add_argument("--llama-bench", metavar="PATH", default=None,
                   help="also run llama.cpp's llama-bench on the same file first, side by side")
    e.add_argument("--llama-n-cpu-moe", default="16", metavar="LIST",
                   help="--n-cpu-moe values for llama.cpp (16)")
    e.add_argument("--llama-args", default="", metavar="ARGS",
                   help="extra llama-bench arguments; write --llama-args='-lm none'")
    e.add_argument("--threads", type=int, default=16, help="CPU threads for llama.cpp (16)")
    e.add_argument("--json", metavar="FILE")
    e.add_argument("--save-placements", metavar="DIR", default=None,
                   help="save each run's placement as a project file DIR/<strategy>.json")
    e.add_argument("--no-host-probe", dest="probe_host", action="store_false",
                   help="do not read the host's RAM speed before each run (nor predict at it)")


def _shape_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", default="s1", choices=sorted(synth.SHAPES), help="model shape (s1)")
    p.add_argument("--layers", type=int, default=None, help="override the layer count")


def _write_json(path: str | None, data) -> None:
    if path:
        Path(path).write_text(json.dumps(data, indent=1, default=str))


def run(args: argparse.Namespace) -> int:
    cmd = args.bench_command
    for name in ("path", "model"):
        p = getattr(args, name, None)
        if p is not None and not Path(p).is_file():
            raise WorkbenchError(f"no such file: {p}")
    if cmd == "write":
        return _write(args)
    if cmd == "reskew":
        betas = synth.rewrite_routers(args.path, coverage_target=None if args.uniform else _coverage(args.coverage))
        print(f"{args.path}: routers rewritten (beta {min(betas):.3f}..{max(betas):.3f})")
        return 0
    if cmd == "llamacpp":
        return _llamacpp(args)
    if cmd == "cpu-formats":
        return _cpu_formats(args)
    from workbench.engine import bench

    return bench.run_command(args)


def _coverage(text: str) -> float | list[float]:
    try:
        vals = [float(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise WorkbenchError(f"--coverage takes a number or comma-separated numbers, not {text!r}") from e
    if not vals:
        raise WorkbenchError("--coverage needs a value")
    return vals[0] if len(vals) == 1 else vals


def _write(args) -> int:
    s = synth.shape(args.shape, args.layers)
    cov = None if args.uniform else _coverage(args.coverage)
    info = synth.write_gguf(args.output, s, coverage_target=cov,
                            wtype=args.weights, seed=args.seed, sparse=args.sparse)
    skew = "uniform" if info.coverage_target is None else f"top 10% experts serve {info.design_coverage:.0%}"
    print(f"wrote {info.path}: {s.name}, {s.n_layers} layers, {info.wtype}, {bytes2human(info.nbytes)} "
          f"in {info.seconds:.1f} s; routing by design: {skew}")
    return 0


def _llamacpp(args) -> int:
    from workbench.engine import bench_llamacpp as lb

    if not Path(args.binary).is_file():
        raise WorkbenchError(f"no llama-bench at {args.binary}: build it with scripts/build_llamacpp.sh")
    budget = parse_size(args.budget)
    try:
        configs = [lb.n_cpu_moe(int(n)) for n in args.n_cpu_moe.split(",") if n.strip()]
    except ValueError as e:
        raise WorkbenchError(f"--n-cpu-moe takes comma-separated integers, not {args.n_cpu_moe!r}") from e
    if args.ot_around is not None:
        configs += lb.ot_variants(args.ot_around)
    if args.all_gpu:
        configs.insert(1, lb.all_gpu())
    deadline = None if args.time_limit is None else time.monotonic() + args.time_limit
    results = lb.run_configs(args.binary, args.model, configs, deadline=deadline, prompt=args.prompt,
                             gen=args.gen, repeats=args.repeats, threads=args.threads,
                             extra=tuple(args.llama_args.split()))
    rows = []
    for r in results:
        fits = None if r.peak_gpu_bytes is None else r.peak_gpu_bytes <= budget
        rows.append({**r.to_json(), "fits": fits, "peak_gpu": _gib(r.peak_gpu_bytes),
                     "peak_host": _gib(r.peak_host_bytes)})
    best = lb.best_within(results, budget)
    _write_json(args.json, {"label": args.label, "model": args.model, "budget_bytes": budget,
                            "best": best.label if best else None, "results": rows})
    from workbench.engine.bench_measure import markdown_table

    print(markdown_table(rows, [("llama.cpp placement", "label"), ("peak GPU GiB", "peak_gpu"),
                                ("fits", "fits"), ("prefill tok/s", "prefill_tps"), ("sd", "prefill_sd"),
                                ("decode tok/s", "decode_tps"), ("sd", "decode_sd"),
                                ("peak host GiB", "peak_host"), ("error", "error")]))
    print(f"best within {args.budget}: {best.label if best else 'none'}")
    return 0


def _gib(b: float | None) -> float | None:
    return None if b is None else b / 2**30


def _cpu_formats(args) -> int:
    import torch

    from workbench.engine.bench import cpu_format_table
    from workbench.engine.bench_measure import markdown_table

    if args.threads:
        torch.set_num_threads(args.threads)
    s = synth.shape(args.shape, args.layers)
    try:
        pool = tuple(int(w) for w in args.pool.split(",") if w.strip())
    except ValueError as e:
        raise WorkbenchError(f"--pool takes comma-separated worker counts, not {args.pool!r}") from e
    rows = cpu_format_table(s.hidden, s.expert_ffn, args.formats.split(","), n_experts=args.experts,
                            tokens=args.tokens, selected=s.n_active, pool_workers=pool)
    _write_json(args.json, {"shape": s.name, "threads": torch.get_num_threads(), "rows": rows})
    print(markdown_table(rows, [("format", "format"), ("matrix", "matrix"), ("µs", "us_per_matrix"),
                                ("GB/s of weight bytes", "gbps"), ("bf16-equivalent GB/s", "bf16_equiv_gbps")]))
    return 0
