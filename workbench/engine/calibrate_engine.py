"""Fit the cost model's per-kernel and per-host-point costs to the engine's own decode steps.

The machine-level figures (bandwidths, the fused CPU kernel's rate) leave out what the engine
adds on top: the GPU time of a layer's ~40 small kernels in its CUDA graphs beyond their bytes, and
the host work of a hybrid layer (the decode server's hand-off). This step writes a small synthetic
MoE model at the calibration's expert shape (8 layers, ``calibration_experts`` experts, a small
vocabulary), runs the engine's decode on CUDA with every expert resident, with a quarter, half and
three quarters of them on the CPU and with all of them on the CPU, and solves the cost model's
``launch_s`` (from the resident run) and ``sync_s`` and CPU expert rate (least squares over the
three hybrid runs: one fixed and one per-byte cost per hybrid layer, the per-byte one pinned by the
runs' spread of 2 to 6 CPU experts a token) so that it predicts those runs; the all-CPU run checks the result. Written
again in Q8_0 and Q4_K, all resident, it gives those blocks' GPU rates (``fit_kept_rates``). Two
deeper models of top-k experts a layer (16 and 32 layers) give the kernel cost from their
difference (``_deep_resident_fit``), and one of 128 experts a layer against the 16-layer one the
cost of a layer's experts beyond those it picks (``_wide_fit``).
The model then carries them to other placements. A quarter of the experts is eight times the
CPU's L3 (160 experts, 12 GB, at the Qwen3-30B-A3B shape on the H200 host's 300 MiB), so the CPU
reads them from RAM, as a real model's.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import psutil
import torch

from workbench.core import synth
from workbench.core.costmodel import CostModel, EngineShape
from workbench.core.errors import WorkbenchError
from workbench.core.hardware import HardwareProfile
from workbench.core.memory import placement_all_gpu, placement_cpu_moe
from workbench.core.placement import CPU_COMPUTE, Placement
from workbench.core.readers import open_model

from . import bus
from .hostclock import HostClock, HostLayer

log = logging.getLogger(__name__)

LAYERS, EXPERTS, VOCAB, STEPS, REPEATS = 8, 32, 2048, 24, 2
HYBRID_SHARES = (1 / 16, 0.25, 0.5, 0.75)
"""The shares of every layer's experts on the CPU in the decode fit's hybrid runs."""
CPU_FIT_SHARES = (1 / 16, 0.5)
"""The shares on the CPU of the runs that fit the CPU's rate for a kept block format."""
PROMPT_TOKENS, PROMPT_EXPERTS = 512, 128
"""The prompt fit's prompt (one chunk) and experts per layer (at the Qwen3-30B-A3B shape a layer's
prompt picks each about 32 times, as Qwen3-30B-A3B's own 128 experts are)."""
SHORT_PROMPT_TOKENS = 128
"""The prompt fit's short prompt: each expert picked about 8 times, so that the CPU computes a share
of them while the rest travel (a skewed model's cold experts in a longer prompt)."""
MAX_EXPERTS = 256
PACKETS_PER_COUNT = 5
"""The fewest packets of one count of CPU pairs whose median ``packet_rate`` fits."""
TRACE_ENV, TRACE_PACKETS = "WORKBENCH_SERVER_TRACE", 200_000
"""The decode server's packet records in the hybrid runs (``served.trace_capacity``): enough for
every packet of a run's steps, warm-up included (40 bytes each)."""


def calibration_experts(hidden: int, ffn: int, top_k: int, dtype_bytes: int = 2, room: int | None = None) -> int:
    """Routed experts per layer of the calibration model: at least ``EXPERTS`` (and ``top_k``), and
    enough that a quarter of them over ``LAYERS`` layers (the lightest fitted placement's CPU tier)
    is eight times the last-level caches. With 32 experts at the Qwen3-30B-A3B shape that quarter
    is 0.6 GB, twice the H200 host's 300 MiB L3: its CPU experts were partly read from the cache,
    the quarter run came out fast against the others, and the fitted host point swung between 57
    and 128 µs from call to call. Rounded up to a multiple of 32, at most ``MAX_EXPERTS``, and at
    most what half of ``room`` holds (bytes: the smaller of the GPU's free memory and the host's
    available RAM, each of which holds the whole model in one of the fitted runs)."""
    from .calibrate import l3_bytes

    expert = 3 * hidden * ffn * dtype_bytes
    want = math.ceil(8 * l3_bytes() / (0.25 * LAYERS * expert)) if expert > 0 else 0
    n = min(MAX_EXPERTS, 32 * math.ceil(want / 32))
    if room is not None and expert > 0:
        n = min(n, 32 * int(room / 2 / (LAYERS * expert) // 32))
    return int(max(EXPERTS, top_k, n))


WARM_S = 0.3
"""Seconds of untimed decode steps before the timed ones. The engine's load leaves the GPU idle for
seconds; the all-resident step of the same 8 layers measured 0.66 to 0.96 ms per step on H100
hosts from call to call (the fitted kernel cost 2.2 to 4.5 µs), while S1 all on the GPU, timed
after its 512-token prompt, held 454-457 tok/s, and the higher fits predicted it 26% slow
(BENCHMARKS.md, seventh stop). A GPU (and a CPU) that idled runs its first steps at lower clocks."""


def _decode_seconds(inv, placement, device: str, steps: int = STEPS, packets: list | None = None) -> float:
    """Median seconds per decode step of the engine under ``placement``, each step waited for as a
    generation's is (``_decode_times``; ``packets`` as there)."""
    return _decode_times(inv, placement, device, steps, packets)[0]


def packet_rate(records: np.ndarray, expert_bytes: float) -> tuple[float, float] | None:
    """The decode server's CPU time per packet as ``fixed + pairs * expert_bytes / rate``, by least
    squares over the median packet of each count of CPU pairs that ``PACKETS_PER_COUNT`` or more
    packets had (``served.DecodeServer.trace`` records, int64 ``[n, 6]``: layer, step, seen ns,
    done ns, pairs, bus pairs; a packet held up by a graph's capture or a neighbour's burst moves no median):
    ``(fixed s, rate B/s)``, the rate at which one token's experts are read where the engine reads
    them (its team, a packet's one to few experts, from RAM). None without two such counts or
    without a positive cost per pair."""
    rec = records[records[:, 4] > 0]
    counts = [c for c in np.unique(rec[:, 4]) if (rec[:, 4] == c).sum() >= PACKETS_PER_COUNT]
    if len(counts) < 2:
        return None
    pairs = np.array(counts, dtype=float)
    seconds = np.array([np.median(rec[rec[:, 4] == c, 3] - rec[rec[:, 4] == c, 2]) for c in counts]) * 1e-9
    a = np.stack([np.ones_like(pairs), pairs], axis=1)
    (fixed, per_pair), *_ = np.linalg.lstsq(a, seconds, rcond=None)
    if per_pair <= 0:
        return None
    return max(0.0, float(fixed)), float(expert_bytes / per_pair)


def _records(packets: list[np.ndarray]) -> np.ndarray:
    """The decode server's records of several runs (``_decode_times``' ``packets``) as one ``[n, 6]`` array."""
    return np.concatenate(packets) if packets else np.zeros((0, 6), dtype=np.int64)


def _expert_bytes(inv) -> float:
    """Bytes of one routed expert of ``inv``'s first MoE layer (its weights as the file holds them)."""
    return float(inv.units[inv.expert_keys(inv.spec.moe_layers[0])[0]].nbytes)


def _decode_times(inv, placement, device: str, steps: int = STEPS, packets: list | None = None) -> tuple[float, float]:
    """Seconds per decode step of the engine under ``placement`` (after a 16-token prompt, the
    graphs' capture and ``WARM_S`` of steps): ``(waited, queued)``. ``waited``: the median step when
    the host waits for each step's token, as a generation does; ``queued``: the mean step when the
    host queues them all and waits once, so that its own time per step (Python, the graph's launch,
    the token's read back) runs under the device's work. Their difference is the host's time per
    step, which a model of 8 layers would otherwise put on its layers' kernels (S1's 24 layers pay
    it once a step too). A step that waits inside (a hybrid layer's server checks its status) gives
    ``queued`` close to ``waited``. ``packets``: a list that gets the decode server's records of
    the run's packets appended (``served.DecodeServer.trace``), where a server ran."""
    from .engine import Engine

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    t0 = time.perf_counter()
    engine = Engine.load(inv, placement, device=device, dtype=dtype, max_context=16 + 2 * steps + 8,
                         bus_share=0.0)  # the CPU alone: the bus share is modelled from the bus's own rate
    if packets is not None and device != "cuda":  # a CPU accelerator: the served steps, run eagerly
        engine.decode_mode, engine.served_mode = "static", "on"
    traced = os.environ.get(TRACE_ENV)
    try:
        if packets is not None:  # read as the decode server starts (the first one-token step)
            os.environ[TRACE_ENV] = str(TRACE_PACKETS)
        log.info("calibration model loaded in %.1f s (%.1f GB on the CPU)", time.perf_counter() - t0,
                 engine.memory_report()["cpu"] / 1e9)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, VOCAB, (16 + 2 * steps,), generator=g)
        engine.forward(ids[:16], 0, last_only=True)

        def queue(i: int) -> torch.Tensor:  # token i after the prompt, at its position: its greedy token
            return engine.forward(ids[16 + i:17 + i], 16 + i)[-1].argmax()

        _sm_clock_mhz(device)  # NVML's first use, before the steps rather than between them
        for i in range(steps):  # the first steps capture the graphs
            queue(i).item()
        warm, i = time.perf_counter(), 0
        while time.perf_counter() - warm < WARM_S:  # the same positions again, until the devices are busy
            queue(i % steps).item()
            i += 1
        before = _sm_clock_mhz(device)
        times = []
        for i in range(steps, 2 * steps):
            t = time.perf_counter()
            queue(i).item()
            times.append(time.perf_counter() - t)
        t = time.perf_counter()
        for i in range(steps, 2 * steps):
            last = queue(i)
        last.item()
        queued = (time.perf_counter() - t) / steps
        waited = statistics.median(times)
        server = engine._decoder.server if packets is not None and engine._decoder is not None else None
        if server is not None:
            packets.append(server.trace())
            log.info("calibration decode: %d packets recorded", len(packets[-1]))
        if before is not None:
            log.info("calibration decode: %.3f ms a step (%.3f ms queued), SM clock %s MHz before the timed steps, "
                     "%s after", waited * 1e3, queued * 1e3, before, _sm_clock_mhz(device))
        return waited, queued
    finally:
        if packets is not None:
            if traced is None:
                os.environ.pop(TRACE_ENV, None)
            else:
                os.environ[TRACE_ENV] = traced
        engine.close()


@functools.cache
def _nvml():
    """One NVML session for the calibration's clock readings (its first use initialises NVML)."""
    from workbench.telemetry.nvml import Nvml

    return Nvml()


def _sm_clock_mhz(device: str) -> int | None:
    """The current GPU's SM clock (MHz) as NVML reports it, or None (no CUDA, no NVML): logged with
    each timed decode run, to tell a GPU still at low clocks from a slow step."""
    if device != "cuda" or not torch.cuda.is_available():
        return None
    nvml = _nvml()
    if not nvml.available:
        return None
    handle = nvml.query("nvmlDeviceGetHandleByIndex", torch.cuda.current_device(), default=None)
    mhz = nvml.query("nvmlDeviceGetClockInfo", handle, 1, default=None)  # 1: NVML_CLOCK_SM
    return int(mhz) if isinstance(mhz, (int, float)) else None


def _solve(cost_at, measured: float, lo: float = 0.0, step: float = 1e-5) -> float:
    """The value ``v >= lo`` of a parameter at which the model's seconds per token ``cost_at(v)``
    (linear in ``v``) equal ``measured``."""
    a, b = cost_at(lo), cost_at(lo + step)
    slope = (b - a) / step
    if slope <= 0:
        return lo
    return max(lo, lo + (measured - a) / slope)


def _ram_seconds_per_byte(prof: HardwareProfile) -> float:
    """The least ``1 / CPU expert rate`` a fit may return (s/B): experts come from RAM no faster than
    the host reads it (0 where the profile has no RAM read rate)."""
    return 1.0 / prof.host_read_bandwidth if prof.host_read_bandwidth > 0 else 0.0


def _upper_on_cpu(inv, share: float) -> Placement:
    """Every layer's upper ``share`` of experts computed on the CPU, the rest resident."""
    first = inv.spec.n_experts - round(share * inv.spec.n_experts)
    p = Placement()
    for layer in inv.spec.moe_layers:
        p.move([k for k in inv.expert_keys(layer) if k.expert >= first], CPU_COMPUTE)
    return p


DEPTHS = (16, 32)
"""Layers of the two all-resident models (``top_k`` experts a layer) that fit the kernel cost and the
host's time per step (``_deep_resident_fit``)."""


def calibration_room(device: str) -> int:
    """Bytes a calibration model may take: the host RAM available now, and on ``cuda`` no more than
    the GPU's free memory."""
    room = psutil.virtual_memory().available
    if device == "cuda" and torch.cuda.is_available():
        room = min(room, torch.cuda.mem_get_info()[0])
    return room


def _layer_bytes(shape: synth.SynthShape, experts: int) -> int:
    """bf16 bytes of one layer of ``shape`` with ``experts`` experts: their gate, up and down
    projections, and the attention's q/k/v/o."""
    return experts * 3 * shape.hidden * shape.expert_ffn * 2 + shape.hidden * shape.head_dim * 2 * (
        2 * shape.n_heads + 2 * shape.n_kv_heads)


def _resident_steps(shapes: list[synth.SynthShape], device: str, wtype: str = "bf16", sparse: bool = False
                    ) -> tuple[list, list[float]]:
    """The engine's decode of a calibration model of each of ``shapes`` (weights in ``wtype``; ``sparse``:
    written as holes, ``synth.write_gguf``), every weight resident, one model at a time on disk:
    ``(models, seconds a step)`` (the faster of ``REPEATS`` runs each)."""
    models, times = [], []
    with tempfile.TemporaryDirectory(prefix="workbench-calibration-") as tmp:
        for s in shapes:
            name = f"{s.n_experts}-experts" if sparse else wtype
            path = Path(tmp) / f"calibration-{s.n_layers}-layers-{name}.gguf"
            synth.write_gguf(path, s, coverage_target=None, wtype=wtype, sparse=sparse)
            model = open_model(path)
            times.append(min(_decode_seconds(model, placement_all_gpu(model), device) for _ in range(REPEATS)))
            models.append(model)
            path.unlink()
    return models, times


def _deep_runs(shape: synth.SynthShape, device: str, room: float, wtype: str = "bf16") -> tuple | None:
    """The engine's decode of two all-resident models of ``DEPTHS`` layers (``top_k`` experts a layer,
    weights in ``wtype``; fewer layers where half of ``room`` bytes holds fewer at bf16's size, none
    where the shallower would have fewer than ``LAYERS``): ``(depths, models, seconds a step)``."""
    deep = min(DEPTHS[1], int(room / 2 / max(_layer_bytes(shape, shape.n_active), 1)))
    depths = (min(DEPTHS[0], deep // 2), deep)
    if depths[0] < LAYERS:
        return None
    models, times = _resident_steps([replace(shape, n_layers=d, n_experts=shape.n_active) for d in depths], device,
                                    wtype)
    return depths, models, times


def _deep_resident_fit(shape: synth.SynthShape, device: str, room: float, seconds, with_launch) -> dict | None:
    """The kernel cost ``launch_s`` and the host's time per step ``step_s`` (s) from the engine's decode
    of two all-resident models of ``DEPTHS`` layers (fewer where half of ``room`` bytes holds fewer;
    none where the shallower would have fewer than ``LAYERS``): the steps' difference is the layers'
    kernels alone, the rest of the shallower step the host's. The 8-layer resident step left the host's time in the kernels: H100
    hosts ran it in 0.66 to 0.96 ms from call to call (the host's Python, not the GPU, set its pace),
    the fitted kernel cost 1.8 to 4.5 µs, while S1 all on the GPU (24 layers) held 454-477 tok/s and
    was predicted up to 25% slow. ``seconds(profile, model)``: the model's seconds per step of a
    model all resident; ``with_launch(v)``: the profile with kernel cost ``v``. Returns
    ``{"depths", "resident_s", "launch_s", "step_s"}``, or None without room or a positive kernel cost."""
    runs = _deep_runs(shape, device, room)
    if runs is None:
        return None
    depths, models, times = runs

    def no_step(v: float) -> HardwareProfile:
        return replace(with_launch(v), decode_step_s=0.0)

    launch = _solve(lambda v: seconds(no_step(v), models[1]) - seconds(no_step(v), models[0]), times[1] - times[0],
                    step=1e-6)
    if launch <= 0:
        return None
    step = max(0.0, times[0] - seconds(no_step(launch), models[0]))
    log.info("engine decode, all resident: %.3f ms a step of %d layers, %.3f ms of %d: the kernel %.2f us, the host "
             "%.0f us a step", times[0] * 1e3, depths[0], times[1] * 1e3, depths[1], launch * 1e6, step * 1e6)
    return {"depths": depths, "resident_s": times, "launch_s": launch, "step_s": step}


def first_gpu(prof: HardwareProfile, **fields) -> HardwareProfile:
    """``prof`` with ``fields`` of its first GPU (the one calibration measures) replaced."""
    return replace(prof, gpus=(replace(prof.gpus[0], **fields),) + tuple(prof.gpus[1:]))


WIDE_EXPERTS = 128
"""Experts a layer of the wide all-resident model (``_wide_fit``): as many as Qwen3-30B-A3B's, fewer
where room is short."""


def _wide_fit(shape: synth.SynthShape, device: str, room: float, deep: dict, seconds) -> dict | None:
    """The routing's cost per expert of a layer beyond those it selects (``GpuProfile.route_s_per_expert``,
    s): the engine's decode of a model as deep as ``deep``'s shallower one (``_deep_resident_fit``) with
    ``WIDE_EXPERTS`` experts a layer (fewer where half of ``room`` bytes holds fewer; none below
    ``2 * top_k``), all resident, against the same depth with ``top_k`` experts a layer: their
    difference, less the model's (``seconds(model)``: its seconds per step, this cost 0), per layer
    and extra expert. The deep models pick every expert they have; S1 picks 8 of 128, and its layers
    all on the GPU ran 7-11 µs longer than the deep models' on three H100 hosts (BENCHMARKS.md,
    fourteenth stop). Both models are written sparse (their tiled weights are holes: zeros, no disk
    space; a 16-layer model of 128 experts is 19 GB at the Qwen3-30B-A3B shape); the routers are
    real, and the kernels' time does not depend on the weights' values. The top-k model is run again
    rather than taken from the deep runs (dense files) so that the two runs differ in their experts
    alone (~5 s). Returns ``{"experts",
    "depth", "wide_s", "narrow_s", "route_s_per_expert"}``, or None without room, or where the models
    cannot be written or run (the rest of the calibration goes on)."""
    d, k = deep["depths"][0], shape.n_active
    other = _layer_bytes(shape, 0)
    experts = min(WIDE_EXPERTS, int((room / 2 / d - other) / (_layer_bytes(shape, 1) - other)))
    if experts < 2 * k:
        return None
    try:
        models, times = _resident_steps([replace(shape, n_layers=d, n_experts=n) for n in (k, experts)], device,
                                        sparse=True)
    except (OSError, RuntimeError, WorkbenchError) as e:
        log.warning("the routing's cost per expert is not fitted: %s", e)
        return None
    extra = (times[1] - times[0]) - (seconds(models[1]) - seconds(models[0]))
    per = max(0.0, extra / (d * (experts - k)))
    log.info("engine decode, all resident, %d layers: %.3f ms with %d experts a layer, %.3f ms with %d: routing %.1f ns "
             "a layer per expert beyond those picked", d, times[1] * 1e3, experts, times[0] * 1e3, k, per * 1e9)
    return {"experts": experts, "depth": d, "wide_s": times[1], "narrow_s": times[0], "route_s_per_expert": per}


def fit_engine_costs(prof: HardwareProfile, hidden: int, ffn: int, top_k: int,
                     n_heads: int = 32, n_kv_heads: int = 4, head_dim: int = 128,
                     device: str = "cuda", kept: tuple[str, ...] | None = None) -> tuple[HardwareProfile, dict]:
    """``prof`` fitted to the engine's decode: ``decode_step_s`` (the host's time per step: the
    all-resident run waited for step by step, less the same steps queued; ``_decode_times``), then
    ``gpus[0].launch_s`` from the all-resident run, then
    ``sync_s`` (the host point of a hybrid layer) and the bf16 CPU expert rate from four runs with a
    sixteenth, a quarter, a half and three quarters of every layer's experts on the CPU
    (``HYBRID_SHARES``): the rate as the decode server read those runs' packets (``packet_rate``),
    then the host point alone by least squares of the relative errors (``_fit_sync``; on an H100
    host the joint fit below put the rate at the RAM's cap and the host point 60 µs too high for
    Q8_0's layers); where the packets pin no rate, both together by least squares. Layers that mix resident and
    CPU experts, as planned placements' do (one fixed and one per-byte cost per hybrid layer; with
    two runs 2 experts apart the host point swung from 44 to 227 µs between identical fits on the
    H200 host; without a physical solution the measured rate stays and ``sync_s`` comes from the
    half run). The sixteenth gives the CPU about half a selection per token and layer, as a
    frequency placement's cold experts get: most of its CPU time is hand-offs, which the runs with
    two to six selections a layer leave unpinned (on an H100 host they put the host point at 19 µs
    and S1's frequency placements decoded 16-71% slower than predicted; with the sixteenth, on
    another, 120 µs and every S1 decode within 10.5%). The all-CPU run is a
    check, its prediction returned next to it: on the H200 host it ran up to 40% slower than the
    model in some processes and not in others, so nothing is fitted to it. Returns the profile and
    ``{"resident_s", "resident_queued_s", "step_s", "sixteenth_s", "quarter_s", "half_s", "three_quarters_s", "cpu_s", "launch_s",
    "sync_s", "cpu_rate", "cpu_predicted_s", "packet_fixed_s", "packet_rate", "packets"}`` (seconds per decode step,
    B/s; fitted values; the decode server's packets of the hybrid runs: ``packet_rate``'s fit, None where
    it had too few, and how many packets each count of CPU pairs had). ``device``: the engine's
    accelerator (``cuda``; ``cpu`` only exercises the fit in tests)."""
    room = calibration_room(device)
    experts = calibration_experts(hidden, ffn, top_k, room=room)
    shape = synth.SynthShape("calibration", "qwen3moe", LAYERS, hidden, n_heads, n_kv_heads, head_dim,
                             experts, min(top_k, experts), ffn, VOCAB, qk_norm=True)
    with tempfile.TemporaryDirectory(prefix="workbench-calibration-") as tmp:
        path = Path(tmp) / "calibration.gguf"
        t0 = time.perf_counter()
        synth.write_gguf(path, shape, coverage_target=None)
        log.info("calibration model written in %.1f s: %d layers of %d experts", time.perf_counter() - t0, LAYERS,
                 experts)
        inv = open_model(path)
        res, cpu = placement_all_gpu(inv), placement_cpu_moe(inv)
        hybrid = [_upper_on_cpu(inv, share) for share in HYBRID_SHARES]
        # each fitted hybrid placement twice, the faster kept: a neighbour's burst on a shared host
        # slows one run's every step, and the fit would carry it to every prediction
        res_times = [_decode_times(inv, res, device) for _ in range(REPEATS)]
        t_res, q_res = min(t for t, _ in res_times), min(q for _, q in res_times)
        packets: list[np.ndarray] = []  # the decode server's records of the hybrid runs
        t_hybrid = [min(_decode_seconds(inv, p, device, packets=packets) for _ in range(REPEATS)) for p in hybrid]
        t_cpu = _decode_seconds(inv, cpu, device)
    half, t_half = hybrid[HYBRID_SHARES.index(0.5)], t_hybrid[HYBRID_SHARES.index(0.5)]

    rate0 = prof.cpu_expert_throughput.get("bf16") or 1e10
    prof = replace(prof, decode_step_s=max(0.0, t_res - q_res))  # the host's part of each step, not the kernels'

    def with_costs(launch: float, sync: float, rate: float = rate0) -> HardwareProfile:
        return replace(first_gpu(prof, launch_s=launch), sync_s=sync,
                       cpu_expert_throughput={**prof.cpu_expert_throughput, "bf16": rate})

    def seconds(p: HardwareProfile, placement, model=inv) -> float:
        return 1.0 / CostModel(model, p, engine=EngineShape(bus_share=0.0)).decode_tps(placement, kv_tokens=16 + STEPS)

    deep = _deep_resident_fit(shape, device, room, lambda p, m: seconds(p, placement_all_gpu(m), m),
                              lambda v: with_costs(v, prof.sync_s))
    wide = None
    if deep is not None:
        launch, prof = deep["launch_s"], replace(prof, decode_step_s=deep["step_s"])
        wide = _wide_fit(shape, device, room, deep, lambda m: seconds(
            first_gpu(with_costs(launch, prof.sync_s), route_s_per_expert=0.0), placement_all_gpu(m), m))
        if wide is not None:
            prof = first_gpu(prof, route_s_per_expert=wide["route_s_per_expert"])
    else:
        launch = _solve(lambda v: seconds(with_costs(v, prof.sync_s), res), t_res, step=1e-6)
    ram = _ram_seconds_per_byte(prof)
    traced = _records(packets)
    served = packet_rate(traced, _expert_bytes(inv))
    sync = None
    if served is not None:  # the CPU's rate as the server read the runs' packets; the host point alone fitted
        rate = served[1]
        sync = _fit_sync(lambda p, s: seconds(with_costs(launch, s, rate), p), list(zip(hybrid, t_hybrid)))
    if sync is None:
        sync, rate = _fit_host(lambda p, s, u: seconds(with_costs(launch, s, 1.0 / u), p), list(zip(hybrid, t_hybrid)),
                               1.0 / rate0, u_min=ram)
    if sync is None:
        sync, rate = _solve(lambda v: seconds(with_costs(launch, v), half), t_half, step=1e-5), rate0
    fitted = with_costs(launch, sync, rate)
    info = {"resident_s": t_res, "resident_queued_s": q_res, "step_s": prof.decode_step_s, "deep": deep, "wide": wide,
            "sixteenth_s": t_hybrid[0], "quarter_s": t_hybrid[1], "half_s": t_hybrid[2], "three_quarters_s": t_hybrid[3],
            "cpu_s": t_cpu, "launch_s": launch, "sync_s": sync, "cpu_rate": rate,
            "packet_fixed_s": served[0] if served else None, "packet_rate": served[1] if served else None,
            "packets": {int(c): int((traced[:, 4] == c).sum()) for c in np.unique(traced[:, 4])},
            "cpu_predicted_s": seconds(fitted, cpu)}
    fitted, info["kept"] = fit_kept_rates(fitted, shape, device, kept, room=room if deep is not None else None)
    if served is not None:
        log.info("the decode server's packets: %.1f us each and %.1f GB/s of experts (one token's, as it reads them)",
                 served[0] * 1e6, served[1] / 1e9)
    log.info("engine decode per %d-layer step: %.2f ms all resident, %.2f / %.2f / %.2f / %.2f ms a sixteenth / quarter "
             "/ half / three quarters on the CPU, %.2f ms all on the CPU (%.2f predicted); the host %.0f us a step, fitted kernel "
             "%.2f us, host point %.0f us, CPU experts %.1f GB/s", LAYERS, t_res * 1e3, *(t * 1e3 for t in t_hybrid),
             t_cpu * 1e3, info["cpu_predicted_s"] * 1e3, prof.decode_step_s * 1e6, launch * 1e6, sync * 1e6, rate / 1e9)
    return fitted, info


def fit_kept_rates(prof: HardwareProfile, shape: synth.SynthShape, device: str = "cuda",
                   formats: tuple[str, ...] | None = None, room: float | None = None
                   ) -> tuple[HardwareProfile, dict[str, dict]]:
    """``prof`` with each kept block format's GPU rate (``gpus[0].expert_throughput``: Q8_0, Q4_K) fitted
    to the engine's decode of calibration models written in that format, every weight resident: the
    one value at which the model, with the fitted ``launch_s``, predicts those runs. The block
    kernels' own rate, measured alone, leaves out how the engine's step uses them (the kept q/k/v
    and o matvecs, their places in the graph).

    Where half of ``room`` (bytes) holds them, the runs are two models of ``DEPTHS`` layers, as for
    the kernel cost (``_deep_resident_fit``), and the rate is fitted to their difference: the
    deeper model's extra layers alone. The 8-layer model's step is paced by the host, not its
    kernels (an H100 host: bf16 0.91 ms against 0.60 ms modelled with the kernel cost of the
    two depths), so a rate fitted to it took that host time as slow reads: Q4_K 450 GB/s against its
    kernels' 719, and S1 Q4_K all on the GPU decoded 509 tok/s against 376 predicted (532 at the
    kernels' rate; BENCHMARKS.md, thirteenth stop). Without the room (``room`` None), the 8-layer model.

    A format whose block does not divide the shape, or whose runs have no positive solution, keeps
    its measured rate. A format the CPU holds too (a measured ``cpu_expert_throughput``) gets its CPU
    rate fitted to runs of the 8-layer model with some of the experts on the CPU (``_fit_cpu_rate``).
    Returns the profile and, per format, ``{"resident_s", "measured_rate", "rate"}`` (with two
    depths also ``"depths"`` and ``"deep_s"``, and ``resident_s`` the deeper step) and, for the CPU,
    ``{"hybrid_s", "cpu_measured_rate", "cpu_rate"}`` (seconds per step, B/s). ``formats``: fit only
    these (None: every format with a measured rate); the others keep their kernels' rates."""
    g0 = prof.gpus[0]
    rates, info = dict(g0.expert_throughput), {}
    cpu_rates = dict(prof.cpu_expert_throughput)
    syncs = dict(prof.sync_by_format)
    for fmt in [f for f in rates if formats is None or f in formats]:
        if not _blocks_divide(fmt, shape.hidden, shape.expert_ffn):
            continue

        def seconds(u: float, inv, fmt=fmt) -> float:
            gpus = (replace(g0, expert_throughput={**rates, fmt: 1.0 / u}),)
            p = replace(prof, gpus=gpus + tuple(prof.gpus[1:]))
            return 1.0 / CostModel(inv, p, engine=EngineShape(bus_share=0.0)).decode_tps(
                placement_all_gpu(inv), kv_tokens=16 + STEPS)

        measured = rates[fmt]
        deep = _deep_runs(shape, device, room, fmt) if room is not None else None
        with tempfile.TemporaryDirectory(prefix="workbench-calibration-") as tmp:
            inv = None  # the 8-layer model: for the rate without the two depths, and for the CPU's fit
            if deep is None or fmt in cpu_rates:
                path = Path(tmp) / f"calibration-{fmt}.gguf"
                synth.write_gguf(path, shape, coverage_target=None, wtype=fmt)
                inv = open_model(path)
            if deep is not None:
                depths, models, times = deep
                u = _rate_solution(lambda v, m=models: seconds(v, m[1]) - seconds(v, m[0]), times[1] - times[0],
                                   1.0 / measured)
                info[fmt] = {"resident_s": times[1], "depths": depths, "deep_s": times}
            else:
                t = min(_decode_seconds(inv, placement_all_gpu(inv), device) for _ in range(REPEATS))
                u = _rate_solution(lambda v, m=inv: seconds(v, m), t, 1.0 / measured)
                info[fmt] = {"resident_s": t}
            if u > 0:
                rates[fmt] = 1.0 / u
            info[fmt].update(measured_rate=measured, rate=rates[fmt])
            log.info("engine decode, %s blocks all resident: %s; their GPU rate %.0f GB/s (kernels alone %.0f GB/s)",
                     fmt, resident_runs(info[fmt]), rates[fmt] / 1e9, measured / 1e9)
            gpus = (replace(g0, expert_throughput=dict(rates)),) + tuple(prof.gpus[1:])
            if fmt in cpu_rates:
                cpu_rates[fmt] = _fit_cpu_rate(replace(prof, gpus=gpus, cpu_expert_throughput=cpu_rates), inv, fmt,
                                               device, info[fmt])
                if info[fmt].get("sync_s") is not None:
                    syncs[fmt] = info[fmt]["sync_s"]
    gpus = (replace(g0, expert_throughput=rates),) + tuple(prof.gpus[1:])
    return replace(prof, gpus=gpus, cpu_expert_throughput=cpu_rates, sync_by_format=syncs), info


def _blocks_divide(fmt: str, hidden: int, ffn: int) -> bool:
    """Whether ``synth`` writes experts of ``fmt`` at this shape: a format it writes whose block (256
    values for the k-quants, else 32) divides both the hidden and the expert's FFN width."""
    block = 256 if fmt.endswith("_k") else 32
    return fmt in synth.WEIGHT_TYPES and hidden % block == 0 and ffn % block == 0


def depth_runs(times: list[float], depths) -> str:
    """Steps of models ``depths`` layers deep (s) in words: ``1.02 / 1.95 ms for 16 / 32 layers``."""
    return " / ".join(f"{t * 1e3:.2f}" for t in times) + " ms for " + " / ".join(str(d) for d in depths) + " layers"


def resident_runs(kept: dict) -> str:
    """A kept format's all-resident calibration runs (``fit_kept_rates``' info) in words: ``1.02 / 1.95 ms
    for 16 / 32 layers`` (two depths) or ``0.77 ms for 8 layers``."""
    if "deep_s" in kept:
        return depth_runs(kept["deep_s"], kept["depths"])
    return depth_runs([kept["resident_s"]], [LAYERS])


def _rate_solution(seconds, target: float, u0: float) -> float:
    """``u`` (seconds a byte) at which ``seconds(u)``, linear in ``u``, gives ``target``: from its value at
    ``u0`` and ``2 * u0``; 0 where it does not grow with ``u`` (no solution)."""
    a = seconds(u0)
    slope = (seconds(2 * u0) - a) / u0
    return u0 + (target - a) / slope if slope > 0 else 0.0


def _fit_cpu_rate(prof: HardwareProfile, inv, fmt: str, device: str, info: dict) -> float:
    """The CPU's rate for experts held in ``fmt``'s blocks in the engine's decode (B/s), from the
    calibration model in that format with a sixteenth and with half of each layer's experts on the
    CPU (``CPU_FIT_SHARES``). Where the decode server traced their packets: the rate it read them at
    (``packet_rate``), and the hand-off of this format's layers fitted to those runs (``info["sync_s"]``:
    ``HardwareProfile.sync_by_format``; None where the runs do not pin it). Else the value at
    which the model, with the fitted kernel cost and host point, best predicts those runs (least
    squares of the relative errors). The kernel's batch rate, measured alone, is
    the rate of many experts a pass; a token's one or two leave most of the cores short of work (on
    the H200 host one Q8_0 expert a packet ran at half the batch rate). At most the host's RAM read
    rate: with the host point fitted high, an H100 host's runs put Q8_0 at 442 GB/s. Adds
    ``cpu_measured_rate``, ``cpu_rate`` and ``hybrid_s`` to ``info``; the measured rate where the fit
    finds no better one."""
    hybrid = [_upper_on_cpu(inv, share) for share in CPU_FIT_SHARES]
    packets: list[np.ndarray] = []
    times = [min(_decode_seconds(inv, p, device, packets=packets) for _ in range(REPEATS)) for p in hybrid]
    measured = prof.cpu_expert_throughput[fmt]
    served = packet_rate(_records(packets), _expert_bytes(inv))
    if served is not None:  # the rate the server read the runs' packets at: measured, not fitted; the
        rate = served[1]    # hand-off of this format's layers fitted to the same runs
        at_rate = replace(prof, cpu_expert_throughput={**prof.cpu_expert_throughput, fmt: rate})

        def model(placement, s: float) -> float:
            p = replace(at_rate, sync_by_format={**at_rate.sync_by_format, fmt: s})
            return 1.0 / CostModel(inv, p, engine=EngineShape(bus_share=0.0)).decode_tps(placement, kv_tokens=16 + STEPS)

        sync = _fit_sync(model, list(zip(hybrid, times)))
        info.update(cpu_measured_rate=measured, cpu_rate=rate, hybrid_s=times, packet_fixed_s=served[0], sync_s=sync)
        log.info("engine decode per %d-layer step, %s blocks, a sixteenth / half on the CPU: %s ms; the decode "
                 "server's packets %.1f us each and %.1f GB/s of experts (kernel alone %.1f GB/s); host point %s",
                 LAYERS, fmt, " / ".join(f"{t * 1e3:.2f}" for t in times), served[0] * 1e6, rate / 1e9,
                 measured / 1e9, "not pinned" if sync is None else f"{sync * 1e6:.0f} us")
        return rate

    def misfit(u: float) -> float:
        p = replace(prof, cpu_expert_throughput={**prof.cpu_expert_throughput, fmt: 1.0 / u})
        model = CostModel(inv, p, engine=EngineShape(bus_share=0.0))
        return sum((1.0 / model.decode_tps(h, kv_tokens=16 + STEPS) / t - 1.0) ** 2 for h, t in zip(hybrid, times))

    u0 = 1.0 / measured
    ram = _ram_seconds_per_byte(prof)
    u = _least_on_line(misfit, max(u0 / 8, ram), max(8 * u0, 2 * ram))
    rate = 1.0 / u if misfit(u) < misfit(u0) else measured
    if ram > 0:
        rate = min(rate, 1.0 / ram)
    info.update(cpu_measured_rate=measured, cpu_rate=rate, hybrid_s=times)
    log.info("engine decode per %d-layer step, %s blocks, a sixteenth / half on the CPU: %s ms; the CPU's rate "
             "%.1f GB/s (kernel alone %.1f GB/s)", LAYERS, fmt, " / ".join(f"{t * 1e3:.2f}" for t in times),
             rate / 1e9, measured / 1e9)
    return rate


def _prompt_seconds(inv, placement, device: str, pair_reads: float | None, lengths: tuple[int, ...],
                    clock: HostClock | None = None, bus_share: float | None = None) -> list[float]:
    """Median seconds of ``REPEATS + 1`` prompts of random tokens of each of ``lengths`` under
    ``placement`` (after one untimed each: kernels tuned, stacks page-locked), with ``bus_share``
    (None: the engine's default) and the profile's cost per further token of a CPU expert
    (``pair_reads``), as the bench runs them. ``clock`` gets the timed prompts' hybrid layers
    (``Engine.record_host``)."""
    from .bench import _sync
    from .engine import Engine

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    engine = Engine.load(inv, placement, device=device, dtype=dtype, max_context=max(lengths) + 8,
                         bus_share=bus_share)
    try:
        engine.set_prompt_pair_reads(pair_reads)
        out = []
        for tokens in lengths:
            ids = torch.randint(0, VOCAB, (tokens,), generator=torch.Generator().manual_seed(tokens))
            engine.forward(ids, 0, last_only=True)
            engine.record_host(clock)
            times = []
            for _ in range(REPEATS + 1):
                _sync(engine.device)
                t = time.perf_counter()
                engine.forward(ids, 0, last_only=True)[-1].argmax().item()
                times.append(time.perf_counter() - t)
            engine.record_host(None)
            out.append(statistics.median(times))
        return out
    finally:
        engine.close()


PROMPT_FORMATS = ("bf16", "q8_0")
"""The prompt fit's calibration model is written in each: Q8_0 experts are half the bytes and four
tensors each, so the engine's thread, not the bus, is a Q8_0 layer's long lane."""

HOST_LANE = ("prompt_host_layer_s", "prompt_host_cpu_s", "prompt_host_batch_s", "prompt_host_copy_s")


def fit_host_lane(layers: list[HostLayer]) -> dict[str, float]:
    """The host lane's costs (``HOST_LANE``, seconds) by least squares at or above zero over the
    engine's own records of hybrid prompt layers: busy seconds = a fixed cost + one with a CPU
    share + one per batch + one per copy. A forward's first hybrid layer is left out (its time
    holds the embedding and what else comes first); no records: all 0 (no host lane)."""
    use = [r for r in layers if not r.first]
    if not use:
        return dict.fromkeys(HOST_LANE, 0.0)
    a = np.array([(1.0, float(r.cpu_share), float(r.batches), float(r.copies)) for r in use])
    b = np.array([r.busy_s for r in use])
    return dict(zip(HOST_LANE, _least_squares_at_least_zero(a, b)))


def cpu_lead(layers: list[HostLayer]) -> float | None:
    """The median, over the hybrid prompt layers in which the engine's thread waited for the CPU's
    share (the CPU the layer's long lane; a forward's first hybrid layer left out), of the layer's
    wall time outside the CPU's run: ``busy + wait + cpu_wait - cpu_run`` (s): its attention, the
    routing's way to the host and the split before the run, adding the result after it. None
    without such layers. S1's hybrid prompt layers: 2.5-3.2 ms on one H100 host, 1.7-2.2 on
    another."""
    out = [r.busy_s + r.wait_s + r.cpu_wait_s - r.cpu_run_s for r in layers
           if not r.first and r.cpu_share and r.cpu_wait_s > 0 and r.cpu_run_s > 0]
    return float(np.median(out)) if out else None


def fit_prompt_costs(prof: HardwareProfile, hidden: int, ffn: int, top_k: int, n_heads: int = 32,
                     n_kv_heads: int = 4, head_dim: int = 128, device: str = "cuda",
                     experts: int | None = None, resident_formats: tuple[str, ...] = ()
                     ) -> tuple[HardwareProfile, dict]:
    """``prof`` with the prompt's host lane (``HOST_LANE``), ``prompt_sync_s``, ``prompt_cpu_scale`` and
    ``prompt_h2d`` fitted to the engine's prompts, of a ``LAYERS``-layer model of ``experts``
    (default ``PROMPT_EXPERTS``, fewer where memory is short) experts at the given shape, written
    in each of ``PROMPT_FORMATS`` (Q8_0 where the shape takes its blocks): ``PROMPT_TOKENS`` tokens
    with an eighth of every layer's experts on the CPU (short lanes: the layer's host time shows)
    and with all of them there (each picked by about 32 tokens: all travel, the bus's rate shows),
    and ``SHORT_PROMPT_TOKENS`` with all of them there (about 8 tokens each: the bus and the CPU
    split them, the CPU's share shows); then ``PROMPT_TOKENS`` with all of them on the GPU.

    The host lane comes first, from what the engine's thread itself recorded in those prompts
    (``fit_host_lane``). With it in the model, the three other values are those at which the
    model's predictions of the six prompts are nearest the measured times (least squares of the
    relative errors, by ``_least_point``: the model's lanes meet in a max, so its times are not
    smooth in them): the host time of a hybrid layer beyond its lanes, how much longer the CPU's
    share takes than its kernel alone (its threads share the RAM with the copies and the cores with
    the engine's thread), and the rate the prompt's copies reach. ``prompt_cpu_sync_s`` follows from
    the records too: in layers that waited for the CPU, the time outside its run (``cpu_lead``),
    less what the model's attention and host points put before and after the lanes (without it the
    fit on one H100 host traded that time for a CPU 1.43 times slower, and S1's hybrid prompts,
    whose CPU shares are shorter, came out 30-50% fast). Last, ``prompt_resident_layer_s``:
    the least time of a resident layer at which the all-resident prompts are predicted best (they
    alone have resident layers), per format: also for each of ``resident_formats`` (e.g. Q4_K, whose
    grouped kernels decode its blocks in the tiles: S1 Q4_K's prompts all on the GPU ran 27% slower than
    the floor of the other formats predicted; BENCHMARKS.md, seventeenth stop), from that prompt alone. Returns the profile and ``{"runs": [{"name", "tokens",
    "measured_s", "predicted_s"}], "prompt_sync_s", "prompt_cpu_scale", "prompt_h2d", "cpu_lead_s",
    "prompt_cpu_sync_s", "prompt_resident_layer_s", "host_lane": {name: s}, "host_layers": n}``
    (seconds per prompt, the predictions at the fitted values)."""
    from workbench.core.costmodel import model_prompt_pair_reads

    room = calibration_room(device)
    expert = 3 * hidden * ffn * 2
    n = experts or max(top_k, min(PROMPT_EXPERTS, int(room / 2 / (LAYERS * expert))))
    shape = synth.SynthShape("calibration", "qwen3moe", LAYERS, hidden, n_heads, n_kv_heads, head_dim,
                             n, min(top_k, n), ffn, VOCAB, qk_norm=True)
    clock, runs, resident = HostClock(), [], []
    formats = [f for f in PROMPT_FORMATS if f == "bf16" or _blocks_divide(f, hidden, ffn)]
    # then the all-resident prompt alone of each other format asked for whose blocks divide the shape
    formats += [f for f in dict.fromkeys(resident_formats) if f not in formats and _blocks_divide(f, hidden, ffn)]
    for fmt in formats:
        tag = "" if fmt == "bf16" else f", {fmt.upper()}"
        with tempfile.TemporaryDirectory(prefix="workbench-calibration-") as tmp:
            path = Path(tmp) / f"calibration-prompt-{fmt}.gguf"
            synth.write_gguf(path, shape, coverage_target=None, wtype=fmt)
            inv = open_model(path)
            pair_reads = model_prompt_pair_reads(inv, prof)
            share = bus.fraction_for(inv, prof)  # the bench's and the app's engines decode with it
            res = placement_all_gpu(inv)
            if fmt in PROMPT_FORMATS:
                few, every = _upper_on_cpu(inv, 0.125), placement_cpu_moe(inv)
                (few_s,) = _prompt_seconds(inv, few, device, pair_reads, (PROMPT_TOKENS,), clock, bus_share=share)
                every_s, short_s = _prompt_seconds(inv, every, device, pair_reads,
                                                   (PROMPT_TOKENS, SHORT_PROMPT_TOKENS), clock, bus_share=share)
                runs += [(f"an eighth on the CPU{tag}", inv, few, PROMPT_TOKENS, few_s),
                         (f"all on the CPU{tag}", inv, every, PROMPT_TOKENS, every_s),
                         (f"all on the CPU, short{tag}", inv, every, SHORT_PROMPT_TOKENS, short_s)]
            try:
                (res_s,) = _prompt_seconds(inv, res, device, pair_reads, (PROMPT_TOKENS,), bus_share=share)
            except torch.cuda.OutOfMemoryError:  # a small GPU: the resident layers' time stays as it was
                log.warning("the calibration's %s prompt all on the GPU did not fit; prompt_resident_layer_s "
                            "is not fitted to it", fmt)
                continue
        resident.append((f"all on the GPU{tag}", inv, res, PROMPT_TOKENS, res_s, fmt))
    lane = fit_host_lane(clock.layers)
    prof = replace(prof, prompt_cpu_sync_s=0.0, **lane)
    measured = np.array([r[4] for r in runs])
    lead = cpu_lead(clock.layers)

    def seconds(p: HardwareProfile, inv, placement, tokens: int) -> float:
        return tokens / CostModel(inv, p).predict(placement, tokens + 8, prompt_tokens=tokens).prefill_tps

    def with_values(values: tuple[float, float, float]) -> HardwareProfile:
        sync, scale, rate = values
        p = replace(prof, prompt_sync_s=sync, prompt_cpu_scale=scale, prompt_h2d=rate)
        if lead is None:
            return p
        # the CPU's share waits the layer's measured time outside its run: what the model's
        # attention and host points do not already put there, with a CPU share
        _, inv, placement, tokens, _ = runs[1]  # all on the CPU, a full prompt
        first = CostModel(inv, p).predict(placement, tokens + 8, prompt_tokens=tokens).prefill_layers[0]
        return replace(p, prompt_cpu_sync_s=max(0.0, lead - first.pre - first.sync))

    def misfit(values: tuple[float, float, float]) -> float:
        p = with_values(values)
        got = np.array([seconds(p, inv, placement, tokens) for _, inv, placement, tokens, _ in runs])
        return float(np.sum((got / measured - 1.0) ** 2))

    values, _ = _least_point(misfit, (0.0, 1.0, prof.h2d_pinned), (1e-3, 0.5, 0.1 * prof.h2d_pinned),
                             ((0.0, 0.05), (1.0, 5.0), (0.2 * prof.h2d_pinned, 2.0 * prof.h2d_pinned)))
    sync, scale, rate = values
    fitted = with_values(values)

    def resident_misfit(value: float, among: list) -> float:  # the hybrid prompts have no resident layer
        p = replace(fitted, prompt_resident_layer_s=value, prompt_resident_layer_by_format={})
        return float(sum((seconds(p, inv, pl, t) / m - 1.0) ** 2 for _, inv, pl, t, m, _ in among))

    layer_s, by_format = prof.prompt_resident_layer_s, dict(prof.prompt_resident_layer_by_format)
    if resident:  # one floor per format, then one for every format (formats not calibrated take it)
        for entry in resident:
            by_format[entry[5]] = _least_on_line(functools.partial(resident_misfit, among=[entry]), 0.0, 0.05)
        layer_s = _least_on_line(functools.partial(resident_misfit, among=resident), min(by_format.values()),
                                 max(by_format.values()))
    fitted = replace(fitted, prompt_resident_layer_s=layer_s, prompt_resident_layer_by_format=by_format)
    info = {"runs": [{"name": r[0], "tokens": r[3], "measured_s": r[4], "predicted_s": seconds(fitted, r[1], r[2], r[3])}
                     for r in runs + resident],
            "prompt_sync_s": sync, "prompt_cpu_scale": scale, "prompt_h2d": rate, "cpu_lead_s": lead,
            "prompt_cpu_sync_s": fitted.prompt_cpu_sync_s, "prompt_resident_layer_s": layer_s,
            "prompt_resident_layer_by_format": by_format, "host_lane": lane, "host_layers": len(clock.layers)}
    log.info("engine prompts of %d layers of %d experts: %s; host lane per hybrid prompt layer %.0f us, +%.0f us "
             "with a CPU share, %.0f us a batch, %.1f us a copy; beyond the lanes %.0f us per hybrid prompt layer, "
             "+%.0f us with a CPU share (outside the CPU's run: %s); the CPU's share %.2fx its kernel's time; "
             "a prompt's copies at %.1f GB/s; a resident prompt layer at least %.0f us (%s)", LAYERS, n,
             ", ".join(f"{r['name']} ({r['tokens']} tokens) {r['measured_s'] * 1e3:.1f} ms, predicted "
                       f"{r['predicted_s'] * 1e3:.1f}" for r in info["runs"]),
             *(lane[k] * 1e6 for k in HOST_LANE), sync * 1e6, fitted.prompt_cpu_sync_s * 1e6,
             "not recorded" if lead is None else f"{lead * 1e6:.0f} us", scale, rate / 1e9, layer_s * 1e6,
             ", ".join(f"{f.upper()} {v * 1e6:.0f} us" for f, v in by_format.items()) or "no format of its own")
    return fitted, info


def _least_on_line(f, low: float, high: float, points: int = 21, rounds: int = 4) -> float:
    """The value in ``[low, high]`` where ``f`` is least, by scanning ``points`` evenly spaced values
    and again around the best one, ``rounds`` times (the lowest among equals: a floor that binds
    nothing is 0). For a time floor that is flat until it binds and then rises: the simplex of
    ``_least_point`` can stop on the flat part."""
    for _ in range(rounds):
        grid = np.linspace(low, high, points)
        vals = [f(float(v)) for v in grid]
        i = int(np.argmin(vals))  # the first of equal values: the lowest
        step = (high - low) / (points - 1)
        low, high = max(grid[0], grid[i] - step), min(grid[-1], grid[i] + step)
        best = float(grid[i])
    return best


def _least_point(f, start: tuple[float, ...], step: tuple[float, ...], bounds: tuple[tuple[float, float], ...],
                 evaluations: int = 200, tol: float = 1e-9) -> tuple[tuple[float, ...], float]:
    """The point within ``bounds`` (per value: (low, high)) where ``f`` is least, by Nelder and Mead's
    simplex search from ``start`` (a first simplex ``step`` away along each value; points outside the
    bounds are moved onto them), until the simplex's values lie within ``tol`` of each other or
    ``evaluations`` calls are spent. ``f`` need not be smooth (the cost model's lanes meet in a
    max), and values of different scales move together along a valley. Returns the point and
    ``f`` there."""
    lo = np.array([b[0] for b in bounds], dtype=float)
    hi = np.array([b[1] for b in bounds], dtype=float)
    scale = np.array(step, dtype=float)  # the search runs in units of the first steps

    def value(u: np.ndarray) -> float:
        return f(tuple(float(v) for v in np.clip(u * scale, lo, hi)))

    n = len(start)
    x0 = np.clip(np.array(start, dtype=float), lo, hi) / scale
    pts = [x0] + [x0 + np.eye(n)[i] for i in range(n)]
    vals = [value(p) for p in pts]
    calls = n + 1
    while calls < evaluations:
        order = np.argsort(vals)
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        if vals[-1] - vals[0] <= tol * max(1.0, abs(vals[0])):
            break
        centre = np.mean(pts[:-1], axis=0)
        refl = centre + (centre - pts[-1])
        fr = value(refl)
        calls += 1
        if fr < vals[0]:
            far = centre + 2.0 * (centre - pts[-1])
            fe = value(far)
            calls += 1
            pts[-1], vals[-1] = (far, fe) if fe < fr else (refl, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = refl, fr
        else:
            inner = centre + 0.5 * (pts[-1] - centre) if fr >= vals[-1] else centre + 0.5 * (refl - centre)
            fc = value(inner)
            calls += 1
            if fc < min(fr, vals[-1]):
                pts[-1], vals[-1] = inner, fc
            else:  # shrink toward the best
                pts = [pts[0]] + [pts[0] + 0.5 * (p - pts[0]) for p in pts[1:]]
                vals = [vals[0]] + [value(p) for p in pts[1:]]
                calls += n
    best = int(np.argmin(vals))
    return tuple(float(v) for v in np.clip(pts[best] * scale, lo, hi)), float(vals[best])


def _scaled_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray | None:
    """Least squares for ``a x = b`` with each column of ``a`` scaled to its largest entry first (the
    fits' columns, seconds per second and seconds per (s/B), lie ~1e10 apart: unscaled, a rank test
    takes the small ones for zero); None when a column is all zero or the rows do not pin every value."""
    scale = np.abs(a).max(axis=0)
    if not np.all(scale > 0):
        return None
    a_n = a / scale
    if np.linalg.matrix_rank(a_n, tol=1e-9) < a.shape[1]:
        return None
    return np.linalg.lstsq(a_n, b, rcond=None)[0] / scale


def _least_squares_at_least_zero(a: np.ndarray, b: np.ndarray) -> tuple[float, ...]:
    """``x >= 0`` minimizing ``|a x - b|`` (``a`` [runs, n], n small): the least-squares solution where
    every value of it is at least 0, else the best of those with some values held at 0 (each subset
    of the columns solved alone; a subset that does not pin its values is skipped; none: all 0)."""
    n = a.shape[1]
    best, best_r = (0.0,) * n, float(np.sum(b ** 2))
    for mask in range(1, 1 << n):
        cols = [j for j in range(n) if mask >> j & 1]
        x = _scaled_lstsq(a[:, cols], b)
        if x is None or np.any(x < 0):
            continue
        full = np.zeros(n)
        full[cols] = x
        r = float(np.sum((a @ full - b) ** 2))
        if r < best_r * (1 - 1e-12):
            best, best_r = tuple(float(v) for v in full), r
    return best


def _fit_host(model, runs: list, u0: float, u_min: float = 0.0) -> tuple[float | None, float]:
    """Least squares of the relative errors for ``model(placement, sync, u) == measured`` over ``runs``
    (``[(placement, measured s)]``, two or more; a short run counts as much as a long one), the model
    being linear in ``sync`` (s) and piecewise linear in ``u = 1 / CPU rate`` (s/B: a token's layer
    waits for the CPU only where its experts there take longer than the GPU's), so solved again
    around each solution until ``u`` settles (from ``u0``): ``(sync, rate)``, or ``(None, 0)`` when
    the runs do not pin both (one equation repeated) or the best fit has ``sync < 0`` or no positive
    rate."""
    ds, u = 1e-5, u0
    for _ in range(HOST_FIT_ROUNDS):
        du = 0.01 * u
        rows, rhs = [], []
        for placement, measured in runs:
            base = model(placement, 0.0, u)
            b = (model(placement, ds, u) - base) / ds
            c = (model(placement, 0.0, u + du) - base) / du
            rows.append((b / measured, c / measured))
            rhs.append((measured - (base - c * u)) / measured)
        sol = _scaled_lstsq(np.array(rows, dtype=float), np.array(rhs, dtype=float))
        if sol is None:
            return None, 0.0
        sync, u_next = float(sol[0]), float(sol[1])
        if 0 < u_next < u_min:  # faster than the host's RAM reads them: that rate, the host point refitted
            a = np.array([r[0] for r in rows])
            sync, u_next = float(a @ (np.array(rhs) - np.array([r[1] for r in rows]) * u_min) / (a @ a)), u_min
        if u_next <= 0:
            return None, 0.0
        settled = abs(u_next - u) <= 1e-6 * u
        u = u_next
        if settled:
            break
    if sync < 0:
        return None, 0.0
    return sync, 1.0 / u


def _fit_sync(model, runs: list) -> float | None:
    """Least squares of the relative errors for ``model(placement, sync) == measured`` over ``runs``
    (``[(placement, measured s)]``), the model piecewise linear in ``sync`` (s): solved around each
    solution until it settles, from the best of a scan over ``[0, SYNC_MAX_S]`` (below some value
    the GPU's lane hides the host point, and the model is flat there); at least 0. None when no run
    depends on ``sync``."""
    def sse(v: float) -> float:
        return sum((model(p, v) / t - 1.0) ** 2 for p, t in runs)

    if sse(0.0) == sse(SYNC_MAX_S):
        return None
    ds, sync = 1e-6, _least_on_line(sse, 0.0, SYNC_MAX_S)
    for _ in range(HOST_FIT_ROUNDS):
        num = den = 0.0
        for placement, measured in runs:
            base = model(placement, sync)
            b = (model(placement, sync + ds) - base) / ds
            num += (b / measured) * (measured - base + b * sync) / measured
            den += (b / measured) ** 2
        if den <= 0:
            break
        nxt = max(0.0, num / den)
        settled = abs(nxt - sync) <= 1e-9
        sync = nxt
        if settled:
            break
    return sync


SYNC_MAX_S = 1e-3
"""The largest host point ``_fit_sync`` scans (s): a hybrid layer's hand-off is tens of µs."""
HOST_FIT_ROUNDS = 20
"""Most linearizations ``_fit_host`` solves (each around the last solution's CPU rate)."""
