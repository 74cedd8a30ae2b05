"""The routed experts of one MoE layer, spread over three tiers.

- ``resident``: stacked on the accelerator, ``w13 [R, 2I, H]`` / ``w2 [R, H, I]``, with a local index
  map global expert -> row; decode gathers the selected rows (no host sync), prefill groups tokens
  per expert so each expert's weights are read once per step.
- ``compute``: stacked CPU tensors; the CPU worker thread computes them while the accelerator works
  on the other tiers (activations travel, not weights).
- ``stream``: CPU copies (pinned when the accelerator is CUDA) fetched on demand into an accelerator
  cache of ``slots`` rows per layer, least recently used evicted first.

An expert computes ``w * down(silu(gate(x)) * up(x))`` or, for Llama 4 (``scale_input``),
``down(silu(gate(w x)) * up(w x))``.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Executor
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from workbench.core.costmodel import fused_prompt_limit, prefill_fetch

from . import blocks, cpu_kernel, gpu_kernels, hostmem, prefill_kernels
from .packed import dequantize_blocks

RESIDENT, COMPUTE, STREAM = 0, 1, 2
TIER_NAMES = ("resident", "compute", "stream")
GATHER_MAX_ROWS = 16
"""Up to this many (token, expert) pairs the resident tier gathers weights instead of grouping."""


def activate(h: torch.Tensor, act: tuple) -> torch.Tensor:
    """``h [n, 2I]`` (gate then up) -> ``[n, I]``. ``act``: ``("silu",)`` for SwiGLU or
    ``("clamped_swiglu", alpha, limit)`` (gpt-oss: clamped gate/up, ``(up + 1) * gate * sigmoid(alpha gate)``)."""
    gate, up = h.chunk(2, dim=-1)
    if act[0] == "silu":
        return F.silu(gate) * up
    alpha, limit = act[1], act[2]
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def expert_ffn(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, b13=None, b2=None, act=("silu",)) -> torch.Tensor:
    """One expert: ``x [n, H]``, ``w13 [2I, H]``, ``w2 [H, I]`` (optional biases ``[2I]``, ``[H]``) -> ``[n, H]``."""
    return F.linear(activate(F.linear(x, w13, b13), act), w2, b2)


class KeptStacks(NamedTuple):
    """A tier's experts kept as GGUF blocks, for the grouped prompt kernels: ``args`` as
    ``prefill_kernels.swiglu_grouped`` takes them (``w13, w2`` and for Q8_0 ``d13, d2``), ``fmt`` (gate/up,
    down), and ``dequant(rows=None)`` giving float stacks ``(w13, w2)`` of all rows or of ``rows`` (an
    index tensor on the blocks' device) where the kernels cannot run."""

    args: tuple
    fmt: tuple
    dequant: Callable


class _PerExpert:
    """Kept stacks as float rows one expert at a time, for the per-expert loops (``w13[r]``, then
    ``w2[r]``): a tier is never dequantized whole (gpt-oss's MXFP4 experts take 3.8x their bytes in
    bf16), and only the expert in use is held."""

    def __init__(self, kept: KeptStacks):
        self.kept, self.row, self.w = kept, None, None
        self.n = kept.args[0].shape[0]

    def get(self, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        if r != self.row:
            self.w = None  # the previous expert's floats go before the next one's are made
            w13, w2 = self.kept.dequant(torch.tensor([r]))
            self.row, self.w = r, (w13[0], w2[0])
        return self.w


class _Half:
    """``w13`` (``half`` 0) or ``w2`` (1) of a ``_PerExpert``, indexed like a stack."""

    def __init__(self, per: _PerExpert, half: int):
        self.per, self.half, self.shape = per, half, (per.n,)

    def __getitem__(self, r: int) -> torch.Tensor:
        return self.per.get(int(r))[self.half]


def _kernel_or_stacks(x, n: int, least: int, w13, w2, b13, act, kept: KeptStacks | None):
    """``(w13, w2, kept)``: ``kept`` when the grouped kernels read its blocks for ``n`` pairs (more than
    ``least``), else float stacks (``kept`` given: its experts dequantized one at a time, as used)."""
    if kept is None:
        return w13, w2, None
    if n > least and prefill_kernels.takes_blocks(x, kept.fmt, act, b13 is not None):
        return None, None, kept
    per = _PerExpert(kept)
    return _Half(per, 0), _Half(per, 1), None


def grouped(x: torch.Tensor, rows: torch.Tensor, scale: torch.Tensor, w13: torch.Tensor | None,
            w2: torch.Tensor | None, scale_input: bool, b13: torch.Tensor | None = None,
            b2: torch.Tensor | None = None, act: tuple = ("silu",), kept: KeptStacks | None = None) -> torch.Tensor:
    """Expert outputs for pairs ``(x[i], rows[i])``, weighted by ``scale [n]``; ``rows`` index ``w13``
    (or, with ``kept`` instead of ``w13``/``w2``, the kept blocks' stacks).

    ``x [n, H]`` -> ``[n, H]``. Small ``n``: one gather + batched matmul, no host sync. Larger ``n``:
    pairs sorted by expert, every expert in two grouped kernels where they run, over a tile table
    built on the device (no host sync); else one matmul per expert, the counts read on the host.
    """
    n = x.shape[0]
    if kept is not None and n <= GATHER_MAX_ROWS:  # a few pairs: only their rows, dequantized
        w13, w2 = kept.dequant(rows)
        if b13 is not None:  # the biases of those rows, in the same order
            b13, b2 = b13[rows], b2[rows]
        rows, kept = torch.arange(n, device=rows.device), None
    w13, w2, kept = _kernel_or_stacks(x, n, GATHER_MAX_ROWS, w13, w2, b13, act, kept)
    scale = scale.to(x.dtype)[:, None]
    if n <= GATHER_MAX_ROWS:
        if scale_input:
            x = x * scale
        h = torch.bmm(w13[rows], x[:, :, None])[:, :, 0]  # [n, 2I]
        if b13 is not None:
            h = h + b13[rows]
        out = torch.bmm(w2[rows], activate(h, act)[:, :, None])[:, :, 0]  # [n, H]
        if b2 is not None:
            out = out + b2[rows]
        return out if scale_input else out * scale
    order = torch.argsort(rows, stable=True)
    xs = x[order]
    if scale_input:
        xs = xs * scale[order]
    ys = _sorted_products(xs, rows, order, w13, w2, b13, b2, act, kept).out
    out = torch.empty_like(x)
    out[order] = ys if scale_input else ys * scale[order]
    return out


def grouped_tokens(x: torch.Tensor, k: int, rows: torch.Tensor, scale: torch.Tensor, w13: torch.Tensor | None,
                   w2: torch.Tensor | None, scale_input: bool, b13: torch.Tensor | None = None,
                   b2: torch.Tensor | None = None, act: tuple = ("silu",), kept: KeptStacks | None = None
                   ) -> torch.Tensor:
    """Each token's weighted sum over its ``k`` experts: ``x [T, H]``, ``rows``/``scale [T * k]`` (token
    ``t``'s pairs at ``t * k ..``) -> ``[T, H]``; what ``grouped`` over each pair's copy of its token
    row, summed per token, gives. Many pairs: the sorted pairs gather their tokens' rows once; the
    down kernel weights each output and stores it at its pair's place, and each token's ``k`` rows
    are summed in one reduction (no atomics); where that store is off, the sorted outputs are weighted
    and added into their tokens (``index_add_``). No ``[T * k, H]`` copy of the tokens in pair order."""
    T, n = x.shape[0], rows.shape[0]
    w13, w2, kept_k = _kernel_or_stacks(x, n, GATHER_MAX_ROWS, w13, w2, b13, act, kept)
    if n <= GATHER_MAX_ROWS or kept_k is None and not isinstance(w13, torch.Tensor):
        token = torch.arange(T, device=x.device).repeat_interleave(k)
        y = grouped(x[token], rows, scale, *((w13, w2) if kept is None else (None, None)), scale_input, b13, b2,
                    act, kept=kept)
        return torch.zeros_like(x).index_add_(0, token, y)
    order = torch.argsort(rows, stable=True)
    token = torch.div(order, k, rounding_mode="floor")  # each sorted pair's token
    xs = x[token]
    scale = scale.to(x.dtype)[order]
    if scale_input:
        xs = xs * scale[:, None]
    ys = _sorted_products(xs, rows, order, w13, w2, b13, b2, act, kept_k, place=True,
                          weights=None if scale_input else scale)
    if ys.placed:  # back in pair order (and weighted) by the kernels: each token's k rows summed, no atomics
        return ys.out.view(T, k, -1).sum(1)
    out = ys.out if scale_input else ys.out * scale[:, None]
    return torch.zeros_like(x).index_add_(0, token, out)


class _Products(NamedTuple):
    out: torch.Tensor
    """``[n, H]``: unweighted in the sorted pairs' order, or (``placed``) weighted in the pairs' own order."""
    placed: bool


def _sorted_products(xs: torch.Tensor, rows: torch.Tensor, order: torch.Tensor, w13, w2, b13, b2, act,
                     kept: KeptStacks | None, place: bool = False, weights: torch.Tensor | None = None
                     ) -> _Products:
    """Expert outputs ``[n, H]`` of the pairs sorted by row (``xs [n, H]``, ``order [n]`` from
    ``argsort(rows)``): the grouped kernels over a tile table where they run, else one product per
    expert (its pairs counted on the host), unweighted in sorted order. With ``place`` the kernels
    store each output at its pair's own place (``order``) instead, times its weight (``weights``, the
    sorted pairs' ``[n]``, if given), where they take a device tile table (``placed``)."""
    n = xs.shape[0]
    n_rows = (w13 if kept is None else kept.args[0]).shape[0]
    # pairs per row, counted in place (bincount on CUDA reads the largest row back first)
    counts = torch.zeros(n_rows, dtype=torch.int64, device=rows.device).index_add_(
        0, rows, torch.ones(rows.shape, dtype=torch.int64, device=rows.device))
    if kept is not None or (isinstance(w13, torch.Tensor)
                            and prefill_kernels.usable_for(xs, w13, w2, b13, b2, act)):  # every expert in two kernels
        device = prefill_kernels.device_tiles()
        if device:  # built on the device: no host sync
            tiles = prefill_kernels.device_tile_table(counts, n)
        else:
            c = counts.cpu().numpy()
            used = np.nonzero(c)[0]
            tiles = prefill_kernels.tile_table((np.cumsum(c) - c)[used], c[used], used)
        stacks = (w13, w2) if kept is None else kept.args
        kw = dict(fmt=None if kept is None else kept.fmt, b13=b13, b2=b2, act=act)
        if place and device:  # each output weighted and stored at its pair's place by the down kernel
            ys = prefill_kernels.placed_or_none(xs, tiles, order, weights, *stacks, **kw)
            if ys is not None:
                return _Products(ys, True)
        ys = prefill_kernels.run_or_none(xs, tiles, *stacks, **kw)
        if ys is not None:
            return _Products(ys, False)
        if kept is not None:
            per = _PerExpert(kept)
            w13, w2 = _Half(per, 0), _Half(per, 1)
    parts = []  # one product per expert: the counts read on the host
    start = 0
    for r, c in enumerate(counts.tolist()):
        if c:
            parts.append(expert_ffn(xs[start:start + c], w13[r], w2[r], None if b13 is None else b13[r],
                                    None if b2 is None else b2[r], act))
            start += c
    return _Products(torch.cat(parts), False)


def one_token_on(x: torch.Tensor, ids: torch.Tensor, scale: torch.Tensor, rowmap: torch.Tensor,
                 stacks: list[torch.Tensor], fmt: tuple[str, str] | None, b13: torch.Tensor | None = None,
                 b2: torch.Tensor | None = None, act: tuple = ("silu",)) -> torch.Tensor:
    """``gpu_kernels.experts_one_token`` over a tier's stacks as ``LayerExperts`` holds them: float
    ``[w13, w2]`` (``fmt`` None) or kept blocks in ``fmt`` (Q8_0 ``[q13, d13, q2, d2]``, k-quants and
    MXFP4 ``[b13, b2]``), with gpt-oss's biases and activation. ``x [1, H]``, ``ids``/``scale [k]``,
    ``rowmap [E]`` -> ``[1, H]``."""
    return gpu_kernels.experts_one_token(x, ids, scale, rowmap, *blocks.kernel_args(fmt, stacks), fmt=fmt,
                                         b13=b13, b2=b2, act=act)


class LayerExperts:
    """Routed experts of one layer. Build with ``add`` per expert then ``finish``."""

    def __init__(self, layer: int, n_experts: int, device: torch.device, dtype: torch.dtype,
                 worker: Executor | None, slots: int = 0, act: tuple = ("silu",), bias: bool = False):
        self.layer = layer
        self.n_experts = n_experts
        self.device = device
        self.dtype = dtype
        self.worker = worker
        self.slots = slots
        self.tier = np.full(n_experts, -1, dtype=np.int8)
        self.local = np.full(n_experts, -1, dtype=np.int64)
        self._pending: dict[int, list[tuple[int, torch.Tensor, torch.Tensor]]] = {0: [], 1: [], 2: []}
        self.w13: list[torch.Tensor | None] = [None, None, None]  # per tier, stacked
        self.w2: list[torch.Tensor | None] = [None, None, None]
        self.b13: list[torch.Tensor | None] = [None, None, None]  # gpt-oss expert biases [n, 2I], [n, H]
        self.b2: list[torch.Tensor | None] = [None, None, None]
        self.act, self.bias = act, bias
        self._cpu_bias: tuple[torch.Tensor, torch.Tensor] | None = None  # compute tier's biases in float32
        self.cache_w13: torch.Tensor | None = None
        self.cache_w2: torch.Tensor | None = None
        self.cache_b13: torch.Tensor | None = None
        self.cache_b2: torch.Tensor | None = None
        self.cpu_kernel = None  # optional CPU-format kernel for the compute tier (cpu_formats.CpuExperts)
        self.kept: tuple[str, str] | None = None  # formats (gate/up, down) of experts kept in the file's blocks
        self.kept_cpu: list[torch.Tensor] | None = None  # compute tier's kept stacks: w13's tensors then w2's
        self.kept_res: list[torch.Tensor] | None = None  # resident tier likewise, on the accelerator
        self.fused_cpu = False  # the compute tier through cpu_kernel.moe_decode (set by the engine)
        self.bus = None  # bus.BusShare: decode sends some CPU-selected experts over the bus (set by the engine)
        self.bus_units = 0.0  # served decode's unit split: the bus's share of each CPU-tier pair's units (engine)
        self.prompt_pair_reads: float | None = None  # Engine.set_prompt_pair_reads
        self.clock = None  # hostclock.HostClock: prompts tell it their host time (Engine.record_host)
        self._cpu_wait_s, self._cpu_run_s, self._cpu_share = 0.0, 0.0, False  # this prompt layer's, for the clock
        self.fast_gpu = os.environ.get("WORKBENCH_GPU_KERNELS", "1") != "0"  # one-token resident experts in Triton
        self.cache_expert: list[int] = []
        self.lru: OrderedDict[int, int] = OrderedDict()  # expert -> cache slot, oldest first
        self.hits = 0
        self.misses = 0

    # -- building ----------------------------------------------------------------------------

    def alloc_tier(self, tier: int, count: int, shape13: tuple[int, int], shape2: tuple[int, int]) -> None:
        """Allocate the stacked tensors of ``tier`` for ``count`` experts (before ``put``)."""
        dev = self.device if tier == RESIDENT else torch.device("cpu")
        pin = tier == STREAM and self.device.type == "cuda"
        if tier == COMPUTE:  # read a few rows at a time: huge pages spare the page walks
            self.w13[tier] = hostmem.empty((count, *shape13), self.dtype)
            self.w2[tier] = hostmem.empty((count, *shape2), self.dtype)
        else:
            self.w13[tier] = torch.empty((count, *shape13), dtype=self.dtype, device=dev, pin_memory=pin)
            self.w2[tier] = torch.empty((count, *shape2), dtype=self.dtype, device=dev, pin_memory=pin)
        if self.bias:
            self.b13[tier] = torch.empty((count, shape13[0]), dtype=self.dtype, device=dev, pin_memory=pin)
            self.b2[tier] = torch.empty((count, shape2[0]), dtype=self.dtype, device=dev, pin_memory=pin)
        if tier == STREAM and count:
            n = max(1, self.slots)
            self.cache_w13 = torch.empty((n, *shape13), dtype=self.dtype, device=self.device)
            self.cache_w2 = torch.empty((n, *shape2), dtype=self.dtype, device=self.device)
            if self.bias:
                self.cache_b13 = torch.empty((n, shape13[0]), dtype=self.dtype, device=self.device)
                self.cache_b2 = torch.empty((n, shape2[0]), dtype=self.dtype, device=self.device)
            self.cache_expert = [-1] * n

    def alloc_kept(self, fmt: tuple[str, str], tier: int, count: int, shape13: tuple[int, int],
                   shape2: tuple[int, int]) -> None:
        """Keep ``tier``'s (COMPUTE or RESIDENT) ``count`` experts in the file's quantized blocks, gate
        and up in ``fmt[0]``, down in ``fmt[1]`` (``blocks.FORMATS``), instead of float stacks (before
        ``put_kept``): ``w13``'s tensors then ``w2``'s, each ``[count, ...]`` as ``blocks.alloc`` lays
        them out."""
        dev = self.device if tier == RESIDENT else None
        host = hostmem.empty if tier == COMPUTE else None
        p13 = blocks.alloc(fmt[0], (count,), *shape13, dev, host)
        parts = p13 + blocks.alloc(fmt[1], (count,), *shape2, dev, host)
        self.kept, self.n13 = tuple(fmt), len(p13)
        self.k13, self.k2 = shape13[1], shape2[1]
        if tier == COMPUTE:
            self.kept_cpu = parts
        else:
            self.kept_res = parts
        self.w13[tier] = self.w2[tier] = None
        if self.bias:  # gpt-oss: the biases as floats beside the blocks
            self.b13[tier] = torch.empty((count, shape13[0]), dtype=self.dtype, device=dev)
            self.b2[tier] = torch.empty((count, shape2[0]), dtype=self.dtype, device=dev)

    def put_kept(self, expert: int, row: int, w: dict, tier: int = COMPUTE, b13=None, b2=None) -> None:
        """Copy expert ``expert``'s blocks (``layouts.FamilyWeights.expert_blocks``: ``{"w13": (gate
        tensors, up tensors), "w2": down tensors}``) into row ``row`` of ``tier``; with expert biases
        (gpt-oss), ``b13 [2I]`` (or its halves) and ``b2 [H]``."""
        parts = self.kept_cpu if tier == COMPUTE else self.kept_res
        n = self.n13
        for dst, gate, up in zip(parts[:n], *w["w13"]):
            _copy_halves(dst[row], (gate, up))
        for dst, src in zip(parts[n:], w["w2"]):
            dst[row].copy_(src)
        if self.bias:
            _copy_halves(self.b13[tier][row], b13)
            self.b2[tier][row].copy_(b2)
            self._cpu_bias = None
        self.tier[expert] = tier
        self.local[expert] = row

    def _dequant(self, parts: list[torch.Tensor], rows=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Kept stacks ``parts`` (rows ``rows`` of them: host ids or an index tensor; or all) as float
        ``w13 [n, 2I, H]``, ``w2 [n, H, I]``."""
        if isinstance(rows, torch.Tensor):  # an index on the blocks' device: no host round trip
            parts = blocks.take(parts, rows.to(parts[0].device))
        elif rows is not None:
            parts = blocks.take(parts, torch.as_tensor(np.asarray(rows, dtype=np.int64), device=parts[0].device))
        n = self.n13
        return (dequantize_blocks(self.kept[0], parts[:n], self.k13, self.dtype),
                dequantize_blocks(self.kept[1], parts[n:], self.k2, self.dtype))

    def kept_layout(self) -> tuple | None:
        """``(formats, tensors of w13, K of w13, K of w2)`` of the CPU tier's kept blocks, or None."""
        return (self.kept, self.n13, self.k13, self.k2) if self.kept_cpu is not None else None

    def resident_kept(self) -> KeptStacks | None:
        """The resident tier's kept blocks for the grouped prompt kernels (None: float stacks)."""
        if self.kept_res is None:
            return None
        return KeptStacks(blocks.kernel_args(self.kept, self.kept_res), self.kept, lambda rows=None: self._dequant(self.kept_res, rows))

    def resident_stacks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The resident tier as float stacks ``w13 [R, 2I, H]``, ``w2 [R, H, I]`` (kept blocks:
        dequantized for this call)."""
        if self.kept_res is None:
            return self.w13[RESIDENT], self.w2[RESIDENT]
        return self._dequant(self.kept_res)

    def put(self, expert: int, tier: int, row: int, w13: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
            w2: torch.Tensor, b13=None, b2=None) -> None:
        """Copy expert ``expert``'s weights into row ``row`` of ``tier``'s stack: ``w13 [2I, H]`` or its
        halves ``(gate [I, H], up [I, H])``, ``w2 [H, I]``, and with expert biases ``b13 [2I]`` (or its
        halves) and ``b2 [H]`` (any dtype/device; converted on copy)."""
        _copy_halves(self.w13[tier][row], w13)
        self.w2[tier][row].copy_(w2)
        if self.bias:
            _copy_halves(self.b13[tier][row], b13)
            self.b2[tier][row].copy_(b2)
            self._cpu_bias = None
        self.tier[expert] = tier
        self.local[expert] = row

    def weights(self, expert: int) -> tuple:
        """Expert ``expert``'s rows ``(w13 [2I, H], w2 [H, I], b13, b2)`` where they live now
        (biases None unless the family has them)."""
        tier, row = int(self.tier[expert]), int(self.local[expert])
        if tier == COMPUTE and self.cpu_kernel is not None:
            ex = self.cpu_kernel.experts[row]
            return ex.gate_up.dequantize(), ex.down.dequantize(), None, None
        kept = self.kept_cpu if tier == COMPUTE else self.kept_res if tier == RESIDENT else None
        if kept is not None:
            w13, w2 = self._dequant(kept, [row])
            if self.bias:
                return w13[0], w2[0], self.b13[tier][row], self.b2[tier][row]
            return w13[0], w2[0], None, None
        if not self.bias:
            return self.w13[tier][row], self.w2[tier][row], None, None
        return self.w13[tier][row], self.w2[tier][row], self.b13[tier][row], self.b2[tier][row]

    def use_cpu_kernel(self, kernel) -> None:
        """Compute the CPU tier with ``kernel`` (called like ``grouped`` without the weights: ``kernel(x,
        rows, scale, scale_input)``), which holds its own copy of the weights; the stacks are dropped."""
        self.cpu_kernel = kernel
        self.w13[COMPUTE] = self.w2[COMPUTE] = None

    def finish(self) -> None:
        self._cpu_bias = None
        self.local_dev = torch.as_tensor(self.local, device=self.device)
        self.tier_dev = torch.as_tensor(self.tier, device=self.device)
        res = self.tier == RESIDENT
        self.res_row_dev = torch.as_tensor(np.where(res, self.local, 0), device=self.device)  # 0 if not resident
        self.res_mask_dev = torch.as_tensor(res, device=self.device)
        self.res_map_dev = torch.as_tensor(np.where(res, self.local, -1), device=self.device)  # -1: not resident
        self.all_resident = bool((self.tier == RESIDENT).all())
        self.n_tier = [int((self.tier == t).sum()) for t in (RESIDENT, COMPUTE, STREAM)]
        self.staging = HostStaging(self.device)

    @property
    def nbytes(self) -> dict[str, int]:
        """Bytes allocated: ``{"accelerator": resident stacks + stream cache, "cpu": compute and stream
        stacks, "stream_cache": the accelerator's stream cache slots alone}``."""
        acc = cpu = cache = 0
        for tier in (RESIDENT, COMPUTE, STREAM):
            for t in (self.w13[tier], self.w2[tier], self.b13[tier], self.b2[tier]):
                if t is not None:
                    n = t.numel() * t.element_size()
                    if tier == RESIDENT:
                        acc += n
                    else:
                        cpu += n
        if self.cpu_kernel is not None:
            cpu += self.cpu_kernel.nbytes
        if self.kept_cpu is not None:
            cpu += sum(t.numel() * t.element_size() for t in self.kept_cpu)
        if self.kept_res is not None:
            acc += sum(t.numel() * t.element_size() for t in self.kept_res)
        for t in (self.cache_w13, self.cache_w2, self.cache_b13, self.cache_b2):
            if t is not None:
                cache += t.numel() * t.element_size()
        return {"accelerator": acc + cache, "cpu": cpu, "stream_cache": cache}

    @property
    def pinned_bytes(self) -> int:
        """Bytes of page-locked host memory this layer holds (CUDA: the stream tier's stacks, the CPU
        tier's with a bus share, and the staging buffers; 0 elsewhere)."""
        if self.device.type != "cuda":
            return 0
        pinned = [self.w13[STREAM], self.w2[STREAM], self.b13[STREAM], self.b2[STREAM]]
        if self.bus is not None:  # the bus share pins the CPU tier's stacks
            pinned += self.bus_stacks()
        n = sum(t.numel() * t.element_size() for t in pinned if t is not None)
        staging = getattr(self, "staging", None)  # made by finish()
        return n + (staging.nbytes if staging is not None else 0)

    # -- running -----------------------------------------------------------------------------

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, scale_input: bool,
                 extra=None) -> torch.Tensor:
        """``x [T, H]``, ``ids``/``weights [T, k]`` -> weighted sum of the selected experts ``[T, H]``.

        ``extra``: optional ``() -> [T, H]`` accelerator work (the shared expert) launched while the
        host waits for the routing and computes the CPU experts; its result is added.

        Order of work in a layer with experts off the accelerator: (1) queue the copies of the
        routing (and of ``x`` when the CPU computes experts) into pinned buffers and record an event,
        (2) launch the resident experts (decode: masked gather, no host data needed) and ``extra``,
        (3) wait for the event (the one host sync of the layer), (4) compute the CPU experts on this
        thread while the accelerator runs (2) (with a bus share: on the CPU kernel's own thread, while this one
        queues the bus's copies), fetch streamed experts, (5) add the CPU result through a pinned
        buffer without waiting.
        """
        host = self.stage(x, ids, weights)
        out = self.device_part(x, ids, weights, scale_input, extra)
        if host is not None and self.clock is not None and x.shape[0] > 1:
            self._timed_host_part(x, ids, weights, host, out, scale_input)
        elif host is not None:
            self.staging.wait()  # the one host sync of a hybrid layer
            self.host_part(x, ids, weights, host, out, scale_input)
        return out

    def _timed_host_part(self, x, ids, weights, host, out, scale_input) -> None:
        """Steps 3 to 5 of a prompt with the engine's ``hostclock.HostClock`` attached: the same work,
        with the thread's blocked time and what the layer fetched told to the clock."""
        bus = self.bus
        before = (bus.copied, bus.batches, bus.copy_calls) if bus is not None else (0, 0, 0)
        t = time.perf_counter()
        self.staging.wait()
        wait_s = time.perf_counter() - t
        self._cpu_wait_s, self._cpu_run_s, self._cpu_share = 0.0, 0.0, False
        self.host_part(x, ids, weights, host, out, scale_input)
        after = (bus.copied, bus.batches, bus.copy_calls) if bus is not None else (0, 0, 0)
        self.clock.layer(self.layer, wait_s, self._cpu_wait_s, *(b - a for a, b in zip(before, after)),
                         self._cpu_share, self._cpu_run_s)

    @property
    def needs_host(self) -> bool:
        """Whether a step needs the host (routing copied back, CPU/streamed experts): every layer but
        an all-resident one on CUDA."""
        return not (self.all_resident and self.staging.cuda)

    def stage(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, record: bool = True
              ) -> list[torch.Tensor] | None:
        """Step 1: queue copies of the routing (and of ``x`` when the CPU computes experts) into pinned
        host buffers and (``record``) record the staging event; None when the step needs no host work.
        Under CUDA graph capture ``record=False``: the caller records after replaying the graph."""
        if not self.needs_host:
            return None
        flat_ids, flat_w = ids.reshape(-1), weights.reshape(-1)
        host = self.staging.to_host([flat_ids, flat_w, x] if self.n_tier[COMPUTE] else [flat_ids, flat_w])
        if record:
            self.staging.record()
        return host

    def _small(self, T: int, k: int) -> bool:
        return T * k <= GATHER_MAX_ROWS and self.staging.cuda  # a CPU accelerator groups on the host

    def device_part(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, scale_input: bool,
                    extra=None, masked: bool = False) -> torch.Tensor:
        """Step 2: the accelerator's share without host data ``[T, H]``: every expert when all are
        resident, else (few pairs) the resident ones by a masked gather; plus ``extra()``.
        ``masked``: the masked gather also on a CPU accelerator (a served step has no host part)."""
        T, k = ids.shape
        flat_ids, flat_w = ids.reshape(-1), weights.reshape(-1)
        small = self._small(T, k) or (masked and T * k <= GATHER_MAX_ROWS)
        if (T == 1 and self.n_tier[RESIDENT] and self._rows_in_place(scale_input) and gpu_kernels.usable(x)
                and (small or not self.needs_host)):
            # one token on CUDA: the selected resident rows read in place (Triton), others skipped
            rowmap = self.res_map_dev if self.needs_host else self.local_dev
            if self.kept_res is not None:  # blocks in place
                out = one_token_on(x, flat_ids, flat_w, rowmap, self.kept_res, self.kept, self.b13[0], self.b2[0],
                                   self.act)
            else:
                out = one_token_on(x, flat_ids, flat_w, rowmap, [self.w13[0], self.w2[0]], None, self.b13[0],
                                   self.b2[0], self.act)
            return out if extra is None else out + extra()
        if self.needs_host and not (small and self.n_tier[RESIDENT]):  # host_part computes every pair
            out = torch.zeros_like(x)
            return out if extra is None else out + extra()
        if not self.needs_host and T > 1 and prefill_kernels.token_sums():  # the sorted pairs add into their tokens
            kept = self.resident_kept()
            w13, w2 = (None, None) if kept is not None else self.resident_stacks()
            out = grouped_tokens(x, k, self.local_dev[flat_ids], flat_w, w13, w2, scale_input, self.b13[0],
                                 self.b2[0], self.act, kept=kept)
            return out if extra is None else out + extra()
        if T == 1:  # one token: its k pairs read x as a view and sum with one reduction
            xt = x.expand(k, x.shape[1])
            pair_sum = lambda y: y.sum(0, keepdim=True)  # noqa: E731
        else:
            token = torch.arange(T, device=x.device).repeat_interleave(k)  # [T*k]
            xt = x[token]
            pair_sum = lambda y: torch.zeros_like(x).index_add_(0, token, y)  # noqa: E731
        if not self.needs_host:
            kept = self.resident_kept()
            w13, w2 = (None, None) if kept is not None else self.resident_stacks()
            out = pair_sum(grouped(xt, self.local_dev[flat_ids], flat_w, w13, w2, scale_input,
                                   self.b13[0], self.b2[0], self.act, kept=kept))
            return out if extra is None else out + extra()
        # resident experts before the sync: masked
        res = self.res_mask_dev[flat_ids]
        kept = self.resident_kept()
        w13, w2 = (None, None) if kept is not None else self.resident_stacks()
        y = grouped(xt, self.res_row_dev[flat_ids], flat_w * res, w13, w2, scale_input,
                    self.b13[0], self.b2[0], self.act, kept=kept)
        if scale_input and self.bias:  # a zero input still gives the biases
            y = y * res[:, None]
        out = pair_sum(y)
        if extra is not None:
            out = out + extra()
        return out

    def _rows_in_place(self, scale_input: bool) -> bool:
        return (self.fast_gpu and not scale_input and gpu_kernels.available()
                and (self.kept is None or gpu_kernels.takes_formats(self.kept)))

    def host_part(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, host: list[torch.Tensor],
                  out: torch.Tensor, scale_input: bool) -> None:
        """Step 3, after ``staging.wait()``: add to ``out [T, H]`` (in place, without waiting) the
        experts that need the host: resident ones of a many-pair step (grouped), streamed ones (fetched
        into the slot cache) and the CPU's (computed on this thread while the accelerator runs step 2;
        with a bus share, one token's CPU-selected experts are split between the CPU and the bus)."""
        T, k = ids.shape
        flat_w = weights.reshape(-1)
        ids_host = host[0].numpy()
        tiers = self.tier[ids_host]
        token_host = np.repeat(np.arange(T), k)
        cpu_sel = np.nonzero(tiers == COMPUTE)[0]
        bus_y = finish = fetched = sent = None
        early = 0
        if cpu_sel.size and self.bus is not None and T > 1:  # experts many tokens select: to the GPU once
            sent, cpu_sel = self._prefill_split(ids_host, cpu_sel)  # first, so that the copies start at once
            early = self._fetch_first(x, ids_host, sent, scale_input)  # the bus starts before the CPU's setup
            if cpu_sel.size and self._fused_cpu(scale_input):  # the CPU starts first, on its own thread
                finish = self._start_cpu(host[2], token_host, host[1], ids_host, cpu_sel, scale_input,
                                         background=True)
        try:
            if sent is not None:
                fetched = self._run_fetched(x, token_host, flat_w, ids_host, sent, out, scale_input, early)
            if not self._small(T, k) and self.n_tier[RESIDENT]:
                pairs = np.nonzero(tiers == RESIDENT)[0]
                if pairs.size:
                    kept = self.resident_kept()
                    w13, w2 = (None, None) if kept is not None else self.resident_stacks()
                    _grouped_host(x, pairs, token_host, self.local[ids_host[pairs]], flat_w, out, scale_input,
                                  w13, w2, self.b13[0], self.b2[0], self.act, kept=kept,
                                  staged=lambda arrays: self.staging.indices("resident", arrays))
            str_sel = np.nonzero(tiers == STREAM)[0]
            if str_sel.size:
                self._run_streamed(x, token_host, flat_w, ids_host, str_sel, out, scale_input)
            if fetched is not None:
                fetched()
        except BaseException:
            if finish is not None:
                finish()  # the background run ends before the error goes up
            raise
        if cpu_sel.size and self.bus is not None and T == 1 and not scale_input and gpu_kernels.usable(x):
            m = self.bus.share(cpu_sel.size)
            if m:  # these travel and the GPU computes them while the CPU computes the rest
                sent, cpu_sel = cpu_sel[:m], cpu_sel[m:]
                if cpu_sel.size:  # the CPU starts first, on its own thread, while this one queues the bus
                    finish = self._start_cpu(host[2], token_host, host[1], ids_host, cpu_sel, scale_input,
                                             background=True)
                experts = ids_host[sent]
                try:
                    bus_y = self.bus.run(x, ids.reshape(-1), flat_w, experts, self.local[experts], self.bus_stacks(),
                                         self.kept_layout(), self.bias, self.act)
                except BaseException:
                    if finish is not None:
                        finish()  # the background run ends before the error goes up
                    raise
        self._cpu_share = bool(cpu_sel.size)
        if finish is None and cpu_sel.size:
            finish = self._start_cpu(host[2], token_host, host[1], ids_host, cpu_sel, scale_input)
        if finish is not None:
            out.add_(self.staging.to_device(finish()))
        if bus_y is not None:
            out.add_(bus_y)

    def _start_cpu(self, x: torch.Tensor, token: np.ndarray, flat_w: torch.Tensor, ids_host: np.ndarray,
                   sel: np.ndarray, scale_input: bool, background: bool = False):
        """The CPU tier's pairs ``sel``: host ``x [T, H]`` -> a function returning the summed ``[T, H]``
        (pinned when the accelerator is CUDA; float32 from the fused kernel, else ``x``'s dtype).
        ``background``: the fused kernel starts on its own thread (``cpu_kernel``'s background run),
        which zeroes and fills its own page-locked float32 buffer, and the function runs a prompt's
        GEMMs for its busy experts, then waits for it; everything else runs here before this returns."""
        fused_cpu = self._fused_cpu(scale_input)
        out = self.staging.buffer("cpu_out", tuple(x.shape), x.dtype)
        rows = self.local[ids_host[sel]]
        fused = None  # a fused kernel's call, given the pairs' weights and its result's buffer
        one = x.shape[0] == 1  # decode: x [H]; a prompt: x [T, H] and a token per pair
        gemm = None  # pairs of experts many tokens select: one GEMM each (torch's CPU GEMM runs near its
        gemm_sum = False  # FLOP rate), past what the kernel does in that time; their sum goes to out
        if not one and fused_cpu:
            _, inverse, counts = np.unique(rows, return_inverse=True, return_counts=True)
            many = counts[inverse.reshape(-1)] > fused_prompt_limit(self.prompt_pair_reads, self.kept_cpu is None)
            if many.any():
                gemm, gemm_sum = (sel[many], rows[many]), True
                sel, rows = sel[~many], rows[~many]
                out.zero_()
                if not background or not sel.size:
                    self._grouped_cpu(x, token, flat_w, *gemm, out, scale_input)
                    gemm = None
                if not sel.size:
                    return lambda: out
        if not fused_cpu:
            out.zero_()  # the paths below add to it
        xk, tok = (x[0], None) if one else (x, token[sel])
        if self.cpu_kernel is not None:
            tok = torch.from_numpy(token[sel])
            y = self.cpu_kernel(x[tok], torch.from_numpy(rows), flat_w[torch.from_numpy(sel)], scale_input)
            out.index_add_(0, tok, y.to(out.dtype))
        elif self.kept_cpu is not None and fused_cpu:  # the file's blocks, read in place
            if self.kept[0] == "q8_0":
                fused = lambda w, bg, o: cpu_kernel.moe_decode_q8(xk, *self.kept_cpu, rows, w,  # noqa: E731
                                                                  background=bg, tokens=tok, out=o)
            else:
                bias13, bias2 = self._cpu_biases()
                fused = lambda w, bg, o: cpu_kernel.moe_decode_q4k(xk, *self.kept_cpu, rows, w,  # noqa: E731
                                                                   *self.kept, background=bg, tokens=tok,
                                                                   bias13=bias13, bias2=bias2, act=self.act, out=o)
        elif fused_cpu:  # the fused C++ kernel: every selected expert in one call
            w13, w2 = self.w13[COMPUTE], self.w2[COMPUTE]
            b13, b2 = self._cpu_biases()
            fused = lambda w, bg, o: cpu_kernel.moe_decode(xk, w13, w2, rows, w, background=bg,  # noqa: E731
                                                           tokens=tok, b13=b13, b2=b2, act=self.act, out=o)
        elif one and not scale_input and not self.bias and self.act[0] == "silu":
            # decode without the kernel: five ops per expert, no grouping or gathers
            w13, w2 = self.w13[COMPUTE], self.w2[COMPUTE]
            i = w2.shape[2]
            for r, wt in zip(rows.tolist(), flat_w[torch.from_numpy(sel)].tolist()):
                h = F.linear(x, w13[r])  # [1, 2I]
                out.add_(F.linear(F.silu(h[:, :i]).mul_(h[:, i:]), w2[r]), alpha=wt)
        else:
            self._grouped_cpu(x, token, flat_w, sel, rows, out, scale_input)
        if fused is None:
            return lambda: out
        weights = flat_w[torch.from_numpy(sel)]
        res = self.staging.buffer("cpu_res", tuple(x.shape), torch.float32)  # the kernel zeroes it
        if not background:
            fused(weights, 0, res)
            if gemm_sum:  # made above
                res.add_(out)
            return lambda: res
        started = time.perf_counter()
        fused(weights, _background_threads(), res)

        def finish():
            try:
                if gemm is not None:  # on this thread while the kernel runs on its own
                    self._grouped_cpu(x, token, flat_w, *gemm, out, scale_input)
            finally:
                t = time.perf_counter()
                cpu_kernel.wait()
                done = time.perf_counter()
                self._cpu_wait_s += done - t
                self._cpu_run_s += done - started
            if gemm_sum:
                res.add_(out)
            return res
        return finish

    def _grouped_cpu(self, x: torch.Tensor, token: np.ndarray, flat_w: torch.Tensor, sel: np.ndarray,
                     rows: np.ndarray, out: torch.Tensor, scale_input: bool) -> None:
        """Add to the host ``out [T, H]`` the CPU tier's pairs ``sel`` (rows ``rows`` of its stacks) by
        torch ops, grouped by expert (kept blocks: the rows used, dequantized once)."""
        if self.kept_cpu is not None:
            uniq, local = np.unique(rows, return_inverse=True)
            w13, w2 = self._dequant(self.kept_cpu, uniq)
            b13, b2 = (self.b13[COMPUTE][uniq], self.b2[COMPUTE][uniq]) if self.bias else (None, None)
            _grouped_host(x, sel, token, local.reshape(-1), flat_w, out, scale_input, w13, w2, b13, b2, self.act,
                          on_host=True)
            return
        _grouped_host(x, sel, token, rows, flat_w, out, scale_input, self.w13[COMPUTE], self.w2[COMPUTE],
                      self.b13[COMPUTE], self.b2[COMPUTE], self.act, on_host=True)

    def _fused_cpu(self, scale_input: bool) -> bool:
        """Whether the fused C++ kernel computes this layer's CPU tier (decode and prompts alike): SwiGLU
        experts, and gpt-oss's biased, clamped ones."""
        if self.cpu_kernel is not None or scale_input:
            return False
        if self.kept_cpu is not None:
            return True
        return self.fused_cpu and self.act[0] in cpu_kernel.ACTIVATIONS

    def _cpu_biases(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The compute tier's expert biases as the fused kernel takes them (float32, made once until
        the weights change), or ``(None, None)``."""
        if not self.bias:
            return None, None
        if self._cpu_bias is None:
            self._cpu_bias = (self.b13[COMPUTE].float().contiguous(), self.b2[COMPUTE].float().contiguous())
        return self._cpu_bias

    def cpu_stacks(self) -> list[torch.Tensor]:
        """The compute tier's host stacks: ``[w13, w2]``, or the kept blocks' tensors (``alloc_kept``)."""
        return list(self.kept_cpu) if self.kept_cpu is not None else [self.w13[COMPUTE], self.w2[COMPUTE]]

    def bus_stacks(self) -> list[torch.Tensor]:
        """What of the compute tier travels over the bus (``bus.BusShare``): ``cpu_stacks``, then with
        expert biases (gpt-oss) ``b13 [n, 2I]`` and ``b2 [n, H]``."""
        return self.cpu_stacks() + ([self.b13[COMPUTE], self.b2[COMPUTE]] if self.bias else [])

    def _prefill_split(self, ids_host: np.ndarray, sel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Prefill with a bus share: the CPU-tier pairs ``sel`` split into those whose experts travel to
        the GPU (``costmodel.prefill_fetch``: the busy ones, and the hotter ones until the bus and the
        CPU finish together) and those the CPU computes: ``(sent, cpu)``."""
        experts = ids_host[sel]
        uniq, counts = np.unique(experts, return_counts=True)
        hot = uniq[prefill_fetch(counts, self.bus.fetch_tokens, self.bus.fraction, self.prompt_pair_reads,
                                 self.kept_cpu is None)]
        travels = np.isin(experts, hot)
        return sel[travels], sel[~travels]

    def _fetch_kernels_usable(self, x: torch.Tensor, scale_input: bool) -> bool:
        """Whether a prompt's fetched experts are computed by the grouped kernels (``_fetched_kernels``)."""
        if scale_input:
            return False
        layout = self.kept_layout()
        slots, sb13, sb2 = self.bus.weight_slots(layout, self.bias)
        if layout is not None:
            return prefill_kernels.takes_blocks(x, layout[0], self.act, self.bias)
        return prefill_kernels.usable_for(x, *slots, sb13, sb2, self.act)

    def _fetch_first(self, x: torch.Tensor, ids_host: np.ndarray, sel: np.ndarray, scale_input: bool) -> int:
        """On CUDA with the grouped kernels: queue the copies of the first ``bus.early_batches`` batches
        (1 or 2, one in each half of the slots) of the experts of the pairs ``sel`` (``_run_fetched``'s
        first batches) right away, with the bus's kernel stream waiting for them, so that the bus runs
        while this thread sets up the CPU's share. Returns how many batches it queued (0 to 2)."""
        if not sel.size or not x.is_cuda or not self._fetch_kernels_usable(x, scale_input):
            return 0
        stacks, layout = self.bus_stacks(), self.kept_layout()
        n = self.bus.half_slots(layout, self.bias)
        halves = self.bus.early_batches if 2 * n <= self.bus.slots_of(layout, self.bias) else 1  # one slot: both halves
        uniq = np.unique(ids_host[sel])[:halves * n]
        side = self.bus.kernel_stream
        side.wait_stream(torch.cuda.current_stream(x.device))  # x and the routing weights are ready there
        with torch.cuda.stream(side):
            for b, start in enumerate(range(0, uniq.size, n)):
                batch = uniq[start:start + n]
                self.bus.fetch(b, batch, self.local[batch], stacks, layout, self.bias)
        return -(-uniq.size // n)

    def _run_fetched(self, x: torch.Tensor, token: np.ndarray, flat_w: torch.Tensor, ids_host: np.ndarray,
                     sel: np.ndarray, out: torch.Tensor, scale_input: bool, early: int = 0):
        """Copy the experts of the pairs ``sel`` to the GPU slots (``bus.half_slots`` of them at a time, the two
        halves alternating; kept blocks travel and stay blocks) and compute their pairs there, queued
        without waiting. Returns a function that adds them to ``out`` (the caller queues the
        resident tier's kernels in between), or None when nothing travels.

        With the grouped kernels the pairs are sorted, gathered and indexed once for the layer, each
        batch is only its copies and two kernel launches over its slice of one tile table, and on
        CUDA all of it runs on the bus's ``kernel_stream``: the copies start before the resident
        tier's kernels are queued, and the batches' kernels do not wait behind them; the returned
        function has the layer's stream wait for them before it adds their sum. ``early``: how many of
        the first batches' copies were queued already (``_fetch_first``)."""
        experts = ids_host[sel]
        stacks, layout = self.bus_stacks(), self.kept_layout()
        n = self.bus.half_slots(layout, self.bias)
        slots, sb13, sb2 = self.bus.weight_slots(layout, self.bias)  # the biases travel with their experts
        fmt = None if layout is None else layout[0]
        args = blocks.kernel_args(fmt, slots)
        order = np.argsort(experts, kind="stable")
        pairs, experts = sel[order], experts[order]
        uniq, starts, counts = np.unique(experts, return_index=True, return_counts=True)
        if not uniq.size:
            return None
        if early or self._fetch_kernels_usable(x, scale_input):
            side = self.bus.kernel_stream if x.is_cuda else None
            main = torch.cuda.current_stream(x.device) if side is not None else None
            if side is not None and not early:
                side.wait_stream(main)  # x and the routing weights are ready there
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                added = self._fetched_kernels(x, token, flat_w, pairs, uniq, starts, counts, stacks, layout,
                                              args, fmt, sb13, sb2, early)
            if added is not None:
                tok_t, y = added

                def add():
                    if side is not None:
                        main.wait_stream(side)
                        for t in (tok_t, y):  # made on the kernel stream, read on the layer's
                            t.record_stream(main)
                    out.index_add_(0, tok_t, y)
                return add
            if side is not None:
                main.wait_stream(side)  # the fallback below reuses the slots on the layer's stream
        kept = None if fmt is None else KeptStacks(args, fmt, lambda rows=None: self._dequant(slots, rows))
        w13, w2 = (None, None) if kept is not None else slots
        for b, start in enumerate(range(0, uniq.size, n)):  # one grouped call per batch
            batch = uniq[start:start + n]
            base = self.bus.fetch(b % 2, batch, self.local[batch], stacks, layout, self.bias)
            in_batch = np.isin(experts, batch)
            slot = base + np.searchsorted(batch, experts[in_batch])  # batch is sorted
            _grouped_host(x, pairs[in_batch], token, slot, flat_w, out, scale_input, w13, w2, sb13, sb2, self.act,
                          kept=kept)
            self.bus.done_with(b % 2)
        return None

    def _fetched_kernels(self, x, token, flat_w, pairs, uniq, starts, counts, stacks, layout, args, fmt, sb13, sb2,
                         early: int = 0):
        """The grouped-kernel path of ``_run_fetched`` on the current stream: ``(tokens [n], weighted
        outputs [n, H])`` of the pairs ``pairs`` (sorted by expert; ``uniq``/``starts``/``counts`` their
        experts), or None if the kernels failed before computing anything (they are then off).
        ``early``: the first ``early`` batches are in their halves already, with this stream waiting."""
        n = self.bus.half_slots(layout, self.bias)
        j = np.arange(uniq.size)
        slot = np.where((j // n) % 2 == 1, self.bus.half_base(1, layout, self.bias),
                        self.bus.half_base(0, layout, self.bias)) + j % n
        per = (counts + prefill_kernels.BLOCK_M - 1) // prefill_kernels.BLOCK_M  # tiles per expert
        ends = np.cumsum(np.bincount(j // n, weights=per)).astype(np.int64)  # tile table end of each batch
        tiles_t, tok_t, pair_t = self.staging.indices("fetched", [prefill_kernels.tile_table(starts, counts, slot),
                                                                    token[pairs], pairs])
        xs = x[tok_t]
        h, ys = prefill_kernels.buffers(xs, args[1], fmt)
        begin = 0
        for b, start in enumerate(range(0, uniq.size, n)):
            batch = uniq[start:start + n]
            if b >= early:
                self.bus.fetch(b % 2, batch, self.local[batch], stacks, layout, self.bias)
            try:
                prefill_kernels.grouped_into(xs, tiles_t[begin:ends[b]], *args[:2], h, ys, *args[2:], fmt=fmt,
                                             b13=sb13, b2=sb2, act=self.act)
            except Exception as exc:
                if b or not gpu_kernels.failed_here(exc):
                    raise
                prefill_kernels.disable(f"{type(exc).__name__}: {exc}")
                return None  # nothing computed yet: the caller's loop does it all
            self.bus.done_with(b % 2)
            begin = int(ends[b])
        ws = flat_w[pair_t].to(x.dtype)[:, None]
        return tok_t, ys * ws

    def _run_streamed(self, x, token, flat_w, ids_host, sel, out, scale_input) -> None:
        needed = list(dict.fromkeys(ids_host[sel].tolist()))  # unique, in first-use order
        n_slots = len(self.cache_expert)
        for b in range(0, len(needed), n_slots):
            batch = needed[b:b + n_slots]
            slot_of = {e: self._fetch(e, set(batch)) for e in batch}
            pick = sel[np.isin(ids_host[sel], batch)]
            rows = np.array([slot_of[e] for e in ids_host[pick].tolist()], dtype=np.int64)
            _grouped_host(x, pick, token, rows, flat_w, out, scale_input, self.cache_w13, self.cache_w2,
                          self.cache_b13, self.cache_b2, self.act)

    def _fetch(self, expert: int, keep: set[int]) -> int:
        """Cache slot holding ``expert``, copying it in (evicting the least recently used) if needed."""
        slot = self.lru.get(expert)
        if slot is not None:
            self.lru.move_to_end(expert)
            self.hits += 1
            return slot
        self.misses += 1
        if -1 in self.cache_expert:
            slot = self.cache_expert.index(-1)
        else:
            victim = next(e for e in self.lru if e not in keep)
            slot = self.lru.pop(victim)
        row = int(self.local[expert])
        self.cache_w13[slot].copy_(self.w13[STREAM][row], non_blocking=True)
        self.cache_w2[slot].copy_(self.w2[STREAM][row], non_blocking=True)
        if self.bias:
            self.cache_b13[slot].copy_(self.b13[STREAM][row], non_blocking=True)
            self.cache_b2[slot].copy_(self.b2[STREAM][row], non_blocking=True)
        self.cache_expert[slot] = expert
        self.lru[expert] = slot
        return slot


def _background_threads() -> int:
    """Threads of a background CPU run: all but one (the caller's thread queues GPU work meanwhile;
    a parallel pass waits for its slowest thread, and one sharing a core is the slowest)."""
    return max(1, torch.get_num_threads() - 1)


def _grouped_host(x: torch.Tensor, pairs: np.ndarray, token: np.ndarray, rows: np.ndarray, flat_w: torch.Tensor,
                  out: torch.Tensor, scale_input: bool, w13: torch.Tensor, w2: torch.Tensor,
                  b13: torch.Tensor | None, b2: torch.Tensor | None, act: tuple, on_host: bool = False,
                  kept: KeptStacks | None = None, staged=None) -> None:
    """Add to ``out [T, H]`` the experts of ``pairs`` (indices into the flat ``[T*k]`` selections;
    ``token [T*k]`` host; ``rows [len(pairs)]`` host rows of ``w13``/``w2``) with weights
    ``flat_w [T*k]``. Pairs are grouped by expert on the host (no host sync): each expert's weights
    are read once, in place (no gathered copy); index tensors reach the accelerator through pinned
    memory without waiting. ``on_host``: the CPU tier's stacks (never the accelerator's kernels);
    ``kept``: blocks instead of ``w13``/``w2`` (see ``grouped``). ``staged``: ``HostStaging.indices``
    for the index arrays (one pinned copy for all of them), else each through ``_h2d``."""
    w13, w2, kept = _kernel_or_stacks(x, len(pairs), 0, w13, w2, b13, act, kept)
    order = np.argsort(rows, kind="stable")
    pairs, rows = pairs[order], rows[order]
    uniq, starts, counts = np.unique(rows, return_index=True, return_counts=True)
    kernels = kept is not None or (not on_host and isinstance(w13, torch.Tensor)
                                   and prefill_kernels.usable_for(x, w13, w2, b13, b2, act))
    tiles = prefill_kernels.tile_table(starts, counts, uniq) if kernels else None
    if staged is not None:
        pair_t, tok_t, *tiles_t = staged([pairs, token[pairs]] + ([tiles] if kernels else []))
        tiles = tiles_t[0] if kernels else None
    else:
        pair_t, tok_t = (_h2d(torch.from_numpy(a), x.device) for a in (pairs, token[pairs]))
    xs = x[tok_t]
    ws = flat_w[pair_t].to(x.dtype)[:, None]
    if scale_input:
        xs = xs * ws
    ys = None
    if kernels:
        ys = prefill_kernels.run_or_none(xs, tiles,
                                         *((w13, w2) if kept is None else kept.args),
                                         fmt=None if kept is None else kept.fmt, b13=b13, b2=b2, act=act)
        if ys is None and kept is not None:
            per = _PerExpert(kept)
            w13, w2 = _Half(per, 0), _Half(per, 1)
    if ys is None:
        ys = torch.empty_like(xs)
        for r, s, c in zip(uniq.tolist(), starts.tolist(), counts.tolist()):
            ys[s:s + c] = expert_ffn(xs[s:s + c], w13[r], w2[r], None if b13 is None else b13[r],
                                     None if b2 is None else b2[r], act)
    if not scale_input:
        ys = ys * ws
    out.index_add_(0, tok_t, ys)


def _h2d(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device`` without a host sync (through pinned memory on CUDA)."""
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}


class HostStaging:
    """Host buffers of one layer's hybrid step, reused across steps: pinned on CUDA, so that copies
    both ways run without blocking. ``to_host`` queues device->host copies, ``record`` marks them;
    ``wait`` is the host sync; ``to_device`` copies a host result back without waiting.

    Reuse is safe because every step waits (``wait``) before it writes a buffer again, and that wait
    comes after the previous step's copies in stream order.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self._bufs: dict[str, torch.Tensor] = {}
        self._views: dict[tuple, torch.Tensor] = {}
        self._event = torch.cuda.Event() if self.cuda else None

    def buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host tensor of ``shape``/``dtype`` (contents undefined), reused by ``name``."""
        view = self._views.get((name, shape, dtype))
        if view is not None:  # a decode step asks for the same shapes every token
            return view
        n = math.prod(shape)
        buf = self._bufs.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < n:
            cap = max(n, 2 * buf.numel() if buf is not None and buf.dtype == dtype else n)
            buf = torch.empty(cap, dtype=dtype, pin_memory=self.cuda)
            self._bufs[name] = buf
            self._views = {k: v for k, v in self._views.items() if k[0] != name}  # views of the old one
        view = self._views[(name, shape, dtype)] = buf[:n].view(shape)
        return view

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers (pinned on CUDA)."""
        return sum(b.numel() * b.element_size() for b in self._bufs.values())

    def to_host(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Host copies of ``tensors``; on CUDA valid only after ``wait()``."""
        if not self.cuda:
            return [t if t.device.type == "cpu" else t.cpu() for t in tensors]
        outs = []
        for i, t in enumerate(tensors):
            h = self.buffer(f"in{i}", tuple(t.shape), t.dtype)
            h.copy_(t, non_blocking=True)
            outs.append(h)
        return outs

    def record(self) -> None:
        """Mark the copies queued so far; ``wait`` returns once they are done."""
        if self.cuda:
            self._event.record(torch.cuda.current_stream(self.device))  # the copies' stream

    def wait(self) -> None:
        if self.cuda:
            self._event.synchronize()

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (a buffer of this staging) on the accelerator, copied without waiting."""
        return t.to(self.device, non_blocking=True) if self.cuda else t

    def indices(self, name: str, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Small host arrays (a prompt layer's pair indices and tile tables) on the accelerator through
        one pinned buffer ``name`` and one copy queued on the current stream, without waiting: the
        tensors in the same order, dtypes and shapes. On the host: the arrays as tensors.

        Each ``pin_memory`` and copy of its own costs the host tens of µs, several times per hybrid
        prompt layer. Reuse of ``name`` is safe as ``buffer``'s: the next step writes it after its
        ``wait``, which follows this copy in stream order (a side stream's copy joins the layer's
        stream before the layer's result is used)."""
        arrays = [np.ascontiguousarray(a) for a in arrays]
        if not self.cuda:
            return [torch.from_numpy(a) for a in arrays]
        offsets, total = [], 0
        for a in arrays:
            offsets.append(total)
            total += -(-a.nbytes // 8) * 8  # each view starts 8-byte aligned
        buf = self.buffer(name, (1 << max(12, (total - 1).bit_length()),), torch.uint8)  # few sizes: few views
        raw = buf.numpy()
        for a, at in zip(arrays, offsets):
            raw[at:at + a.nbytes] = a.reshape(-1).view(np.uint8)
        dev = buf[:total].to(self.device, non_blocking=True)
        return [dev[at:at + a.nbytes].view(_TORCH_DTYPES[a.dtype]).view(a.shape) for a, at in zip(arrays, offsets)]


def _copy_halves(dst: torch.Tensor, src) -> None:
    """Copy ``src`` (a tensor, or its two halves along axis 0) into ``dst``."""
    if isinstance(src, tuple):
        half = dst.shape[0] // 2
        dst[:half].copy_(src[0])
        dst[half:].copy_(src[1])
    else:
        dst.copy_(src)
