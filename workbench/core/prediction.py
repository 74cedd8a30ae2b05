"""What the cost model predicts for a placement: per-layer costs and the totals (see ``costmodel``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .fmt import bytes2human
from .memory import MemoryEstimate


@dataclass
class LayerCost:
    """Predicted decode (or prefill-chunk) time of one layer, seconds. ``gpu`` includes ``pre``."""

    layer: int
    pre: float = 0.0
    gpu: float = 0.0
    cpu: float = 0.0
    bus: float = 0.0
    sync: float = 0.0
    gpu_share: float = 1.0
    """Expected share of the layer's expert selections served by GPU-resident experts."""
    stream_hit_rate: float = float("nan")
    """Expected hit rate of the layer's stream cache (NaN without streamed experts)."""
    host: float = 0.0
    """A prompt chunk's host lane: the engine thread's own work for the layer (0: not modelled). The
    layer takes at least this long, however short its other lanes."""
    spread: float = 0.0
    """Decode: the expected time beyond ``max(gpu, cpu, bus) + sync`` of those expected lanes, from
    tokens that give the CPU more than the mean (the layer waits for the slowest lane token by token)."""
    bus_units: float = 0.0
    """Served decode's unit split of the layer: the share of each CPU-tier pair's intermediate units
    the bus computes (0: whole experts by the bus share, or no bus)."""

    @property
    def total(self) -> float:
        return max(self.pre + max(self.gpu, self.cpu, self.bus) + self.sync + self.spread, self.host)

    @property
    def bound(self) -> str:
        if self.host > self.pre + max(self.gpu, self.cpu, self.bus) + self.sync + self.spread:
            return "host"
        lanes = {"gpu": self.gpu, "cpu": self.cpu, "bus": self.bus}
        return max(lanes, key=lanes.get)

    def to_json(self) -> dict:
        return {"layer": self.layer, "pre_s": self.pre, "gpu_s": self.gpu, "cpu_s": self.cpu,
                "bus_s": self.bus, "sync_s": self.sync, "spread_s": self.spread, "host_s": self.host, "total_s": self.total, "bound": self.bound,
                "gpu_share": self.gpu_share,
                "stream_hit_rate": None if math.isnan(self.stream_hit_rate) else self.stream_hit_rate}


@dataclass
class Prediction:
    """What the cost model predicts for one placement."""

    memory: MemoryEstimate
    decode_tps: float
    prefill_tps: float
    prompt_tokens: int
    kv_tokens: int
    decode_layers: list[LayerCost] = field(default_factory=list)
    prefill_layers: list[LayerCost] = field(default_factory=list)
    """Per-layer costs of one prefill chunk of ``min(prompt_tokens, PREFILL_CHUNK)`` tokens."""
    decode_other_s: float = 0.0
    """Embedding, final norm, lm_head, sampling and the host's own time (``decode_step_s``) per
    decoded token (s)."""

    @property
    def decode_s(self) -> float:
        return 1.0 / self.decode_tps

    @property
    def gpu_share(self) -> float:
        """Expected share of all routed selections served by GPU-resident experts."""
        moe = [c.gpu_share for c in self.decode_layers if not math.isnan(c.gpu_share)]
        return float(np.mean(moe)) if moe else 1.0

    def to_json(self) -> dict:
        return {
            "decode_tps": self.decode_tps,
            "prefill_tps": self.prefill_tps,
            "prompt_tokens": self.prompt_tokens,
            "kv_tokens": self.kv_tokens,
            "decode_other_s": self.decode_other_s,
            "memory": self.memory.to_json(),
            "decode_layers": [c.to_json() for c in self.decode_layers],
            "prefill_layers": [c.to_json() for c in self.prefill_layers],
        }

    def table(self, per_layer: bool = False) -> str:
        """Plain-text summary: bytes per device, decode and prefill tokens/s (and optionally layers)."""
        lines = [f"{'device':<8} {'weights':>11} {'KV cache':>10} {'stream':>10} {'overhead':>10} {'total':>11}"]
        for name, t in self.memory.tiers.items():
            lines.append(f"{name:<8} {bytes2human(t.weights_total):>11} {bytes2human(t.kv_cache):>10} "
                         f"{bytes2human(t.stream_cache):>10} {bytes2human(t.overhead):>10} {bytes2human(t.total):>11}")
        lines.append("")
        lines.append(f"decode  {self.decode_tps:10.2f} tokens/s  (context {self.kv_tokens} tokens; "
                     f"{100 * self.gpu_share:.1f}% of expert selections on the GPU)")
        lines.append(f"prefill {self.prefill_tps:10.1f} tokens/s  (prompt {self.prompt_tokens} tokens)")
        if per_layer:
            lines.append("")
            lines.append(f"{'layer':>5} {'pre µs':>8} {'gpu µs':>8} {'cpu µs':>8} {'bus µs':>8} {'sync µs':>8} "
                         f"{'spread µs':>9} {'total µs':>9} {'bound':>5} {'gpu share':>9}")
            for c in self.decode_layers:
                lines.append(f"{c.layer:>5} {c.pre * 1e6:8.1f} {c.gpu * 1e6:8.1f} {c.cpu * 1e6:8.1f} "
                             f"{c.bus * 1e6:8.1f} {c.sync * 1e6:8.1f} {c.spread * 1e6:9.1f} {c.total * 1e6:9.1f} {c.bound:>5} "
                             + ("        -" if math.isnan(c.gpu_share) else f"{100 * c.gpu_share:8.1f}%"))
        return "\n".join(lines)
