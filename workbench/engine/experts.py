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

from collections import OrderedDict
from concurrent.futures import Executor

import numpy as np
import torch
import torch.nn.functional as F

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


def grouped(x: torch.Tensor, rows: torch.Tensor, scale: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
            scale_input: bool, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
            act: tuple = ("silu",)) -> torch.Tensor:
    """Expert outputs for pairs ``(x[i], rows[i])``, weighted by ``scale [n]``; ``rows`` index ``w13``.

    ``x [n, H]`` -> ``[n, H]``. Small ``n``: one gather + batched matmul, no host sync. Larger ``n``:
    pairs sorted by expert, one matmul per expert (reads the per-expert counts on the host).
    """
    n = x.shape[0]
    scale = scale.to(x.dtype)[:, None]
    if scale_input:
        x = x * scale
    if n <= GATHER_MAX_ROWS:
        h = torch.bmm(w13[rows], x[:, :, None])[:, :, 0]  # [n, 2I]
        if b13 is not None:
            h = h + b13[rows]
        out = torch.bmm(w2[rows], activate(h, act)[:, :, None])[:, :, 0]  # [n, H]
        if b2 is not None:
            out = out + b2[rows]
    else:
        order = torch.argsort(rows, stable=True)
        counts = torch.bincount(rows, minlength=w13.shape[0]).tolist()
        xs = x[order]
        parts = []
        start = 0
        for r, c in enumerate(counts):
            if c:
                parts.append(expert_ffn(xs[start:start + c], w13[r], w2[r], None if b13 is None else b13[r],
                                        None if b2 is None else b2[r], act))
                start += c
        out = torch.empty_like(x)
        out[order] = torch.cat(parts)
    return out if scale_input else out * scale


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
        self.cache_w13: torch.Tensor | None = None
        self.cache_w2: torch.Tensor | None = None
        self.cache_b13: torch.Tensor | None = None
        self.cache_b2: torch.Tensor | None = None
        self.cpu_kernel = None  # optional CPU-format kernel for the compute tier (cpu_formats.CpuExperts)
        self.cache_expert: list[int] = []
        self.lru: OrderedDict[int, int] = OrderedDict()  # expert -> cache slot, oldest first
        self.hits = 0
        self.misses = 0

    # -- building ----------------------------------------------------------------------------

    def alloc_tier(self, tier: int, count: int, shape13: tuple[int, int], shape2: tuple[int, int]) -> None:
        """Allocate the stacked tensors of ``tier`` for ``count`` experts (before ``put``)."""
        dev = self.device if tier == RESIDENT else torch.device("cpu")
        pin = tier == STREAM and self.device.type == "cuda"
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
        self.tier[expert] = tier
        self.local[expert] = row

    def weights(self, expert: int) -> tuple:
        """Expert ``expert``'s rows ``(w13 [2I, H], w2 [H, I], b13, b2)`` where they live now
        (biases None unless the family has them)."""
        tier, row = int(self.tier[expert]), int(self.local[expert])
        if tier == COMPUTE and self.cpu_kernel is not None:
            ex = self.cpu_kernel.experts[row]
            return ex.gate_up.dequantize(), ex.down.dequantize(), None, None
        if not self.bias:
            return self.w13[tier][row], self.w2[tier][row], None, None
        return self.w13[tier][row], self.w2[tier][row], self.b13[tier][row], self.b2[tier][row]

    def use_cpu_kernel(self, kernel) -> None:
        """Compute the CPU tier with ``kernel`` (called like ``grouped`` without the weights: ``kernel(x,
        rows, scale, scale_input)``), which holds its own copy of the weights; the stacks are dropped."""
        self.cpu_kernel = kernel
        self.w13[COMPUTE] = self.w2[COMPUTE] = None

    def finish(self) -> None:
        self.local_dev = torch.as_tensor(self.local, device=self.device)
        self.all_resident = bool((self.tier == RESIDENT).all())

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
        for t in (self.cache_w13, self.cache_w2, self.cache_b13, self.cache_b2):
            if t is not None:
                cache += t.numel() * t.element_size()
        return {"accelerator": acc + cache, "cpu": cpu, "stream_cache": cache}

    # -- running -----------------------------------------------------------------------------

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, scale_input: bool) -> torch.Tensor:
        """``x [T, H]``, ``ids``/``weights [T, k]`` -> weighted sum of the selected experts ``[T, H]``."""
        T, k = ids.shape
        flat_w = weights.reshape(-1)
        token = torch.arange(T, device=x.device).repeat_interleave(k)  # [T*k]
        if self.all_resident:
            rows = self.local_dev[ids.reshape(-1)]
            out = torch.zeros_like(x)
            return out.index_add_(0, token, grouped(x[token], rows, flat_w, self.w13[0], self.w2[0], scale_input,
                                                    self.b13[0], self.b2[0], self.act))
        ids_host = ids.reshape(-1).cpu().numpy()  # the one host sync per hybrid layer
        tiers = self.tier[ids_host]
        future = None
        cpu_sel = np.nonzero(tiers == COMPUTE)[0]
        if cpu_sel.size:
            sel = torch.as_tensor(cpu_sel, device=x.device)
            x_cpu = x[token[sel]].to("cpu", non_blocking=False)
            w_cpu = flat_w[sel].to("cpu")
            rows_cpu = torch.as_tensor(self.local[ids_host[cpu_sel]])
            if self.cpu_kernel is not None:
                fn, args = self.cpu_kernel, (x_cpu, rows_cpu, w_cpu, scale_input)
            else:
                fn, args = grouped, (x_cpu, rows_cpu, w_cpu, self.w13[COMPUTE], self.w2[COMPUTE], scale_input,
                                     self.b13[COMPUTE], self.b2[COMPUTE], self.act)
            future = self.worker.submit(fn, *args) if self.worker is not None else None
            cpu_now = None if future is not None else fn(*args)
        out = torch.zeros_like(x)
        res_sel = np.nonzero(tiers == RESIDENT)[0]
        if res_sel.size:
            sel = torch.as_tensor(res_sel, device=x.device)
            rows = torch.as_tensor(self.local[ids_host[res_sel]], device=x.device)
            out.index_add_(0, token[sel], grouped(x[token[sel]], rows, flat_w[sel], self.w13[0], self.w2[0],
                                                  scale_input, self.b13[0], self.b2[0], self.act))
        str_sel = np.nonzero(tiers == STREAM)[0]
        if str_sel.size:
            self._run_streamed(x, token, flat_w, ids_host, str_sel, out, scale_input)
        if cpu_sel.size:
            cpu_out = future.result() if future is not None else cpu_now
            sel = torch.as_tensor(cpu_sel, device=x.device)
            out.index_add_(0, token[sel], cpu_out.to(x.device, non_blocking=True))
        return out

    def _run_streamed(self, x, token, flat_w, ids_host, sel, out, scale_input) -> None:
        needed = list(dict.fromkeys(ids_host[sel].tolist()))  # unique, in first-use order
        n_slots = len(self.cache_expert)
        for b in range(0, len(needed), n_slots):
            batch = needed[b:b + n_slots]
            slot_of = {e: self._fetch(e, set(batch)) for e in batch}
            pick = sel[np.isin(ids_host[sel], batch)]
            rows = torch.as_tensor([slot_of[e] for e in ids_host[pick].tolist()], device=x.device)
            p = torch.as_tensor(pick, device=x.device)
            out.index_add_(0, token[p], grouped(x[token[p]], rows, flat_w[p], self.cache_w13, self.cache_w2,
                                                scale_input, self.cache_b13, self.cache_b2, self.act))

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


def _copy_halves(dst: torch.Tensor, src) -> None:
    """Copy ``src`` (a tensor, or its two halves along axis 0) into ``dst``."""
    if isinstance(src, tuple):
        half = dst.shape[0] // 2
        dst[:half].copy_(src[0])
        dst[half:].copy_(src[1])
    else:
        dst.copy_(src)
