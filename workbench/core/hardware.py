"""HardwareProfile: what the cost model needs to know about a machine, measured or from a preset.

Bandwidths are bytes per second, times are seconds, sizes are bytes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class GpuProfile:
    """One GPU. ``mem_bandwidth``: achievable HBM/GDDR read bandwidth (B/s); ``launch_s``: cost of one
    kernel launch (s); ``bf16_flops``: dense bf16 matrix rate (FLOP/s); ``expert_bandwidth``: bytes of
    expert weights per second a batch-1 expert matmul reaches on this GPU."""

    name: str
    vram_bytes: int
    mem_bandwidth: float
    bf16_flops: float
    launch_s: float = 5e-6
    expert_bandwidth: float | None = None
    pcie_gen: int | None = None
    pcie_width: int | None = None


@dataclass(frozen=True)
class HardwareProfile:
    """A machine: its GPUs, host RAM, the bus between them and the CPU's expert throughput.

    ``cpu_expert_throughput`` maps a CPU weight format (``"bf16"``, ``"f32"``, ``"int8"``, ``"int4"``...)
    to the bytes of expert weights per second the CPU serves at batch 1. ``h2d_pinned`` /
    ``h2d_pageable`` / ``d2h_pinned`` are host<->GPU copy bandwidths (B/s). ``sync_s`` is the cost of
    one host<->GPU synchronisation (s), paid per MoE layer when CPU experts are used.
    ``cpu_flops`` is the CPU's bf16 GEMM rate (FLOP/s) for prefill. ``source`` says where the numbers
    come from ("measured on ... at ..." or "preset: datasheet").
    """

    name: str
    gpus: tuple[GpuProfile, ...]
    host_ram_bytes: int
    host_read_bandwidth: float
    h2d_pinned: float
    h2d_pageable: float
    d2h_pinned: float
    cpu_expert_throughput: dict[str, float] = field(default_factory=dict)
    cpu_flops: float = 1e11
    cpu_cores: int = 1
    sync_s: float = 5e-5
    source: str = ""

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> HardwareProfile:
        d = dict(d)
        d["gpus"] = tuple(GpuProfile(**g) for g in d.get("gpus", ()))
        d["cpu_expert_throughput"] = dict(d.get("cpu_expert_throughput", {}))
        return cls(**d)
