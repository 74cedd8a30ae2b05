"""CostModel: predict what a placement does before running it — bytes per device, decode and prefill
tokens/s, and a per-layer breakdown.

Decode, per decoder layer (batch 1, times in seconds):

- ``pre``: attention (weights + the KV cache read for the current context), norms and the router,
  on their tier: bytes / bandwidth + kernel launches. It runs before routing is known.
- then three lanes run at the same time and the layer waits for the longest:
  GPU lane (shared expert, dense MLP, resident routed experts: expected bytes of the selected ones /
  the GPU's expert bandwidth, plus launches), CPU lane (expected bytes of the selected CPU-compute
  experts / the CPU's expert throughput for their weight format), bus lane (streamed experts:
  expected misses of an LRU cache of ``stream_slots`` per layer x transfer time over the pinned bus,
  then their GPU compute).
- a host<->GPU sync per layer that has CPU or streamed experts (the router's choice must reach the
  host), plus the GPU-side launches of bringing CPU results back; with the engine's decode server
  (``EngineShape.served``) the sync is the hand-off to and from its native thread, which delays
  only the CPU's result, so it joins the CPU lane (the GPU's and the bus's lanes run meanwhile:
  on an H100 host, the S1 runs that send experts over the bus were predicted 17-28% slow with it
  added after the lanes), and the bus's experts are read in place by kernels while the CPU
  computes the others.

So a layer costs ``pre + max(gpu, cpu, bus) + sync`` rather than the sum. Expected selections come
from ExpertStats per layer (uniform without stats): a token picks expert ``e`` of layer ``l`` with
probability ``min(1, top_k * share[l, e])``.

Prefill of ``P`` tokens runs in chunks of ``memory.PREFILL_CHUNK``: GPU work is the larger of weight
reads and GEMM FLOPs (plus causal attention FLOPs); a CPU expert that ``n`` tokens pick is either
computed on the CPU (weights read once, FLOPs at the CPU's GEMM rate) or copied to the GPU for the
chunk (pinned copies for streamed experts, pageable for CPU-compute ones), whichever is cheaper
(``EngineShape`` can turn either choice off to model an engine that does not make it).

Every rate comes from the HardwareProfile (calibrated by ``workbench calibrate`` or a preset); the
engine's kernel counts are in ``EngineShape``.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import numpy as np

from .ggml_types import BLOCK
from .hardware import HardwareProfile
from .inventory import Inventory
from .memory import (
    PREFILL_CHUNK,
    MemoryEstimate,
    estimate_memory,
    experts_as_stored,
    held_bytes,
    kept_in_blocks,
    kv_cache_bytes,
)
from .placement import TIER_CPU_COMPUTE, TIER_CPU_STREAM, Placement, expert_grid, gpu_index, is_gpu
from .prediction import LayerCost, Prediction
from .stats import ExpertStats
from .units import UnitKey

BUS_SHARE = 0.45
"""Share of a token's CPU-selected experts sent over the bus in decode where the profile gives no bus
rate to balance it by (``balanced_bus_share``; about bus / (bus + CPU kernel) read rates on the H200
machine: 48 and 62 GB/s)."""
BUS_SLOTS = 16
"""Device slots for them (decode sends at most ``round(top_k * BUS_SHARE)`` per layer and token; a
prompt's fetched experts travel half the slots at a time). 16 rather than 8: a prompt's batch of
fetched experts costs the host ~0.3 ms (copies queued, two kernel launches, events) whatever its
size, and Q8_0 experts copy in ~0.1 ms each, so batches of 4 left the copy engine waiting on the
host; the Q8_0 `frequency` prompt of S1 ran 169 -> 145 ms on an H100 host with 16 (2026-12-05)."""
FUSED_PROMPT_TOKENS = 8
"""A prompt's CPU-tier expert picked by up to this many tokens goes through the fused CPU kernel (a
weight read per token); one picked by more, through torch's CPU GEMM (about this many reads' time:
bf16 GEMMs of a few tokens measured 0.8 ms per Qwen3-30B-A3B expert on the H200 machine's host, the
kernel 0.12 ms per token)."""
KEPT_EXPERT_FORMATS = ("q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs", "mxfp4")
"""Routed expert formats (``weight_format``) the engine keeps in their GGUF blocks on the CPU too."""

KQUANT_KIN = {"q2_k": "q4_k", "q3_k": "q4_k", "q5_k": "q4_k", "q6_k": "q4_k", "iq4_xs": "q4_k", "mxfp4": "q4_k"}
"""Kept k-quant formats that calibration does not time, rated as the one it times: their kernels decode
the same super-blocks a few bits wider (a rate in bytes/s of blocks; conservative where bytes bound).
MXFP4 (gpt-oss) decodes like IQ4_XS: a 4-bit index looked up per value, on the CPU and in the GPU's
tiled kernels. ``workbench calibrate --kquants`` times any of them (e.g. ``q4_k,mxfp4``): the rate it
measures is used instead."""
PREFILL_FETCH_TOKENS = 16
"""With the bus share, prefill always copies a CPU-tier expert picked by at least this many tokens of
a chunk to the GPU (pinned, once) instead of computing it on the CPU; of the others, ``prefill_fetch``
splits by time."""
PROMPT_DRAWS = 16
"""Draws of a prompt chunk's token counts per expert over which the prefill model averages the
engine's bus/CPU split (``CostModel._sampled_split``)."""


def cpu_prompt_reads(tokens, pair_reads=None, gemm=True) -> np.ndarray:
    """The CPU's time for a prompt's CPU-tier expert that ``tokens`` tokens pick, in reads of the
    expert at its decode rate: the fused kernel's one read plus ``pair_reads`` per further token
    (``prompt_pair_reads``; None or NaN, not measured: a read per token), at most
    ``FUSED_PROMPT_TOKENS`` reads where torch's GEMM may take over (``gemm``, a bool or a mask like
    ``tokens``: float experts; experts kept in GGUF blocks stay with the kernel, see
    ``fused_prompt_limit``)."""
    t = np.maximum(np.asarray(tokens, dtype=float), 1.0)
    pr = np.asarray(np.nan if pair_reads is None else pair_reads, dtype=float)
    fused = np.where(np.isnan(pr), t, 1.0 + (t - 1.0) * np.nan_to_num(pr))
    return np.where(gemm, np.minimum(fused, FUSED_PROMPT_TOKENS), fused)


def fused_prompt_limit(pair_reads: float | None, gemm: bool = True) -> float:
    """Most tokens of a prompt's CPU-tier expert the fused CPU kernel computes before torch's GEMM
    takes it (about ``FUSED_PROMPT_TOKENS`` reads' time): ``FUSED_PROMPT_TOKENS`` when the kernel's
    cost per token is not measured, else where ``1 + (t - 1) * pair_reads`` reaches the GEMM's.
    Without ``gemm`` (experts kept in GGUF blocks, which a GEMM would first dequantize: ~36 ms per
    Q4_K expert of Qwen3-30B-A3B on a 2-core host, 200 reads) no limit."""
    if not gemm:
        return math.inf
    if pair_reads is None or math.isnan(pair_reads):
        return float(FUSED_PROMPT_TOKENS)
    if pair_reads <= 0:
        return math.inf
    return max(float(FUSED_PROMPT_TOKENS), 1.0 + (FUSED_PROMPT_TOKENS - 1) / pair_reads)


def prompt_pair_reads(profile: HardwareProfile, dtype: str, params: float, nbytes: float) -> float | None:
    """The fused CPU kernel's time for one further token of a prompt's expert (``params`` weights,
    ``nbytes`` stored as ``dtype``) over its time to read the expert at batch 1
    (``cpu_prompt_flops`` against ``cpu_rate``); None when the profile did not measure the format."""
    table = {k.lower(): v for k, v in profile.cpu_prompt_flops.items()}
    fmt = weight_format(dtype)
    flops = table.get(fmt) or table.get(KQUANT_KIN.get(fmt, "")) or table.get("bf16" if fmt in ("f16", "fp16", "f32") else "")
    if not flops or flops <= 0 or nbytes <= 0:
        return None
    return (2.0 * params / flops) / (nbytes / cpu_rate(profile, dtype))


def expert_dtype(unit) -> str:
    """The storage type a routed expert ``unit`` is rated by: its largest tensor's (BF16 without any)."""
    return max(unit.tensors, key=lambda t: t.nbytes).tensor.dtype if unit.tensors else "BF16"


def _held_expert(inventory: Inventory) -> tuple[str, float, float] | None:
    """``(format, weights, bytes)`` of the first routed expert of ``inventory`` as the engine's CPU
    tier holds it (bfloat16 unless it keeps the file's blocks); None without experts."""
    unit = next((u for k, u in sorted(inventory.units.items()) if k.kind == "expert"), None)
    if unit is None or not unit.tensors:
        return None
    if not experts_as_stored(inventory):  # held in bfloat16
        return "BF16", unit.n_params, 2 * unit.n_params
    return expert_dtype(unit), unit.n_params, unit.nbytes


def model_prompt_pair_reads(inventory: Inventory, profile: HardwareProfile) -> float | None:
    """``prompt_pair_reads`` for the routed experts of ``inventory`` (its first expert's format and
    size), None without experts or a measurement for their format."""
    held = _held_expert(inventory)
    return None if held is None else prompt_pair_reads(profile, *held)


BUS_READ = 0.87
"""Share of the pinned host-to-device copy rate that kernels reading page-locked host memory in
place reach where calibration did not measure it (``HardwareProfile.bus_read_rate``; H200 machine:
48 of 55 GB/s, ``scripts/bench_device.sh bus_sweep``)."""


def bus_rate(profile: HardwareProfile, bus_read: float = BUS_READ) -> float:
    """Bytes/s at which the GPU's expert kernels read CPU-tier experts in place from page-locked host
    memory (decode's bus share): ``bus_read_rate`` as calibration measured it, else ``bus_read``
    of the pinned copy rate; 0 without either."""
    if profile.bus_read_rate > 0:
        return float(profile.bus_read_rate)
    h2d = profile.h2d_pinned
    return float(h2d * bus_read) if h2d and math.isfinite(h2d) and h2d > 0 else 0.0


BUS_SHARE_RANGE = (0.1, 0.75)
"""Least and most of ``balanced_bus_share``: guard rails against a rate measured wrong, not a limit a
real machine reaches (bus / (bus + CPU) was 0.19 to 0.45 on the GPU machine's hosts)."""


def balanced_bus_share(profile: HardwareProfile, dtype: str = "bf16") -> float:
    """The share of a token's CPU-selected experts that decode sends over the bus so that the bus
    and the CPU take equally long: ``bus / (bus + cpu)`` of their read rates for experts stored as
    ``dtype`` (``bus_rate``, ``cpu_rate``). A host whose CPU reads experts at 130 GB/s and whose bus
    reads them at 48 GB/s sends about a quarter; one at 65 and 48 GB/s, about 0.4 (``BUS_SHARE``,
    the fixed share before, balanced the H200 machine's); within ``BUS_SHARE_RANGE``. ``BUS_SHARE``
    where calibration did not measure the bus's in-place reads (``bus_read_rate``): a profile from
    before it, or a preset, keeps the share its predictions were checked with."""
    bus, cpu = profile.bus_read_rate, cpu_rate(profile, dtype)
    if not (bus > 0 and cpu > 0):
        return BUS_SHARE
    return min(max(bus / (bus + cpu), BUS_SHARE_RANGE[0]), BUS_SHARE_RANGE[1])


def bus_ratio(fraction: float) -> float:
    """How many times as long the bus takes for one expert as the CPU, for a bus share ``fraction``
    that balances their rates: ``(1 - fraction) / fraction`` in float32 (0 for a share of 0 or less)."""
    f = np.float32(fraction)
    return float((np.float32(1) - f) / f) if f > 0 else 0.0


def bus_count(n, fraction: float, slots: int):
    """How many of the ``n`` CPU-tier experts one token selects in a layer travel over the bus (an int
    or an integer array like ``n``): ``m`` of ``floor(n * fraction)`` and one more, whichever lets
    the slower of the two lanes finish first, the CPU's ``n - m`` experts against the bus's ``m``
    when the bus takes ``(1 - fraction) / fraction`` times as long for one (``fraction`` splits their
    rates so: ``balanced_bus_share``); a tie stays with the CPU; at most ``slots``. Rounding ``n *
    fraction`` instead sent the bus one of 3 at a fraction of 0.18, a layer 1.5 times as long as the
    CPU computing all three. float32 arithmetic, as the decode step's publish kernel does it."""
    f = np.float32(fraction)
    n_arr = np.asarray(n, dtype=np.int64)
    if not f > 0:
        m = np.zeros_like(n_arr)
    else:
        nf = n_arr.astype(np.float32)
        m0 = np.floor(nf * f).astype(np.int64)
        r = np.float32(bus_ratio(fraction))
        a0 = np.maximum((n_arr - m0).astype(np.float32), m0.astype(np.float32) * r)
        a1 = np.maximum((n_arr - m0 - 1).astype(np.float32), (m0 + 1).astype(np.float32) * r)
        m = m0 + ((a1 < a0) & (m0 < n_arr))
        m = np.minimum(m, n_arr)
    m = np.minimum(m, max(0, int(slots)))
    return int(m) if np.ndim(n) == 0 else m


UNIT_CHOICES = (0.25, 0.375, 0.5, 0.625, 0.75)
"""The unit splits (the bus's share of each pair's units) the model weighs per layer against whole
experts (``EngineShape.unit_share`` None)."""
UNIT_GAIN = 0.03
"""A layer takes a unit split only where the model predicts it at least this much shorter than whole
experts. On an H100 host whose RAM read 104 GB/s (the CPU's 69 and the bus's 51 GB/s together
more), the model predicted S1 bf16 ``balanced`` the same either way and the split measured 136.5
tok/s against 139.6 with whole experts (BENCHMARKS.md, eighteenth stop): where the RAM bounds both
lanes, a split only adds the bus's partial rows."""


def unit_block(fmt: str) -> int:
    """Intermediate units per block of experts held in ``fmt`` (``weight_format``): the GGML block
    (``ggml_types.BLOCK``; 32 for Q8_0 and MXFP4, 256 for the k-quants), at least 32 (float stacks:
    aligned views). A unit split (``units_for``) cuts whole blocks."""
    return max(32, BLOCK.get(fmt.upper(), (1, 0))[0])


def units_for(ffn: int, share: float, block: int) -> int:
    """The intermediate units of each CPU-tier expert that the CPU computes under a unit split of
    ``share`` (the bus's share of them): ``ffn`` less ``share * ffn`` rounded to whole ``block``s, or all ``ffn``
    (no split) where that leaves either side nothing."""
    if not share > 0 or ffn <= 0 or block <= 0:
        return ffn
    bus = int(round(share * ffn / block)) * block
    return ffn - bus if 0 < bus < ffn else ffn


def model_bus_share(inventory: Inventory, profile: HardwareProfile) -> float:
    """``balanced_bus_share`` for the routed experts of ``inventory`` (their first expert's format as
    the CPU holds it: bfloat16 unless the engine keeps the file's blocks); ``BUS_SHARE`` without
    experts."""
    held = _held_expert(inventory)
    return BUS_SHARE if held is None else balanced_bus_share(profile, held[0])


def prefill_fetch(counts: np.ndarray, fetch_tokens: float, bus_share: float,
                  pair_reads: float | None = None, gemm: bool = True) -> np.ndarray:
    """Which of one layer's CPU-tier experts a prompt chunk sends over the bus: a boolean mask like
    ``counts`` (tokens of the chunk that select each expert).

    An expert ``fetch_tokens`` or more tokens select always travels. Of the others the hottest travel
    and the coldest stay with the CPU, split where the two lanes finish together: the CPU's time for
    an expert is ``cpu_prompt_reads`` (one read plus ``pair_reads`` per further token, or a read per
    token when that is not measured; at most ``FUSED_PROMPT_TOKENS`` reads, a GEMM), the bus's is one
    copy of the expert, ``(1 - bus_share) / bus_share`` reads (``bus_share``: the bus's part of the
    two lanes' summed read rates, as in decode; 0 sends no more, 1 sends all). ``gemm``: as in
    ``cpu_prompt_reads`` (False for experts kept in GGUF blocks).
    """
    counts = np.asarray(counts, dtype=float)
    fetch = counts >= fetch_tokens
    rest = np.flatnonzero(~fetch)
    if bus_share <= 0 or rest.size == 0:
        return fetch
    if bus_share >= 1:
        return np.ones_like(fetch)
    order = rest[np.argsort(counts[rest], kind="stable")]  # coldest first
    cpu = np.concatenate([[0.0], np.cumsum(cpu_prompt_reads(counts[order], pair_reads, gemm))])  # the m coldest
    bus = (1 - bus_share) / bus_share * (fetch.sum() + order.size - np.arange(order.size + 1))
    m = int(np.argmin(np.maximum(cpu, bus)))
    fetch[order[m:]] = True
    return fetch

_QUANT_FAMILY = {"Q8": "int8", "I8": "int8", "INT8": "int8", "F8": "fp8", "FP8": "fp8"}


@dataclass(frozen=True)
class EngineShape:
    """Kernel launches of the hybrid engine's decode step (structure of the engine, not of the machine)."""

    launches_attn: int = 10
    """norm, q/k/v projections, rope, cache write, attention, output projection, residual."""
    launches_moe: int = 6
    """router, top-k, gather, grouped gate_up / down GEMMs, weighted combine (per MoE layer)."""
    launches_mlp: int = 4
    """a dense MLP or a shared expert: gate_up, act, down, residual."""
    launches_cpu_return: int = 4
    """GPU-side work per layer with CPU experts, every token: the decode server's publish kernel, the
    packet's and the step number's copies to host memory, ``wait_add`` (an H100 host: 11.7 µs a
    layer when the packet leaves the CPU nothing, against a graph's 1.4 µs; ``time_served_handoff.py``)."""
    launches_stream: int = 2
    """per streamed expert fetched: the copy and its compute."""
    launches_head: int = 3
    """final norm, lm_head, sampling."""
    prefill_fetch_compute: bool = True
    """Prefill may copy a CPU-compute expert that many tokens pick to the GPU (pinned with the bus
    share, else pageable) when that is cheaper than computing it on the CPU."""
    prefill_cpu_stream: bool = True
    """Prefill may compute a streamed expert that few tokens pick on the CPU instead of fetching it."""
    bus_share: float = BUS_SHARE
    """Decode sends ``round(n * bus_share)`` (at most ``bus_slots``) of the ``n`` CPU-compute experts a
    token selects in a layer over the bus to the GPU, while the CPU computes the rest; 0: none."""
    bus_slots: int = BUS_SLOTS
    unit_share: float | None = 0.0
    """Served decode's unit split: every CPU-tier pair's intermediate units split between the CPU and
    the bus (``units_for``) instead of whole experts by ``bus_share``. 0 (the default): whole
    experts; None: each layer takes whichever of whole experts and ``UNIT_CHOICES`` the model
    predicts fastest for the placement (``CostModel.unit_shares``, which the engine then runs); a
    share: that one wherever it beats whole experts. Off by default: on the one host it was
    measured on (H100, RAM read 104 GB/s) the split did not speed S1 bf16 up, where the model with
    it on predicted +4% (BENCHMARKS.md, eighteenth stop)."""
    launches_bus: int = 4
    """per layer that sends experts over the bus: the expert map copy, gate_up, down, add."""
    served: bool = True
    """Decode's hybrid layers are served by a native thread (the engine's ``served.DecodeServer`` on
    CUDA): ``sync_s`` is then its hand-off per layer, and the bus's experts are computed by kernels
    reading the CPU stacks in place (no copy, no separate compute) at ``bus_read`` of the pinned copy
    rate. False: the host-driven layer (copies into slots, then their compute)."""
    bus_read: float = BUS_READ
    """Share of the pinned host-to-device copy rate that kernels reading page-locked host memory in
    place reach, where the profile has no ``bus_read_rate`` (``bus_rate``)."""
    shared_read: float = 1.0
    """Share of the host's read bandwidth (calibration's read of a buffer many times the L3) that the
    CPU's and the bus's reads of the CPU tier reach together (H200 machine: 89 GB/s with both busy
    in the same sweep, 81-88 GB/s read by the CPU alone)."""


def count_probs(lam, top_k: int) -> np.ndarray:
    """``P(n)`` for ``n = 0..top_k`` (last axis; ``lam``'s shape before it): how many of a token's
    ``top_k`` selections in a layer fall on a tier that gets ``lam`` of them on average, binomial
    over the ``top_k`` picks (mean ``lam``; all ``top_k`` where ``lam == top_k``, as a layer with
    every expert on the CPU gets; a Poisson count capped at ``top_k`` put a quarter of such tokens
    at fewer)."""
    q = np.clip(np.asarray(lam, dtype=float) / top_k, 0.0, 1.0)[..., None]
    n = np.arange(top_k + 1)
    comb = np.array([math.comb(top_k, int(i)) for i in n], dtype=float)
    with np.errstate(invalid="ignore"):
        return comb * q ** n * (1.0 - q) ** (top_k - n)


def split_counts(lam, top_k: int, fraction: float, slots: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A token's CPU-compute selections in a layer and the bus's part of them: ``(n [top_k + 1],
    P(n) [..., top_k + 1], m [top_k + 1])`` for ``n = 0..top_k`` (``count_probs`` of their expected
    count ``lam``, any shape; ``bus_count(n, fraction, slots)``)."""
    n = np.arange(top_k + 1)
    return n, count_probs(lam, top_k), bus_count(n, fraction, slots)


def weight_format(dtype: str) -> str:
    """The CPU throughput key of a storage dtype: ``BF16 -> bf16``, ``Q8_0 -> q8_0`` (then ``int8``)."""
    return dtype.lower()


def _kept_by_format(unit) -> dict[str, float]:
    """Bytes of ``unit`` the engine keeps in GGUF blocks (``memory.kept_in_blocks``), by format."""
    out: dict[str, float] = {}
    for t in unit.tensors:
        if kept_in_blocks(t.tensor):
            fmt = weight_format(t.tensor.dtype)
            out[fmt] = out.get(fmt, 0.0) + t.nbytes
    return out


def cpu_rate(profile: HardwareProfile, dtype: str) -> float:
    """Bytes of expert weights per second the CPU serves at batch 1 for weights stored as ``dtype``.

    Looks up ``cpu_expert_throughput`` by the exact format (``q4_k``), then ``KQUANT_KIN``, then its family (``int8``,
    ``int4`` for other quantized types, ``bf16`` for ``f16``), then ``bf16``; without any entry,
    half the host RAM read bandwidth (plain PyTorch bf16 GEMV reaches a third to two thirds of it).
    """
    table = {k.lower(): v for k, v in profile.cpu_expert_throughput.items()}
    fmt = weight_format(dtype)
    family = next((v for k, v in _QUANT_FAMILY.items() if fmt.upper().startswith(k)), None)
    if family is None and (fmt[:1] in ("q", "i") or fmt.startswith(("mxfp", "nvfp"))):
        family = "int4"
    for key in (fmt, KQUANT_KIN.get(fmt), family, "bf16" if fmt in ("f16", "fp16") else None, "bf16"):
        if key and key in table and table[key] > 0:
            return float(table[key])
    return 0.5 * profile.host_read_bandwidth


class CostModel:
    """Predicts a placement's memory and speed for one model on one machine.

    Build it once per (inventory, profile, stats); ``predict`` is then cheap (milliseconds for
    94 layers x 256 experts) so that the GUI can call it while the user drags experts.
    """

    def __init__(self, inventory: Inventory, profile: HardwareProfile, stats: ExpertStats | None = None,
                 engine: EngineShape | None = None, recent: bool = False):
        if not profile.gpus:
            raise ValueError("the hardware profile has no GPU")
        self.inv = inventory
        self.profile = profile
        self.engine = engine or EngineShape(bus_share=model_bus_share(inventory, profile))
        spec = inventory.spec
        self.n_layers = spec.n_layers
        self.n_experts = max(1, spec.n_experts)
        L, E = self.n_layers, self.n_experts
        self.expert_bytes = np.zeros((L, E))
        self.expert_params = np.zeros((L, E))
        self.expert_cpu_rate = np.ones((L, E))
        self.expert_format = np.full((L, E), "bf16", dtype=object)
        self.pair_reads = np.full((L, E), np.nan)  # prompt_pair_reads per expert (NaN: not measured)
        self._gpu_rate_cache: dict[int, np.ndarray] = {}
        self.present = np.zeros((L, E), dtype=bool)
        self.expert_keys: list[UnitKey] = []
        rates: dict[str, float] = {}
        pairs: dict[tuple, float] = {}  # prompt_pair_reads by (dtype, params, bytes): one per expert shape
        kept = experts_as_stored(inventory)  # else the engine holds every expert in bfloat16
        for key, unit in inventory.units.items():
            if key.kind != "expert":
                continue
            if key.layer >= L or key.expert >= E:
                raise ValueError(f"{key} lies outside the model's {L} layers x {E} experts")
            self.expert_keys.append(key)
            self.present[key.layer, key.expert] = True
            self.expert_bytes[key.layer, key.expert] = held_bytes(key, unit, kept)
            self.expert_params[key.layer, key.expert] = unit.n_params
            dtype = expert_dtype(unit) if kept else "BF16"
            if dtype not in rates:
                rates[dtype] = cpu_rate(profile, dtype)
            self.expert_cpu_rate[key.layer, key.expert] = rates[dtype]
            self.expert_format[key.layer, key.expert] = weight_format(dtype)
            shape = (dtype, unit.n_params, self.expert_bytes[key.layer, key.expert])
            if shape not in pairs:
                pair = prompt_pair_reads(profile, *shape)
                pairs[shape] = np.nan if pair is None else pair
            self.pair_reads[key.layer, key.expert] = pairs[shape]
        self.expert_keys.sort()
        self.expert_biases = any("bias" in t.tensor.name for k, u in inventory.units.items()
                                 if k.kind == "expert" for t in u.tensors)
        self.moe_layer = self.present.any(axis=1)
        self.unit_choices = self._unit_choices(int(spec.expert_ffn or 0))
        """Per layer, the unit splits decode may take ``[L, C]`` (the bus's share of each pair's units
        as ``units_for`` rounds it; column 0: whole experts)."""
        self.stats = stats
        self.p_sel = self._selection_probs(stats, recent)
        self.other_units = [(k, held_bytes(k, u), u.n_params) for k, u in sorted(inventory.units.items())
                            if k.kind != "expert"]  # bytes as the engine holds them
        self.kept_bytes = {k: _kept_by_format(u) for k, u in inventory.units.items() if k.kind != "expert"}
        """Per unit, the bytes of it kept in GGUF blocks by format (read at the format's GPU rate)."""
        embed = UnitKey(None, "embed")
        self.tied_head = None
        """Tied embeddings: (embed key, bytes) the output projection reads per token from the embedding."""
        if UnitKey(None, "lm_head") not in inventory.units and embed in inventory.units:
            self.tied_head = (embed, held_bytes(embed, inventory.units[embed]))

    def _selection_probs(self, stats: ExpertStats | None, recent: bool) -> np.ndarray:
        """``[layers, experts]`` probability that a token selects each expert (uniform without stats)."""
        L, E = self.n_layers, self.n_experts
        top_k = max(1, self.inv.spec.n_experts_active)
        if stats is not None:
            if stats.shape != (L, E):
                raise ValueError(f"expert stats of shape {stats.shape} do not fit this model ({L} x {E})")
            p = stats.selection_probs(recent, top_k)
        else:
            n = np.maximum(self.present.sum(axis=1, keepdims=True), 1)
            p = np.minimum(1.0, top_k / n) * np.ones((L, E))
        return np.where(self.present, p, 0.0)

    def with_stats(self, stats: ExpertStats | None, recent: bool = False) -> CostModel:
        """The same model with other expert stats (milliseconds: live stats update it often)."""
        other = copy.copy(self)
        other.stats = stats
        other.p_sel = self._selection_probs(stats, recent)
        return other

    # -- rates -----------------------------------------------------------------------------------

    def _gpu(self, index: int):
        gpus = self.profile.gpus
        return gpus[min(index, len(gpus) - 1)]

    def expert_bandwidth(self, index: int) -> float:
        """Bytes/s of expert weights a batch-1 expert matmul reads on the GPU (``expert_bandwidth``
        when the profile has it, else the memory bandwidth)."""
        g = self._gpu(index)
        eb = g.expert_bandwidth
        return eb if eb is not None and math.isfinite(eb) and eb > 0 else g.mem_bandwidth

    def gpu_rate(self, index: int) -> np.ndarray:
        """``[layers, experts]`` bytes/s at which GPU ``index`` reads each resident expert at batch 1:
        its format's ``expert_throughput`` (experts kept in a quantized file's blocks; ``KQUANT_KIN``
        for k-quants without their own) or ``expert_bandwidth``."""
        rate = self._gpu_rate_cache.get(index)
        if rate is None:
            table = self._gpu(index).expert_throughput
            base = self.expert_bandwidth(index)
            rate = np.full(self.expert_format.shape, base)
            for fmt in KEPT_EXPERT_FORMATS:
                r = table.get(fmt, table.get(KQUANT_KIN.get(fmt, "")))
                if r and math.isfinite(r) and r > 0:
                    rate[self.expert_format == fmt] = r
            self._gpu_rate_cache[index] = rate
        return rate

    # -- prediction ------------------------------------------------------------------------------

    def predict(self, placement: Placement, ctx: int = 4096, kv_dtype: str = "f16",
                prompt_tokens: int = 512, kv_tokens: int | None = None,
                memory: MemoryEstimate | None = None) -> Prediction:
        """Memory (for a context of ``ctx`` tokens), decode tokens/s with ``kv_tokens`` tokens in the
        cache (default: the prompt), and prefill tokens/s for a prompt of ``prompt_tokens``.
        ``memory``: the placement's estimate when the caller has it already."""
        if prompt_tokens < 1:
            raise ValueError("the prompt has at least one token")
        kv_tokens = min(ctx, prompt_tokens if kv_tokens is None else kv_tokens)
        if memory is None:
            memory = estimate_memory(self.inv, placement, ctx, kv_dtype)
        grid = expert_grid(placement, self.n_layers, self.n_experts)
        decode, other = self._decode(placement, grid, kv_tokens, kv_dtype)
        chunk = min(prompt_tokens, PREFILL_CHUNK)
        n_chunks = math.ceil(prompt_tokens / chunk)
        prefill = self._prefill(placement, grid, chunk, prompt_tokens)
        step = self.profile.decode_step_s  # the host's own time per decoded token
        decode_s = sum(c.total for c in decode) + other + step
        prefill_s = n_chunks * sum(c.total for c in prefill) + other
        return Prediction(memory, 1.0 / decode_s, prompt_tokens / prefill_s, prompt_tokens, kv_tokens,
                          decode, prefill, other + step)

    def decode_tps(self, placement: Placement, kv_tokens: int = 512, kv_dtype: str = "f16",
                   grid: np.ndarray | None = None) -> float:
        """Decode tokens/s alone (no memory estimate, no prefill): what planners compare. ``grid``
        (``[layers, experts]`` tier codes) overrides the placement's routed experts."""
        if grid is None:
            grid = expert_grid(placement, self.n_layers, self.n_experts)
        layers, other = self._decode(placement, grid, kv_tokens, kv_dtype)
        return 1.0 / (sum(c.total for c in layers) + other + self.profile.decode_step_s)

    def roofline(self, placement: Placement, kv_tokens: int = 512, kv_dtype: str = "f16") -> dict[str, tuple[float, float]]:
        """Bytes each device must read per decoded token and the seconds that takes at its bandwidth:
        ``{"gpu:0": (bytes, s), "cpu": (bytes, s), "bus": (bytes, s)}``. Weights of non-expert units
        and the KV cache count in full, routed experts by their expected selections, streamed ones
        by their expected misses (the bus). No launches, syncs or overlap: a floor, not a prediction."""
        out: dict[str, list[float]] = {}

        def add(tier: str, nbytes: float, rate: float) -> None:
            acc = out.setdefault(tier, [0.0, 0.0])
            acc[0] += nbytes
            acc[1] += nbytes / rate

        for key, nbytes, _ in self.other_units:
            if key.kind == "embed":
                nbytes = nbytes / max(1, self.inv.spec.vocab_size) + (self.tied_head[1] if self.tied_head else 0)
            if key.kind == "attn":
                nbytes += kv_cache_bytes(self.inv, key.layer, kv_tokens, kv_dtype)
            tier = placement.get(key).tier
            if is_gpu(tier):
                add(tier, nbytes, self._gpu(gpu_index(tier)).mem_bandwidth)
            else:
                add("cpu", nbytes, self.profile.host_read_bandwidth)
        grid = expert_grid(placement, self.n_layers, self.n_experts)
        load = self.p_sel * self.expert_bytes * self.present
        for g in np.unique(grid[(grid >= 0) & self.present]):
            acc = out.setdefault(f"gpu:{int(g)}", [0.0, 0.0])
            acc[0] += float((load * (grid == g)).sum())
            acc[1] += float((load * (grid == g) / self.gpu_rate(int(g))).sum())
        compute = grid == TIER_CPU_COMPUTE
        if compute.any():
            acc = out.setdefault("cpu", [0.0, 0.0])
            acc[0] += float((load * compute).sum())
            acc[1] += float((load * compute / self.expert_cpu_rate).sum())
        stream = (grid == TIER_CPU_STREAM) & self.present
        if stream.any():
            hits = lru_hit_probs(np.where(stream, self.p_sel, 0.0), placement.stream_slots)
            add("bus", float((load * (1 - hits) * stream).sum()), self.profile.h2d_pinned)
        return {k: (v[0], v[1]) for k, v in out.items()}

    # -- decode ----------------------------------------------------------------------------------

    def _unit_time(self, tier: str, nbytes: float, launches: int, kept: dict[str, float] | None = None
                   ) -> tuple[str, float]:
        """(lane, seconds) of reading ``nbytes`` of weights on ``tier`` at batch 1; ``kept``: the part of
        them held in GGUF blocks, by format, which a GPU reads at that format's ``expert_throughput``
        (the same decoder reads them) where the profile has one."""
        if is_gpu(tier):
            g = self._gpu(gpu_index(tier))
            s = nbytes / g.mem_bandwidth + launches * g.launch_s
            for fmt, b in (kept or {}).items():
                r = g.expert_throughput.get(fmt)
                if r and math.isfinite(r) and r > 0:
                    s += b / r - b / g.mem_bandwidth
            return tier, s
        return "cpu", nbytes / self.profile.host_read_bandwidth

    def _fixed_decode(self, placement: Placement, kv_tokens: int, kv_dtype: str):
        """Per-layer costs of the units that are not routed experts: (pre [L], post lanes, syncs [L], other s)."""
        L = self.n_layers
        pre = np.zeros(L)
        post: dict[str, np.ndarray] = {}
        sync = np.zeros(L)
        other = 0.0
        eng = self.engine
        for key, nbytes, _ in self.other_units:
            a = placement.get(key)
            if key.layer is None:
                if key.kind == "embed":
                    nbytes = nbytes / max(1, self.inv.spec.vocab_size)  # one row per token
                launches = eng.launches_head if key.kind == "lm_head" else 1
                kept = self.kept_bytes.get(key) if key.kind != "embed" else None
                lane, t = self._unit_time(a.tier, nbytes, launches, kept)
                other += t
                if key.kind == "embed" and self.tied_head is not None:  # the output projection
                    other += self._unit_time(a.tier, self.tied_head[1], eng.launches_head, self.kept_bytes.get(key))[1]
                continue
            layer = key.layer
            if key.kind == "attn":
                nbytes = nbytes + kv_cache_bytes(self.inv, layer, kv_tokens, kv_dtype)
                launches = eng.launches_attn
            elif key.kind == "router":
                launches = eng.launches_moe
                if is_gpu(a.tier):  # routing over the layer's experts beyond those it picks
                    pre[layer] += self._gpu(gpu_index(a.tier)).route_s_per_expert * max(
                        0, self.n_experts - self.inv.spec.n_experts_active)
            elif key.kind in ("shared", "dense_mlp"):
                launches = eng.launches_mlp
            else:
                launches = 0
            lane, t = self._unit_time(a.tier, nbytes, launches, self.kept_bytes.get(key))
            if lane == "cpu":
                sync[layer] += self.profile.sync_s
            if key.kind in ("shared", "dense_mlp"):
                post.setdefault(lane, np.zeros(L))[layer] += t
            else:
                pre[layer] += t
        return pre, post, sync, other

    def _decode(self, placement: Placement, grid: np.ndarray, kv_tokens: int, kv_dtype: str):
        L = self.n_layers
        pre, post, sync, other = self._fixed_decode(placement, kv_tokens, kv_dtype)
        eng = self.engine
        p, b = self.p_sel, self.expert_bytes
        load = p * b  # expected bytes read per token [L, E]
        present = self.present

        gpu_lanes: dict[str, np.ndarray] = {k: v.copy() for k, v in post.items() if k != "cpu"}
        cpu_lane = post.get("cpu", np.zeros(L)).copy()
        gpu_share = np.full(L, np.nan)
        sel_total = p.sum(axis=1)
        on_gpu = (grid >= 0) & present
        for g in np.unique(grid[on_gpu]):
            mask = on_gpu & (grid == g)
            tier = f"gpu:{int(g)}"
            lane = gpu_lanes.setdefault(tier, np.zeros(L))
            lane += (load * mask / self.gpu_rate(int(g))).sum(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            gpu_share = np.where(self.moe_layer, (p * on_gpu).sum(axis=1) / np.where(sel_total > 0, sel_total, 1), np.nan)

        compute = (grid == TIER_CPU_COMPUTE) & present
        bus = np.zeros(L)
        stream = (grid == TIER_CPU_STREAM) & present
        hit_rate = np.full(L, np.nan)
        if stream.any():
            hits = lru_hit_probs(np.where(stream, p, 0.0), placement.stream_slots)
            miss_bytes = (load * (1 - hits) * stream).sum(axis=1)
            fetches = (p * (1 - hits) * stream).sum(axis=1)
            g0 = self._gpu(0)
            stream_compute = (load * stream).sum(axis=1) / self.expert_bandwidth(0)
            bus = bus + miss_bytes / self.profile.h2d_pinned + stream_compute + fetches * eng.launches_stream * g0.launch_s
            gpu_lanes.setdefault("gpu:0", np.zeros(L))
            gpu_lanes["gpu:0"] += stream_compute
            with np.errstate(invalid="ignore", divide="ignore"):
                hit_rate = np.where(stream.any(axis=1), (p * hits * stream).sum(axis=1) / (p * stream).sum(axis=1), np.nan)

        has_compute = compute.any(axis=1)
        launch = np.array([self._gpu(self._attn_gpu(placement, layer)).launch_s for layer in range(L)])
        gpu0 = gpu_lanes.pop("gpu:0", np.zeros(L))
        gpu_other = np.max(list(gpu_lanes.values()), axis=0) if gpu_lanes else np.zeros(L)
        sync = sync + np.where(stream.any(axis=1), self.profile.sync_s, 0.0)  # the host-driven step
        lanes, units = self._best_lanes((load * compute / self.expert_cpu_rate).sum(axis=1),
                                        (load * compute).sum(axis=1), (p * compute).sum(axis=1), has_compute,
                                        stream.any(axis=1), gpu0, gpu_other, cpu_lane, bus, sync,
                                        has_compute * eng.launches_cpu_return * launch)
        units = np.where(has_compute & ~stream.any(axis=1), units, 0.0)
        return [LayerCost(layer, float(pre[layer]), *(float(v[layer]) for v in lanes[:4]),
                          float(gpu_share[layer]), float(hit_rate[layer]), spread=float(lanes[4][layer]),
                          bus_units=float(units[layer]))
                for layer in range(L)], other

    def _unit_choices(self, ffn: int) -> np.ndarray:
        """``unit_choices`` for experts of ``ffn`` intermediate units (``EngineShape.unit_share``): none
        where decode is not served, the experts carry biases (the engine computes those whole) or
        the bus share is off."""
        L, share = self.n_layers, self.engine.unit_share
        if not (self.engine.served and ffn > 0 and self.engine.bus_share > 0) or self.expert_biases or share == 0:
            return np.zeros((L, 1))
        shares = UNIT_CHOICES if share is None else (float(share),)
        return np.array([[0.0] + [1.0 - units_for(ffn, s, unit_block(str(self.expert_format[layer, 0]))) / ffn
                                  for s in shares] for layer in range(L)])

    def unit_shares(self, placement: Placement, kv_tokens: int = 512, kv_dtype: str = "f16") -> np.ndarray:
        """Per layer ``[L]``, the share of each CPU-tier pair's intermediate units that served decode's bus
        computes for ``placement`` as the model predicts it fastest (0: whole experts by the bus
        share): what the engine runs (``Engine(unit_shares=...)``) and ``predict`` assumes. Without a
        split to weigh (``EngineShape.unit_share`` 0, the default) zeros, predicting nothing."""
        if self.unit_choices.shape[1] == 1:
            return np.zeros(self.n_layers)
        layers, _ = self._decode(placement, expert_grid(placement, self.n_layers, self.n_experts), kv_tokens, kv_dtype)
        return np.array([c.bus_units for c in layers])

    def _best_lanes(self, *args):
        """``_count_lanes`` at each of ``unit_choices`` (per layer: ``args``' arrays lead with the layer
        axis), the fastest per element, a split only where it beats whole experts by ``UNIT_GAIN``:
        its lanes and the unit split taken (``[L, ...]`` like ``lam``)."""
        lam = args[2]
        best, taken, best_t, whole_t = None, None, None, None
        for c in range(self.unit_choices.shape[1]):
            units = self.unit_choices[:, c].reshape((-1,) + (1,) * (np.ndim(lam) - 1))
            lanes = self._count_lanes(*args, units=units)
            t = np.maximum(np.maximum(lanes[0], lanes[1]), lanes[2]) + lanes[3] + lanes[4]
            if best is None:  # column 0: whole experts
                best, taken, best_t, whole_t = list(lanes), np.broadcast_to(units, np.shape(t)).astype(float), t, t
                continue
            better = (t < best_t * (1 - 1e-9)) & (t < whole_t * (1 - UNIT_GAIN))
            best = [np.where(better, new, old) for new, old in zip(lanes, best)]
            taken, best_t = np.where(better, units, taken), np.where(better, t, best_t)
        return best, taken

    def _count_lanes(self, cpu_t, cpu_bytes, lam, has_compute, streamed, gpu0, gpu_other, cpu_fixed, bus_fixed,
                     sync_fixed, gpu_fixed, units=0.0):
        """A decode layer's lanes over how many CPU-compute experts a token selects in it (``n``,
        ``count_probs`` of their expected count ``lam``), ``bus_count(n)`` of them over the bus
        (``EngineShape.bus_share``): the layer waits for its slowest lane token by token, so its
        expected time is the mean of ``max(gpu, cpu, bus) + sync`` over ``n``, longer than the
        slowest mean lane where one expert takes the CPU longer than the resident ones take the GPU.
        In (arrays of one shape, one value per layer or per layer and count of GPU experts): the
        CPU's seconds ``cpu_t`` and bytes ``cpu_bytes`` for all its expected selections, ``lam``,
        whether the layer has CPU-compute experts and streamed ones, the GPU lanes (``gpu0``, which
        a host-driven bus's compute joins, and the other GPUs'), the lanes' parts that do not depend
        on ``n`` (CPU units, streamed experts' bus time, host points, the CPU result's launches on
        the GPU). Out: the expected ``(gpu, cpu, bus, sync)`` lanes and ``spread``, the expected
        layer beyond ``max(gpu, cpu, bus) + sync`` of those means. Both of the bus's forms read host
        RAM with the CPU, so the CPU lane is at least the bytes of all ``n`` at the RAM's read rate.
        ``units`` (like ``lam``; served decode): the layer's unit split, the bus's share of every
        pair's units (0: whole experts by ``bus_count``)."""
        eng, prof = self.engine, self.profile
        k = max(1, self.inv.spec.n_experts_active)
        frac = self._bus_fraction() if self.moe_layer.any() else 0.0
        n, pn, m = split_counts(lam, k, frac, eng.bus_slots)
        if frac > 0 and eng.served and np.any(units):
            # the unit split: every pair's units shared, the bus's part of n pairs as many pairs' bytes
            u = np.asarray(units, dtype=float)[..., None]
            m = np.where(u > 0, n * u, m)
        safe = np.where(lam > 0, lam, 1.0)
        c1, b1 = (cpu_t / safe)[..., None], (cpu_bytes / safe)[..., None]  # one selection's seconds and bytes
        launches = (m > 0) * eng.launches_bus * self._gpu(0).launch_s
        gpu_x = np.zeros_like(pn)
        bus_n = np.zeros_like(pn)
        waits = (n - m > 0) if eng.served else np.ones_like(n, dtype=bool)  # the server's hand-off: only then
        per_layer = self._layer_sync().reshape((-1,) + (1,) * (np.ndim(has_compute) - 1))
        hand = np.where((has_compute & ~streamed)[..., None], per_layer[..., None] * waits, 0.0)
        # served: the packet's way to the native thread and back delays only the CPU's result, so the
        # hand-off joins the CPU lane; host-driven: the host waits for the routing before any lane starts
        on_cpu = hand if eng.served else 0.0
        sync_n = sync_fixed[..., None] + (0.0 if eng.served else hand)
        if frac <= 0:
            cpu_n = n * c1 + on_cpu
        elif eng.served:  # kernels read the rows in place: the bus lane is their reads
            cpu_n = np.maximum((n - m) * c1, n * b1 / (prof.host_read_bandwidth * eng.shared_read)) + on_cpu
            bus_n = m * b1 / bus_rate(prof, eng.bus_read) + launches
        else:  # copies into slots, then their compute on the GPU
            gpu_x = m * b1 / self.expert_bandwidth(0)
            cpu_n = np.maximum((n - m) * c1, n * b1 / prof.host_read_bandwidth)
            bus_n = m * b1 / prof.h2d_pinned + gpu_x + launches
        gpu_n = np.maximum(gpu0[..., None] + gpu_x, gpu_other[..., None]) + gpu_fixed[..., None]
        cpu_n = cpu_n + cpu_fixed[..., None]
        bus_n = bus_n + bus_fixed[..., None]
        total = (pn * (np.maximum(np.maximum(gpu_n, cpu_n), bus_n) + sync_n)).sum(axis=-1)
        gpu, cpu, bus, sync = ((pn * v).sum(axis=-1) for v in (gpu_n, cpu_n, bus_n, sync_n))
        spread = np.maximum(total - (np.maximum(np.maximum(gpu, cpu), bus) + sync), 0.0)
        return gpu, cpu, bus, sync, spread

    def _layer_sync(self) -> np.ndarray:
        """Per layer, the decode hand-off of its CPU experts (s): ``sync_by_format`` for the format of
        its first expert, else ``sync_s``."""
        by, base = self.profile.sync_by_format, self.profile.sync_s
        return np.array([by.get(str(self.expert_format[layer, 0]), base) for layer in range(self.n_layers)])

    def layer_curves(self, base: Placement, order: np.ndarray, kv_tokens: int = 512,
                     kv_dtype: str = "f16") -> tuple[np.ndarray, np.ndarray]:
        """Decode time of each layer when its first ``k`` experts of ``order`` sit on ``gpu:0`` and
        the others are CPU-compute, for every ``k``; ``base`` places the other units.

        ``order[l]`` lists the expert indices of layer ``l`` (``[layers, experts]``). Returns
        ``(seconds [layers, experts + 1], gpu_bytes [layers, experts + 1])``; column ``k`` is the
        layer's time and its experts' GPU bytes with ``k`` experts on the GPU. The same formula as
        ``predict`` (the planners search these curves, ``predict`` checks the result).
        """
        L, E = self.n_layers, self.n_experts
        pre, post, sync, _ = self._fixed_decode(base, kv_tokens, kv_dtype)
        rows = np.arange(L)[:, None]
        present = self.present[rows, order]
        load = (self.p_sel * self.expert_bytes)[rows, order] * present
        zeros = np.zeros((L, 1))
        g_cum = np.hstack([zeros, np.cumsum(load / self.gpu_rate(0)[rows, order], axis=1)])
        c_gain = np.hstack([zeros, np.cumsum(load / self.expert_cpu_rate[rows, order], axis=1)])
        b_cum = np.hstack([zeros, np.cumsum(self.expert_bytes[rows, order] * present, axis=1)])
        n_present = present.sum(axis=1)
        k = np.arange(E + 1)[None, :]
        cpu_left = k < n_present[:, None]  # some experts of the layer stay on the CPU
        gpu0 = post.get("gpu:0", np.zeros(L))[:, None] + g_cum
        others = [v for name, v in post.items() if name not in ("gpu:0", "cpu")]
        gpu_other = np.broadcast_to(np.max(others, axis=0)[:, None], gpu0.shape) if others else np.zeros_like(gpu0)
        launch = np.array([self._gpu(self._attn_gpu(base, layer)).launch_s for layer in range(L)])[:, None]
        p_cum = np.hstack([zeros, np.cumsum((self.p_sel[rows, order] * present), axis=1)])
        l_cum = np.hstack([zeros, np.cumsum(load, axis=1)])  # expected bytes per token
        cpu_fixed = np.broadcast_to(post.get("cpu", np.zeros(L))[:, None], gpu0.shape)
        (gpu, cpu, bus, sync_n, spread), _ = self._best_lanes(
            c_gain[:, -1:] - c_gain, l_cum[:, -1:] - l_cum, p_cum[:, -1:] - p_cum, cpu_left, np.zeros_like(cpu_left),
            gpu0, gpu_other, cpu_fixed, np.zeros_like(gpu0), np.zeros_like(gpu0),
            cpu_left * self.engine.launches_cpu_return * launch)
        t = pre[:, None] + np.maximum(np.maximum(gpu, cpu), bus) + sync[:, None] + sync_n + spread
        return t, b_cum

    def _bus_fraction(self) -> float:
        """The share of a step's CPU-compute selections that the bus takes (``EngineShape.bus_share``),
        or 0 where the profile has no pinned host->GPU rate to carry them at."""
        return max(0.0, self.engine.bus_share) if self.profile.h2d_pinned else 0.0

    def _attn_gpu(self, placement: Placement, layer: int) -> int:
        a = placement.get(UnitKey(layer, "attn"))
        return gpu_index(a.tier) if is_gpu(a.tier) else 0

    # -- prefill ---------------------------------------------------------------------------------

    def _prefill(self, placement: Placement, grid: np.ndarray, tokens: int, prompt_tokens: int) -> list[LayerCost]:
        """Per-layer costs of one chunk of ``tokens`` tokens of a ``prompt_tokens``-token prompt."""
        L = self.n_layers
        spec = self.inv.spec
        prof = self.profile
        n_chunks = math.ceil(prompt_tokens / tokens)
        attn_flops = 2.0 * spec.n_heads * spec.head_dim * prompt_tokens * prompt_tokens / n_chunks
        pre = np.zeros(L)
        lanes: dict[str, np.ndarray] = {}
        cpu = np.zeros(L)
        bus = np.zeros(L)
        sync = np.zeros(L)
        for key, nbytes, params in self.other_units:
            if key.layer is None:
                continue
            a = placement.get(key)
            flops = 2.0 * params * tokens + (attn_flops if key.kind == "attn" else 0.0)
            if is_gpu(a.tier):
                g = self._gpu(gpu_index(a.tier))
                t = max(nbytes / g.mem_bandwidth, flops / g.bf16_flops) + 4 * g.launch_s
                if self.kept_bytes.get(key):  # kept blocks: a bf16 copy written and read again per chunk
                    t += 4.0 * params / g.mem_bandwidth
            else:
                t = max(nbytes / prof.host_read_bandwidth, flops / prof.cpu_flops)
                sync[key.layer] += prof.sync_s
            if key.kind in ("shared", "dense_mlp"):
                if is_gpu(a.tier):
                    lanes.setdefault(a.tier, np.zeros(L))[key.layer] += t
                else:
                    cpu[key.layer] += t
            else:
                pre[key.layer] += t

        p, b, params = self.p_sel, self.expert_bytes, self.expert_params
        used = 1.0 - (1.0 - p) ** tokens  # probability the chunk uses the expert at all
        n_tok = p * tokens  # expected tokens per expert
        flops = 2.0 * params * n_tok
        present = self.present
        for g in np.unique(grid[(grid >= 0) & present]):
            gp = self._gpu(int(g))
            mask = (grid == g) & present
            read = (b * used * mask).sum(axis=1) / self.expert_bandwidth(int(g))
            comp = (flops * mask).sum(axis=1) / gp.bf16_flops
            lanes.setdefault(f"gpu:{int(g)}", np.zeros(L))
            lanes[f"gpu:{int(g)}"] += np.maximum(read, comp) + self.engine.launches_moe * gp.launch_s

        host = (grid < 0) & present
        g0 = self._gpu(0)
        on_cpu = np.maximum(b * used / self.expert_cpu_rate, flops / prof.cpu_flops)
        pinned = (grid == TIER_CPU_STREAM) | (self.engine.bus_share > 0)  # the bus share page-locks the CPU tier
        h2d = np.where(pinned, prof.prompt_h2d if prof.prompt_h2d > 0 else prof.h2d_pinned, prof.h2d_pageable)
        fetch = b * used / h2d + flops / g0.bf16_flops
        stream = grid == TIER_CPU_STREAM
        choose_cpu = on_cpu <= fetch
        sampled = np.zeros(L, dtype=bool)
        cpu_share = np.zeros(L)  # chance that the CPU computes a share of the layer's experts
        host_lane = np.zeros(L)  # the engine thread's own work (HardwareProfile.prompt_host_*)
        if self.engine.bus_share > 0:  # the fused kernel's cost, or a GEMM's
            given_used = n_tok / np.maximum(used, 1e-12)  # tokens per expert when the chunk uses it
            gemm = ~np.isin(self.expert_format, KEPT_EXPERT_FORMATS)  # kept blocks: the kernel at any count
            reads = used * cpu_prompt_reads(given_used, self.pair_reads, gemm)
            on_cpu = np.where(stream, on_cpu, b * reads / self.expert_cpu_rate)
        if self.engine.bus_share > 0 and self.engine.prefill_fetch_compute:  # the engine's rule (prefill_fetch)
            compute = host & ~stream
            for layer in np.flatnonzero(compute.any(axis=1)):
                cols = np.flatnonzero(compute[layer])
                c, f, read, cpu_share[layer], batches, copies = self._sampled_split(layer, cols, n_tok[layer, cols],
                                                                                    h2d[layer, cols])
                host_lane[layer] += prof.prompt_host_batch_s * batches + prof.prompt_host_copy_s * copies
                # both lanes read the CPU tier from host RAM: together at most its read rate
                cpu[layer] += max(c * prof.prompt_cpu_scale,
                                  read / (prof.host_read_bandwidth * self.engine.shared_read)) if c > 0 else 0.0
                bus[layer] += f
                sampled[layer] = True
                host[layer, cols] = False  # done
        if not self.engine.prefill_fetch_compute:
            choose_cpu |= ~stream
        if not self.engine.prefill_cpu_stream:
            choose_cpu &= ~stream
        cpu += (on_cpu * host * choose_cpu).sum(axis=1)
        bus += (fetch * host * ~choose_cpu).sum(axis=1)
        cpu_share = np.maximum(cpu_share, (host & choose_cpu).any(axis=1))
        hybrid = host.any(axis=1) | sampled
        sync += np.where(hybrid, prof.sync_s + prof.prompt_sync_s, 0.0)
        sync += prof.prompt_cpu_sync_s * cpu_share
        host_lane += np.where(hybrid, prof.prompt_host_layer_s + prof.prompt_host_cpu_s * cpu_share, 0.0)
        host_lane += np.where(self.moe_layer & ~hybrid, self._resident_floor(), 0.0)
        out = []
        for layer in range(L):
            gpu_t = max([v[layer] for v in lanes.values()] or [0.0])
            out.append(LayerCost(layer, float(pre[layer]), float(gpu_t), float(cpu[layer]), float(bus[layer]),
                                 float(sync[layer]), host=float(host_lane[layer])))
        return out

    def _resident_floor(self) -> np.ndarray:
        """Per layer, the least seconds of a prompt chunk's MoE layer with all its experts on the GPU
        (``prompt_resident_layer_by_format`` for its first expert's format, else
        ``prompt_resident_layer_s``)."""
        prof = self.profile
        by = {k.lower(): v for k, v in prof.prompt_resident_layer_by_format.items()}
        return np.array([by.get(str(self.expert_format[layer, 0]), prof.prompt_resident_layer_s)
                         for layer in range(self.n_layers)])

    def _prompt_batch(self, layer: int, col: int) -> tuple[int, int]:
        """How the engine fetches a prompt's CPU-tier expert ``col`` of ``layer``: ``(experts per batch,
        copies per run of consecutive rows)``. The bus's slots hold ``BUS_SLOTS`` bf16 experts' bytes
        and a batch is half of them (``bus.slot_count``); an expert travels as its tensors: two float
        matrices, Q8_0's values and scales of each (four), one block array of each otherwise, then
        two biases where the model has them (gpt-oss)."""
        params, nbytes = self.expert_params[layer, col], self.expert_bytes[layer, col]
        fmt = self.expert_format[layer, col]
        slots = self.engine.bus_slots
        if fmt in KEPT_EXPERT_FORMATS and nbytes > 0:
            slots = max(slots, int(slots * 2 * params // nbytes))
        tensors = (4 if fmt == "q8_0" else 2) + (2 if self.expert_biases else 0)
        return max(1, slots // 2), tensors

    def _sampled_split(self, layer: int, cols: np.ndarray, n_tok: np.ndarray, h2d: np.ndarray
                       ) -> tuple[float, float, float, float, float, float]:
        """Expected CPU and bus seconds, the bytes both read from host RAM, the chance that the CPU
        computes any of them, and the batches and copies the engine's thread queues for them
        (``_prompt_batch``), of one prompt chunk for the CPU-compute experts ``cols`` of ``layer``
        under the engine's split (``prefill_fetch``), which decides on the chunk's actual token
        counts: averaged over ``PROMPT_DRAWS`` draws of those counts (Poisson, mean ``n_tok`` tokens
        per expert; fixed seed). An expert near the always-fetch threshold travels in some
        draws and not in others, and the engine sends more of them than the mean counts would.
        A travelling expert costs its copy (``h2d``, B/s) and its tokens' GPU work."""
        b = self.expert_bytes[layer, cols]
        rate = self.expert_cpu_rate[layer, cols]
        gemm = not np.isin(self.expert_format[layer, cols[0]], KEPT_EXPERT_FORMATS)
        pair = float(self.pair_reads[layer, cols[0]])
        rng = np.random.default_rng(layer)
        counts = rng.poisson(np.broadcast_to(n_tok, (PROMPT_DRAWS, len(cols))))
        gpu_per_token = 2.0 * self.expert_params[layer, cols] / self._gpu(0).bf16_flops  # seconds
        half, tensors = self._prompt_batch(layer, int(cols[0]))
        cpu = bus = read = shared = batches = copies = 0.0
        for draw in counts:
            used = draw > 0
            sent = np.zeros(len(cols), dtype=bool)
            sent[used] = prefill_fetch(draw[used], PREFILL_FETCH_TOKENS, self.engine.bus_share, pair, gemm)
            stay = used & ~sent
            cpu += float((b[stay] * cpu_prompt_reads(draw[stay], pair, gemm) / rate[stay]).sum())
            bus += float((b[sent] / h2d[sent] + gpu_per_token[sent] * draw[sent]).sum())
            read += float(b[used].sum())
            shared += float(stay.any())
            rows = np.flatnonzero(sent)  # the CPU tier's rows, in expert order, fetched in this order
            if rows.size:
                new_run = np.diff(rows) != 1
                new_run[half - 1::half] = True  # each batch starts its own runs
                batches += -(-rows.size // half)
                copies += tensors * (1 + int(new_run.sum()))
        n = PROMPT_DRAWS
        return cpu / n, bus / n, read / n, shared / n, batches / n, copies / n


def lru_hit_probs(q: np.ndarray, slots: int) -> np.ndarray:
    """Per-expert hit probability of an LRU cache of ``slots`` entries per layer (Che's approximation).

    ``q[l, e]``: probability that a token selects expert ``e`` of layer ``l`` (0 for experts not
    streamed). The cache is updated per step: a step's selected experts are looked up, then all of
    them become the most recent.
    Under independent requests an expert stays cached for a characteristic time ``T`` (tokens) with
    ``sum_e (1 - (1 - q_e)^T) = slots``; its hit probability is ``1 - (1 - q_e)^T``. Layers with no
    more streamed experts than slots hit always (after warm-up). Returns ``[layers, experts]``.
    """
    q = np.asarray(q, dtype=np.float64)
    hits = np.zeros_like(q)
    # Requests come once per token (Bernoulli, not Poisson): the rate whose Poisson process is
    # requested at least once per token with probability q makes ``1 - exp(-rate T) = 1 - (1-q)^T``.
    rate = -np.log1p(-np.minimum(q, 1 - 1e-12))
    if slots <= 0:
        return hits
    requested = q > 0
    n = requested.sum(axis=1)
    fits_all = n <= slots
    hits[fits_all] = requested[fits_all].astype(np.float64)
    rows = np.flatnonzero(~fits_all)
    if rows.size:
        qr = rate[rows]
        lo = np.zeros(rows.size)
        hi = np.ones(rows.size)
        while True:  # grow hi until it holds more than ``slots`` entries
            occ = (1 - np.exp(-qr * hi[:, None])).sum(axis=1)
            if np.all(occ >= slots):
                break
            hi = np.where(occ < slots, hi * 4, hi)
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            occ = (1 - np.exp(-qr * mid[:, None])).sum(axis=1)
            lo = np.where(occ < slots, mid, lo)
            hi = np.where(occ < slots, hi, mid)
        hits[rows] = 1 - np.exp(-qr * hi[:, None])
    return hits
