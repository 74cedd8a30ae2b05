"""``workbench hw``: this machine's GPUs (NVML) and host (psutil), once or live; hardware presets.

Imports neither torch nor Qt. Without an NVIDIA driver it says so and shows the host.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from workbench.core.errors import WorkbenchError
from workbench.core.fmt import bytes2human
from workbench.core.hardware import HardwareProfile, load_presets
from workbench.telemetry.host import CpuInfo, HostMonitor, HostSnapshot, cpu_info
from workbench.telemetry.na import NA, is_na
from workbench.telemetry.nvml import GpuSnapshot, NvmlReport, report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json", action="store_true", help="print JSON (one object per refresh with --watch)"
    )
    parser.add_argument("--watch", action="store_true", help="refresh until Ctrl-C")
    parser.add_argument(
        "--interval", type=float, default=1.0, metavar="S", help="seconds between refreshes (1.0)"
    )
    parser.add_argument(
        "--count", type=int, default=0, metavar="N", help="with --watch: stop after N refreshes"
    )
    parser.add_argument("--no-processes", action="store_true", help="do not list the processes on each GPU")
    parser.add_argument(
        "--presets", action="store_true", help="list the hardware presets for what-if planning instead"
    )


def _num(value: float, fmt: str = ".0f", unit: str = "") -> str:
    return "N/A" if is_na(value) else f"{value:{fmt}}{unit}"


def _rate(value: float) -> str:
    return "N/A" if is_na(value) else f"{bytes2human(value)}/s"


def format_gpu(g: GpuSnapshot) -> list[str]:
    """Text lines for one GPU."""
    head = f"  GPU {g.index}  {g.name}  {g.uuid}  bus {g.pci_bus_id}"
    if g.lost:
        return [head, "     LOST: the GPU stopped answering (fields N/A)"]
    used, total = bytes2human(g.memory_used), bytes2human(g.memory_total)
    lines = [
        head,
        f"     memory   {used} used / {total} (free {bytes2human(g.memory_free)}, "
        f"reserved {bytes2human(g.memory_reserved)})",
        f"     load     GPU {_num(g.util_gpu, '.0f', '%')}, memory {_num(g.util_memory, '.0f', '%')}; "
        f"{_num(g.temperature, '.0f', ' C')}; power {_num(g.power_draw, '.0f', ' W')} / "
        f"{_num(g.power_limit, '.0f', ' W')}",
        f"     clocks   graphics {_num(g.clock_graphics)} / {_num(g.clock_max_graphics)} MHz, "
        f"SM {_num(g.clock_sm)} / {_num(g.clock_max_sm)} MHz, "
        f"memory {_num(g.clock_memory)} / {_num(g.clock_max_memory)} MHz",
        f"     PCIe     gen {_num(g.pcie_gen)} x{_num(g.pcie_width)} now, gen {_num(g.pcie_gen_max)} "
        f"x{_num(g.pcie_width_max)} max (GPU gen {_num(g.pcie_gen_gpu_max)}); "
        f"rx {_rate(g.pcie_rx)}, tx {_rate(g.pcie_tx)}",
    ]
    for p in g.processes:
        lines.append(f"     process  {p.pid:>7} {p.name:<24} {bytes2human(p.used_bytes):>10}  ({p.kind})")
    return lines


def format_host(cpu: CpuInfo, host: HostSnapshot) -> list[str]:
    """Text lines for the host."""
    feats = ", ".join(cpu.features) if cpu.flags_known else "ISA flags unknown on this OS"
    limit = "" if is_na(host.ram_limit) else f"; container limit {bytes2human(host.ram_limit)}"
    return [
        "Host:",
        f"  CPU      {cpu.model}; {cpu.usable_cores} cores usable ({cpu.logical_cores} logical, "
        f"{_num(cpu.physical_cores)} physical); {feats or 'no AVX2'}; load {_num(host.cpu_percent, '.0f', '%')}",
        f"  RAM      {bytes2human(host.ram_used)} used / {bytes2human(host.ram_total)}, "
        f"{bytes2human(host.ram_available)} available{limit}; swap {bytes2human(host.swap_used)} / "
        f"{bytes2human(host.swap_total)}",
        f"  process  RSS {bytes2human(host.process_rss)}; pinned by the engine {bytes2human(host.pinned_bytes)}",
    ]


def format_report(nv: NvmlReport, cpu: CpuInfo, host: HostSnapshot) -> str:
    if nv.gpus:
        lines = [f"GPUs (NVIDIA driver {nv.driver_version}):"]
        for g in nv.gpus:
            lines += format_gpu(g)
    else:
        lines = ["GPUs: N/A", f"  {nv.message}"]
    return "\n".join(lines + format_host(cpu, host))


def _profile_line(key: str, p: HardwareProfile) -> str:
    gpu = ", ".join(f"{g.name} {bytes2human(g.vram_bytes, 0)}" for g in p.gpus[:1]) or "no GPU"
    bus = "" if is_na(p.h2d_pinned) else f", bus {p.h2d_pinned / 1e9:.0f} GB/s"
    return (
        f"  {key:<24} {gpu}{bus}; RAM {bytes2human(p.host_ram_bytes, 0)} "
        f"read {p.host_read_bandwidth / 1e9:.0f} GB/s, {p.cpu_cores} cores"
    )


def _presets(as_json: bool) -> int:
    presets = load_presets()
    if as_json:
        out = {
            "machines": {k: presets.machine(k).to_json() for k in presets.machines},
            "gpus": {k: presets.gpus[k] for k in presets.gpus},
            "hosts": {k: presets.compose(None, k).to_json() for k in presets.hosts},
        }
        print(json.dumps(out, indent=2))
        return 0
    print("Machines:")
    for k in presets.machines:
        print(_profile_line(k, presets.machine(k)))
    print("Hosts (alone, or as GPU+host):")
    for k in presets.hosts:
        print(_profile_line(k, presets.compose(None, k)))
    print("GPUs (combine with a host: GPU+host, or 2x GPU+host):")
    for k in presets.gpus:
        g = presets.gpu(k)
        print(
            f"  {k:<24} {g.name}, {bytes2human(g.vram_bytes, 0)}, {g.mem_bandwidth / 1e9:.0f} GB/s achievable, "
            f"PCIe {g.pcie_gen} x{g.pcie_width}"
        )
    print(f"Sources: {presets.path}")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.presets:
        return _presets(args.json)
    if args.interval <= 0:
        raise WorkbenchError(f"--interval must be positive, got {args.interval}")
    cpu = cpu_info()
    monitor = HostMonitor()
    time.sleep(0.2)  # CPU load is measured between two readings: give the first one some time
    n = 0
    try:
        while True:
            nv = report(processes=not args.no_processes)
            host = monitor.snapshot()
            if args.json:
                obj = {
                    "time": time.time(),
                    "nvml": nv.to_json(),
                    "host": host.to_json(),
                    "cpu": cpu.to_json(),
                }
                print(json.dumps(obj, indent=None if args.watch else 2, allow_nan=False))
            else:
                if args.watch and sys.stdout.isatty():
                    print("\x1b[H\x1b[2J", end="")
                print(format_report(nv, cpu, host))
            sys.stdout.flush()
            n += 1
            if not args.watch or (args.count and n >= args.count):
                return 0
            time.sleep(args.interval)
    except (KeyboardInterrupt, BrokenPipeError):  # Ctrl-C ends --watch; `| head` closes the pipe
        return 0


__all__ = ["NA", "add_arguments", "format_gpu", "format_host", "format_report", "run"]
