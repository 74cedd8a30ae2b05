"""Engine: runs a model under a Placement on one accelerator (``cuda`` or, in tests, ``cpu``).

    engine = Engine.load(inventory, placement, device="cuda", dtype=torch.bfloat16, max_context=4096)
    logits = engine.forward(torch.tensor([1, 2, 3]), start_pos=0)   # [3, vocab] float32
    counts = engine.routing_counts()                                # [n_layers, n_experts] int64

Attention, routers, shared experts, dense MLPs, embeddings and lm_head live on the accelerator;
each routed expert is resident there, computed on the CPU, or streamed through a slot cache
(``experts.LayerExperts``). Loading copies each unit once from the mmap'd file to where it belongs.

One-token steps (decode) on CUDA replay CUDA graphs (``graphs.DecodeStep``). ``engine.decode_mode``
(default from ``WORKBENCH_DECODE``): ``auto`` (graphs on CUDA, plain eager steps elsewhere),
``eager`` (never graphs), ``static`` (the graphs' fixed-shape pieces run eagerly: tests on the CPU).
``engine.served_mode`` (default from ``WORKBENCH_SERVED``): ``auto`` (hybrid layers of those steps
served by a native thread without a host round trip on CUDA, ``served.DecodeServer``), ``on`` (also
on a CPU accelerator), ``off`` (every hybrid layer waits on the host).
"""

from __future__ import annotations

import gc
import logging
import math
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from workbench.core.errors import WorkbenchError
from workbench.core.inventory import Inventory
from workbench.core.memory import expert_weight_types
from workbench.core.placement import Placement, is_gpu
from workbench.core.units import KINDS, UnitKey

from . import blocks, bus, gpu_kernels, prefill_kernels
from .budget import cap_reserved, check_placement, uncap_reserved
from .experts import COMPUTE, RESIDENT, STREAM, LayerExperts
from .families import ModelArgs
from .hostclock import HostClock
from .layouts import FamilyWeights
from .mla import LatentCache, MlaAttention
from .model import Attention, DenseMlp, KVCache, Layer, Rope, rms_norm
from .moe import MoeBlock
from .packed import Packed, embedding, linear
from .packed import nbytes as weight_bytes
from .weights import WeightReader

log = logging.getLogger(__name__)

Progress = Callable[[int, int, str], None]
"""``progress(done_bytes, total_bytes, what)`` while loading."""


_ATTN_ROLES = ("q", "k", "v", "o", "q_bias", "k_bias", "v_bias", "o_bias", "q_norm", "k_norm", "sinks")
_MLA_ROLES = ("q", "q_a", "q_a_norm", "q_b", "kv_a", "kv_a_norm", "kv_b", "o", "o_bias")


class LoadCancelled(WorkbenchError):
    """Loading was cancelled; everything loaded so far was freed."""


class AcceleratorMemoryError(WorkbenchError):
    """The accelerator ran out of memory while loading; everything loaded so far was freed."""


class HostMemoryError(WorkbenchError):
    """Host RAM ran out while loading (CPU expert stacks, pinned stream copies); everything was freed."""


def keeps_blocks(inventory: Inventory, args: ModelArgs, cpu_format: str | None) -> bool:
    """Whether the engine keeps this model's routed experts in their GGUF quantized blocks on the GPU
    and the CPU instead of dequantizing them at load: every expert tensor is Q8_0, or every one is
    MXFP4, or every one is Q2_K ... Q6_K or IQ4_XS (``blocks.FORMATS``), whose sizes fill whole blocks
    and whose routing weight scales the output (not Llama 4's input), no CPU format asked for, and
    ``WORKBENCH_KEEP_QUANTS`` is not ``0``. gpt-oss's biased, clamped experts only in raw blocks
    (MXFP4, the k-quants): the fused CPU kernel's Q8_0 entry takes no biases."""
    if (cpu_format is not None or not args.n_experts
            or args.router == "sigmoid_topk_scale_input"  # Llama 4 scales the input: no in-place kernels
            or os.environ.get("WORKBENCH_KEEP_QUANTS", "1") == "0"):
        return False
    types = expert_weight_types(inventory)
    fmts = {blocks.FORMATS.get(t) for t in types}
    if not fmts or None in fmts or (fmts & {"q8_0", "mxfp4"} and len(fmts) > 1):
        return False
    if (args.expert_bias or args.expert_act != "silu") and not fmts <= set(blocks.RAW):
        return False
    block = max(blocks.BLOCK[f] for f in fmts)
    return args.expert_ffn % block == 0 and args.hidden % block == 0


def keeps_dense(inventory: Inventory, device: torch.device) -> bool:
    """Whether the engine keeps a GGUF file's Q8_0 / Q4_K / Q5_K / Q6_K attention projections, embeddings,
    head and dense / shared MLPs in their blocks (``packed.Packed``, ``memory.kept_in_blocks``):
    on CUDA (and under Triton's interpreter, for tests), unless ``WORKBENCH_KEEP_QUANTS`` (experts
    too) or ``WORKBENCH_KEEP_DENSE`` (these alone) is ``0``. On a CPU accelerator they are
    dequantized at load (a prompt step would dequantize them again each time)."""
    return (inventory.format == "gguf" and os.environ.get("WORKBENCH_KEEP_QUANTS", "1") != "0"
            and os.environ.get("WORKBENCH_KEEP_DENSE", "1") != "0"
            and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"))


def _bus_bytes(inventory: Inventory, args: ModelArgs, placement: Placement, device: torch.device,
               dtype: torch.dtype, share: float, keeps: bool) -> int:
    """Device bytes of the bus share's slots (``bus.BusShare``) when the engine will make one: on CUDA,
    with experts computed on the CPU and a ``share`` above 0; one slot set per layout of those layers'
    experts (float in ``dtype``, or their GGUF blocks when ``keeps``: ``keeps_blocks``)."""
    if device.type != "cuda" or not args.n_experts or share <= 0:
        return 0

    def on_cpu(a) -> bool:
        return not is_gpu(a.tier) and a.mode != "stream"

    layers = {layer for layer in args.moe_layers
              if any(on_cpu(placement.get(UnitKey(layer, "expert", e))) for e in range(args.n_experts))}
    layouts = {_expert_formats(inventory, layer) if keeps else None for layer in layers}
    shape13, shape2 = (2 * args.expert_ffn, args.hidden), (args.hidden, args.expert_ffn)
    slots, total = bus.slots_from_env(), 0
    for f in layouts:
        kept = None if f is None else (f, None, args.hidden, args.expert_ffn)
        total += (bus.slot_count(slots, shape13, shape2, dtype, kept, args.expert_bias)
                  * bus.slot_bytes(shape13, shape2, dtype, kept, args.expert_bias))
    return total


def _expert_formats(inventory: Inventory, layer: int) -> tuple[str, str] | None:
    """``(gate/up, down)`` block formats of ``layer``'s routed experts in a GGUF file (``blocks.FORMATS``),
    as ``FamilyWeights.expert_blocks`` finds them (stacked ``ffn_*_exps`` tensors whose formats the
    kernels pair), or None: the engine dequantizes that layer's experts."""
    t = [inventory.tensors.get(f"blk.{layer}.ffn_{p}_exps.weight") for p in ("gate", "up", "down")]
    if any(x is None for x in t):
        return None
    return blocks.expert_formats(*(blocks.FORMATS.get(x.dtype.upper()) for x in t))


def _pair_reads_from_env() -> float | None:
    """``WORKBENCH_PROMPT_PAIR_READS`` as a number of reads >= 0 (see ``Engine.set_prompt_pair_reads``),
    or None when unset or not a number."""
    raw = os.environ.get("WORKBENCH_PROMPT_PAIR_READS", "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        log.warning("WORKBENCH_PROMPT_PAIR_READS=%r is not a number; ignored", raw)
        return None
    return value if value >= 0 and math.isfinite(value) else None


def _served_mode(raw: str) -> str:
    """``WORKBENCH_SERVED`` as ``auto``, ``on`` or ``off`` (``1``/``0``, ``true``/``false``, ``yes``/``no``
    too; anything else: ``auto``)."""
    v = raw.strip().lower()
    if v in ("on", "1", "true", "yes"):
        return "on"
    if v in ("off", "0", "false", "no"):
        return "off"
    return "auto"


def _is_host_oom(exc: BaseException) -> bool:
    text = str(exc)
    return "can't allocate memory" in text or "DefaultCPUAllocator" in text or "CachingHostAllocator" in text


class _Loader:
    """Puts tensors where they belong; knows which unit is being loaded (for errors and progress)."""

    def __init__(self, device: torch.device, dtype: torch.dtype, total: int, progress: Progress | None, cancel,
                 weights: FamilyWeights | None = None, keep_dense: bool = False):
        self.device, self.dtype = device, dtype
        self.weights, self.keep_dense = weights, keep_dense
        self.total, self.done = total, 0
        self.progress, self.cancel = progress, cancel
        self.unit: UnitKey | None = None

    def begin(self, key: UnitKey, nbytes: int) -> None:
        if self.cancel is not None and (self.cancel.is_set() if hasattr(self.cancel, "is_set") else self.cancel()):
            raise LoadCancelled("loading was cancelled")
        self.unit = key
        self.done += nbytes
        if self.progress is not None:
            self.progress(self.done, self.total, str(key))

    def place(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The one allocation function for accelerator weights (tests inject failures here)."""
        return t.to(device=self.device, dtype=dtype or self.dtype)

    def weight(self, role: str, layer: int | None = None) -> torch.Tensor | Packed:
        """``role``'s weight on the accelerator: kept in the file's blocks where the engine keeps
        them (``keep_dense`` and ``FamilyWeights.blocks``), else a tensor in the engine's dtype."""
        kept = self.weights.blocks(role, layer) if self.keep_dense else None
        if kept is not None:
            return kept.to(self.device, self.dtype)
        return self.place(self.weights.get(role, layer))


class Engine:
    """A loaded model. Build with ``Engine.load``; see the module docstring."""

    def __init__(self) -> None:
        raise TypeError("use Engine.load(inventory, placement, ...)")

    # -- loading ---------------------------------------------------------------------------------

    @classmethod
    def load(cls, inventory: Inventory, placement: Placement | None = None, device: str | torch.device = "cpu",
             dtype: torch.dtype = torch.float32, max_context: int = 2048, progress: Progress | None = None,
             cancel=None, vram_budget: int | None = None, cpu_format: str | None = None,
             cpu_workers: int = 1, bus_share: float | None = None, unit_shares=None) -> Engine:
        """Load ``inventory`` under ``placement`` (default: everything on the accelerator).

        ``device`` is the accelerator. ``max_context`` sizes the static KV cache (tokens).
        ``vram_budget`` (bytes) defaults to the free memory of a CUDA device and to no limit on the
        CPU; one given on CUDA also caps what PyTorch may reserve there until ``close``
        (``budget.cap_reserved``), so that the process stays within it as NVML counts.
        ``cancel`` is a ``threading.Event`` or a callable returning True to stop.
        ``cpu_format`` (``cpu_formats.FORMATS``: bf16, f32, int8, int4) computes the CPU tier's experts
        with that weight format on ``cpu_workers`` threads; None keeps them in ``dtype``.
        ``bus_share`` (CUDA): the share of a token's CPU-selected experts that decode sends over the bus
        (``bus.BusShare``); None: ``WORKBENCH_BUS_SHARE`` or the default, 0: none. ``unit_shares``
        (CUDA, served decode; a value per layer, e.g. ``CostModel.unit_shares`` of the placement): each
        layer's unit split, the share of each CPU-tier pair's intermediate units the bus computes
        while the CPU computes the rest (0: whole experts by ``bus_share``); ``WORKBENCH_BUS_UNITS``
        overrides them (``bus.unit_shares_from_env``).
        Raises PlacementError before allocating anything when the placement does not fit, and
        AcceleratorMemoryError / LoadCancelled after freeing what was loaded.
        """
        try:
            device = torch.device(device)
        except RuntimeError:
            raise WorkbenchError(f"unknown device {device!r}: use 'cpu' or 'cuda' (or 'cuda:N')") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise WorkbenchError("CUDA is not available (no NVIDIA GPU, or this PyTorch was built without CUDA); "
                                 "use device 'cpu'")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        placement = placement if placement is not None else Placement()
        args = ModelArgs.from_config(inventory.family, inventory.config)
        if max_context < 1:
            raise WorkbenchError(f"max_context must be at least 1 token, not {max_context}")
        capped = vram_budget is not None and device.type == "cuda"  # a budget the caller set: held to it
        if vram_budget is None and device.type == "cuda":  # free memory less the activation buffers
            from workbench.core.memory import CUDA_CONTEXT_BYTES, gpu_runtime_overhead

            activations = gpu_runtime_overhead(inventory, max_context) - CUDA_CONTEXT_BYTES
            vram_budget = max(0, torch.cuda.mem_get_info(device)[0] - activations)
        dtype_bytes = torch.empty((), dtype=dtype).element_size()
        bus_share = bus.fraction_from_env() if bus_share is None else min(1.0, max(0.0, float(bus_share)))
        keeps = keeps_blocks(inventory, args, cpu_format)
        bus_bytes = 0 if cpu_format is not None else _bus_bytes(inventory, args, placement, device, dtype, bus_share,
                                                                  keeps)
        dense_kept = keeps_dense(inventory, device)
        predicted = check_placement(inventory, args, placement, 1, dtype_bytes, max_context, vram_budget, bus_bytes,
                                    keeps, dense_kept)
        self = object.__new__(cls)
        self.inventory, self.args, self.device, self.dtype = inventory, args, device, dtype
        self.max_context, self.vocab_size = max_context, args.vocab
        self.predicted = predicted
        self._lock = threading.RLock()
        self.decode_mode = os.environ.get("WORKBENCH_DECODE", "auto")
        self.served_mode = _served_mode(os.environ.get("WORKBENCH_SERVED", "auto"))
        self._decoder = None
        self._bus, self.bus_share, self._keeps_blocks, self._keeps_dense = None, bus_share, keeps, dense_kept
        self.unit_shares = bus.unit_shares_from_env(unit_shares, inventory.spec.n_layers)
        self.prompt_pair_reads = _pair_reads_from_env()
        self.host_clock: HostClock | None = None  # record_host
        self._reader = WeightReader(inventory)
        self._fw = FamilyWeights(self._reader, args)
        self.cpu_format, self._pool = cpu_format, None
        if cpu_format is not None:
            from .cpu_formats import ExpertPool, available_formats

            if cpu_format not in available_formats():
                raise WorkbenchError(f"CPU weight format {cpu_format!r} is not available here; "
                                     f"available: {', '.join(available_formats())}")
            self._pool = ExpertPool(cpu_workers)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cpu-experts")
        total = sum(u.nbytes for u in inventory.units.values())
        loader = _Loader(device, dtype, total, progress, cancel, self._fw, dense_kept)
        failure = None
        try:
            self._build(loader, placement)
        except torch.OutOfMemoryError as exc:
            failure = AcceleratorMemoryError(
                f"out of memory on {device} while loading {loader.unit}; freed everything loaded so far "
                f"(try a placement with fewer units on the accelerator or a shorter context): {str(exc)[:160]}"
            )
        except WorkbenchError as exc:  # cancelled, or a file that does not hold what its header says
            failure = exc
        except RuntimeError as exc:
            if not _is_host_oom(exc):
                self._free()
                raise
            failure = HostMemoryError(
                f"out of host memory while loading {loader.unit}; freed everything loaded so far "
                f"(try a placement with fewer experts on the CPU, or a CPU format such as int8)")
        except BaseException:
            self._free()
            raise
        if failure is not None:  # outside the except block: no traceback keeps tensors alive
            self._free()
            raise failure.with_traceback(None)
        self.placement = placement.copy()
        # the fraction of the GPU's memory PyTorch may reserve (``budget.cap_reserved``); None: no cap
        self.memory_cap = cap_reserved(device, vram_budget) if capped else None
        self._warned_cap = False
        self._retries_at_load = torch.cuda.memory_stats(device).get("num_alloc_retries", 0) if capped else 0
        if device.type == "cuda":  # host telemetry reports the pinned memory of the engine loaded last
            from workbench.telemetry import host

            host.set_pinned_bytes_provider(self.pinned_bytes)
        log.info("loaded %s on %s: %s", inventory.path.name, device, self.memory_report())
        return self

    def _build(self, loader: _Loader, placement: Placement) -> None:
        a, fw, place, dev = self.args, self._fw, loader.place, self.device
        units = self.inventory.units
        nbytes = {k: u.nbytes for k, u in units.items()}
        self.layers = []
        self.rope = Rope(a.rope, a.head_dim, a.max_position, self.max_context, dev, fw.rope_factors())
        self.counts = torch.zeros(a.n_layers, max(1, a.n_experts), dtype=torch.int64, device=dev)
        self.caches = []
        loader.begin(UnitKey(None, "embed"), nbytes.get(UnitKey(None, "embed"), 0))
        self.embed = loader.weight("embed")
        self.experts: dict[int, LayerExperts] = {}
        for layer in range(a.n_layers):
            loader.begin(UnitKey(layer, "attn"), nbytes.get(UnitKey(layer, "attn"), 0))
            roles = _MLA_ROLES if a.mla else _ATTN_ROLES
            w = {role: loader.weight(role, layer) for role in roles if fw.has(role, layer)}
            if a.mla:
                cache = LatentCache(self.max_context, a.mla["kv_lora_rank"], a.mla["rope"], dev, self.dtype)
                attn = MlaAttention(a, layer, w, cache)
            else:
                cache = KVCache(self.max_context, a.n_kv_heads, a.head_dim, dev, self.dtype,
                                span=a.window[layer] or a.chunk[layer])  # windowed layers keep a ring
                attn = Attention(a, layer, w, cache)
            self.caches.append(cache)
            loader.begin(UnitKey(layer, "norm"), nbytes.get(UnitKey(layer, "norm"), 0))
            attn_norm, ffn_norm = place(fw.get("attn_norm", layer)), place(fw.get("ffn_norm", layer))
            if layer in a.moe_layers:
                ffn = self._build_moe(loader, placement, layer)
            else:
                loader.begin(UnitKey(layer, "dense_mlp"), nbytes.get(UnitKey(layer, "dense_mlp"), 0))
                ffn = DenseMlp(*(loader.weight(r, layer) for r in ("mlp_gate", "mlp_up", "mlp_down")))
            self.layers.append(Layer(attn, attn_norm, ffn_norm, ffn, a.rms_eps))
        loader.begin(UnitKey(None, "norm"), nbytes.get(UnitKey(None, "norm"), 0))
        self.norm = place(fw.get("norm"))
        loader.begin(UnitKey(None, "lm_head"), nbytes.get(UnitKey(None, "lm_head"), 0))
        self.lm_head = loader.weight("lm_head") if fw.has("lm_head") else self.embed

    def _build_moe(self, loader: _Loader, placement: Placement, layer: int) -> MoeBlock:
        a, fw, place = self.args, self._fw, loader.place
        nbytes = {k: u.nbytes for k, u in self.inventory.units.items() if k.layer == layer}
        loader.begin(UnitKey(layer, "router"), nbytes.get(UnitKey(layer, "router"), 0))
        f32 = torch.float32 if a.family.startswith("deepseek") else None  # DeepSeek routes in float32
        router = place(fw.get("router", layer), f32)
        router_bias = place(fw.get("router_bias", layer)) if fw.has("router_bias", layer) else None
        score_bias = place(fw.get("score_bias", layer), torch.float32) if fw.has("score_bias", layer) else None
        shared = shared_router = None
        if fw.has("shared_gate", layer):
            loader.begin(UnitKey(layer, "shared"), nbytes.get(UnitKey(layer, "shared"), 0))
            shared = DenseMlp(*(loader.weight(r, layer) for r in ("shared_gate", "shared_up", "shared_down")))
            if fw.has("shared_router", layer):
                shared_router = place(fw.get("shared_router", layer))
        experts = self._build_experts(loader, placement, layer)
        return MoeBlock(a, layer, router, experts, shared, shared_router, self.counts, router_bias, score_bias)

    def _build_experts(self, loader: _Loader, placement: Placement, layer: int,
                       source: LayerExperts | None = None) -> LayerExperts:
        a = self.args
        tiers = []
        for e in range(a.n_experts):
            asg = placement.get(UnitKey(layer, "expert", e))
            tiers.append(RESIDENT if is_gpu(asg.tier) else STREAM if asg.mode == "stream" else COMPUTE)
        act = ("clamped_swiglu", *a.swiglu) if a.expert_act == "clamped_swiglu" else ("silu",)
        lx = LayerExperts(layer, a.n_experts, self.device, self.dtype, self._worker, placement.stream_slots,
                          act, a.expert_bias)
        shape13, shape2 = (2 * a.expert_ffn, a.hidden), (a.hidden, a.expert_ffn)
        lx.prompt_pair_reads, lx.clock = self.prompt_pair_reads, self.host_clock
        self.experts[layer] = lx  # reachable for _free() if a later allocation fails
        loader.unit = UnitKey(layer, "expert", 0)
        fmt = self._kept_format(layer)
        kept_res = RESIDENT in tiers and fmt is not None
        kept_cpu = COMPUTE in tiers and fmt is not None and self._cpu_block_kernel()
        for tier in (RESIDENT, COMPUTE, STREAM):
            kept = (tier == COMPUTE and kept_cpu) or (tier == RESIDENT and kept_res)
            lx.alloc_tier(tier, 0 if kept else tiers.count(tier), shape13, shape2)
        if kept_cpu:
            lx.alloc_kept(fmt, COMPUTE, tiers.count(COMPUTE), shape13, shape2)
        if kept_res:
            lx.alloc_kept(fmt, RESIDENT, tiers.count(RESIDENT), shape13, shape2)
        rows = [0, 0, 0]
        units = self.inventory.units
        for e, tier in enumerate(tiers):
            key = UnitKey(layer, "expert", e)
            loader.begin(key, units[key].nbytes if key in units else 0)
            if (tier == COMPUTE and kept_cpu) or (tier == RESIDENT and kept_res):  # the file's blocks as they are
                b = (self._fw.expert_biases(layer, e) or {}) if lx.bias else {}
                lx.put_kept(e, rows[tier], self._fw.expert_blocks(layer, e), tier, b.get("b13"), b.get("b2"))
            elif source is not None:  # moving between tiers: copy from where the expert is now
                lx.put(e, tier, rows[tier], *source.weights(e))
            else:
                w = self._fw.expert(layer, e)
                b = self._fw.expert_biases(layer, e) or {}
                lx.put(e, tier, rows[tier], w["w13"], w["w2"], b.get("b13"), b.get("b2"))
            rows[tier] += 1
        lx.finish()
        if self.cpu_format is not None and rows[COMPUTE]:
            self._attach_cpu_kernel(lx)
        elif rows[COMPUTE] and self.dtype in (torch.bfloat16, torch.float16, torch.float32) and not kept_cpu:
            lx.fused_cpu = self._fused_cpu_kernel(loader)
        self._attach_bus(lx)
        return lx

    def _attach_bus(self, lx: LayerExperts) -> None:
        """On CUDA, let decode steps send some of ``lx``'s CPU-selected experts over the bus
        (``bus.BusShare``): its CPU stacks are page-locked in place."""
        if (self.device.type != "cuda" or not lx.n_tier[COMPUTE] or lx.cpu_kernel is not None
                or lx.act[0] not in prefill_kernels.ACTS or not gpu_kernels.available()):
            return
        if self._bus is None:
            fraction = self.bus_share
            if fraction <= 0:
                return
            a = self.args
            self._bus = bus.BusShare(self.device, self.dtype, a.n_experts, (2 * a.expert_ffn, a.hidden),
                                     (a.hidden, a.expert_ffn), fraction)
        if self._bus.pin(lx, lx.bus_stacks(), lx.kept_layout(), lx.bias):
            lx.bus = self._bus
            lx.bus_units = float(self.unit_shares[lx.layer]) if self.unit_shares is not None else 0.0
            log.debug("layer %d: bus share %.2f of its CPU-selected experts", lx.layer, self._bus.fraction)
        else:
            log.warning("layer %d: CPU experts not page-locked, no bus share", lx.layer)

    def _kept_format(self, layer: int) -> tuple[str, str] | None:
        """The formats ``(gate/up, down)`` ``layer``'s routed experts stay in (see ``keeps_blocks``):
        a half (Q8_0) to a quarter (Q4_K) of bf16's bytes to hold on the GPU, for the CPU to read and
        for the bus to carry."""
        if not self._keeps_blocks:
            return None
        w = self._fw.expert_blocks(layer, 0)
        return None if w is None else w["fmt"]

    @staticmethod
    def _cpu_block_kernel() -> bool:
        from . import cpu_kernel

        return cpu_kernel.available()

    @staticmethod
    def _fused_cpu_kernel(loader: _Loader) -> bool:
        """Whether the fused CPU decode kernel runs here (built on first use: tens of seconds, once
        per machine; the loader's progress says so)."""
        from . import cpu_kernel

        if loader.progress is not None and not cpu_kernel.disabled() and cpu_kernel.unavailable_reason() is None:
            loader.progress(loader.done, loader.total, "CPU expert kernel (built once per machine)")
        return cpu_kernel.available()

    def _attach_cpu_kernel(self, lx: LayerExperts) -> None:
        from .cpu_formats import CpuExperts, supports

        a, fmt = self.args, self.cpu_format
        if lx.bias or lx.act[0] != "silu":
            log.warning("CPU format %s does not take %s experts (biases, clamped SwiGLU); layer %d computes "
                        "them in %s", fmt, a.family, lx.layer, self.dtype)
            return
        if not (supports(fmt, 2 * a.expert_ffn, a.hidden) and supports(fmt, a.hidden, a.expert_ffn)):
            log.warning("CPU format %s does not take experts of %d x %d; layer %d computes them in %s",
                        fmt, a.hidden, a.expert_ffn, lx.layer, self.dtype)
            return
        lx.use_cpu_kernel(CpuExperts.from_stacked(lx.w13[COMPUTE], lx.w2[COMPUTE], fmt, self._pool))

    def _drop_decoder(self) -> None:
        """Forget the decode step (its graphs and decode server hold the expert stacks)."""
        if self._decoder is not None:
            self._decoder.close()
            self._decoder = None

    def _free(self) -> None:
        self._drop_decoder()
        if getattr(self, "_bus", None) is not None:
            self._bus.close()  # page locks off before the stacks go
            self._bus = None
        for name in ("layers", "experts", "caches", "embed", "norm", "lm_head", "rope", "counts"):
            self.__dict__.pop(name, None)
        self._worker.shutdown(wait=False)
        if getattr(self, "_pool", None) is not None:
            self._pool.close()
            self._pool = None
        self._reader.close()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # -- running ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, start_pos: int, last_only: bool = False) -> torch.Tensor:
        """Logits ``[T, vocab]`` (float32) for ``input_ids [T]`` at positions ``start_pos..start_pos+T-1``;
        ``last_only``: only the last position's, ``[1, vocab]`` (a prompt's logits take
        ``T * vocab * 6`` bytes of GPU memory otherwise: 470 MB for 512 tokens of a 152k vocabulary).

        Writes those positions of the KV cache; positions after them are ignored until rewritten.
        """
        ids = torch.as_tensor(input_ids).reshape(-1)
        T = ids.shape[0]
        if T == 0:
            raise WorkbenchError("forward needs at least one token")
        if start_pos < 0 or start_pos + T > self.max_context:
            raise WorkbenchError(
                f"{start_pos + T} tokens do not fit the context of {self.max_context} tokens"
                f" ({T} new tokens after {start_pos})"
            )
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            raise WorkbenchError(f"token ids must be in 0..{self.vocab_size - 1}")
        with self._lock:
            if not hasattr(self, "layers"):
                raise WorkbenchError("the engine was closed")
            if not self.resumable(start_pos):
                ring = next(c for c in self.caches if not c.resumable(start_pos))
                raise WorkbenchError(
                    f"this model's sliding-window / chunked attention layers keep only the last {ring.size} "
                    f"positions, and going back to position {start_pos} lost some it needs; go on from "
                    f"position {ring.next_pos} or start again from 0")
            try:
                if self.host_clock is not None and T > 1:
                    self.host_clock.start()
                out = self._forward(ids, start_pos, last_only)
                if T > 1 and self.memory_cap is not None:
                    self._warn_at_cap()
                return out
            except torch.OutOfMemoryError:
                pass  # reported below, outside the except block, once the failed step's activations are freed
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        raise AcceleratorMemoryError(
            f"out of memory on {self.device} computing {T} tokens at once; feed the prompt in smaller "
            f"pieces or keep fewer experts resident (positions {start_pos}..{start_pos + T - 1} of the "
            f"KV cache must be written again)")

    def _warn_at_cap(self) -> None:
        """Once per engine: warn when PyTorch had to free its cache to stay within the VRAM budget's
        cap (each time synchronizes the GPU: a budget this tight costs speed)."""
        if self._warned_cap:
            return
        retries = torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0) - self._retries_at_load
        if retries > 0:
            self._warned_cap = True
            log.warning("the VRAM budget is tight: PyTorch freed its cached GPU memory %d times to stay within "
                        "%.2f GiB, which slows prompts and decoding; a larger budget or fewer resident experts "
                        "avoid it", retries, self.memory_cap * torch.cuda.get_device_properties(self.device)
                        .total_memory / 2**30)

    def pinned_bytes(self) -> int:
        """Bytes of page-locked host memory the engine holds (streamed experts' host copies, the CPU
        tier's stacks with a bus share, staging)."""
        return sum(lx.pinned_bytes for lx in list(getattr(self, "experts", {}).values()))

    def resumable(self, start_pos: int) -> bool:
        """Whether a forward pass may start at ``start_pos`` with what the KV cache holds: always,
        except going back on a model whose windowed layers keep a ring of their last positions
        (``model.KVCache``); position 0 always works."""
        return all(c.resumable(start_pos) for c in self.caches if isinstance(c, KVCache))

    def _forward(self, ids: torch.Tensor, start_pos: int, last_only: bool = False) -> torch.Tensor:
        T = ids.shape[0]
        for c in self.caches:  # host bookkeeping of the rings (decode graphs write them on the device)
            if isinstance(c, KVCache):
                c.next_pos = start_pos + T
        mode = self.decode_mode
        if T == 1 and mode != "eager" and (mode == "static" or self.device.type == "cuda"):
            if self._decoder is None:
                from .graphs import DecodeStep

                self._decoder = DecodeStep(self, capture=self.device.type == "cuda" and mode != "static")
            return self._decoder(int(ids[0]), start_pos)
        ids = ids.to(self.device)
        pos = torch.arange(start_pos, start_pos + T, device=self.device)
        x = embedding(ids, self.embed)
        for layer in self.layers:
            x = layer(x, pos, start_pos, self.rope)
        if last_only:
            x = x[-1:]
        x = rms_norm(x, self.norm, self.args.rms_eps)
        return linear(x, self.lm_head).float()

    # -- statistics ------------------------------------------------------------------------------

    def routing_counts(self) -> np.ndarray:
        """How often each expert was selected since the last reset: ``[n_layers, n_experts]`` int64.

        One device->host copy; call it a few times per second, not per token.
        """
        return self.counts.to("cpu").numpy().copy()

    def reset_routing_counts(self) -> None:
        self.counts.zero_()

    def expert_stats(self, half_life: float = 256.0):
        """The routing counts so far as a ``core.stats.ExpertStats`` (tokens = busiest layer's picks / top_k)."""
        from workbench.core.stats import ExpertStats

        stats = ExpertStats(self.args.n_layers, max(1, self.args.n_experts), max(1, self.args.top_k), half_life)
        stats.add(self.routing_counts())
        return stats

    def stream_stats(self) -> dict[int, tuple[int, int]]:
        """Per MoE layer with streamed experts: ``(cache hits, fetches)`` since loading."""
        return {layer: (lx.hits, lx.misses) for layer, lx in self.experts.items() if lx.cache_w13 is not None}

    # -- placement -------------------------------------------------------------------------------

    def record_host(self, clock: HostClock | None) -> None:
        """Tell ``clock`` the host time of every hybrid layer of the prompts from now on (None: stop)."""
        self.host_clock = clock
        for lx in self.experts.values():
            lx.clock = clock

    def set_prompt_pair_reads(self, pair_reads: float | None) -> None:
        """What a prompt's further token of a CPU-tier expert costs the fused CPU kernel, in reads of
        the expert (``costmodel.model_prompt_pair_reads`` from a calibrated profile; None: a read
        per token, the rule without a measurement). Prompts split their CPU-tier experts between the
        CPU and the bus (``costmodel.prefill_fetch``) and between the kernel and torch's GEMM
        (``costmodel.fused_prompt_limit``) by it. ``WORKBENCH_PROMPT_PAIR_READS``, when set, wins."""
        env = _pair_reads_from_env()
        self.prompt_pair_reads = env if env is not None else pair_reads
        for lx in self.experts.values():
            lx.prompt_pair_reads = self.prompt_pair_reads

    def apply_placement(self, placement: Placement, progress: Progress | None = None, cancel=None) -> None:
        """Move routed experts between tiers without reloading the model: each layer whose expert
        assignments changed gets new tier stacks filled from the old ones (not from the file), one
        layer at a time. The new placement is checked first (PlacementError leaves the engine as it
        was). Out of memory (AcceleratorMemoryError) or cancel (LoadCancelled) midway stops after the
        layers already moved; ``self.placement`` then says where every expert really is.
        """
        vram = torch.cuda.mem_get_info(self.device)[0] + self.memory_report()["gpu:0"] \
            if self.device.type == "cuda" else None
        dtype_bytes = torch.empty((), dtype=self.dtype).element_size()
        check_placement(self.inventory, self.args, placement, 1, dtype_bytes, self.max_context, vram,
                        0 if self._bus is not None or self.cpu_format is not None
                        else _bus_bytes(self.inventory, self.args, placement, self.device, self.dtype,
                                        self.bus_share, self._keeps_blocks),
                        self._keeps_blocks, self._keeps_dense)
        changed = [layer for layer in self.args.moe_layers
                   if placement.stream_slots != self.placement.stream_slots
                   or any(placement.get(UnitKey(layer, "expert", e)) != self.placement.get(UnitKey(layer, "expert", e))
                          for e in range(self.args.n_experts))]
        total = sum(self.inventory.units[k].nbytes for layer in changed for k in self.inventory.expert_keys(layer))
        loader = _Loader(self.device, self.dtype, total, progress, cancel)
        done: list[int] = []
        failure = None
        with self._lock:
            self._drop_decoder()  # its graphs hold the old expert stacks
            for layer in changed:
                block = self.layers[layer].ffn
                old = block.experts
                try:
                    block.experts = self._build_experts(loader, placement, layer, source=old)
                except torch.OutOfMemoryError:
                    failure = AcceleratorMemoryError(
                        f"out of memory on {self.device} while moving {loader.unit}; layers "
                        f"{', '.join(map(str, done)) or 'none'} moved, the others kept their experts where they were")
                except WorkbenchError as exc:
                    failure = exc
                if failure is not None:
                    self.experts[layer] = block.experts  # the old stacks, still in use
                    break
                if self._bus is not None:
                    self._bus.release(old)
                done.append(layer)  # the old stacks are freed by reference counting, no collection needed
            if self._bus is not None and not self._bus.registered:  # no layer shares the bus any more
                self._bus.close()
                self._bus = None
            moved = self.placement.copy()
            for layer in done:
                for key in self.inventory.expert_keys(layer):
                    moved.set(key, placement.get(key))
            if len(done) == len(changed):
                moved.stream_slots = placement.stream_slots
            self.placement = moved
        if failure is not None:
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            raise failure.with_traceback(None)

    # -- memory ----------------------------------------------------------------------------------

    def memory_report(self) -> dict[str, int]:
        """Bytes allocated by the engine per tier: ``{"gpu:0": accelerator, "cpu": host}``.

        With ``device="cpu"`` the accelerator tier still reports as ``gpu:0``. File-backed views of
        weights (mmap, no copy) count as allocated.
        """
        return {tier: sum(m["weights"].values()) + m["kv_cache"] + m["stream_cache"]
                for tier, m in self.memory_breakdown().items()}

    def memory_breakdown(self) -> dict[str, dict]:
        """Bytes per tier by component, shaped like ``core.memory.TierMemory``:
        ``{"gpu:0": {"weights": {kind: bytes}, "kv_cache": bytes, "stream_cache": bytes}, "cpu": {...}}``
        (kinds as in ``core.units.KINDS``; tied embeddings count once, under ``embed``)."""
        out = {t: {"weights": dict.fromkeys(KINDS, 0), "kv_cache": 0, "stream_cache": 0} for t in ("gpu:0", "cpu")}
        acc = out["gpu:0"]["weights"]
        seen: set[int] = set()

        def add(kind: str, *tensors: torch.Tensor | None) -> None:
            for t in tensors:
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    acc[kind] += weight_bytes(t)

        add("embed", self.embed)
        add("norm", self.norm)
        add("lm_head", self.lm_head)
        for layer in self.layers:
            add("attn", *layer.attn.w.values())
            add("norm", layer.attn_norm, layer.ffn_norm)
            out["gpu:0"]["kv_cache"] += layer.attn.cache.nbytes
            ffn = layer.ffn
            if isinstance(ffn, DenseMlp):
                add("dense_mlp", ffn.gate, ffn.up, ffn.down)
                continue
            add("router", ffn.router, ffn.router_bias, ffn.score_bias)
            if ffn.shared is not None:
                add("shared", ffn.shared.gate, ffn.shared.up, ffn.shared.down, ffn.shared_router)
            n = ffn.experts.nbytes
            acc["expert"] += n["accelerator"] - n["stream_cache"]
            out["gpu:0"]["stream_cache"] += n["stream_cache"]
            out["cpu"]["weights"]["expert"] += n["cpu"]
        if self._bus is not None:
            out["gpu:0"]["stream_cache"] += self._bus.nbytes
        return out

    def close(self) -> None:
        """Free everything; the engine cannot be used afterwards. Waits for a step in progress on
        another thread (its next ``forward`` raises WorkbenchError)."""
        from workbench.telemetry import host

        with self._lock:
            host.clear_pinned_bytes_provider(self.pinned_bytes)
            self._free()
            if getattr(self, "memory_cap", None) is not None:
                uncap_reserved(self.device)
                self.memory_cap = None
