"""Hardware profiles for planning tests: the H200 machine of BENCH.md and a 24 GB desktop."""

from __future__ import annotations

from workbench.core.hardware import GpuProfile, HardwareProfile

GiB = 2**30


def h200_profile(vram: int = 139 * GiB) -> HardwareProfile:
    """Figures measured on the H200 machine (BENCH.md): bandwidths in B/s, times in s."""
    return HardwareProfile(
        name="h200-bench", gpus=(GpuProfile("H200", vram, 3.3e12, 7e14, launch_s=6e-6, expert_bandwidth=1.3e12),),
        host_ram_bytes=128 * GiB, host_read_bandwidth=88e9, h2d_pinned=54.9e9, h2d_pageable=5.1e9,
        d2h_pinned=50e9, cpu_expert_throughput={"bf16": 50e9, "f32": 73e9, "int8": 44e9, "int4": 36e9},
        cpu_flops=0.83e12, cpu_cores=16, sync_s=5e-5, source="BENCH.md",
    )


def desktop_profile(vram: int = 24 * GiB) -> HardwareProfile:
    """A 24 GB desktop card on PCIe 4 with dual-channel DDR5 (datasheet-like figures)."""
    return HardwareProfile(
        name="desktop", gpus=(GpuProfile("RTX", vram, 0.9e12, 1.6e14, launch_s=5e-6),),
        host_ram_bytes=128 * GiB, host_read_bandwidth=60e9, h2d_pinned=24e9, h2d_pageable=8e9,
        d2h_pinned=24e9, cpu_expert_throughput={"bf16": 20e9}, cpu_flops=0.5e12, cpu_cores=8,
        sync_s=4e-5, source="test",
    )
