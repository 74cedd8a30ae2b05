#!/usr/bin/env python3
"""On a machine with NVIDIA GPUs: check workbench's NVML telemetry against nvidia-smi, then calibrate.

    python scripts/gpu_check.py [--out DIR] [--budget 20] [--hidden 2048 --ffn 768]

1. Every GPU field of ``workbench.telemetry.nvml`` beside ``nvidia-smi --query-gpu=FIELD
   --format=csv,noheader,nounits`` (one query per field, so an unknown field does not sink the rest):
   static fields must match exactly (name, UUID, bus id, max clocks, power limit, max PCIe link),
   memory within 1% of the total, fast-moving fields (load, temperature, power, clocks, current
   PCIe link) within a tolerance. Per-process memory against ``--query-compute-apps`` while this
   script holds 1 GiB on each GPU.
2. NVML's PCIe RX counter while the script copies host->GPU, and the sampler at 4 Hz for 2 s.
3. ``calibrate()`` at the expert shape, printed and saved as JSON.

Writes ``gpu_check.txt`` and ``calibration.json`` to ``--out`` (default ``$OUT`` or ``.``); exits 1
when a field fails.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workbench.telemetry.nvml import GpuSnapshot, Nvml  # noqa: E402

MiB = 2**20
# (our field, nvidia-smi field, scale from nvidia-smi units to ours, check, tolerance)
FIELDS = [
    ("name", "name", None, "exact", 0),
    ("uuid", "uuid", None, "exact", 0),
    ("pci_bus_id", "pci.bus_id", None, "exact", 0),
    ("memory_total", "memory.total", MiB, "of_total", 0.01),
    ("memory_used", "memory.used", MiB, "of_total", 0.01),
    ("memory_free", "memory.free", MiB, "of_total", 0.01),
    ("memory_reserved", "memory.reserved", MiB, "of_total", 0.01),
    ("util_gpu", "utilization.gpu", 1, "abs", 15),
    ("util_memory", "utilization.memory", 1, "abs", 15),
    ("temperature", "temperature.gpu", 1, "abs", 3),
    ("power_draw", "power.draw", 1, "rel_or_abs", (0.15, 25)),
    ("power_limit", "enforced.power.limit", 1, "abs", 1),
    ("clock_graphics", "clocks.gr", 1, "rel_or_abs", (0.15, 50)),
    ("clock_sm", "clocks.sm", 1, "rel_or_abs", (0.15, 50)),
    ("clock_memory", "clocks.mem", 1, "rel_or_abs", (0.05, 20)),
    ("clock_max_graphics", "clocks.max.gr", 1, "abs", 0),
    ("clock_max_sm", "clocks.max.sm", 1, "abs", 0),
    ("clock_max_memory", "clocks.max.mem", 1, "abs", 0),
    ("pcie_gen", "pcie.link.gen.current", 1, "dynamic", 0),
    ("pcie_gen_max", "pcie.link.gen.max", 1, "abs", 0),
    ("pcie_gen_gpu_max", "pcie.link.gen.gpumax", 1, "abs", 0),
    ("pcie_width", "pcie.link.width.current", 1, "dynamic", 0),
    ("pcie_width_max", "pcie.link.width.max", 1, "abs", 0),
]


def smi(query: str, kind: str = "gpu") -> list[str] | None:
    """One nvidia-smi column (a line per GPU or per process), or None if the field is unknown."""
    try:
        r = subprocess.run(
            ["nvidia-smi", f"--query-{kind}={query}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0:
        return None
    return [line.strip() for line in r.stdout.strip().splitlines()]


def _num(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan  # "[N/A]", "[Not Supported]"


def compare(g: GpuSnapshot, values: dict[str, str | None]) -> tuple[list[str], int]:
    """Table rows for one GPU and the number of failed fields."""
    rows, failed = [], 0
    total = g.memory_total
    for ours_name, smi_name, scale, check, tol in FIELDS:
        ours = getattr(g, ours_name)
        raw = values.get(smi_name)
        if raw is None:
            rows.append(f"  {ours_name:<20} {ours!s:>28}  {'(field unknown to nvidia-smi)':>28}  skip")
            continue
        if scale is None:
            theirs_show = raw
            ok = str(ours).lower() == raw.lower() or (
                ours_name == "pci_bus_id" and str(ours)[-12:].lower() == raw[-12:].lower()
            )
        else:
            theirs = _num(raw) * scale
            theirs_show = raw
            if math.isnan(theirs) or (isinstance(ours, float) and math.isnan(ours)):
                ok = math.isnan(theirs) and math.isnan(float(ours))
                if check == "dynamic":
                    ok = True
            elif check == "of_total":
                ok = abs(ours - theirs) <= tol * (total if not math.isnan(total) else theirs)
            elif check == "abs":
                ok = abs(ours - theirs) <= tol
            elif check == "rel_or_abs":
                rel, ab = tol
                ok = abs(ours - theirs) <= max(ab, rel * abs(theirs))
            else:  # dynamic: reported, not judged
                ok = True
        if scale not in (None, 1) and not math.isnan(float(ours)):
            ours = f"{ours / scale:.0f}"  # show in nvidia-smi's unit (MiB)
        verdict = "ok" if ok else "FAIL"
        if check == "dynamic" and scale is not None and not math.isnan(_num(raw)) and _num(raw) != ours:
            verdict = "ok (changes with load)"
        failed += not ok
        rows.append(f"  {ours_name:<20} {ours!s:>28}  {theirs_show:>28}  {verdict}")
    return rows, failed


def check_processes(nvml: Nvml, out: list[str]) -> int:
    pid = os.getpid()
    ours = {p.pid: p for g in nvml.gpus() for p in g.processes}
    apps = smi("pid,process_name,used_memory", "compute-apps") or []
    theirs = {}
    for line in apps:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[0].isdigit():
            theirs[int(parts[0])] = (parts[1], _num(parts[2]) * MiB)
    out.append(f"processes: NVML lists {len(ours)}, nvidia-smi lists {len(theirs)}; this script is pid {pid}")
    failed = 0
    for p in ours.values():
        t = theirs.get(p.pid)
        if t is None:
            out.append(f"  pid {p.pid} {p.name}: {p.used_bytes / MiB:.0f} MiB (not in nvidia-smi)")
            continue
        ok = abs(p.used_bytes - t[1]) <= 0.01 * max(t[1], 1) or abs(p.used_bytes - t[1]) <= 2 * MiB
        failed += not ok
        out.append(
            f"  pid {p.pid} {p.name}: NVML {p.used_bytes / MiB:.0f} MiB, nvidia-smi {t[1] / MiB:.0f} MiB ({t[0]}) {'ok' if ok else 'FAIL'}"
        )
    return failed


def pcie_under_load(nvml: Nvml, out: list[str]) -> None:
    import torch

    src = torch.ones(256 * MiB, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(src, device="cuda")
    stop = threading.Event()

    def copy() -> None:
        while not stop.is_set():
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()

    t = threading.Thread(target=copy)
    t.start()
    time.sleep(0.3)
    rx = [nvml.gpu(torch.cuda.current_device(), processes=False).pcie_rx for _ in range(5)]
    stop.set()
    t.join()
    out.append("NVML PCIe RX while copying host->GPU: " + ", ".join(f"{r / 1e9:.1f}" for r in rx) + " GB/s")


def sampler_run(nvml: Nvml, out: list[str]) -> None:
    from workbench.telemetry.sampler import Sampler

    s = Sampler(rate_hz=4.0, nvml=nvml)
    s.start()
    time.sleep(2.0)
    s.stop()
    t, used = s.series("memory_used", gpu=0)
    out.append(
        f"sampler: {len(t)} samples in 2 s at 4 Hz, errors {s.errors}, GPU 0 used {used[-1] / MiB:.0f} MiB"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget", type=float, default=20.0)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=768)
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []
    nvml = Nvml()
    lines.append(
        f"NVML status: {nvml.status.name}, driver {nvml.driver_version()}, {nvml.device_count()} GPU(s)"
    )
    if nvml.message:
        lines.append(nvml.message)
    failed = 0
    import torch

    hold = [
        torch.empty(1 << 30, dtype=torch.uint8, device=f"cuda:{i}") for i in range(torch.cuda.device_count())
    ]
    if hold:
        torch.cuda.synchronize()
    time.sleep(0.5)
    snaps = nvml.gpus()
    per_field = {name: smi(name) for _, name, *_ in FIELDS}
    for g in snaps:
        values = {k: (v[g.index] if v and g.index < len(v) else None) for k, v in per_field.items()}
        lines.append(f"GPU {g.index}: field, workbench (NVML), nvidia-smi, verdict")
        rows, f = compare(g, values)
        lines += rows
        failed += f
    for name, step in (
        ("processes", check_processes),
        ("PCIe under load", pcie_under_load),
        ("sampler", sampler_run),
    ):
        try:  # one broken section must not hide the others' results
            failed += step(nvml, lines) or 0
        except Exception as e:
            lines.append(f"{name}: FAILED with {type(e).__name__}: {e}")
            failed += 1
    del hold
    torch.cuda.empty_cache()
    print("\n".join(lines), flush=True)

    from workbench.commands.calibrate import format_profile
    from workbench.engine.calibrate import calibrate

    t = time.perf_counter()
    try:
        prof = calibrate(
            args.hidden,
            args.ffn,
            budget_s=args.budget,
            progress=lambda f, m: print(f"[{f * 100:3.0f}%] {m}", flush=True),
        )
    except Exception as e:  # keep the CPU figures if the GPU part breaks
        traceback.print_exc()
        lines.append(f"calibration with CUDA FAILED: {type(e).__name__}: {e}; retrying CPU only")
        print(lines[-1], flush=True)
        failed += 1
        prof = calibrate(args.hidden, args.ffn, budget_s=args.budget, use_cuda=False)
    wall = time.perf_counter() - t
    text = format_profile(prof)
    lines += ["", f"calibration ({wall:.1f} s wall):", text, f"problems: {prof.problems() or 'none'}"]
    print(lines[-3] + "\n" + text + "\n" + lines[-1])
    prof.save(out_dir / "calibration.json")
    lines.append(f"fields failed: {failed}")
    (out_dir / "gpu_check.txt").write_text("\n".join(lines) + "\n")
    print(f"fields failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
