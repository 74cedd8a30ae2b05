#!/usr/bin/env python3
"""Fit the routing's cost per expert beyond those picked (``calibrate_engine._wide_fit``) and the
kernel cost (``_deep_resident_fit``) alone, on top of a saved profile, without the rest of a
calibration (~2 minutes on CUDA instead of ~6): the 16- and 32-layer models of top-k experts a layer,
then the 16-layer one of 128 experts. Prints the fitted values and writes the profile with them.

    python scripts/probe_wide_fit.py --profile h200.json -o h200_wide.json [--hidden 2048 --ffn 768 --top-k 8]
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workbench.core import synth  # noqa: E402
from workbench.core.costmodel import CostModel, EngineShape  # noqa: E402
from workbench.core.hardware import HardwareProfile  # noqa: E402
from workbench.core.memory import placement_all_gpu  # noqa: E402
from workbench.engine import calibrate_engine as ce  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    prof = HardwareProfile.load(a.profile)
    room = ce.calibration_room(a.device)
    shape = synth.SynthShape("calibration", "qwen3moe", ce.LAYERS, a.hidden, 32, 4, 128, a.top_k, a.top_k, a.ffn,
                             ce.VOCAB, qk_norm=True)

    def with_launch(v: float) -> HardwareProfile:
        return ce.first_gpu(prof, launch_s=v, route_s_per_expert=0.0)

    def seconds(p: HardwareProfile, model) -> float:
        return 1.0 / CostModel(model, p, engine=EngineShape(bus_share=0.0)).decode_tps(
            placement_all_gpu(model), kv_tokens=16 + ce.STEPS)

    deep = ce._deep_resident_fit(shape, a.device, room, seconds, with_launch)
    if deep is None:
        print("no room for the deep models")
        return 1
    fitted = replace(with_launch(deep["launch_s"]), decode_step_s=deep["step_s"])
    wide = ce._wide_fit(shape, a.device, room, deep, lambda m: seconds(fitted, m))
    if wide is not None:
        fitted = ce.first_gpu(fitted, route_s_per_expert=wide["route_s_per_expert"])
    print(f"kernel {deep['launch_s'] * 1e6:.2f} us, host {deep['step_s'] * 1e6:.0f} us a step; "
          f"{ce.depth_runs(deep['resident_s'], deep['depths'])} all resident; "
          + ("no room for the wide model" if wide is None else
             f"wide {wide['wide_s'] * 1e3:.3f} ms ({wide['experts']} experts) against {wide['narrow_s'] * 1e3:.3f}: "
             f"{wide['route_s_per_expert'] * 1e9:.1f} ns per expert beyond those picked"))
    fitted.save(a.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
