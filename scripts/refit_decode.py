#!/usr/bin/env python3
"""Fit a profile's decode costs again, offline, from the step times a `workbench calibrate` logged,
with this checkout's cost model: after a change to the model, what the same calibration would have
fitted, without a GPU.

The calibration log's line ``engine decode per 8-layer step: R ms all resident (Q ms a step
queued ...), S16 / S4 / S2 / S34 ms a sixteenth / quarter / half / three quarters on the CPU, C ms
all on the CPU`` gives the times; ``--experts`` is the calibration model's experts per layer (its
log: ``calibration model written ...: 8 layers of N experts``). The calibration model is written
sparse (header and routers only). Runs the calibration did not log (queued steps before they were
timed, a kept format's hybrid runs) are left out: their fitted values stay as in the profile.

    python scripts/refit_decode.py --profile h200.json --experts 64 \\
        --steps 0.60,0.96,1.83,3.24,4.31,5.37 [--queued 0.52] [--q8-resident 0.48] [--deep 1.31,2.35] \\
        [--packets 12,80] [--wide 1.28,1.10] -o refit.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workbench.core import synth  # noqa: E402
from workbench.core.hardware import HardwareProfile  # noqa: E402
from workbench.engine import calibrate_engine as ce  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("--experts", type=int, required=True, help="the calibration model's experts per layer")
    ap.add_argument("--steps", required=True, help="ms per step: all resident, the four hybrid shares, all on the CPU")
    ap.add_argument("--queued", type=float, default=None, help="ms per all-resident step queued (absent: as waited)")
    ap.add_argument("--q8-resident", type=float, default=None, help="ms per Q8_0 all-resident step (absent: no Q8_0 fit)")
    ap.add_argument("--deep", default=None,
                    help="ms per step of the two deeper all-resident models, as logged (`... a step of 16 layers, "
                         "... of 32`): 'T16,T32' (absent: the 8-layer resident run fits the kernel cost, as before)")
    ap.add_argument("--packets", default=None,
                    help="the decode server's packets as traced (scripts/trace_served.py): 'FIXED_US,GBS' per packet "
                         "and GB/s of experts; calibration then fits the host point alone (absent: with the rate)")
    ap.add_argument("--wide", default=None,
                    help="ms per step of the wide fit's two models, as logged (`... layers: W ms with E experts a "
                         "layer, N ms with K`): 'W,N' (absent: no routing cost per expert, as before it)")
    ap.add_argument("--wide-experts", type=int, default=None,
                    help="the wide model's experts a layer, as logged (absent: what this machine's room gives)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("-o", "--out", required=True)
    args = ap.parse_args(argv)

    steps = [float(v) * 1e-3 for v in args.steps.split(",")]
    if len(steps) != 2 + len(ce.HYBRID_SHARES):
        ap.error(f"--steps takes {2 + len(ce.HYBRID_SHARES)} times")
    queued = steps[0] if args.queued is None else args.queued * 1e-3
    prof = HardwareProfile.load(args.profile)
    write = synth.write_gguf
    synth.write_gguf = lambda path, shape, **kw: write(path, shape, **{**kw, "sparse": True})
    ce.calibration_experts = lambda *a, **k: args.experts
    ce._fit_cpu_rate = lambda p, inv, fmt, device, info: p.cpu_expert_throughput[fmt]  # no logged hybrid runs
    order = iter([0] * ce.REPEATS + [i for i in range(1, 1 + len(ce.HYBRID_SHARES)) for _ in range(ce.REPEATS)]
                 + [len(steps) - 1])

    deep = dict(zip(ce.DEPTHS, (float(v) * 1e-3 for v in args.deep.split(",")))) if args.deep else None
    if deep is None:
        ce._deep_resident_fit = lambda *a: None

    wide = [float(v) * 1e-3 for v in args.wide.split(",")] if args.wide else None
    if wide is None:
        ce._wide_fit = lambda *a: None
    elif args.wide_experts:  # as many experts as the GPU's room gave, not this machine's
        ce.WIDE_EXPERTS, fit_wide = args.wide_experts, ce._wide_fit
        ce._wide_fit = lambda shape, device, room, deep, seconds: fit_wide(shape, device, 1e15, deep, seconds)

    if args.packets:  # the decode server's packets as a trace measured them (calibration fits the rest)
        fixed_us, rate_gbs = (float(v) for v in args.packets.split(","))
        ce.packet_rate = lambda records, nbytes: (fixed_us * 1e-6, rate_gbs * 1e9)
    else:  # a log has no packets: the host point and rate fitted together, as before the trace
        ce.packet_rate = lambda records, nbytes: None

    def times(inv, placement, device, steps_=ce.STEPS, packets=None):
        if wide is not None and "experts.gguf" in str(inv.path):  # the wide fit's models: top-k, then wide
            return (wide[1],) * 2 if inv.spec.n_experts == inv.spec.n_experts_active else (wide[0],) * 2
        if deep is not None and inv.spec.n_layers in deep and "layers" in str(inv.path):
            return deep[inv.spec.n_layers], deep[inv.spec.n_layers]
        if "q8_0" in str(inv.path):
            return args.q8_resident * 1e-3, args.q8_resident * 1e-3
        i = next(order)
        return steps[i], (queued if i == 0 else steps[i])

    ce._decode_times = times
    kept = ("q8_0",) if args.q8_resident is not None else ()
    fitted, info = ce.fit_engine_costs(prof, args.hidden, args.ffn, args.top_k, device="cpu", kept=kept)
    fitted.save(args.out)
    print(f"host per step {info['step_s'] * 1e6:.0f} us, kernel {info['launch_s'] * 1e6:.2f} us, host point "
          f"{info['sync_s'] * 1e6:.0f} us, CPU experts {info['cpu_rate'] / 1e9:.1f} GB/s"
          + (f", routing {info['wide']['route_s_per_expert'] * 1e9:.1f} ns per expert" if info.get("wide") else "")
          + "".join(f"; {f} GPU rate {k['rate'] / 1e9:.0f} GB/s" for f, k in info.get("kept", {}).items())
          + f" -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
