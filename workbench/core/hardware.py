"""HardwareProfile: what the cost model needs to know about a machine, measured or from a preset.

Bandwidths are bytes per second, times are seconds, sizes are bytes.

Presets (``resources/hardware/presets.json``, every figure with its source) describe machines the user
may not have: ``preset("rtx4090+ddr5-2ch")`` composes a GPU and a host, ``preset("2x rtx3090+ddr4-2ch")``
two GPUs, ``preset("bench-h200")`` a measured machine, ``preset("ddr5-2ch")`` a host without GPU.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from workbench.core.errors import WorkbenchError
from workbench.core.resources import resource


def _gpu_rates(g: dict) -> dict:
    """A GPU's JSON with ``expert_throughput`` as ``{format: float}`` (absent: empty)."""
    g = dict(g)
    g["expert_throughput"] = {str(k).lower(): float(v) for k, v in dict(g.get("expert_throughput") or {}).items()}
    return g


@dataclass(frozen=True)
class GpuProfile:
    """One GPU. ``mem_bandwidth``: achievable HBM/GDDR read bandwidth (B/s); ``launch_s``: cost of one
    kernel launch (s); ``bf16_flops``: dense bf16 matrix rate (FLOP/s); ``expert_bandwidth``: bytes of
    expert weights per second a batch-1 expert matmul reaches on this GPU; ``expert_throughput``: the
    same for experts kept in a quantized file's blocks, by format (``q8_0``, ``q4_k``), bytes of the
    blocks per second through the engine's one-token kernels (formats not listed: ``expert_bandwidth``);
    ``route_s_per_expert``: what one token's decode step takes longer per MoE layer for each expert
    that layer has beyond the ones it selects (s; its router and routing over more experts, fitted to
    the engine by calibration; 0: not measured)."""

    name: str
    vram_bytes: int
    mem_bandwidth: float
    bf16_flops: float
    launch_s: float = 5e-6
    expert_bandwidth: float | None = None
    pcie_gen: int | None = None
    pcie_width: int | None = None
    expert_throughput: dict[str, float] = field(default_factory=dict)
    route_s_per_expert: float = 0.0

    def problems(self) -> list[str]:
        """What is wrong with this GPU's numbers, one sentence each."""
        out = []
        if not self.name:
            out.append("no name")
        out += _check_size("vram_bytes", self.vram_bytes)
        out += _check_rate("mem_bandwidth", self.mem_bandwidth, "B/s")
        out += _check_rate("bf16_flops", self.bf16_flops, "FLOP/s")
        if self.expert_bandwidth is not None:
            out += _check_rate("expert_bandwidth", self.expert_bandwidth, "B/s")
        for fmt, rate in self.expert_throughput.items():
            out += _check_rate(f"expert_throughput[{fmt}]", rate, "B/s")
        if not (0 <= self.launch_s < 0.1):
            out.append(f"launch_s is {self.launch_s!r} s: expected microseconds")
        if not (0 <= self.route_s_per_expert < 1e-5):
            out.append(f"route_s_per_expert is {self.route_s_per_expert!r} s: expected well under 10 microseconds")
        if self.pcie_gen is not None and self.pcie_gen not in range(1, 8):
            out.append(f"pcie_gen {self.pcie_gen!r} is not a PCIe generation")
        if self.pcie_width is not None and self.pcie_width not in (1, 2, 4, 8, 12, 16, 32):
            out.append(f"pcie_width {self.pcie_width!r} is not a PCIe link width")
        return out


@dataclass(frozen=True)
class HardwareProfile:
    """A machine: its GPUs, host RAM, the bus between them and the CPU's expert throughput.

    ``cpu_expert_throughput`` maps a CPU weight format (``"bf16"``, ``"f32"``, ``"int8"``, ``"int4"``...)
    to the bytes of expert weights per second the CPU serves at batch 1. ``h2d_pinned`` /
    ``h2d_pageable`` / ``d2h_pinned`` are host<->GPU copy bandwidths (B/s). ``sync_s`` is the cost of
    one host<->GPU synchronisation (s), paid per MoE layer when CPU experts are used.
    ``cpu_flops`` is the CPU's bf16 GEMM rate (FLOP/s) for prefill. ``cpu_prompt_flops`` maps a
    format the fused CPU kernel reads (``"bf16"``, ``"q8_0"``...) to the FLOP/s its further tokens
    per expert cost in a prompt, beyond the expert's one read (absent: measured before it was). ``source``
    says where the numbers come from ("measured on ... at ..." or "preset: datasheet").
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
    cpu_prompt_flops: dict[str, float] = field(default_factory=dict)
    cpu_cores: int = 1
    sync_s: float = 5e-5
    decode_step_s: float = 0.0
    """Host seconds per decode step that the GPU's work does not hide: the step's Python, its graphs'
    launch and the token's read back, paid once a token whatever the layer count (fitted to the
    engine's decode by ``workbench calibrate``; 0: not measured, the fitted kernel cost holds it)."""
    bus_read_rate: float = 0.0
    """Bytes/s of expert weights the GPU's kernels read in place from page-locked host memory, a few
    experts a call as decode's bus share runs them (measured by ``workbench calibrate``; 0: not
    measured, ``costmodel.bus_rate`` takes a share of ``h2d_pinned``)."""
    prompt_sync_s: float = 0.0
    """Host seconds of each hybrid layer of a prompt chunk beyond its lanes and ``sync_s``: splitting
    its CPU-tier experts, setting up the CPU's share, summing the tiers, while neither the bus nor
    the GPU has work queued (fitted to the engine's prompts by ``workbench calibrate``; 0: not
    measured)."""
    prompt_cpu_sync_s: float = 0.0
    """Host seconds more in a hybrid layer of a prompt chunk where the CPU computes a share of the
    experts (not all of them travel): starting its run, waiting for it, adding its result (fitted
    with ``prompt_sync_s``; 0: not measured)."""
    prompt_h2d: float = 0.0
    """Bytes/s a prompt's fetched experts travel at in the engine, its per-batch pauses included
    (fitted with ``prompt_sync_s``; 0: not measured, ``h2d_pinned``)."""
    prompt_cpu_scale: float = 1.0
    """How much longer the CPU's share of a hybrid prompt layer takes in the engine than the fused
    kernel's prompt rate (``cpu_prompt_flops``, measured alone) gives: its threads share the RAM with
    the bus's copies and the cores with the engine's thread (fitted to the engine's prompts; 1: not
    measured)."""
    prompt_host_layer_s: float = 0.0
    """The engine thread's busy seconds per hybrid layer of a prompt chunk, the layer's attention and
    routing queued, its split, the resident tier's grouping and the CPU's result added; the next four
    make the layer's host lane, which bounds the layer when it is longer than the lanes it feeds
    (fitted to the engine's own records, ``hostclock.HostClock``, by ``workbench calibrate``; all 0:
    not measured, no host lane)."""
    prompt_host_cpu_s: float = 0.0
    """Host lane seconds more where the CPU computes a share of the layer's experts."""
    prompt_host_batch_s: float = 0.0
    """Host lane seconds per batch of fetched experts (its kernel launches and events)."""
    prompt_host_copy_s: float = 0.0
    """Host lane seconds per host-to-GPU copy queued for a fetched expert (a tensor's run of rows)."""
    prompt_resident_layer_s: float = 0.0
    """Seconds a MoE layer of a prompt chunk takes at least when all its experts are on the GPU: the
    engine's own work for it (attention, routing, grouping the pairs, the grouped kernels' launches)
    where that outlasts the GPU's reads and math (fitted to the calibration's all-resident prompts by
    ``workbench calibrate``; 0: not measured)."""
    prompt_resident_layer_by_format: dict[str, float] = field(default_factory=dict)
    """``prompt_resident_layer_s`` by the resident experts' weight format (``"bf16"``, ``"q8_0"``...),
    fitted to the calibration's all-resident prompt in that format: a layer of kept Q8_0 blocks
    dequantizes its tiles as it goes and takes longer than a bf16 one (16.5 against 11.9 ms for
    8 layers on the H200 machine). A format not in it takes ``prompt_resident_layer_s``."""
    sync_by_format: dict[str, float] = field(default_factory=dict)
    """``sync_s`` of a decode layer whose CPU experts are held in a kept block format (``"q8_0"``...),
    fitted to the calibration's hybrid runs in that format (a Q8_0 layer's hand-off came to 59 µs
    where bf16's took 132 on the same H100 host). A format not in it takes ``sync_s``."""
    source: str = ""
    provenance: dict[str, str] = field(default_factory=dict)
    """Where each number came from, by field name: ``"measured"``, ``"preset:<name>"`` or ``"absent"``
    (a field this machine cannot measure and no preset filled; its value is NaN)."""

    def to_json(self) -> dict:
        """Plain JSON-ready dict (NaN, an absent number, becomes ``None``)."""
        return _nan_to_none(asdict(self))

    @classmethod
    def from_json(cls, d: dict) -> HardwareProfile:
        """Inverse of :meth:`to_json`. Raises :class:`HardwareProfileError` on a malformed dict."""
        if not isinstance(d, dict):
            raise HardwareProfileError(f"a hardware profile must be a JSON object, not {type(d).__name__}")
        d = dict(d)
        try:
            d["gpus"] = tuple(GpuProfile(**_none_to_nan(_gpu_rates(g), GpuProfile)) for g in d.get("gpus", ()))
            d["cpu_expert_throughput"] = {
                str(k): float(v) for k, v in dict(d.get("cpu_expert_throughput", {})).items()
            }
            d["cpu_prompt_flops"] = {str(k): float(v) for k, v in dict(d.get("cpu_prompt_flops") or {}).items()}
            d["prompt_resident_layer_by_format"] = {
                str(k): float(v) for k, v in dict(d.get("prompt_resident_layer_by_format") or {}).items()}
            d["sync_by_format"] = {str(k): float(v) for k, v in dict(d.get("sync_by_format") or {}).items()}
            d["provenance"] = dict(d.get("provenance", {}))
            return cls(**_none_to_nan(d, cls))
        except (TypeError, ValueError, AttributeError) as e:
            raise HardwareProfileError(f"not a valid hardware profile: {e}") from None

    # -- checks and files ----------------------------------------------------------------------
    def problems(self) -> list[str]:
        """What is wrong with this profile, one sentence each (empty when it is usable)."""
        out: list[str] = []
        if not self.name:
            out.append("the profile has no name")
        out += _check_size("host_ram_bytes", self.host_ram_bytes)
        out += _check_rate("host_read_bandwidth", self.host_read_bandwidth, "B/s")
        for name in ("h2d_pinned", "h2d_pageable", "d2h_pinned"):
            value = getattr(self, name)
            if not self.gpus and _isnan(value):
                continue  # no GPU: no bus to measure
            out += _check_rate(name, value, "B/s")
        for fmt, value in self.cpu_expert_throughput.items():
            out += _check_rate(f"cpu_expert_throughput[{fmt}]", value, "B/s")
        out += _check_rate("cpu_flops", self.cpu_flops, "FLOP/s")
        for fmt, value in self.cpu_prompt_flops.items():
            out += _check_rate(f"cpu_prompt_flops[{fmt}]", value, "FLOP/s")
        if not (isinstance(self.cpu_cores, int) and self.cpu_cores >= 1):
            out.append(f"cpu_cores must be a whole number >= 1, got {self.cpu_cores!r}")
        if not (0 <= self.sync_s < 1):
            out.append(f"sync_s is {self.sync_s!r} s: expected a cost between 0 and 1 second")
        if not (1 <= self.prompt_cpu_scale < 100):
            out.append(f"prompt_cpu_scale is {self.prompt_cpu_scale!r}: expected a factor of at least 1")
        if not (self.bus_read_rate >= 0):
            out.append(f"bus_read_rate is {self.bus_read_rate!r} B/s: expected a rate, or 0 (not measured)")
        if not (0 <= self.decode_step_s < 1):
            out.append(f"decode_step_s is {self.decode_step_s!r} s: expected a cost between 0 and 1 second")
        if not (self.prompt_h2d >= 0):
            out.append(f"prompt_h2d is {self.prompt_h2d!r} B/s: expected a rate, or 0 (not measured)")
        for name in ("prompt_sync_s", "prompt_cpu_sync_s", "prompt_host_layer_s", "prompt_host_cpu_s",
                     "prompt_host_batch_s", "prompt_host_copy_s", "prompt_resident_layer_s"):
            if not (0 <= getattr(self, name) < 1):
                out.append(f"{name} is {getattr(self, name)!r} s: expected a cost between 0 and 1 second")
        for fmt, value in self.sync_by_format.items():
            if not (0 <= value < 1):
                out.append(f"sync_by_format[{fmt}] is {value!r} s: expected a cost between 0 and 1 second")
        for fmt, value in self.prompt_resident_layer_by_format.items():
            if not (0 <= value < 1):
                out.append(f"prompt_resident_layer_by_format[{fmt}] is {value!r} s: expected a cost between 0 and 1 "
                           "second")
        for i, g in enumerate(self.gpus):
            out += [f"GPU {i} ({g.name}): {p}" for p in g.problems()]
        return out

    def validate(self) -> HardwareProfile:
        """Return self, or raise :class:`HardwareProfileError` listing every problem."""
        problems = self.problems()
        if problems:
            raise HardwareProfileError(
                f"hardware profile {self.name!r} is not usable: " + "; ".join(problems)
            )
        return self

    def save(self, path: str | os.PathLike) -> None:
        """Write the profile as JSON, atomically (temp file + rename)."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> HardwareProfile:
        """Read and validate a profile written by :meth:`save` (or ``workbench calibrate -o``)."""
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise HardwareProfileError(f"cannot read hardware profile {path}: {e.strerror or e}") from None
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise HardwareProfileError(f"{path} is not JSON ({e.msg} at line {e.lineno})") from None
        if isinstance(d, dict) and "hardware" in d and "gpus" not in d:
            d = d["hardware"]  # a project file or a calibrate report: take its profile
        return cls.from_json(d).validate()

    def at_host_read(self, read: float, limits: tuple[float, float] = (0.5, 2.0)) -> HardwareProfile:
        """A copy for a host whose RAM reads ``read`` B/s now instead of ``host_read_bandwidth``: the
        RAM read scaled by ``f = read / host_read_bandwidth`` (clamped to ``limits``), and each CPU
        expert rate ``r`` by the part of its time spent waiting on the RAM, taken as ``s = r / host
        read`` (at most 1): ``r / (s / f + 1 - s)``. A kernel that reads at the RAM's rate moves
        with it; one that computes at half of it (Q8_0 on the H200 host) moves half as much. A shared
        host's RAM read moves between minutes (80 to 124 GB/s on the H200 machine's host)."""
        if not (read > 0 and math.isfinite(read) and self.host_read_bandwidth > 0):
            return self
        f = min(max(read / self.host_read_bandwidth, limits[0]), limits[1])

        def moved(r: float) -> float:
            s = min(1.0, r / self.host_read_bandwidth)
            return r / (s / f + 1.0 - s)

        return replace(self, host_read_bandwidth=self.host_read_bandwidth * f,
                       cpu_expert_throughput={k: moved(v) for k, v in self.cpu_expert_throughput.items()})

    def with_gpus(self, gpus: tuple[GpuProfile, ...], source: str = "") -> HardwareProfile:
        """A copy with other GPUs (e.g. a measured host with a preset GPU)."""
        return replace(self, gpus=tuple(gpus), source=source or self.source)


class HardwareProfileError(WorkbenchError):
    """A hardware profile or preset is missing, malformed or has impossible numbers."""


def _isnan(x) -> bool:
    return isinstance(x, float) and math.isnan(x)


def _check_rate(name: str, value, unit: str) -> list[str]:
    if not isinstance(value, (int, float)) or _isnan(value) or math.isinf(value):
        return [f"{name} is missing ({value!r})"]
    if value <= 0:
        return [f"{name} must be positive, got {value!r}"]
    if value < 1e6:
        return [f"{name} is {value!r} {unit}: far too small; rates are in {unit}, not G{unit}"]
    if value > 1e16:
        return [f"{name} is {value!r} {unit}: impossibly large"]
    return []


def _check_size(name: str, value) -> list[str]:
    if not isinstance(value, int) or value <= 0:
        return [f"{name} must be a positive whole number of bytes, got {value!r}"]
    if value < 1 << 24:
        return [f"{name} is {value!r} bytes: far too small; sizes are in bytes, not GiB"]
    return []


def _nan_to_none(obj):
    if isinstance(obj, dict):
        return {k: _nan_to_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_nan_to_none(v) for v in obj]
    return None if _isnan(obj) else obj


def _none_to_nan(d: dict, cls) -> dict:
    """``None`` back to NaN for float fields, so a saved absent number loads as absent."""
    d = dict(d)
    for f in fields(cls):
        if d.get(f.name, 0) is None and "float" in str(f.type) and "None" not in str(f.type):
            d[f.name] = math.nan
    return d


# -- presets -----------------------------------------------------------------------------------

PRESETS_PATH = resource("hardware", "presets.json")
_GPU_KEYS = ("name", "vram_bytes", "mem_bandwidth_peak", "bf16_flops", "pcie_gen", "pcie_width", "sources")
_HOST_KEYS = ("name", "host_ram_bytes", "host_read_bandwidth_peak", "cpu_cores", "pcie_gen", "sources")


@dataclass(frozen=True)
class Presets:
    """The contents of the presets file: GPU and host datasheet entries, measured machines and the
    efficiency factors that turn datasheet peaks into achievable rates (each with its source)."""

    gpus: dict[str, dict]
    hosts: dict[str, dict]
    machines: dict[str, dict]
    efficiency: dict[str, dict]
    lane_bandwidth: dict[int, float]  # bytes/s per PCIe lane per direction, by generation
    path: str = ""

    def names(self) -> list[str]:
        """Preset names :meth:`get` accepts as they are (GPU names need a host: ``gpu+host``)."""
        return sorted(self.machines) + sorted(self.hosts)

    def _eff(self, key: str):
        return self.efficiency[key]["value"]

    def gpu(self, key: str) -> GpuProfile:
        """One preset GPU as a profile (achievable memory bandwidth = datasheet x efficiency)."""
        g = self._entry(self.gpus, key, "GPU")
        return GpuProfile(
            name=g["name"],
            vram_bytes=int(g["vram_bytes"]),
            mem_bandwidth=float(g["mem_bandwidth_peak"]) * self._eff("gpu_memory"),
            bf16_flops=float(g["bf16_flops"]),
            pcie_gen=int(g["pcie_gen"]),
            pcie_width=int(g["pcie_width"]),
        )

    def link_bandwidth(self, gen: int, width: int) -> float:
        """Achievable pinned copy rate of a PCIe link, bytes/s (theoretical x efficiency)."""
        if gen not in self.lane_bandwidth:
            raise HardwareProfileError(f"no lane bandwidth for PCIe generation {gen} in {self.path}")
        return self.lane_bandwidth[gen] * width * self._eff("pcie")

    def compose(self, gpu_key: str | None, host_key: str, n_gpus: int = 1) -> HardwareProfile:
        """A machine made of ``n_gpus`` preset GPUs (or none) in a preset host.

        The bus runs at the lower PCIe generation of GPU and host; CPU expert throughput per format is
        the host's achievable read bandwidth times the measured per-format ratio in the file.
        """
        h = self._entry(self.hosts, host_key, "host")
        read = float(h["host_read_bandwidth_peak"]) * self._eff("host_read")
        cores = int(h["cpu_cores"])
        gpus: tuple[GpuProfile, ...] = ()
        pinned = pageable = math.nan
        name = h["name"]
        if gpu_key is not None:
            if n_gpus < 1:
                raise HardwareProfileError(f"a machine needs at least one GPU, got {n_gpus}")
            g = self.gpu(gpu_key)
            gpus = (g,) * n_gpus
            pinned = self.link_bandwidth(min(g.pcie_gen, int(h["pcie_gen"])), g.pcie_width)
            pageable = pinned * self._eff("pageable_ratio")
            name = f"{n_gpus}x {g.name} + {h['name']}" if n_gpus > 1 else f"{g.name} + {h['name']}"
        preset_tag = f"preset:{gpu_key}+{host_key}" if gpu_key else f"preset:{host_key}"
        prof = HardwareProfile(
            name=name,
            gpus=gpus,
            host_ram_bytes=int(h["host_ram_bytes"]),
            host_read_bandwidth=read,
            h2d_pinned=pinned,
            h2d_pageable=pageable,
            d2h_pinned=pinned,
            cpu_expert_throughput={fmt: read * r for fmt, r in self._eff("cpu_expert").items()},
            cpu_flops=cores * self._eff("cpu_flops_per_core"),
            cpu_cores=cores,
            sync_s=self._eff("sync_s"),
            source=f"{preset_tag}: datasheet figures x efficiency factors ({self.path})",
        )
        absent = () if gpus else ("h2d_pinned", "h2d_pageable", "d2h_pinned")
        return replace(
            prof, provenance={f: "absent" if f in absent else preset_tag for f in _PROFILE_NUMBERS}
        )

    def machine(self, key: str) -> HardwareProfile:
        """A measured machine from the file (its own figures, the GPU's datasheet for the rest)."""
        m = self._entry(self.machines, key, "machine")
        p = dict(m["profile"])
        g = self.gpu(m["gpu"])
        # "gpu_<field>" keys override the GPU preset with this machine's own figures
        over = {k[4:]: p.pop(k) for k in list(p) if k.startswith("gpu_")}
        g = replace(
            g,
            **{
                k: int(v) if k in ("vram_bytes", "pcie_gen", "pcie_width") else float(v)
                for k, v in over.items()
            },
        )
        prof = HardwareProfile(
            name=m["name"],
            gpus=(g,) * int(m.get("n_gpus", 1)),
            cpu_expert_throughput={k: float(v) for k, v in p.pop("cpu_expert_throughput").items()},
            source=f"preset:{key}: " + " | ".join(m["sources"]),
            **{k: (int(v) if k in ("host_ram_bytes", "cpu_cores") else float(v)) for k, v in p.items()},
        )
        return replace(prof, provenance={f: f"preset:{key}" for f in _PROFILE_NUMBERS})

    def get(self, name: str) -> HardwareProfile:
        """A profile by name: ``"bench-h200"`` (machine), ``"ddr5-2ch"`` (host, no GPU),
        ``"rtx4090+ddr5-2ch"`` (GPU + host) or ``"2x rtx3090+ddr4-2ch"`` (several GPUs)."""
        text = name.strip().lower()
        if text in self.machines:
            return self.machine(text)
        n_gpus = 1
        head, plus, host = text.rpartition("+")
        if not plus:
            if text in self.hosts:
                return self.compose(None, text)
            if text.split("x ", 1)[-1].strip() in self.gpus:
                raise HardwareProfileError(
                    f"{name!r} is a GPU; name a host too, e.g. {text}+ddr5-2ch (hosts: {', '.join(self.hosts)})"
                )
            raise HardwareProfileError(f"unknown hardware preset {name!r}; {self.help()}")
        gpu = head.strip()
        count, x, rest = gpu.partition("x ")
        if x and count.strip().isdigit():
            n_gpus, gpu = int(count), rest.strip()
        return self.compose(gpu, host.strip(), n_gpus)

    def help(self) -> str:
        return (
            f"machines: {', '.join(self.machines)}; GPUs: {', '.join(self.gpus)}; hosts: {', '.join(self.hosts)} "
            "(combine as GPU+host, e.g. rtx4090+ddr5-2ch or 2x rtx3090+ddr4-2ch)"
        )

    def _entry(self, table: dict, key: str, what: str) -> dict:
        if key not in table:
            raise HardwareProfileError(f"unknown {what} preset {key!r}; {self.help()}")
        return table[key]

    def problems(self) -> list[str]:
        """Every problem in the file: missing keys or sources, and profiles that do not validate."""
        out = []
        for table, keys, what in ((self.gpus, _GPU_KEYS, "GPU"), (self.hosts, _HOST_KEYS, "host")):
            for key, entry in table.items():
                missing = [k for k in keys if k not in entry]
                if missing:
                    out.append(f"{what} preset {key}: missing {', '.join(missing)}")
                elif not entry["sources"]:
                    out.append(f"{what} preset {key}: no source cited")
        for key, eff in self.efficiency.items():
            if "value" not in eff or not eff.get("source"):
                out.append(f"efficiency {key}: needs a value and a source")
        for key, m in self.machines.items():
            if not m.get("sources"):
                out.append(f"machine {key}: no source cited")
        if out:
            return out
        profiles = [self.machine(k) for k in self.machines] + [self.compose(None, h) for h in self.hosts]
        profiles += [self.compose(g, h) for g in self.gpus for h in self.hosts]
        for p in profiles:
            out += [f"{p.name}: {msg}" for msg in p.problems()]
        return out


_PROFILE_NUMBERS = (
    "gpus",
    "host_ram_bytes",
    "host_read_bandwidth",
    "h2d_pinned",
    "h2d_pageable",
    "d2h_pinned",
    "cpu_expert_throughput",
    "cpu_flops",
    "cpu_cores",
    "sync_s",
)


def load_presets(path: str | os.PathLike | None = None) -> Presets:
    """Read the presets file (default: ``resources/hardware/presets.json`` in the source tree)."""
    path = Path(path) if path is not None else PRESETS_PATH
    try:
        d = json.loads(path.read_text())
    except OSError as e:
        raise HardwareProfileError(f"cannot read hardware presets {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise HardwareProfileError(
            f"hardware presets {path} are not JSON ({e.msg} at line {e.lineno})"
        ) from None
    if not isinstance(d, dict) or d.get("schema_version") != 1:
        raise HardwareProfileError(
            f"hardware presets {path}: unknown schema_version {d.get('schema_version')!r}"
        )
    try:
        lanes = {int(k): float(v) for k, v in d["pcie_lane_bandwidth"]["value"].items()}
        return Presets(
            gpus=dict(d["gpus"]),
            hosts=dict(d["hosts"]),
            machines=dict(d.get("machines", {})),
            efficiency=dict(d["efficiency"]),
            lane_bandwidth=lanes,
            path=str(path),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise HardwareProfileError(f"hardware presets {path} are malformed: {e!r}") from None


def preset(name: str, path: str | os.PathLike | None = None) -> HardwareProfile:
    """A validated profile from the presets file by name (see :meth:`Presets.get`)."""
    return load_presets(path).get(name).validate()


def preset_names(path: str | os.PathLike | None = None) -> list[str]:
    """Names :func:`preset` accepts alone (machines and hosts); GPUs combine as ``gpu+host``."""
    return load_presets(path).names()
