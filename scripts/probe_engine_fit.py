#!/usr/bin/env python3
"""Run calibration's engine fit alone (``calibrate_engine.fit_engine_costs``) and print its decode
steps and fitted values in microseconds (with the two resident depths' steps), to see how steady
they are from process to process. Kept block formats are not fitted.

    python scripts/probe_engine_fit.py fresh|warm PROFILE.json

``warm`` first runs a 16-thread matrix product in the main thread (as ``workbench calibrate``'s CPU
measurements do before the fit). ``WORKBENCH_SERVER_THREADS`` and ``WORKBENCH_SERVED`` apply.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from workbench.core.hardware import HardwareProfile  # noqa: E402
from workbench.engine.calibrate_engine import fit_engine_costs  # noqa: E402


def main(argv: list[str]) -> int:
    mode, profile = argv
    prof = HardwareProfile.load(profile)
    if mode == "warm":
        a = torch.randn(4096, 4096)
        for _ in range(5):
            a @ a
    t = time.time()
    _, info = fit_engine_costs(prof, 2048, 768, 8, kept=())
    us = {k: round(v * 1e6) for k, v in info.items() if k != "cpu_rate" and isinstance(v, float)}
    deep = info.get("deep")
    if deep:  # the two resident depths behind the kernel cost and the host's time per step
        us["deep"] = {d: round(t * 1e6) for d, t in zip(deep["depths"], deep["resident_s"])}
    print(mode, os.environ.get("WORKBENCH_SERVER_THREADS", "default threads"), us,
          f"CPU rate {info['cpu_rate'] / 1e9:.1f} GB/s", f"{time.time() - t:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
