"""CPU weight formats for routed experts, chosen to get batch-1 GEMV close to RAM bandwidth.

A CPU expert is memory bound at batch 1: its time is its weight bytes over the bandwidth the kernel
reaches. Plain bf16 ``F.linear`` reaches a third to two thirds of RAM bandwidth; PyTorch's
weight-only int8 (per output channel) and int4 (group-wise affine) kernels read 2x / 4x fewer bytes.

Formats (``FORMATS``); a weight is ``W [N, K]`` (out, in) as ``F.linear`` takes it:
- ``bf16``, ``f32``: plain ``F.linear``.
- ``int8``: symmetric per-output-channel int8, ``torch.ops.aten._weight_int8pack_mm``.
- ``int4``: group-wise affine 4-bit (``value = (q - 8) * scale + zero``, groups of ``INT4_GROUP``
  along K), ``torch.ops.aten._weight_int4pack_mm_for_cpu``. A GGUF Q4_K block maps onto it exactly
  (``scale = d*sc``, ``zero = 8*scale - dmin*m`` per 32 values), up to bf16 rounding of scale/zero.

``pack(w, fmt)`` packs a float tensor; ``pack_gguf`` packs GGUF ``Q8_0`` / ``Q4_K`` (or bf16/f32)
block bytes of one expert's matrices directly, never through a float copy of the whole tensor.
``ExpertFFN`` holds one expert as a fused gate+up matrix ``[2I, H]`` and a down matrix ``[H, I]``:
batch 1 costs two kernel calls. ``throughput`` measures GB/s of weight bytes at an expert's shape.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from workbench.core.errors import WorkbenchError

FORMATS = ("bf16", "f32", "int8", "int4")
INT4_GROUP = 32  # values per scale/zero group along K in int4 (what Q4_K uses)
_Q8_0_BYTES, _Q4_K_BYTES = 34, 144  # bytes per GGUF block of 32 / 256 values


def available_formats(n: int | None = None, k: int | None = None) -> list[str]:
    """The formats this torch build runs (and that take ``[n, k]`` weights, if given)."""
    out = []
    for f in FORMATS:
        if f == "int8" and not hasattr(torch.ops.aten, "_weight_int8pack_mm"):
            continue
        if f == "int4" and not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
            continue
        if n is not None and k is not None and not supports(f, n, k):
            continue
        out.append(f)
    return out


def supports(fmt: str, n: int, k: int) -> bool:
    """Whether ``fmt``'s kernel takes a [n, k] weight (int4: n a multiple of 16, k of the group)."""
    if fmt == "int4":
        return n % 16 == 0 and k % INT4_GROUP == 0
    return fmt in FORMATS


@dataclass
class PackedLinear:
    """A weight ``[N, K]`` in one CPU format; ``self(x)`` computes ``x @ W.T``.

    ``data``: the packed weight; ``scales``: int8 per-channel scales [N] (bf16) or int4 scales and
    zeros [K/group, N, 2] (bf16); ``act_dtype``: the activation dtype the kernel takes.
    """

    fmt: str
    n: int
    k: int
    data: torch.Tensor
    scales: torch.Tensor | None = None
    group: int = 0

    @property
    def act_dtype(self) -> torch.dtype:
        return torch.float32 if self.fmt == "f32" else torch.bfloat16

    @property
    def nbytes(self) -> int:
        """Bytes the kernel reads per call (weights plus scales)."""
        s = 0 if self.scales is None else self.scales.numel() * self.scales.element_size()
        return self.data.numel() * self.data.element_size() + s

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: [M, K] in ``act_dtype`` -> [M, N] in ``act_dtype``."""
        if self.fmt in ("bf16", "f32"):
            return F.linear(x, self.data)
        if self.fmt == "int8":
            return torch.ops.aten._weight_int8pack_mm(x, self.data, self.scales)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.data, self.group, self.scales)

    def dequantize(self) -> torch.Tensor:
        """The weight the kernel multiplies by, [N, K] float32 (reference for tests)."""
        if self.fmt in ("bf16", "f32"):
            return self.data.float()
        if self.fmt == "int8":
            return self.data.float() * self.scales.float()[:, None]
        eye = torch.eye(self.k, dtype=torch.bfloat16)  # the packed layout is the kernel's own
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.data, self.group, self.scales).float().T


def pack(w: torch.Tensor, fmt: str) -> PackedLinear:
    """Pack a float weight ``w`` [N, K] (any float dtype) into ``fmt``."""
    if w.ndim != 2:
        raise WorkbenchError(f"a weight must be 2-D [N, K], got shape {tuple(w.shape)}")
    if fmt not in FORMATS:
        raise WorkbenchError(f"unknown CPU weight format {fmt!r}; choose from {', '.join(FORMATS)}")
    n, k = w.shape
    if not supports(fmt, n, k):
        raise WorkbenchError(f"the {fmt} kernel does not take a [{n}, {k}] weight")
    if fmt == "bf16":
        return PackedLinear(fmt, n, k, w.to(torch.bfloat16).contiguous())
    if fmt == "f32":
        return PackedLinear(fmt, n, k, w.to(torch.float32).contiguous())
    wf = w.float()
    if fmt == "int8":
        return _int8(wf)
    g = wf.view(n, k // INT4_GROUP, INT4_GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15.0).clamp(min=1e-12)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).view(n, k)
    return _int4(q, scale, lo + 8.0 * scale)


def _int8(vals: torch.Tensor) -> PackedLinear:
    """float32 [N, K] -> symmetric per-channel int8."""
    scale = vals.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(vals / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return PackedLinear("int8", vals.shape[0], vals.shape[1], q.contiguous(), scale.to(torch.bfloat16))


def _int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> PackedLinear:
    """``q`` [N, K] int32 in 0..15, ``scale``/``zero`` [N, K/INT4_GROUP] -> the kernel's layout."""
    n, k = q.shape
    if not supports("int4", n, k):
        raise WorkbenchError(f"the int4 kernel does not take a [{n}, {k}] weight")
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
    sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return PackedLinear("int4", n, k, packed, sz, INT4_GROUP)


# ---------------------------------------------------------------- GGUF blocks

def _blocks(raw, n: int, k: int, per_block: int, nbytes: int) -> np.ndarray:
    a = np.asarray(raw, dtype=np.uint8)
    if k % per_block or a.size != n * (k // per_block) * nbytes:
        raise WorkbenchError(
            f"GGUF block data of {a.size} bytes does not hold a [{n}, {k}] matrix "
            f"({per_block} values per {nbytes}-byte block)")
    return a.reshape(n, k // per_block, nbytes)


def q8_0_values(raw, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """GGUF Q8_0 bytes of a [N, K] matrix -> (q [N, K/32, 32] int8, d [N, K/32] float32)."""
    b = _blocks(raw, n, k, 32, _Q8_0_BYTES)
    d = np.ascontiguousarray(b[..., :2]).view(np.float16)[..., 0].astype(np.float32)
    return np.ascontiguousarray(b[..., 2:]).view(np.int8), d


def q4_k_values(raw, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GGUF Q4_K bytes of a [N, K] matrix -> (q [N, K] uint8 0..15, scale [N, K/32], min [N, K/32]).

    Each value is ``scale * q - min`` (float32), groups of 32 along K, as llama.cpp decodes it.
    """
    b = _blocks(raw, n, k, 256, _Q4_K_BYTES)
    nb = b.shape[1]
    d = np.ascontiguousarray(b[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)
    dmin = np.ascontiguousarray(b[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)
    s = b[..., 4:16]
    sc = np.empty((n, nb, 8), np.uint8)
    mn = np.empty((n, nb, 8), np.uint8)
    sc[..., :4] = s[..., 0:4] & 63
    mn[..., :4] = s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    qs = b[..., 16:].reshape(n, nb, 4, 32)
    q = np.stack([qs & 0xF, qs >> 4], axis=3).reshape(n, k)  # sub-blocks 2i (low), 2i+1 (high)
    return q, (d[..., None] * sc).reshape(n, nb * 8), (dmin[..., None] * mn).reshape(n, nb * 8)


def _float_matrix(raw, n: int, k: int, gguf_type: str) -> torch.Tensor:
    """bf16 (raw uint16 bits or a tensor) or f32 values of a [N, K] matrix as a tensor."""
    if isinstance(raw, torch.Tensor):
        return raw.reshape(n, k)
    a = np.ascontiguousarray(raw)
    if gguf_type == "bf16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).reshape(n, k)
    return torch.from_numpy(a.astype(np.float32, copy=False)).reshape(n, k)


def pack_gguf(raws: list, gguf_type: str, n_rows: list[int], k: int, fmt: str) -> PackedLinear:
    """Pack GGUF matrices of one type (``"q8_0"``, ``"q4_k"``, ``"bf16"``, ``"f32"``), stacked along
    N (e.g. one expert's gate and up -> [2I, K]), into the CPU format ``fmt``.

    ``raws[i]``: the bytes (values for bf16/f32) of matrix i, [n_rows[i], k]. Only these matrices are
    decoded. ``q4_k -> int4`` is exact up to bf16 scale/zero; ``q8_0 -> int8`` re-scales each row to
    one scale (error at most half a step of the row's largest block).
    """
    if fmt not in FORMATS:
        raise WorkbenchError(f"unknown CPU weight format {fmt!r}; choose from {', '.join(FORMATS)}")
    n = sum(n_rows)
    if gguf_type == "q4_k":
        parts = [q4_k_values(r, m, k) for r, m in zip(raws, n_rows)]
        q, scale, mins = (np.concatenate([p[j] for p in parts]) for j in range(3))
        if fmt == "int4" and INT4_GROUP == 32:
            s = torch.from_numpy(scale)
            return _int4(torch.from_numpy(q.astype(np.int32)), s, 8.0 * s - torch.from_numpy(mins))
        vals = (q.reshape(n, -1, 32) * scale[..., None] - mins[..., None]).reshape(n, k)
    elif gguf_type == "q8_0":
        parts = [q8_0_values(r, m, k) for r, m in zip(raws, n_rows)]
        vals = np.concatenate([(q.astype(np.float32) * d[..., None]).reshape(-1, k) for q, d in parts])
        if fmt == "int8":
            return _int8(torch.from_numpy(vals))
    elif gguf_type in ("bf16", "f32"):
        return pack(torch.cat([_float_matrix(r, m, k, gguf_type) for r, m in zip(raws, n_rows)]), fmt)
    else:
        raise WorkbenchError(f"no CPU packing from GGUF type {gguf_type!r}")
    return pack(torch.from_numpy(vals), fmt)


# ---------------------------------------------------------------- experts

@dataclass
class ExpertFFN:
    """One routed expert on the CPU: ``down(silu(gate(x)) * up(x))`` with gate and up fused.

    ``gate_up``: [2I, H] (gate rows first), ``down``: [H, I].
    """

    gate_up: PackedLinear
    down: PackedLinear

    @classmethod
    def from_float(cls, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, fmt: str) -> ExpertFFN:
        """From float weights gate [I, H], up [I, H], down [H, I]."""
        return cls(pack(torch.cat([gate, up], dim=0), fmt), pack(down, fmt))

    @classmethod
    def from_gguf(cls, gate, up, down, gguf_type: str, hidden: int, inter: int, fmt: str) -> ExpertFFN:
        """From one expert's slices of GGUF tensors (block bytes for quantized types)."""
        return cls(pack_gguf([gate, up], gguf_type, [inter, inter], hidden, fmt),
                   pack_gguf([down], gguf_type, [hidden], inter, fmt))

    @property
    def nbytes(self) -> int:
        """Bytes read per call (weights and scales of both matrices)."""
        return self.gate_up.nbytes + self.down.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: [M, H] (any float dtype) -> [M, H] in the format's activation dtype."""
        gu = self.gate_up(x.to(self.gate_up.act_dtype))  # [M, 2I]
        i = self.gate_up.n // 2
        return self.down(F.silu(gu[:, :i]) * gu[:, i:])


def time_per_call(fns: list, x: torch.Tensor, repeats: int = 3) -> tuple[float, list[float]]:
    """Median seconds per call of ``fn(x)`` over ``fns`` (several distinct weights, cycled so that RAM,
    not cache, feeds them), after a warm-up of four calls; also every repeat's figure."""
    for fn in fns[:4]:
        fn(x)
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for fn in fns:
            fn(x)
        runs.append((time.perf_counter() - t0) / len(fns))
    return float(np.median(runs)), runs


def throughput(fmt: str, n: int, k: int, *, n_mats: int = 64, tokens: int = 1, repeats: int = 3,
               seed: int = 0) -> dict:
    """Time ``x @ W.T`` over ``n_mats`` different [N, K] matrices in ``fmt``, cycled so that RAM,
    not cache, feeds them. Returns median µs per matrix, GB/s of packed bytes read, and the
    bf16-equivalent GB/s (``N*K*2`` bytes over the same time)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, k, generator=g) * 0.02
    mats = [pack(base.roll(i, dims=1), fmt) for i in range(n_mats)]
    x = torch.randn(tokens, k, generator=g).to(mats[0].act_dtype)
    t, runs = time_per_call(mats, x, repeats)
    return {
        "format": fmt, "n": n, "k": k, "tokens": tokens, "threads": torch.get_num_threads(),
        "us_per_matrix": t * 1e6, "bytes_per_matrix": mats[0].nbytes,
        "gbps": mats[0].nbytes / t / 1e9, "bf16_equiv_gbps": n * k * 2 / t / 1e9,
        "spread_us": [r * 1e6 for r in runs],
    }


class ExpertPool:
    """Computes a token's selected CPU experts of one layer, several at a time.

    With 16 threads on one GEMV, a small matrix pays the thread fork/join of every op (a whole S1
    expert costs ~2x what its bytes say). The pool runs ``workers`` experts at once, each on its own
    thread, and sets PyTorch's intra-op thread count (global to the process) to
    ``threads_per_worker`` while it is open, so each op wakes fewer threads and each thread reads
    more bytes. ``close()`` restores the previous count. ``workers=1`` is the plain loop.
    """

    def __init__(self, workers: int = 1, threads_per_worker: int | None = None):
        from concurrent.futures import ThreadPoolExecutor

        if workers < 1:
            raise WorkbenchError(f"an expert pool needs at least one worker, not {workers}")
        self.workers = workers
        self._saved = torch.get_num_threads()
        self.threads = threads_per_worker or max(1, self._saved // workers)
        torch.set_num_threads(self.threads)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="cpu-expert") if workers > 1 else None

    @staticmethod
    def _run(experts: list[ExpertFFN], x: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
        out = None
        for i, e in enumerate(experts):
            y = e(x).float()
            if weights is not None:
                y = y * weights[i]
            out = y if out is None else out + y
        return out

    def map(self, fn, items: list) -> list:
        """``[fn(item) for item in items]``, spread over the workers (in order)."""
        if self._pool is None or len(items) <= 1:
            return [fn(it) for it in items]
        return list(self._pool.map(fn, items))

    def __call__(self, experts: list[ExpertFFN], x: torch.Tensor,
                 weights: torch.Tensor | None = None) -> torch.Tensor:
        """``sum_i weights[i] * experts[i](x)``: ``x`` [M, H], ``weights`` [n] (None: all 1) ->
        [M, H] float32."""
        if not experts:
            return torch.zeros(x.shape, dtype=torch.float32)
        w = self.workers if self._pool is not None else 1
        chunks = [list(range(i, len(experts), w)) for i in range(min(w, len(experts)))]
        parts = self.map(lambda c: self._run([experts[j] for j in c], x, None if weights is None else weights[c]),
                         chunks)
        out = parts[0]
        for p in parts[1:]:
            out = out + p
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        torch.set_num_threads(self._saved)

    def __enter__(self) -> ExpertPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class CpuExperts:
    """A layer's CPU-computed experts in one format, called like the engine's ``grouped``.

    ``self(x, rows, scale, scale_input)``: ``x`` [n, H] (one row per (token, expert) pair), ``rows``
    [n] (index into this layer's CPU experts), ``scale`` [n] (routing weights) -> [n, H] in
    ``x``'s dtype, each row the expert's output scaled (input scaled instead when
    ``scale_input``). Pairs are grouped by expert, so each expert's weights are read once per call
    whatever the number of tokens, with no copy of the weights (the engine's gather+bmm copies the
    selected experts first); groups run in parallel on ``pool``. SiLU-gated experts without biases.
    """

    def __init__(self, experts: list[ExpertFFN], pool: ExpertPool | None = None):
        self.experts = experts
        self.pool = pool or ExpertPool(1)

    @classmethod
    def from_stacked(cls, w13: torch.Tensor, w2: torch.Tensor, fmt: str = "bf16",
                     pool: ExpertPool | None = None) -> CpuExperts:
        """From stacked weights ``w13`` [E, 2I, H] (gate rows first) and ``w2`` [E, H, I]; bf16
        weights in ``bf16`` format are used in place, not copied."""
        if w13.ndim != 3 or w2.ndim != 3 or w13.shape[0] != w2.shape[0] or w13.shape[1] != 2 * w2.shape[2]:
            raise WorkbenchError(f"stacked experts need w13 [E, 2I, H] and w2 [E, H, I], got "
                                 f"{tuple(w13.shape)} and {tuple(w2.shape)}")
        return cls([ExpertFFN(pack(w13[e], fmt), pack(w2[e], fmt)) for e in range(w13.shape[0])], pool)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.experts)

    def __call__(self, x: torch.Tensor, rows: torch.Tensor, scale: torch.Tensor,
                 scale_input: bool) -> torch.Tensor:
        rows_np = np.asarray(rows.reshape(-1).cpu().numpy(), dtype=np.int64)
        s = scale.reshape(-1, 1).float()
        xs = x.float() * s if scale_input else x
        groups = [(int(r), np.nonzero(rows_np == r)[0]) for r in np.unique(rows_np)]
        outs = self.pool.map(lambda g: self.experts[g[0]](xs[torch.from_numpy(g[1])]).float(), groups)
        out = torch.empty((x.shape[0], x.shape[1]), dtype=torch.float32)
        for (_, idx), y in zip(groups, outs):
            out[torch.from_numpy(idx)] = y
        if not scale_input:
            out *= s
        return out.to(x.dtype)
