"""``workbench calibrate``: measure this machine (under 30 s) and print or save its HardwareProfile.

The expert shape comes from ``--model PATH`` (headers only) or ``--hidden``/``--ffn`` (default: the
Qwen3-30B-A3B expert, 2048 x 768). Without CUDA the CPU side is measured and ``--preset`` supplies
the GPU side (what-if), or the GPU fields stay absent.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from workbench.core.errors import WorkbenchError
from workbench.core.fmt import bytes2human
from workbench.core.hardware import HardwareProfile


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the profile as JSON")
    parser.add_argument("-o", "--output", metavar="FILE", help="save the profile as JSON to FILE")
    parser.add_argument("--model", metavar="PATH", help="take the expert shape from this model's headers")
    parser.add_argument("--hidden", type=int, metavar="N", help="model hidden size (2048)")
    parser.add_argument("--ffn", type=int, metavar="N", help="routed expert FFN size (768)")
    parser.add_argument(
        "--budget", type=float, default=20.0, metavar="S", help="seconds to spend (20, at most 28)"
    )
    parser.add_argument("--preset", metavar="NAME", help="GPU side from this preset when there is no CUDA")
    parser.add_argument("--formats", metavar="LIST", help="CPU weight formats to measure, e.g. bf16,int8")
    parser.add_argument("--kquants", metavar="LIST", default="q4_k",
                        help="kept GGUF block formats whose CPU kernel is timed (q4_k; e.g. q4_k,q3_k,iq4_xs,mxfp4: "
                             "others are rated as q4_k)")
    parser.add_argument("--kept-fits", metavar="LIST",
                        help="kept GGUF block formats whose GPU rate is fitted to the engine's decode (default: "
                             "q8_0,q4_k; 'none': each keeps its kernel's measured rate)")
    parser.add_argument("--cpu-only", action="store_true", help="do not measure GPUs even if CUDA is present")
    parser.add_argument("--threads", type=int, metavar="N", help="CPU threads (default: torch's choice)")
    parser.add_argument("--refit-prompt", metavar="PROFILE",
                        help="measure nothing else: fit only the prompt's host time per hybrid layer (CUDA, "
                             "~30 s) on top of this saved profile")


def _shape(args: argparse.Namespace) -> tuple[int, int]:
    hidden, ffn = args.hidden, args.ffn
    if args.model:
        from workbench.core.readers import open_model

        spec = open_model(args.model).spec
        if not spec.expert_ffn:
            raise WorkbenchError(f"{args.model} has no routed experts (expert FFN size unknown)")
        hidden = spec.hidden_size if hidden is None else hidden
        ffn = spec.expert_ffn if ffn is None else ffn
    hidden, ffn = 2048 if hidden is None else hidden, 768 if ffn is None else ffn
    if hidden < 1 or ffn < 1 or hidden > 65536 or ffn > 65536:
        raise WorkbenchError(f"expert shape {hidden} x {ffn} is out of range (1..65536)")
    return hidden, ffn


def _rate(value: float) -> str:
    return "N/A" if value is None or math.isnan(value) else f"{value / 1e9:.1f} GB/s"


def format_profile(p: HardwareProfile) -> str:
    """The profile as text, with where each figure came from."""
    prov = p.provenance
    tag = lambda key: f"  [{prov[key]}]" if key in prov else ""  # noqa: E731
    lines = [f"{p.name}", f"  source: {p.source}"]
    for g in p.gpus:
        exp = "N/A" if g.expert_bandwidth is None else f"{g.expert_bandwidth / 1e9:.0f} GB/s"
        lines.append(
            f"  GPU {g.name}: {bytes2human(g.vram_bytes)}, memory {g.mem_bandwidth / 1e12:.2f} TB/s, "
            f"bf16 {g.bf16_flops / 1e12:.0f} TFLOP/s, experts (batch 1) {exp}, launch {g.launch_s * 1e6:.1f} us, "
            f"PCIe gen {g.pcie_gen or 'N/A'} x{g.pcie_width or 'N/A'}{tag('gpus')}"
        )
    if not p.gpus:
        lines.append(f"  GPU: none{tag('gpus')}")
    lines += [
        f"  host->GPU pinned {_rate(p.h2d_pinned)}, pageable {_rate(p.h2d_pageable)}; "
        f"GPU->host pinned {_rate(p.d2h_pinned)}{tag('h2d_pinned')}",
        f"  sync per layer {p.sync_s * 1e6:.0f} us{tag('sync_s')}; host time per hybrid prompt layer "
        f"{p.prompt_sync_s * 1e6:.0f} us"
        + (f", +{p.prompt_cpu_sync_s * 1e6:.0f} us with a CPU share" if p.prompt_cpu_sync_s else "")
        + (f", the CPU's share {p.prompt_cpu_scale:.2f}x its kernel's time" if p.prompt_cpu_scale != 1 else "")
        + (f", its copies at {_rate(p.prompt_h2d)}" if p.prompt_h2d else "")
        + (f"; a resident prompt layer at least {p.prompt_resident_layer_s * 1e6:.0f} us"
           if p.prompt_resident_layer_s else "") + tag("prompt_sync_s"),
        f"  host RAM {bytes2human(p.host_ram_bytes)}, read {_rate(p.host_read_bandwidth)}{tag('host_read_bandwidth')}",
        f"  CPU {p.cpu_cores} cores, bf16 GEMM {p.cpu_flops / 1e12:.2f} TFLOP/s{tag('cpu_flops')}",
        "  CPU experts (batch 1, bytes of weights/s):"
        + "".join(f" {fmt} {_rate(v)};" for fmt, v in p.cpu_expert_throughput.items())
        + tag("cpu_expert_throughput"),
    ]
    if any((p.prompt_host_layer_s, p.prompt_host_cpu_s, p.prompt_host_batch_s, p.prompt_host_copy_s)):
        lines.insert(4 + max(1, len(p.gpus)),  # after the sync line
                     f"  engine thread per hybrid prompt layer {p.prompt_host_layer_s * 1e6:.0f} us, "
                     f"+{p.prompt_host_cpu_s * 1e6:.0f} us with a CPU share, {p.prompt_host_batch_s * 1e6:.0f} us "
                     f"a fetched batch, {p.prompt_host_copy_s * 1e6:.1f} us a copy" + tag("prompt_host_layer_s"))
    if p.cpu_prompt_flops:
        lines.append("  CPU experts in a prompt (each further token per expert, FLOP/s):"
                     + "".join(f" {fmt} {v / 1e9:.0f} G;" for fmt, v in p.cpu_prompt_flops.items())
                     + tag("cpu_prompt_flops"))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    hidden, ffn = _shape(args)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()] if args.formats else None
    if args.preset:
        from workbench.core.hardware import preset

        preset(args.preset)  # fail on a bad name before spending 20 s
    import torch

    from workbench.engine.calibrate import calibrate

    if args.threads:
        torch.set_num_threads(args.threads)
    show = not args.json

    import time

    t0 = time.perf_counter()
    if args.refit_prompt:
        from workbench.engine.calibrate import refit_prompt

        if not torch.cuda.is_available():
            raise WorkbenchError("--refit-prompt times the engine's prompts on CUDA, and there is no CUDA GPU here")
        base = HardwareProfile.load(args.refit_prompt)
        prof = refit_prompt(base, hidden, ffn, report=lambda m: print(m, file=sys.stderr, flush=True))
        return _finish(args, prof)

    def progress(fraction: float, message: str) -> None:  # with the seconds since the start
        if show:
            print(f"[{fraction * 100:3.0f}% {time.perf_counter() - t0:5.0f} s] {message}", file=sys.stderr, flush=True)

    prof = calibrate(
        hidden,
        ffn,
        budget_s=args.budget,
        progress=progress,
        preset=args.preset,
        formats=formats,
        use_cuda=False if args.cpu_only else None,
        kquants=tuple(f.strip().lower() for f in args.kquants.split(",") if f.strip()),
        kept_fits=_kept_fits(args.kept_fits),
    )
    return _finish(args, prof)


def _kept_fits(text: str | None) -> tuple[str, ...] | None:
    """``--kept-fits``'s formats: None (the default set) when absent, () for ``none``."""
    if text is None:
        return None
    names = tuple(f.strip().lower() for f in text.split(",") if f.strip())
    if names == ("none",):
        return ()
    bad = sorted(set(names) - {"q8_0", "q4_k"})
    if bad:
        raise WorkbenchError(f"--kept-fits takes q8_0, q4_k or none, not {', '.join(bad)}")
    return names


def _finish(args: argparse.Namespace, prof: HardwareProfile) -> int:
    """Save and print ``prof`` as the arguments ask."""
    problems = prof.problems()
    if args.output:
        prof.save(args.output)
    if args.json:
        print(json.dumps(prof.to_json(), indent=2, allow_nan=False))
    else:
        print(format_profile(prof))
        if args.output:
            print(f"saved to {args.output}")
    if problems:
        print("warning: " + "; ".join(problems), file=sys.stderr)
    return 0
