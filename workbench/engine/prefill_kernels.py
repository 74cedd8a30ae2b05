"""A grouped GEMM for a prompt's routed experts on CUDA: every expert of a layer in two kernels.

A prompt of ``T`` tokens makes ``T * k`` (token, expert) pairs. Sorted by expert, the pairs of one
expert are a small matrix product against that expert's weights; one ``F.linear`` pair per expert
costs ~6 kernel launches, ~128 experts per layer at the Qwen3-30B-A3B shape: the launches, not the
GPU, set the prefill rate. ``swiglu_grouped`` runs them all in two kernels over a tile table (each
tile: one expert's row in the stacks and up to ``BLOCK_M`` of its consecutive pairs): gate and up
projections with SiLU·up in the epilogue, then the down projection. Each weight tile is read once
per tile of pairs.

``usable_for`` says when it applies (SwiGLU, or gpt-oss's with biases; float weights, Triton usable); any
failure to build or launch turns it off for the process (``disable``) and the caller's per-expert
loop takes over, leaving the decode kernels of ``gpu_kernels`` alone. ``WORKBENCH_PREFILL_KERNELS=0``
turns them off.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import torch

from . import blocks, gpu_kernels

log = logging.getLogger(__name__)

BLOCK_M = 32
"""Pairs per tile (a prompt of 512 tokens gives ~32 pairs per expert at 8 of 128 experts)."""

_disabled: list[str] = []

triton = gpu_kernels.triton
if triton is not None:
    import triton.language as tl

    def _configs() -> list:
        """``(BLOCK_N, BLOCK_K, num_warps, num_stages)`` candidates, timed at the first call per shape
        (under the interpreter only the first)."""
        options = [(64, 64, 4, 3), (128, 64, 4, 3), (64, 128, 4, 3), (128, 128, 8, 3)]
        return [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
                for n, k, w, s in options[:1 if gpu_kernels.ONE_CONFIG else None]]

    _block_tile = gpu_kernels._block_tile

    @triton.autotune(configs=_configs(), key=["N", "K", "SWIGLU", "FMT", "BIAS", "ACT"])
    @triton.jit
    def _grouped_kernel(x_ptr, w_ptr, d_ptr, tiles_ptr, out_ptr, b_ptr, N, K, stride_e, stride_n, stride_x,
                        alpha, limit, dest_ptr, scale_ptr, SWIGLU: tl.constexpr, F32_DOT: tl.constexpr,
                        FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        BIAS: tl.constexpr = False, ACT: tl.constexpr = 0, SCATTER: tl.constexpr = False,
                        SCALE: tl.constexpr = False):
        """Tile ``t`` (``tiles[t] = (row, start, count)``), outputs ``n`` of block ``pid(1)``:
        ``out[start + m, n] = x[start + m] . w[row, n]`` for ``m < count``, or with ``SWIGLU``
        ``silu(x . w[row, n]) * (x . w[row, N + n])`` (gate rows first, then up). ``FMT`` 0: float
        stacks; 1: GGUF Q8_0 (int8 values, float16 scales at ``d_ptr``); 2 / 3 / 4: raw Q4_K / Q6_K / Q5_K rows
        (``stride_n`` bytes a row), decoded in the tile a block at a time (``_block_tile``) and
        rounded to ``x``'s dtype as a dequantized stack would be. gpt-oss: ``BIAS`` adds ``b[row]``
        (``[2N]`` gate then up with ``SWIGLU``, else ``[N]``) to the products, and ``ACT`` 1 takes its
        clamped SwiGLU ``(clamp(u, -limit, limit) + 1) * g * sigmoid(alpha g)``, ``g <= limit``.
        Without ``SWIGLU``: ``SCALE`` multiplies each row, rounded to the output's dtype, by
        ``scale[start + m]`` (rounded again, as a separate multiply would), and ``SCATTER`` stores it
        at row ``dest[start + m]`` of ``out`` instead of ``start + m``."""
        t = tl.program_id(0)
        row = tl.load(tiles_ptr + 3 * t).to(tl.int64)
        start = tl.load(tiles_ptr + 3 * t + 1).to(tl.int64)
        count = tl.load(tiles_ptr + 3 * t + 2)
        if count > 0:  # an empty tile (device_tile_table's padding) reads nothing
            offs_m = tl.arange(0, BLOCK_M)
            offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            offs_k = tl.arange(0, BLOCK_K)
            m_ok = offs_m < count
            n_ok = offs_n < N
            x_rows = x_ptr + (start + offs_m)[:, None] * stride_x
            w_cols = w_ptr + row * stride_e + offs_n[None, :].to(tl.int64) * stride_n  # [1, BN]: k runs down
            at_n = row * stride_e + offs_n.to(tl.int64) * stride_n
            w_rows = w_ptr + at_n  # [BN]: each row's first byte (blocks)
            d_rows = d_ptr + at_n // 32  # Q8_0: each row's first scale
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + offs_k
                k_ok = kk < K
                xt = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                if FMT == 0:
                    wm = k_ok[:, None] & n_ok[None, :]
                    w = tl.load(w_cols + kk[:, None], mask=wm, other=0.0)  # [BK, BN]
                    if SWIGLU:
                        wu = tl.load(w_cols + N * stride_n + kk[:, None], mask=wm, other=0.0)
                else:
                    w = tl.trans(_block_tile(w_rows, d_rows, k0, n_ok, K, FMT, BLOCK_N, BLOCK_K).to(x_ptr.dtype.element_ty))
                    if SWIGLU:
                        wu = tl.trans(_block_tile(w_rows + N * stride_n, d_rows + N * stride_n // 32, k0, n_ok, K, FMT,
                                                  BLOCK_N, BLOCK_K).to(x_ptr.dtype.element_ty))
                if F32_DOT:  # float32 weights (no tf32), or the interpreter (whose bfloat16 dot is wrong)
                    xt = xt.to(tl.float32)
                    acc += tl.dot(xt, w.to(tl.float32), input_precision="ieee")
                    if SWIGLU:
                        acc_up += tl.dot(xt, wu.to(tl.float32), input_precision="ieee")
                else:
                    acc += tl.dot(xt, w)
                    if SWIGLU:
                        acc_up += tl.dot(xt, wu)
            if BIAS:
                n_b = N * 2 if SWIGLU else N
                acc += tl.load(b_ptr + row * n_b + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
                if SWIGLU:
                    acc_up += tl.load(b_ptr + row * n_b + N + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            if SWIGLU:  # rounded where F.linear, silu and mul round (their bfloat16 results), no more
                ty = out_ptr.dtype.element_ty
                g = acc.to(ty).to(tl.float32)
                u = acc_up.to(ty).to(tl.float32)
                if ACT == 1:  # gpt-oss
                    g = tl.minimum(g, limit)
                    u = tl.minimum(tl.maximum(u, -limit), limit)
                    acc = (u + 1.0) * (g / (1.0 + tl.exp(-alpha * g)))
                else:
                    act = (g / (1.0 + tl.exp(-g))).to(ty).to(tl.float32)
                    acc = act * u
            at_m = start + offs_m
            if SCALE:  # the pair's routing weight on its rounded output
                sc = tl.load(scale_ptr + at_m, mask=m_ok, other=0.0).to(tl.float32)
                acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32) * sc[:, None]
            if SCATTER:  # each pair's row where its token's pairs lie
                at_m = tl.load(dest_ptr + at_m, mask=m_ok, other=0).to(tl.int64)
            out = out_ptr + at_m[:, None] * N + offs_n[None, :]
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def available() -> bool:
    """Whether the grouped kernels may run (Triton usable, they did not fail here, and
    ``WORKBENCH_PREFILL_KERNELS`` is not ``0``)."""
    return not _disabled and gpu_kernels.available() and _switch("WORKBENCH_PREFILL_KERNELS")


def _switch(name: str) -> bool:
    """Whether the environment leaves switch ``name`` on (unset, or anything but 0 / false / no / off)."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")


def disable(reason: str) -> None:
    """Stop using these kernels in this process (the per-expert loop takes over)."""
    if not _disabled:
        log.warning("grouped prefill kernels off, one matrix product per expert instead: %s", reason[:300])
    _disabled.append(reason)


def usable_for(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, b13, b2, act: tuple) -> bool:
    """Whether ``swiglu_grouped`` takes these: SwiGLU (or gpt-oss's, with biases on both matrices or
    neither), float stacks of ``x``'s dtype with contiguous rows, on CUDA (or under Triton's
    interpreter)."""
    return (available() and gpu_kernels.usable(x) and act[0] in ACTS and (b13 is None) == (b2 is None)
            and w13.is_floating_point() and w13.dtype == w2.dtype == x.dtype
            and w13.stride(2) == 1 and w2.stride(2) == 1 and w13.device == x.device)


def tile_table(starts: np.ndarray, counts: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Tiles ``[n_tiles, 3]`` int32 ``(row, start, count)``: each run of pairs (``starts``/``counts``
    into the sorted pairs, ``rows`` its expert's row in the stacks) cut into pieces of ``BLOCK_M``."""
    per = (counts + BLOCK_M - 1) // BLOCK_M
    run = np.repeat(np.arange(len(counts)), per)
    piece = np.arange(per.sum()) - np.repeat(np.cumsum(per) - per, per)
    start = starts[run] + piece * BLOCK_M
    count = np.minimum(BLOCK_M, counts[run] - piece * BLOCK_M)
    return np.stack([rows[run], start, count], axis=1).astype(np.int32)


def device_tiles() -> bool:
    """Whether a prompt layer's experts on the GPU take their tile table from ``device_tile_table``
    (no host sync) rather than from ``tile_table`` over counts read back (``WORKBENCH_DEVICE_TILES=0``:
    the host table, for side-by-side timing of the two)."""
    return _switch("WORKBENCH_DEVICE_TILES")


def token_sums() -> bool:
    """Whether a prompt layer with every expert on the GPU sums its sorted pairs straight into their
    tokens (``experts.grouped_tokens``) and builds its tile table in one kernel; ``WORKBENCH_TOKEN_SUMS=0``:
    the pairs copied out in pair order and the table built by PyTorch's operations, as before (for
    side-by-side timing of the two)."""
    return _switch("WORKBENCH_TOKEN_SUMS")


def tile_bound(n_pairs: int, n_rows: int) -> int:
    """The most tiles ``n_pairs`` pairs sorted by row can make over ``n_rows`` rows: each used row
    adds at most one partial tile to ``n_pairs / BLOCK_M`` full ones."""
    return (n_pairs + min(n_rows, n_pairs) * (BLOCK_M - 1)) // BLOCK_M


def device_tile_table(counts: torch.Tensor, n_pairs: int) -> torch.Tensor:
    """``tile_table`` built where ``counts`` lies, without reading it back: ``counts [R]`` (pairs
    per row of the stacks, summing to ``n_pairs``; pairs sorted by row) -> ``[tile_bound(n_pairs, R),
    3]`` int32 ``(row, start, count)``, the real tiles first and the rest empty (count 0, which the
    kernels skip). A prompt layer with every expert on the GPU then queues its experts with no host
    sync, so the host runs ahead of the GPU instead of waiting on it every layer. On CUDA (or under
    the interpreter) one kernel launch (``_tile_table_kernel``) instead of ~20 small operations, each
    of which costs the host more than the GPU; PyTorch's operations where the kernel did not build."""
    if counts.shape[0] <= TABLE_MAX_ROWS and token_sums() and available() and gpu_kernels.usable(counts):
        tiles = _or_none("table", lambda: _tile_table_by_kernel(counts, n_pairs))
        if tiles is not None:
            return tiles
    return _tile_table_by_torch(counts, n_pairs)


TABLE_MAX_ROWS = 1024
"""Rows of a layer's stacks up to which ``_tile_table_kernel`` builds the tile table (its programs hold
every row's count in registers)."""

_off: dict[str, str] = {}
"""Forms of these kernels that failed to build, launch or check here (``"table"``: the tile table's
kernel; ``"placed"``: the down kernel's weighted store at each pair's place) and why: each is off for the
process and its other path takes over; the grouped kernels stay on."""

_OFF_INSTEAD = {"table": "PyTorch builds the prompt's tile tables",
                "placed": "the grouped prompt kernels store in sorted order"}


def _or_none(which: str, run):
    """``run()``, or None where form ``which`` is off or fails to build, launch or check here (then off
    from now on: ``_off``)."""
    if which in _off:
        return None
    try:
        return run()
    except Exception as exc:  # a Triton build, launch or check failure of this form only
        if not gpu_kernels.failed_here(exc):
            raise
        log.warning("%s from now on: %s", _OFF_INSTEAD[which], f"{type(exc).__name__}: {exc}"[:300])
        _off[which] = f"{type(exc).__name__}: {exc}"
        return None


def _tile_table_by_kernel(counts: torch.Tensor, n_pairs: int) -> torch.Tensor:
    R = counts.shape[0]
    n_tiles = tile_bound(n_pairs, R)
    tiles = torch.empty((n_tiles, 3), dtype=torch.int32, device=counts.device)
    if n_tiles:
        r_p2 = triton.next_power_of_2(max(R, 16))
        block_t = max(16, min(64, 8192 // r_p2))
        _tile_table_kernel[(triton.cdiv(n_tiles, block_t),)](counts, tiles, R, n_tiles, BLOCK_M=BLOCK_M, R_P2=r_p2,
                                                              BLOCK_T=block_t, num_warps=4)
    return tiles


def _tile_table_by_torch(counts: torch.Tensor, n_pairs: int) -> torch.Tensor:
    R = counts.shape[0]
    counts = counts.to(torch.int64)
    per = (counts + BLOCK_M - 1) // BLOCK_M  # [R] tiles per row
    ends = torch.cumsum(per, 0)  # [R]
    t = torch.arange(tile_bound(n_pairs, R), device=counts.device)
    run = torch.searchsorted(ends, t, right=True)  # each tile's row; R past the real tiles
    real = run < R
    run = run.clamp(max=R - 1)
    piece = t - (ends - per)[run]
    start = (torch.cumsum(counts, 0) - counts)[run] + piece * BLOCK_M
    count = torch.where(real, torch.clamp(counts[run] - piece * BLOCK_M, max=BLOCK_M), 0)
    return torch.stack([run, torch.where(real, start, 0), count], dim=1).to(torch.int32)


if triton is not None:
    @triton.jit
    def _tile_table_kernel(counts_ptr, tiles_ptr, R, n_tiles, BLOCK_M: tl.constexpr, R_P2: tl.constexpr,
                           BLOCK_T: tl.constexpr):
        """Tiles ``pid * BLOCK_T ..`` of ``device_tile_table`` from ``counts [R]`` (int64): each program
        scans every row's count (``R <= R_P2``), and a tile belongs to the row whose run of tiles holds
        it (rows without pairs hold none); tiles past the real ones get row ``R - 1``, start 0, count 0."""
        r = tl.arange(0, R_P2)
        c = tl.load(counts_ptr + r, mask=r < R, other=0).to(tl.int32)  # [R_P2]
        per = (c + BLOCK_M - 1) // BLOCK_M
        ends = tl.cumsum(per, 0)
        first = ends - per  # each row's first tile
        pair0 = tl.cumsum(c, 0) - c  # each row's first pair
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        mine = (t[:, None] >= first[None, :]) & (t[:, None] < ends[None, :])  # [BLOCK_T, R_P2]: one row at most
        real = tl.sum(mine.to(tl.int32), 1) > 0
        row = tl.where(real, tl.sum(tl.where(mine, r[None, :], 0), 1), R - 1)
        piece = t - tl.sum(tl.where(mine, first[None, :], 0), 1)
        start = tl.where(real, tl.sum(tl.where(mine, pair0[None, :], 0), 1) + piece * BLOCK_M, 0)
        count = tl.where(real, tl.minimum(tl.sum(tl.where(mine, c[None, :], 0), 1) - piece * BLOCK_M, BLOCK_M), 0)
        ok = t < n_tiles
        tl.store(tiles_ptr + 3 * t, row, mask=ok)
        tl.store(tiles_ptr + 3 * t + 1, start, mask=ok)
        tl.store(tiles_ptr + 3 * t + 2, count, mask=ok)


_FMT = gpu_kernels.FMT_CODES


ACTS = {"silu": 0, "clamped_swiglu": 1}
"""The experts' activations the kernels compute (``experts.activate``'s names) -> ``ACT``."""


def takes_blocks(x: torch.Tensor, fmt: tuple[str, str], act: tuple, bias: bool) -> bool:
    """Whether ``swiglu_grouped`` reads experts kept as GGUF blocks of formats ``fmt`` (gate/up, down)
    in place for activations like ``x``: SwiGLU, or gpt-oss's with its biases (``bias``)."""
    return available() and gpu_kernels.usable(x) and act[0] in ACTS and all(f in _FMT for f in fmt)


def swiglu_grouped(xs: torch.Tensor, tiles: np.ndarray | torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   d13: torch.Tensor | None = None, d2: torch.Tensor | None = None,
                   fmt: tuple[str, str] | None = None, b13: torch.Tensor | None = None,
                   b2: torch.Tensor | None = None, act: tuple = ("silu",), dest: torch.Tensor | None = None,
                   scale: torch.Tensor | None = None) -> torch.Tensor:
    """``xs [n, H]`` (pairs sorted so that each tile's pairs are consecutive), ``tiles`` from
    ``tile_table`` (or that table as an int32 tensor on ``xs``'s device), ``w13 [R, 2I, H]`` (gate rows first), ``w2 [R, H, I]`` -> ``[n, H]`` in ``xs``'s
    dtype: each pair's SwiGLU expert output (unweighted). Queued without a host sync.

    Experts kept as GGUF blocks (``fmt`` = formats of gate/up and down): Q8_0 as ``w13``/``w2`` int8
    values with ``d13 [R, 2I, H/32]``/``d2 [R, H, I/32]`` float16 scales; Q4_K/Q6_K as the rows' raw
    bytes ``[R, 2I, H/256*bytes]``/``[R, H, I/256*bytes]`` uint8. They are decoded in the tiles, so no
    dequantized stack is ever made. gpt-oss: biases ``b13 [R, 2I]``, ``b2 [R, H]`` and its
    ``act=("clamped_swiglu", alpha, limit)``.

    ``scale [n]`` (``xs``'s dtype): each pair's output times its weight, rounded as ``ys * scale``
    rounds; ``dest [n]`` (int64, a permutation of ``0..n-1``): sorted pair ``j``'s row of the result is
    row ``dest[j]`` (the pairs back in their tokens' order, so that ``[T * k, H]`` sums over ``k``
    without atomics).

    Raises what Triton raises when a kernel fails to build or launch (``gpu_kernels.failed_here``).
    """
    xs = xs.contiguous()
    dev = xs.device
    if isinstance(tiles, torch.Tensor):  # on the device already
        tiles_t = tiles
    else:
        tiles_t = torch.from_numpy(np.ascontiguousarray(tiles))
        tiles_t = tiles_t.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else tiles_t
    h, out = buffers(xs, w2, fmt)
    grouped_into(xs, tiles_t, w13, w2, h, out, d13, d2, fmt, b13, b2, act, dest, scale)
    return out


def buffers(xs: torch.Tensor, w2: torch.Tensor, fmt: tuple[str, str] | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``grouped_into``'s outputs for ``xs [n, H]``: the activations ``[n, I]`` and the result ``[n, H]``."""
    i = w2.shape[2] if fmt is None or _FMT[fmt[1]] == 1 else blocks.row_values(fmt[1], w2.shape[2])
    return (torch.empty((xs.shape[0], i), dtype=xs.dtype, device=xs.device),
            torch.empty(xs.shape, dtype=xs.dtype, device=xs.device))


def grouped_into(xs: torch.Tensor, tiles_t: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, h: torch.Tensor,
                 out: torch.Tensor, d13: torch.Tensor | None = None, d2: torch.Tensor | None = None,
                 fmt: tuple[str, str] | None = None, b13: torch.Tensor | None = None,
                 b2: torch.Tensor | None = None, act: tuple = ("silu",), dest: torch.Tensor | None = None,
                 scale: torch.Tensor | None = None) -> None:
    """``swiglu_grouped`` for the tiles ``tiles_t [t, 3]`` int32 already on the device (a slice of a
    larger table: the pairs of other tiles are left as they are), into ``h``/``out`` from ``buffers``
    (``dest``/``scale``: as there).
    Queued without a host sync, after the first call per shape (which checks the kernel's autotuning
    candidates against PyTorch: ``kernel_check``)."""
    H = xs.shape[1]
    i = h.shape[1]
    f13, f2 = (0, 0) if fmt is None else (_FMT[fmt[0]], _FMT[fmt[1]])
    f32 = xs.dtype == torch.float32 or not xs.is_cuda
    if tiles_t.shape[0] == 0 or w13.shape[0] == 0:
        return
    bias, code = b13 is not None, ACTS[act[0]]
    alpha, limit = (float(act[1]), float(act[2])) if code else (1.0, 0.0)

    def launch(xs=xs, tiles_t=tiles_t, h=h, out=out, dest=dest, scale=scale):
        nt = tiles_t.shape[0]
        _grouped_kernel[lambda meta: (nt, triton.cdiv(i, meta["BLOCK_N"]))](
            xs, w13, d13 if d13 is not None else w13, tiles_t, h, b13 if bias else h, i, H, w13.stride(0),
            w13.stride(1), xs.stride(0), alpha, limit, tiles_t, h, SWIGLU=True, F32_DOT=f32, FMT=f13, BLOCK_M=BLOCK_M,
            BIAS=bias, ACT=code)
        _grouped_kernel[lambda meta: (nt, triton.cdiv(H, meta["BLOCK_N"]))](
            h, w2, d2 if d2 is not None else w2, tiles_t, out, b2 if bias else h, H, i, w2.stride(0), w2.stride(1),
            h.stride(0), alpha, limit, dest if dest is not None else tiles_t, scale if scale is not None else h,
            SWIGLU=False, F32_DOT=f32, FMT=f2, BLOCK_M=BLOCK_M, BIAS=bias, SCATTER=dest is not None,
            SCALE=scale is not None)
        return out

    def probe():  # one tile of random tokens on this call's first expert against PyTorch (kernel_check)
        g = torch.Generator(device=xs.device).manual_seed(0)
        xc = torch.randn((BLOCK_M, H), generator=g, device=xs.device).to(xs.dtype)
        row = int(tiles_t[0, 0])
        tc = torch.tensor([[row, 0, BLOCK_M]], dtype=torch.int32, device=xs.device)
        hc, oc = torch.empty((BLOCK_M, i), dtype=xs.dtype, device=xs.device), torch.empty_like(xc)
        ref = gpu_kernels.expert_f32(xc, row, fmt or (None, None), w13, w2, d13, d2, b13, b2, act)
        dc = sc = None
        if dest is not None:  # the rows stored in reverse: the scatter's addresses checked too
            dc = torch.arange(BLOCK_M - 1, -1, -1, device=xs.device)
            ref = ref.flip(0)
        if scale is not None:  # the weights of the rows as stored
            sc = (torch.rand(BLOCK_M, generator=g, device=xs.device) + 0.5).to(scale.dtype)
            ref = ref * (sc if dc is None else sc[dc]).float()[:, None]
        return (lambda: launch(xc, tc, hc, oc, dc, sc)), ref

    key = ("grouped", i, H, f13, f2, xs.dtype, w13.dtype, bias, act, dest is not None, scale is not None)
    gpu_kernels.run_checked([_grouped_kernel], launch, key, probe)


def placed_or_none(xs: torch.Tensor, tiles: torch.Tensor, dest: torch.Tensor, scale: torch.Tensor | None, *stacks,
                   **kw) -> torch.Tensor | None:
    """``swiglu_grouped`` with ``dest`` (and ``scale``): each pair's output at its own place; None if that
    form failed to build, launch or check here (then never tried again in this process; the grouped
    kernels without it stay on)."""
    return _or_none("placed", lambda: swiglu_grouped(xs, tiles, *stacks, dest=dest, scale=scale, **kw))


def run_or_none(xs: torch.Tensor, tiles: np.ndarray, *stacks, **kw) -> torch.Tensor | None:
    """``swiglu_grouped``, or None (and the kernels off for the process) if they fail to build or run."""
    try:
        return swiglu_grouped(xs, tiles, *stacks, **kw)
    except Exception as exc:  # a Triton build or launch failure: fall back, keep serving
        if not gpu_kernels.failed_here(exc):
            raise
        disable(f"{type(exc).__name__}: {exc}")
        return None
