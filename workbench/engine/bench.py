"""The benchmark runner: CPU expert formats and our engine over placements under a VRAM budget.

llama.cpp runs are in :mod:`workbench.engine.bench_llamacpp`; memory sampling in
:mod:`workbench.engine.bench_measure`.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from workbench.core import synth
from workbench.core.costmodel import CostModel, model_prompt_pair_reads
from workbench.core.errors import WorkbenchError
from workbench.core.fmt import parse_size
from workbench.core.hardware import HardwareProfile, preset
from workbench.core.placement import (
    TIER_CPU_COMPUTE,
    TIER_CPU_STREAM,
    Budget,
    Placement,
    expert_grid,
    is_gpu,
    parse_ranges,
)
from workbench.core.planner import Planner
from workbench.core.readers import open_model
from workbench.core.stats import ExpertStats
from workbench.engine import bus, kernel_check
from workbench.engine import cpu_formats as cf
from workbench.engine.bench_measure import PeakSampler, markdown_table
from workbench.engine.calibrate import host_read_now
from workbench.engine.experts import COMPUTE, RESIDENT

log = logging.getLogger(__name__)


def expert_throughput(fmt: str, hidden: int, inter: int, *, n_experts: int = 64, tokens: int = 1,
                      repeats: int = 3, seed: int = 0) -> dict:
    """Time whole experts (fused gate+up, SiLU, down) in ``fmt``, cycling through ``n_experts``
    distinct ones so RAM feeds them. Returns µs per expert and GB/s of weight bytes."""
    g = torch.Generator().manual_seed(seed)
    gate, up = (torch.randn(inter, hidden, generator=g) * 0.02 for _ in range(2))
    down = torch.randn(hidden, inter, generator=g) * 0.02
    experts = [cf.ExpertFFN.from_float(gate.roll(i, 1), up.roll(i, 1), down.roll(i, 1), fmt)
               for i in range(n_experts)]
    x = torch.randn(tokens, hidden, generator=g)
    t, runs = cf.time_per_call(experts, x, repeats)
    nbytes = experts[0].nbytes
    return {"format": fmt, "matrix": f"expert [{hidden}x{inter}] x3", "tokens": tokens,
            "threads": torch.get_num_threads(), "us_per_matrix": t * 1e6, "bytes_per_matrix": nbytes,
            "gbps": nbytes / t / 1e9, "bf16_equiv_gbps": 3 * hidden * inter * 2 / t / 1e9,
            "spread_us": [r * 1e6 for r in runs]}


def layer_throughput(fmt: str, hidden: int, inter: int, *, selected: int = 8, workers: int = 1,
                     threads_per_worker: int | None = None, n_experts: int = 64, repeats: int = 3,
                     seed: int = 0) -> dict:
    """Time one token through ``selected`` CPU experts of a layer with an :class:`ExpertPool`
    (``workers`` experts at once), cycling through ``n_experts`` so RAM feeds them. Returns µs per
    layer-token and GB/s of expert weight bytes."""
    g = torch.Generator().manual_seed(seed)
    gate, up = (torch.randn(inter, hidden, generator=g) * 0.02 for _ in range(2))
    down = torch.randn(hidden, inter, generator=g) * 0.02
    experts = [cf.ExpertFFN.from_float(gate.roll(i, 1), up.roll(i, 1), down.roll(i, 1), fmt)
               for i in range(n_experts)]
    pool = cf.ExpertPool(workers, threads_per_worker)
    x = torch.randn(1, hidden, generator=g)
    w = torch.full((selected,), 1.0 / selected)
    groups = [experts[i:i + selected] for i in range(0, n_experts - selected + 1, selected)]
    try:
        pool(groups[0], x, w)
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for grp in groups:
                pool(grp, x, w)
            runs.append((time.perf_counter() - t0) / len(groups))
    finally:
        pool.close()
    t = float(np.median(runs))
    nbytes = selected * experts[0].nbytes
    return {"format": fmt, "matrix": f"{selected} experts, {workers} x {pool.threads} threads",
            "tokens": 1, "threads": workers * pool.threads, "us_per_matrix": t * 1e6,
            "bytes_per_matrix": nbytes, "gbps": nbytes / t / 1e9,
            "bf16_equiv_gbps": selected * 3 * hidden * inter * 2 / t / 1e9, "spread_us": [r * 1e6 for r in runs]}


def cpu_format_table(hidden: int, inter: int, formats: list[str], *, n_experts: int = 128,
                     tokens: int = 1, selected: int = 8, pool_workers: tuple[int, ...] = ()) -> list[dict]:
    """Per format: the fused gate_up matrix [2I, H] alone, the whole expert (batch ``tokens``), and
    for each count in ``pool_workers`` a layer's ``selected`` experts through an ExpertPool."""
    rows = []
    for fmt in formats:
        if fmt not in cf.available_formats(2 * inter, hidden):
            log.warning("format %s not available for this shape", fmt)
            continue
        r = cf.throughput(fmt, 2 * inter, hidden, n_mats=n_experts, tokens=tokens)
        r["matrix"] = f"gate_up [{2 * inter}, {hidden}]"
        rows.append(r)
        rows.append(expert_throughput(fmt, hidden, inter, n_experts=n_experts, tokens=tokens))
        threads = torch.get_num_threads()
        for workers in pool_workers:
            if workers <= threads and threads % workers == 0:
                rows.append(layer_throughput(fmt, hidden, inter, selected=selected, workers=workers,
                                             threads_per_worker=threads // workers, n_experts=n_experts))
        log.info("%s: %.1f GB/s", fmt, r["gbps"])
    return rows


@dataclass
class EngineRun:
    """One placement run by our engine. Times in seconds, rates in tokens/s (medians over repeats,
    with every repeat kept), memory in bytes; ``coverage``: measured share of each layer's
    selections served by its top 10% experts."""

    label: str
    strategy: str
    ok: bool = False
    error: str = ""
    prefill_tps: float | None = None
    decode_tps: float | None = None
    ttft_s: float | None = None
    prefill_samples: list[float] = field(default_factory=list)
    decode_samples: list[float] = field(default_factory=list)
    ttft_samples: list[float] = field(default_factory=list)
    peak_gpu_bytes: float | None = None
    peak_torch_bytes: float | None = None
    peak_reserved_bytes: float | None = None
    """PyTorch's peak allocated / reserved (cached) GPU bytes; ``peak_gpu_bytes`` (NVML) adds the CUDA
    context and loaded kernels to the reserved."""
    peak_host_bytes: float | None = None
    alloc_retries: int | None = None
    """Times PyTorch's allocator freed its cached blocks and retried an allocation during the run (at
    the VRAM cap, ``budget.cap_reserved``; each one synchronizes the device)."""
    predicted_decode_tps: float | None = None
    predicted_prefill_tps: float | None = None
    predicted_from: str = "routing counts of the runs before it"
    """Which routing counts the predictions used: the runs' before it, or, for a run the bench planned
    before any run had routed a token, its own (the counts, not its timings; the prediction without
    any counts, i.e. with uniform routing, is then ``uniform_decode_tps`` / ``uniform_prefill_tps``)."""
    uniform_decode_tps: float | None = None
    uniform_prefill_tps: float | None = None
    host_read_gbs: float | None = None
    """The host's RAM read (GB/s) just before the run; None when not probed."""
    at_read_decode_tps: float | None = None
    """The decode prediction with the profile's CPU rates moved to ``host_read_gbs``
    (``HardwareProfile.at_host_read``), next to the calibration's own (``predicted_decode_tps``)."""
    roofline_decode_tps: float | None = None
    roofline: dict = field(default_factory=dict)
    engine_paths: dict = field(default_factory=dict)
    """What the engine did on this placement: experts copied over the bus (``bus_experts``), the decode
    server's layers and the pairs its kernels read from the CPU stacks in place (``served_layers``,
    ``served_bus_pairs``) and the formats of the experts kept as quantized blocks (``kept``, by
    layer), for reading the figures."""
    coverage: list[float] = field(default_factory=list)
    load_s: float = 0.0
    prompt_host: dict = field(default_factory=dict)
    """The engine thread's records of the timed prompts' hybrid layers, means per layer
    (``HostClock.summary``: busy, waiting for the routing and for the CPU, experts fetched,
    batches, copies), beside the model's host lane for them (``predicted_host_ms``) and its lanes
    (``predicted_lanes_ms``: ``predicted_prompt_lanes``)."""
    predicted_decode_lanes_us: dict = field(default_factory=dict)
    """The model's decode lanes for this placement (``predicted_decode_lanes``)."""

    @property
    def roofline_fraction(self) -> float | None:
        if not self.decode_tps or not self.roofline_decode_tps:
            return None
        return self.decode_tps / self.roofline_decode_tps

    @property
    def prediction_error(self) -> float | None:
        """(predicted - measured) / measured decode tokens/s."""
        if not self.decode_tps or not self.predicted_decode_tps:
            return None
        return (self.predicted_decode_tps - self.decode_tps) / self.decode_tps

    @property
    def prefill_prediction_error(self) -> float | None:
        """(predicted - measured) / measured prefill tokens/s."""
        if not self.prefill_tps or not self.predicted_prefill_tps:
            return None
        return (self.predicted_prefill_tps - self.prefill_tps) / self.prefill_tps

    def to_json(self) -> dict:
        d = dict(self.__dict__)
        d["roofline_fraction"] = self.roofline_fraction
        d["prediction_error"] = self.prediction_error
        d["prefill_prediction_error"] = self.prefill_prediction_error
        return d


PRE_MOE_KINDS = ("attn", "router", "norm")
"""Units a layer reads before its experts can start: attention, its norms and the router."""


def roofline(cost: CostModel, placement: Placement, profile: HardwareProfile) -> dict:
    """Decode roofline of a placement: the bytes each device must read per token (routed experts
    weighted by the cost model's selection probabilities; the embedding's one row ignored) over its
    bandwidth, in the order a token needs them. Layer by layer, the units before the experts
    (attention, norms, router: ``PRE_MOE_KINDS``) are read first, then the routed experts and the
    shared expert or dense MLP on each device at once (GPU, the CPU's RAM, the bus), the layer
    lasting as long as its slowest device; the lm_head and final norm after the last layer. A
    layer's experts need its attention's output and the next layer's attention needs its experts'
    sum, so no device can work ahead. Bandwidth alone: no launches, syncs or hand-offs.

    Returns ``gpu_bytes``/``cpu_bytes``/``bus_bytes`` (per token), ``seconds`` (per device, each
    alone), ``serial_s`` (the layers' pre-expert reads, s), ``tps`` (1 / the sum) and ``bound`` (the
    device whose reads, where they are the slowest, take the most of that sum)."""
    inv = cost.inv
    L = cost.n_layers
    grid = expert_grid(placement, L, cost.n_experts)
    per_tok = cost.p_sel * cost.expert_bytes * cost.present  # expected bytes of each expert per token
    names = ("gpu", "cpu", "bus")
    rates = np.array([profile.gpus[0].mem_bandwidth, profile.host_read_bandwidth, profile.h2d_pinned])
    moe = np.stack([(per_tok * (grid >= 0)).sum(axis=1),  # per layer, the expert phase's bytes by device
                    (per_tok * (grid == TIER_CPU_COMPUTE)).sum(axis=1),
                    (per_tok * (grid == TIER_CPU_STREAM)).sum(axis=1)], axis=1)  # bus: every pick fetched
    serial = np.zeros(2)  # gpu, cpu: bytes read with nothing beside them
    for key, unit in inv.units.items():
        if key.kind in ("expert", "embed"):
            continue
        dev = 0 if is_gpu(placement.get(key).tier) else 1
        if key.layer is None or key.kind in PRE_MOE_KINDS or key.layer >= L:
            serial[dev] += unit.nbytes
        else:
            moe[key.layer, dev] += unit.nbytes
    lanes = moe / rates
    slowest = lanes.max(axis=1)
    serial_lanes = serial / rates[:2]
    t = float(serial_lanes.sum() + slowest.sum())
    totals = moe.sum(axis=0) + np.append(serial, 0.0)
    setting = np.bincount(lanes.argmax(axis=1), weights=slowest, minlength=3)  # time each device sets
    setting[:2] += serial_lanes
    return {"gpu_bytes": float(totals[0]), "cpu_bytes": float(totals[1]), "bus_bytes": float(totals[2]),
            "seconds": {n: float(totals[i] / rates[i]) for i, n in enumerate(names)},
            "serial_s": float(serial_lanes.sum()), "tps": 1.0 / t if t > 0 else None,
            "bound": names[int(np.argmax(setting))]}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


PROMPT_SAMPLES = 5
"""Timed prompts per run at least: after the ``repeats`` of a prompt and its decode, prompts alone
until there are this many (a prompt of S1 takes ~0.2 s; two samples of one run differed by 15%)."""


def measure_engine(engine, *, prompt: int, gen: int, repeats: int, seed: int = 0) -> dict:
    """Prefill ``prompt`` random tokens, then decode ``gen`` random tokens one by one (like
    llama-bench: each step reads its logits back), ``repeats`` times after a warm-up (the whole
    prompt, then 4 steps); then the prompt alone until ``PROMPT_SAMPLES`` prompts were timed.
    Returns per-repeat decode tokens/s, per-prompt prefill tokens/s and time to first token (s),
    and under ``host`` the engine thread's records of the timed prompts' hybrid layers
    (``HostClock.summary``)."""
    from .hostclock import HostClock

    clock = HostClock()
    g = torch.Generator().manual_seed(seed)
    vocab, dev = engine.vocab_size, engine.device
    ids = torch.randint(0, vocab, (prompt,), generator=g)
    steps = torch.randint(0, vocab, (gen,), generator=g)
    engine.forward(ids, 0, last_only=True)  # the whole prompt: kernels tuned per shape are tuned here
    for i in range(min(gen, 4)):
        engine.forward(steps[i: i + 1], prompt + i).argmax().item()
    engine.reset_routing_counts()
    out = {"prefill": [], "decode": [], "ttft": []}

    def timed_prompt() -> float:  # the whole prompt to its first token, its hybrid layers recorded
        engine.record_host(clock)
        t0 = time.perf_counter()
        engine.forward(ids, 0, last_only=True)[-1].argmax().item()
        t1 = time.perf_counter()
        engine.record_host(None)
        out["ttft"].append(t1 - t0)
        out["prefill"].append(prompt / (t1 - t0))
        return t1

    for _ in range(repeats):
        _sync(dev)
        t1 = timed_prompt()
        for i in range(gen):
            engine.forward(steps[i: i + 1], prompt + i)[-1].argmax().item()
        _sync(dev)
        out["decode"].append(gen / (time.perf_counter() - t1))
    for _ in range(PROMPT_SAMPLES - repeats if repeats > 0 else 0):
        timed_prompt()
    out["host"] = clock.summary()
    return out


def run_placement(inv, placement: Placement, label: str, strategy: str, *, device: str, dtype: torch.dtype,
                  prompt: int, gen: int, repeats: int, vram_budget: int | None,
                 pair_reads: float | None = None, bus_share: float | None = None,
                 unit_shares=None) -> tuple[EngineRun, np.ndarray]:
    """Load ``placement``, measure it, close the engine. Returns the run and its routing counts.
    ``pair_reads``: the profile's cost of a prompt's further token per CPU expert
    (``costmodel.model_prompt_pair_reads``), which the engine's prompt split then uses;
    ``bus_share``: decode's bus share (``bus.fraction_for``; None: the engine's default);
    ``unit_shares``: decode's unit split per layer (``CostModel.unit_shares``; None: none)."""
    from workbench.engine import Engine

    run = EngineRun(label, strategy)
    counts = np.zeros((inv.spec.n_layers, max(1, inv.spec.n_experts)), np.int64)
    dev = torch.device(device)
    retries = 0
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        retries = torch.cuda.memory_stats(dev).get("num_alloc_retries", 0)
    with PeakSampler() as sampler:
        engine = None
        try:
            t0 = time.perf_counter()
            engine = Engine.load(inv, placement, device=dev, dtype=dtype, max_context=prompt + gen,
                                 vram_budget=vram_budget, bus_share=bus_share, unit_shares=unit_shares)
            run.load_s = time.perf_counter() - t0
            engine.set_prompt_pair_reads(pair_reads)
            m = measure_engine(engine, prompt=prompt, gen=gen, repeats=repeats)
            counts = engine.routing_counts()
            run.engine_paths = engine_paths(engine, counts)
            run.prefill_samples, run.decode_samples, run.ttft_samples = m["prefill"], m["decode"], m["ttft"]
            run.prompt_host = m["host"]
            run.prefill_tps = float(np.median(m["prefill"]))
            run.decode_tps = float(np.median(m["decode"]))
            run.ttft_s = float(np.median(m["ttft"]))
            run.ok = True
        except WorkbenchError as e:
            run.error = str(e)
        finally:
            if engine is not None:
                engine.close()
    pk = sampler.peaks
    run.peak_gpu_bytes, run.peak_host_bytes = pk.gpu, pk.host_rss
    if dev.type == "cuda":
        run.peak_torch_bytes = float(torch.cuda.max_memory_allocated(dev))
        run.peak_reserved_bytes = float(torch.cuda.max_memory_reserved(dev))
        run.alloc_retries = int(torch.cuda.memory_stats(dev).get("num_alloc_retries", 0) - retries)
    if counts.any():
        run.coverage = [float(c) for c in synth.coverage(counts)]
    return run, counts


def predicted_prompt_lanes(prediction) -> dict:
    """The model's lanes of a prompt chunk (ms), means over its hybrid layers (``"hybrid"``: ``pre``,
    ``gpu``, ``cpu``, ``bus``, ``sync``, ``host``, ``total``, and ``"layers"``) and over its other
    layers (``"resident"``: ``total`` and ``"layers"``), to set beside the engine's records."""
    return _lanes(prediction.prefill_layers, 1e3, ("pre", "gpu", "cpu", "bus", "sync", "host", "total"))


def predicted_decode_lanes(prediction) -> dict:
    """The model's lanes of a decode step (µs), as ``predicted_prompt_lanes``: means over its hybrid
    layers (``pre``, ``gpu``, ``cpu``, ``bus``, ``sync``, ``spread``: what tokens that give the CPU
    more than the mean add, ``total``) and over its other layers, and ``"other"``: the head, sampling
    and the host's own time per token."""
    lanes = _lanes(prediction.decode_layers, 1e6, ("pre", "gpu", "cpu", "bus", "sync", "spread", "total"))
    return {**lanes, "other": 1e6 * prediction.decode_other_s}


def _lanes(layers, unit: float, names: tuple[str, ...]) -> dict:
    hybrid = [c for c in layers if c.cpu > 0 or c.bus > 0]
    other = [c for c in layers if not (c.cpu > 0 or c.bus > 0)]

    def mean(cs, name: str) -> float:
        return unit * sum(getattr(c, name) for c in cs) / len(cs) if cs else 0.0

    return {"hybrid": {"layers": len(hybrid), **{k: mean(hybrid, k) for k in names}},
            "resident": {"layers": len(other), "total": mean(other, "total")}}


def predicted_host_ms(prediction) -> float:
    """The model's host lane (ms) of a prompt chunk's hybrid layers, their mean (0 when none has one)."""
    lanes = [c.host for c in prediction.prefill_layers if c.host > 0 and (c.cpu > 0 or c.bus > 0)]  # resident: no
    return 1e3 * sum(lanes) / len(lanes) if lanes else 0.0


def engine_paths(engine, counts: np.ndarray | None = None) -> dict:
    """What a loaded engine did: ``bus_experts`` (experts the bus share copied so far: prompts, and
    decode without the decode server), ``bus_share`` (the share of a token's CPU-selected experts its
    decode sends over the bus), ``served_layers`` / ``served_bus_pairs`` (the decode server's
    hybrid layers and the (token, expert) pairs its bus kernels computed so far, whole or, under a
    unit split, in part), ``unit_split`` (``{layer: [CPU units, all units]}`` of the served layers
    whose pairs the CPU and the bus split by units), ``kept``
    (``{layer: "gate/up format+down format"}``), ``tiers`` (``{layer: [resident, compute, stream]}``
    expert counts), ``decode_server_off`` (why hybrid layers went back to host-driven steps, which
    the cost model does not predict; None when they did not), ``dropped_candidates`` (kernel
    candidates this process found computing wrong here: ``kernel_check.dropped``) and, given its
    routing ``counts [L, E]``, ``cpu_selected`` (``{layer: selections of CPU-tier experts per
    token}``: the host work of each hybrid layer), ``prompt_pair_reads`` (the
    prompt split's cost of a further token per CPU expert, in reads; None: a read per token) and
    ``cpu_huge_pages`` (the share of the CPU tier's stack bytes the OS backs with huge pages now,
    ``hostmem.huge_bytes``; None without a CPU tier) and ``cpu_numa`` (``{node: share}`` of those
    bytes by NUMA node, ``hostmem.node_bytes_each``, and ``nodes``: the host's NUMA nodes online;
    None without a CPU tier or where the OS does not say)."""
    share = getattr(engine, "_bus", None)
    kept = {str(layer): "+".join(lx.kept) for layer, lx in engine.experts.items() if lx.kept is not None}
    tiers = {str(layer): [int(n) for n in lx.n_tier] for layer, lx in engine.experts.items()}
    out = {"bus_experts": share.copied if share is not None else 0, "kept": kept, "tiers": tiers,
           "dropped_candidates": list(kernel_check.dropped), "bus_share": getattr(engine, "bus_share", None)}
    decoder = getattr(engine, "_decoder", None)
    server = getattr(decoder, "server", None)
    out["served_layers"] = sorted(server.layers) if server is not None else []
    out["decode_server_off"] = getattr(decoder, "unserved", None)
    out["served_bus_pairs"] = server.bus_pairs if server is not None else 0
    out["unit_split"] = {str(layer): [s.units, s.ffn] for layer, s in server.layers.items()
                         if s.bus_stacks is not None} if server is not None else {}
    out["prompt_pair_reads"] = getattr(engine, "prompt_pair_reads", None)
    out["cpu_huge_pages"] = huge_page_share(engine)
    out["cpu_numa"] = numa_shares(engine)
    if counts is not None and counts.any():
        k = max(1, engine.args.top_k)
        cpu = {}
        for layer, lx in engine.experts.items():
            c = counts[layer]  # [E], like lx.tier
            if lx.n_tier[COMPUTE] and c.sum():
                cpu[str(layer)] = round(float(c[lx.tier > RESIDENT].sum() / c.sum() * k), 3)
        out["cpu_selected"] = cpu
    return out


def path_warnings(runs: list[EngineRun]) -> list[str]:
    """Lines for the runs whose engine left its fast path (the decode server turned off): their
    figures are the fallback's, not what the placement and the model stand for."""
    return [f"WARNING {r.label}: the decode server went off ({r.engine_paths['decode_server_off']}); "
            "its hybrid layers ran host-driven steps" for r in runs if r.engine_paths.get("decode_server_off")]


def huge_page_share(engine) -> float | None:
    """The share (0..1) of the CPU tier's stack bytes on huge pages now, over every layer's stacks
    (``LayerExperts.cpu_stacks``); None when no layer has a CPU tier. A stack from ``hostmem.empty``
    is a mapping of its own; a small one shares torch's, so each counts at most its own bytes."""
    from . import hostmem

    stacks = _cpu_stacks(engine)
    sizes = [t.numel() * t.element_size() for t in stacks]
    huge = sum(min(n, h) for n, h in zip(sizes, hostmem.huge_bytes_each(stacks)))
    return huge / sum(sizes) if stacks else None


def _cpu_stacks(engine) -> list[torch.Tensor]:
    """Every layer's CPU-tier stacks that hold anything (``LayerExperts.cpu_stacks``)."""
    return [t for lx in engine.experts.values() for t in lx.cpu_stacks() if t is not None and t.numel()]


def numa_shares(engine) -> dict | None:
    """The CPU tier's stack bytes by NUMA node, ``{"nodes": nodes online, "N0": share, ...}`` (shares
    0..1 of the bytes placed; ``LayerExperts.cpu_stacks``; a stack in a mapping larger than itself
    counts its own part of that mapping's pages); None without a CPU tier or where
    ``/proc/self/numa_maps`` says nothing."""
    from . import hostmem

    stacks = _cpu_stacks(engine)
    placed: dict[int, float] = {}
    for t, nodes in zip(stacks, hostmem.node_bytes_each(stacks)):
        total = sum(nodes.values())
        if total <= 0:
            continue
        own = t.numel() * t.element_size()
        for node, b in nodes.items():  # a small stack in torch's shared mapping: its part of the mapping's pages
            placed[node] = placed.get(node, 0.0) + b * min(1.0, own / total)
    if not placed or sum(placed.values()) <= 0:
        return None
    whole = sum(placed.values())
    online = Path("/sys/devices/system/node/online")
    out: dict = {"nodes": _count_nodes(online.read_text()) if online.exists() else None}
    out.update({f"N{n}": round(b / whole, 4) for n, b in sorted(placed.items())})
    return out


def _count_nodes(spec: str) -> int:
    """Nodes in a kernel node list such as ``0-1,3`` (``placement.parse_ranges``)."""
    return len(parse_ranges(spec.strip()))


def load_profile(name_or_path: str) -> HardwareProfile:
    """A hardware profile from a JSON file (``workbench calibrate`` output) or a preset name."""
    p = Path(name_or_path)
    if p.suffix == ".json" and p.is_file():
        return HardwareProfile.from_json(json.loads(p.read_text()))
    return preset(name_or_path)


def run_strategies(model: str, strategies: list[str], *, budget_bytes: int, profile: HardwareProfile,
                   device: str = "cuda", dtype: torch.dtype = torch.bfloat16, prompt: int = 512,
                   gen: int = 128, repeats: int = 3, all_gpu: bool = False,
                   time_limit: float | None = None, margin_bytes: int = 0,
                   save_placements: str | Path | None = None, probe_host: bool = True) -> list[EngineRun]:
    """Plan each strategy under the budget and run it. Routing statistics for the frequency-based
    planners come from the runs before them (put ``n-cpu-moe`` first): measured, not assumed.
    ``time_limit`` (s): strategies that would start later are reported as skipped. ``margin_bytes``:
    VRAM the planner leaves free under ``budget_bytes`` (what the engine and CUDA add beyond the
    planner's estimate); the runs are still judged against ``budget_bytes``. ``save_placements``: a
    folder for each run's placement as a project file ``<strategy>.json`` (with the routing counts
    the planner saw), which ``workbench generate --placement`` and the profile scripts load.
    ``probe_host``: read the host's RAM speed just before each run and report it with a second
    prediction at that speed (``EngineRun.at_read_decode_tps``)."""
    deadline = None if time_limit is None else time.monotonic() + time_limit
    inv = open_model(model)
    spec = inv.spec
    stats = ExpertStats(spec.n_layers, max(1, spec.n_experts), max(1, spec.n_experts_active))
    from .engine import keeps_dense

    extra = dequantized_extra_bytes(inv, dtype, keeps_dense(inv, torch.device(device)))
    budget = Budget((budget_bytes,), margin=margin_bytes + extra)
    runs = []
    pair_reads = model_prompt_pair_reads(inv, profile)  # the engine's prompt split, from the profile
    bus_share = bus.fraction_for(inv, profile)  # and its decode's, as the cost model predicts it
    todo = [("all-gpu", None)] if all_gpu else []
    todo += [(s, budget) for s in strategies]
    for strategy, b in todo:
        if deadline is not None and time.monotonic() > deadline:
            runs.append(EngineRun(strategy, strategy, error="skipped: out of time"))
            continue
        seen = stats if stats.tokens > 0 else None
        cost = CostModel(inv, profile, seen)
        planner = Planner(cost, b or Budget((2**62,)), ctx=prompt + gen, prompt_tokens=prompt)
        try:
            plan = planner.plan(strategy)
        except WorkbenchError as e:
            runs.append(EngineRun(strategy, strategy, error=str(e)))
            continue
        label = strategy + (f" {plan.n_cpu_moe}" if plan.n_cpu_moe is not None else "")
        if save_placements is not None:
            from workbench.core.project import save_project

            Path(save_placements).mkdir(parents=True, exist_ok=True)
            save_project(Path(save_placements) / f"{strategy}.json", inv, plan.placement, profile,
                         stats if stats.tokens > 0 else None)
        read = host_read_now() if probe_host else None
        run, counts = run_placement(inv, plan.placement, label, strategy, device=device, dtype=dtype,
                                    prompt=prompt, gen=gen, repeats=repeats,
                                    vram_budget=budget_bytes if b is not None else None,
                                    pair_reads=pair_reads, bus_share=bus_share,
                                    unit_shares=cost.unit_shares(plan.placement, kv_tokens=prompt + gen))
        run.predicted_decode_tps = plan.prediction.decode_tps
        run.predicted_prefill_tps = plan.prediction.prefill_tps
        prediction = plan.prediction
        if read:
            run.host_read_gbs = read / 1e9
            run.at_read_decode_tps = CostModel(inv, profile.at_host_read(read), seen).predict(
                plan.placement, prompt + gen, prompt_tokens=prompt).decode_tps
        if counts.any():
            stats.add(counts)
        if seen is None and counts.any():  # planned blind: predict again with the routing it saw
            run.uniform_decode_tps, run.uniform_prefill_tps = run.predicted_decode_tps, run.predicted_prefill_tps
            cost = CostModel(inv, profile, stats)
            again = cost.predict(plan.placement, prompt + gen, prompt_tokens=prompt)
            run.predicted_decode_tps, run.predicted_prefill_tps = again.decode_tps, again.prefill_tps
            run.predicted_from = "routing counts of this run (none before it)"
            prediction = again
        run.predicted_decode_lanes_us = predicted_decode_lanes(prediction)
        if run.prompt_host.get("layers"):
            run.prompt_host["predicted_host_ms"] = predicted_host_ms(prediction)
            run.prompt_host["predicted_lanes_ms"] = predicted_prompt_lanes(prediction)
        rf = roofline(cost, plan.placement, profile)
        run.roofline, run.roofline_decode_tps = rf, rf["tps"]
        runs.append(run)
        log.info("%s: decode %s tok/s (predicted %s)", label, run.decode_tps, run.predicted_decode_tps)
    return runs


def dequantized_extra_bytes(inv, dtype: torch.dtype, dense_kept: bool = True) -> int:
    """GPU bytes our engine holds beyond the file's for the units the planner counts at file size:
    quantized tensors are dequantized to ``dtype`` at load, except routed experts the engine keeps in
    their blocks (``engine.keeps_blocks``) and, with ``dense_kept`` (CUDA: ``engine.keeps_dense``),
    the projections, embeddings and head it keeps too (``memory.kept_in_blocks``); the planner
    leaves that much free."""
    from workbench.core.memory import engine_bytes

    from .engine import keeps_blocks
    from .families import ModelArgs

    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    experts_kept = keeps_blocks(inv, ModelArgs.from_config(inv.family, inv.config), None)
    extra = 0
    for key, unit in inv.units.items():
        quantized = any(t.tensor.dtype.upper() not in ("F32", "F16", "BF16") for t in unit.tensors)
        if quantized:
            extra += max(0, engine_bytes(key, unit, dtype_bytes, experts_kept, dense_kept) - unit.nbytes)
    return extra


RUN_COLUMNS = [("placement", "label"), ("peak GPU GiB", "peak_gpu_gib"), ("fits", "fits"),
               ("prefill tok/s", "prefill_tps"), ("predicted prefill", "predicted_prefill_tps"),
               ("prefill error %", "prefill_prediction_error_pct"), ("TTFT s", "ttft_s"), ("decode tok/s", "decode_tps"),
               ("predicted decode", "predicted_decode_tps"), ("error %", "prediction_error_pct"),
               ("RAM GB/s", "host_read_gbs"), ("predicted at that RAM", "at_read_decode_tps"),
               ("roofline decode", "roofline_decode_tps"), ("of roofline", "roofline_pct"),
               ("peak host GiB", "peak_host_gib"), ("top-10% coverage", "coverage_mean"), ("error", "error")]


def _gib(b: float | None) -> float | None:
    return None if b is None else b / 2**30


def run_rows(runs: list[EngineRun], budget_bytes: int) -> list[dict]:
    """Table rows (GiB, percent) for :data:`RUN_COLUMNS`."""
    rows = []
    for r in runs:
        d = r.to_json()
        d["peak_gpu_gib"], d["peak_host_gib"] = _gib(r.peak_gpu_bytes), _gib(r.peak_host_bytes)
        d["fits"] = None if r.peak_gpu_bytes is None or r.strategy == "all-gpu" else r.peak_gpu_bytes <= budget_bytes
        d["prediction_error_pct"] = None if r.prediction_error is None else 100 * r.prediction_error
        e = r.prefill_prediction_error
        d["prefill_prediction_error_pct"] = None if e is None else 100 * e
        d["roofline_pct"] = None if r.roofline_fraction is None else 100 * r.roofline_fraction
        d["coverage_mean"] = float(np.mean(r.coverage)) if r.coverage else None
        rows.append(d)
    return rows


def compare(runs: list[EngineRun], llama: list, budget_bytes: int) -> dict:
    """Ratios of our best run within the budget to llama.cpp's best within the budget (decode and
    prefill), and all-GPU decode against llama.cpp all-GPU, where both exist."""
    from workbench.engine.bench_llamacpp import best_within

    ours = [r for r in runs if r.ok and r.strategy != "all-gpu" and r.peak_gpu_bytes is not None
            and r.peak_gpu_bytes <= budget_bytes]
    best = max(ours, key=lambda r: r.decode_tps, default=None)
    theirs = best_within([r for r in llama if "--n-cpu-moe" in r.args or "-ot" in r.args], budget_bytes)
    out = {"ours": best.label if best else None, "llama.cpp": theirs.label if theirs else None}
    if best and theirs:
        out["decode_ratio"] = best.decode_tps / theirs.decode_tps
        if best.prefill_tps and theirs.prefill_tps:
            out["prefill_ratio"] = best.prefill_tps / theirs.prefill_tps
    ours_all = next((r for r in runs if r.ok and r.strategy == "all-gpu"), None)
    theirs_all = next((r for r in llama if r.ok and r.args == ["-ngl", "99"]), None)
    if ours_all and theirs_all and theirs_all.decode_tps:
        out["all_gpu_decode_ratio"] = ours_all.decode_tps / theirs_all.decode_tps
    return out


def run_command(args) -> int:
    """``workbench bench run``: llama.cpp (optional) then our engine over strategies on the same file;
    markdown tables, the ratios, optional JSON."""
    from workbench.engine import bench_llamacpp as lb

    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise WorkbenchError("no CUDA GPU here: use --device cpu (every tier on the CPU)")
    budget = parse_size(args.budget)
    dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[args.dtype]
    deadline = None if args.time_limit is None else time.monotonic() + args.time_limit
    llama = []
    if args.llama_bench:
        if not Path(args.llama_bench).is_file():
            raise WorkbenchError(f"no llama-bench at {args.llama_bench}: build it with scripts/build_llamacpp.sh")
        try:
            cfgs = [lb.n_cpu_moe(int(n)) for n in args.llama_n_cpu_moe.split(",") if n.strip()]
        except ValueError as e:
            raise WorkbenchError(f"--llama-n-cpu-moe takes integers, not {args.llama_n_cpu_moe!r}") from e
        if args.all_gpu:
            cfgs.append(lb.all_gpu())
        llama = lb.run_configs(args.llama_bench, args.model, cfgs, deadline=deadline, prompt=args.prompt,
                               gen=args.gen, repeats=args.repeats, threads=args.threads,
                               extra=tuple(args.llama_args.split()))
    left = None if deadline is None else max(0.0, deadline - time.monotonic())
    runs = run_strategies(args.model, [s for s in args.strategies.split(",") if s], budget_bytes=budget,
                          profile=load_profile(args.profile), device=device, dtype=dtype, prompt=args.prompt,
                          gen=args.gen, repeats=args.repeats, all_gpu=args.all_gpu,
                          time_limit=left, margin_bytes=parse_size(args.margin),
                          save_placements=args.save_placements, probe_host=args.probe_host)
    rows = run_rows(runs, budget)
    ratios = compare(runs, llama, budget) if llama else {}
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "budget_bytes": budget, "device": device,
                                               "runs": rows, "llama_cpp": [r.to_json() for r in llama],
                                               "ratios": ratios}, indent=1, default=str))
    if llama:
        lrows = [{**r.to_json(), "peak_gpu_gib": _gib(r.peak_gpu_bytes),
                  "fits": None if r.peak_gpu_bytes is None else r.peak_gpu_bytes <= budget} for r in llama]
        print(markdown_table(lrows, [("llama.cpp", "label"), ("peak GPU GiB", "peak_gpu_gib"), ("fits", "fits"),
                                     ("prefill tok/s", "prefill_tps"), ("decode tok/s", "decode_tps"),
                                     ("error", "error")]))
        print()
    print(markdown_table(rows, RUN_COLUMNS))
    for line in path_warnings(runs):
        print("\n" + line)
    if ratios:
        print("\n" + ", ".join(f"{k}: {v:.2f}" if isinstance(v, float) else f"{k}: {v}" for k, v in ratios.items()))
    return 0 if all(r.ok for r in runs) else 1
