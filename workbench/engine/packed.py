"""Dense weights kept in a GGUF file's quantized blocks on the accelerator.

A Q4_K file's attention projections, embeddings and head take a quarter of the bytes they take
dequantized to bfloat16: at the Qwen3-30B-A3B shape ~0.4 GB instead of ~1.5 GB, which is 1 GB more
room for experts under a VRAM budget and 1 GB less to read per decoded token. ``Packed`` holds such
a matrix ``[N, K]`` as ``blocks`` stores it (the tensors ``memory.kept_in_blocks`` names), and
``linear`` / ``embedding`` stand in for ``F.linear`` / ``F.embedding`` wherever a weight may be one:

- one token (decode) on CUDA, or under Triton's interpreter: a matrix-vector kernel reads the
  blocks in place (``gpu_kernels._row_dots``, the routed experts' decoder), float32 sums;
- more tokens (prompts): the rows dequantized to the activations' dtype, at most ``CHUNK_BYTES`` at
  a time, then ``F.linear`` (the dequantized copy is the one a load-time dequantization would give);
- embeddings: the picked rows dequantized.

A plain tensor goes straight to ``F.linear`` / ``F.embedding``.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

from . import blocks, gpu_kernels

log = logging.getLogger(__name__)

CHUNK_BYTES = 64 * 2**20
"""Largest dequantized piece of a kept matrix a prompt step makes (bytes)."""

CHECK_ROWS = 4096
"""Rows (the first ones, and the last 64) of a kept matrix that the one-token kernel's candidates
are checked on at the first call per shape (``kernel_check``)."""

_FMT = {f: c for f, c in gpu_kernels.FMT_CODES.items() if f not in gpu_kernels.EXPERTS_ONLY}

triton = gpu_kernels.triton
if triton is not None:
    import triton.language as tl

    _row_dots = gpu_kernels._row_dots
    _after_inputs = gpu_kernels._after_inputs
    _block_tile = gpu_kernels._block_tile

    _T, _NT = {"TILE": True}, {"TILE": False}

    @triton.autotune(configs=gpu_kernels._configs([(16, 256, 4, _T), (8, 256, 4, _T), (4, 256, 4, _T), (2, 256, 2, _T),
                                                   (16, 256, 4, _NT), (32, 256, 4, _NT), (8, 256, 4, _NT),
                                                   (32, 128, 4, _NT), (32, 128, 4, _T)]), key=["N", "K", "FMT"])
    @triton.jit
    def _matvec_kernel(x_ptr, w_ptr, d_ptr, out_ptr, N, K: tl.constexpr, stride_n, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, FMT: tl.constexpr, TILE: tl.constexpr, PDL: tl.constexpr = False,
                       PRELOAD: tl.constexpr = False):
        """``out[n] = w[n, :] . x`` for rows ``n`` of block ``pid(0)``, summed in float32 and stored in
        out's dtype. ``FMT`` 1: ``w`` int8 [N, K] with float16 scales at ``d_ptr`` [N, K/32]; 2 / 3:
        raw Q4_K / Q6_K / Q5_K rows of ``stride_n`` bytes. ``PRELOAD`` (float rows, ``FMT`` 0): the
        rows' first ``BLOCK_K`` values are loaded before ``x``, so that with ``PDL`` they are read
        while the kernel before finishes."""
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = offs_n < N
        at = offs_n.to(tl.int64) * stride_n
        if PRELOAD and FMT == 0:
            offs_k = tl.arange(0, BLOCK_K)
            km = offs_k < K
            w = tl.load(w_ptr + at[:, None] + offs_k[None, :], mask=rm[:, None] & km[None, :], other=0)
            _after_inputs(PDL)
            x = tl.load(x_ptr + offs_k, mask=km, other=0.0).to(tl.float32)
            acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)  # the rest of each row as _row_dots reads it
            acc += _row_dots(w_ptr + at + BLOCK_K, d_ptr, x_ptr + BLOCK_K, K - BLOCK_K, rm, FMT, False, BLOCK_N,
                             BLOCK_K, TILE)
        else:
            _after_inputs(PDL)
            acc = _row_dots(w_ptr + at, d_ptr + at // 32, x_ptr, K, rm, FMT, False, BLOCK_N, BLOCK_K, TILE)
        tl.store(out_ptr + offs_n, acc.to(out_ptr.dtype.element_ty), mask=rm)

    @triton.jit
    def _dequant_kernel(w_ptr, d_ptr, out_ptr, N, K: tl.constexpr, stride_n, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, FMT: tl.constexpr):
        """Rows of block ``pid(0)``, inputs ``pid(1) * BLOCK_K ..`` of a kept matrix, decoded a block
        at a time (``gpu_kernels._block_tile``) into ``out [N, K]`` (its dtype)."""
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = offs_n < N
        k0 = tl.program_id(1) * BLOCK_K
        at = offs_n.to(tl.int64) * stride_n
        w = _block_tile(w_ptr + at, d_ptr + at // 32, k0, rm, K, FMT, BLOCK_N, BLOCK_K)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        tl.store(out_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :], w.to(out_ptr.dtype.element_ty),
                 mask=rm[:, None] & (offs_k < K)[None, :])


class Packed:
    """A matrix ``[N, K]`` (``nn.Linear`` layout: out x in) kept as ``blocks`` format ``fmt``.

    ``parts``: ``[q int8 [N, K], d float16 [N, K/32]]`` for Q8_0, ``[raw uint8 [N, K/256 * bytes]]``
    for Q4_K / Q5_K / Q6_K, rows contiguous. ``dtype``: what products and embeddings come out as (the
    engine's activation dtype).
    """

    def __init__(self, fmt: str, parts: list[torch.Tensor], k: int, dtype: torch.dtype = torch.float32):
        if fmt not in _FMT or k % blocks.BLOCK[fmt]:
            raise ValueError(f"cannot keep a matrix of {k} inputs in {fmt}")
        self.fmt, self.parts, self.k, self.dtype = fmt, parts, k, dtype

    @property
    def shape(self) -> tuple[int, int]:
        return self.parts[0].shape[0], self.k

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    @property
    def nbytes(self) -> int:
        return blocks.nbytes(self.parts)

    def to(self, device: torch.device, dtype: torch.dtype) -> Packed:
        """A copy on ``device`` (contiguous rows) whose products come out in ``dtype``."""
        return Packed(self.fmt, [p.to(device).contiguous() for p in self.parts], self.k, dtype)

    def rows(self, start: int, stop: int) -> Packed:
        """Rows ``start .. stop - 1`` (views of this one's storage)."""
        return Packed(self.fmt, [p[start:stop] for p in self.parts], self.k, self.dtype)

    def dequantize(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows ``start .. stop - 1`` as ``[rows, K]`` in ``dtype`` (float32 arithmetic)."""
        part = self if (start, stop) == (0, None) else self.rows(start, self.shape[0] if stop is None else stop)
        return dequantize_blocks(part.fmt, part.parts, part.k, part.dtype)

    def _dequantize_kernel(self) -> torch.Tensor:
        """The rows dequantized by one Triton kernel: ``[N, K]`` in ``dtype``."""
        n, k = self.shape
        out = torch.empty((n, k), dtype=self.dtype, device=self.device)
        w = self.parts[0]
        bn, bk = 32, 256
        _dequant_kernel[(triton.cdiv(n, bn), triton.cdiv(k, bk))](
            w, self.parts[-1], out, n, k, w.stride(0), BLOCK_N=bn, BLOCK_K=bk, FMT=_FMT[self.fmt])
        return out

    def matvec(self, x: torch.Tensor) -> torch.Tensor:
        """``x [1, K]`` -> ``[1, N]`` in ``x``'s dtype with the one-token kernel (CUDA, or the
        interpreter). The first call per shape checks the kernel's autotuning candidates against
        PyTorch's decoding (``kernel_check``: host syncs, eager only); later calls: no host sync,
        capturable in a CUDA graph."""
        n = self.shape[0]
        w = self.parts[0]

        def launch(x=x):
            return _launch_matvec(x.contiguous(), w, self.parts[-1], self.k, _FMT[self.fmt])

        def probe():  # a random token; the first and last rows against PyTorch's decoding (kernel_check)
            g = torch.Generator(device=x.device).manual_seed(0)
            xc = torch.randn(x.shape, generator=g, device=x.device).to(x.dtype)
            at = torch.cat([torch.arange(min(n, CHECK_ROWS)), torch.arange(max(0, n - 64), n)]).unique().to(x.device)
            ref = xc.float() @ blocks.dequantize(self.fmt, blocks.take(self.parts, at), self.k, torch.float32).T
            return (lambda: launch(xc)[:, at]), ref

        key = ("matvec", n, self.k, self.fmt, x.dtype)
        return gpu_kernels.run_checked([_matvec_kernel], launch, key, probe)


_off: dict[str, str] = {}
"""This module's kernels that failed to build or run here (``"matvec"``, ``"dequant"``) and why:
their PyTorch paths take over, the other Triton kernels stay on."""


def _turn_off(which: str, exc: BaseException) -> None:
    if which not in _off:
        log.warning("the %s kernel for kept blocks is off, PyTorch instead: %s", which, f"{type(exc).__name__}: {exc}"[:300])
    _off[which] = f"{type(exc).__name__}: {exc}"


def dequantize_blocks(fmt: str, parts: list[torch.Tensor], k: int, dtype: torch.dtype,
                      kernel: bool | None = None) -> torch.Tensor:
    """``blocks.dequantize``: kept matrices ``[..., N, K]`` as ``dtype`` (float32 arithmetic). On CUDA
    (``kernel=None``; ``True`` also under Triton's interpreter) one Triton kernel decodes all the
    rows a block at a time instead of a dozen PyTorch ops with int32 temporaries; if it fails to
    build, that kernel is turned off and PyTorch decodes (as it always does MXFP4)."""
    use = ((parts[0].is_cuda if kernel is None else kernel) and gpu_kernels.available() and "dequant" not in _off
           and fmt in _FMT)
    if use:
        lead = parts[0].shape[:-1]
        flat = Packed(fmt, [p.reshape(-1, p.shape[-1]).contiguous() for p in parts], k, dtype)
        try:
            return flat._dequantize_kernel().reshape(*lead, k)
        except Exception as exc:  # a Triton build or launch failure: the PyTorch decoder instead
            if not gpu_kernels.failed_here(exc):
                raise
            _turn_off("dequant", exc)
    return blocks.dequantize(fmt, parts, k, dtype)


class Group:
    """Matrices of different kept formats used as one, their rows one after another (q, k and v
    of a Q4_K_M file, whose v is Q6_K): ``linear`` gives their outputs side by side."""

    def __init__(self, members: list):
        self.members = members

    @property
    def shape(self) -> tuple[int, int]:
        return sum(m.shape[0] for m in self.members), self.members[0].shape[1]

    @property
    def device(self) -> torch.device:
        return self.members[0].device

    @property
    def nbytes(self) -> int:
        return sum(nbytes(m) for m in self.members)


def cat_rows(ws: list) -> tuple[object, list]:
    """``ws`` (tensors or ``Packed``, same K) as one matrix of their rows in order, and each one as a
    view of it: ``(fused, views)``. Tensors: ``torch.cat``; ``Packed`` of one format: one ``Packed``;
    a mix of formats: a ``Group`` of the originals (each its own view)."""
    if all(isinstance(w, torch.Tensor) for w in ws):
        fused = torch.cat(ws)
    elif all(isinstance(w, Packed) for w in ws) and len({w.fmt for w in ws}) == 1:
        fused = Packed(ws[0].fmt, [torch.cat([w.parts[i] for w in ws]) for i in range(len(ws[0].parts))],
                       ws[0].k, ws[0].dtype)
    else:
        return Group(list(ws)), list(ws)
    views, at = [], 0
    for w in ws:
        n = w.shape[0]
        views.append(fused[at:at + n] if isinstance(fused, torch.Tensor) else fused.rows(at, at + n))
        at += n
    return fused, views


DENSE_MATVEC_MAX = 32 * 2**20
"""Most values of a float matrix whose one-token product ``linear`` gives the Triton matvec
(``dense_matvec``); larger ones (a vocabulary's head) stay with cuBLAS, which reads them at ~3 TB/s."""


def dense_matvec(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``linear`` gives the one-token product with float matrix ``w`` to the Triton matvec
    instead of cuBLAS: ``WORKBENCH_DENSE_MATVEC`` ``1`` always, ``0`` never, unset (``auto``) where
    the kernels launch with programmatic dependent launch (``gpu_kernels.pdl``: Hopper and later),
    which lets the matvec read its first weights while the kernel before it finishes;
    cuBLAS's kernels wait for it.
    Only contiguous matrices of at most ``DENSE_MATVEC_MAX`` values in ``x``'s dtype, on its device,
    with at least as many rows as inputs: the matvec spreads rows, not inputs, over the SMs, and
    S1's attention output (2048 x 4096) took 13.8 µs so against cuBLAS's split-K 11.0 µs on the
    H100 (``scripts/time_decode_kernels.py``; its q/k/v, 5120 x 2048: 9.5 against 9.9 µs)."""
    mode = os.environ.get("WORKBENCH_DENSE_MATVEC", "auto")
    if mode == "0" or (mode != "1" and not gpu_kernels.pdl()) or "matvec" in _off:
        return False
    return (x.dim() == 2 and x.shape[0] == 1 and w.dim() == 2 and w.dtype == x.dtype and w.device == x.device
            and w.is_contiguous() and w.shape[0] >= w.shape[1] and w.numel() <= DENSE_MATVEC_MAX
            and gpu_kernels.usable(x))


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` for ``x [T, K]`` and ``w`` a tensor, a ``Packed`` or a ``Group``:
    ``[T, N]`` in ``x``'s dtype. One token's product with a float matrix runs on the Triton matvec
    where ``dense_matvec`` says so."""
    if isinstance(w, torch.Tensor):
        if not dense_matvec(x, w):
            return F.linear(x, w, bias)
        out = float_matvec(x, w)
        return out if bias is None else out + bias
    if isinstance(w, Group):
        out = torch.cat([linear(x, m) for m in w.members], dim=-1)
    elif x.shape[0] == 1 and x.dim() == 2 and gpu_kernels.usable(x) and x.device == w.device and "matvec" not in _off:
        out = _matvec_or_none(lambda: w.matvec(x))
        if out is None:
            out = _dequantized_linear(x, w)
    else:
        out = _dequantized_linear(x, w)
    return out if bias is None else out + bias


def float_matvec(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [1, K] @ w.T`` for a small float matrix ``w [N, K]`` (contiguous, x's dtype) with the
    one-token kernel: ``[1, N]`` in x's dtype, summed in float32. A MoE router's product at S1's shape
    (128 x 2048 bf16) took 2.9 µs this way against 4.9 µs in cuBLAS on the H100; the attention's
    larger projections gained nothing (``scripts/time_decode_kernels.py``), so they stay with cuBLAS.
    The first call per shape checks the autotuning candidates (``kernel_check``, eager); later calls
    capturable. A kernel that fails to build here gives ``F.linear``'s result from then on."""
    n, k = w.shape

    def launch(x=x):
        return _launch_matvec(x, w, w, k, 0)

    def probe():  # a random token, against PyTorch
        g = torch.Generator(device=x.device).manual_seed(0)
        xc = torch.randn(x.shape, generator=g, device=x.device).to(x.dtype)
        return (lambda: launch(xc)), xc.float() @ w.float().T

    out = None if "matvec" in _off else _matvec_or_none(
        lambda: gpu_kernels.run_checked([_matvec_kernel], launch, ("float_matvec", n, k, x.dtype), probe))
    return F.linear(x, w) if out is None else out


def _launch_matvec(x: torch.Tensor, w: torch.Tensor, d: torch.Tensor, k: int, fmt: int) -> torch.Tensor:
    """``_matvec_kernel`` over the rows of ``w [N, ...]`` (``d``: Q8_0's scales, else ``w``; ``fmt`` its
    ``FMT``) for ``x [1, k]``: ``[1, N]`` in x's dtype."""
    n = w.shape[0]
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    pdl = gpu_kernels.pdl_args()
    _matvec_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](x, w, d, out, n, k, w.stride(0), FMT=fmt,
                                                                     PRELOAD=bool(pdl), **pdl)
    return out


def _matvec_or_none(run) -> torch.Tensor | None:
    """``run()`` (a one-token matvec); None, with the kernel off from now on (``_off["matvec"]``),
    where it fails to build or launch here: the caller's PyTorch path takes over."""
    try:
        return run()
    except Exception as exc:  # a Triton build or launch failure: this kernel off
        if not gpu_kernels.failed_here(exc):
            raise
        _turn_off("matvec", exc)
        return None


def _dequantized_linear(x: torch.Tensor, w: Packed) -> torch.Tensor:
    n, k = w.shape
    step = max(1, CHUNK_BYTES // (k * x.element_size()))
    if step >= n:
        return F.linear(x, w.dequantize().to(x.dtype))
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    for a in range(0, n, step):
        out[..., a:a + step] = F.linear(x, w.dequantize(a, min(n, a + step)).to(x.dtype))
    return out


def embedding(ids: torch.Tensor, w) -> torch.Tensor:
    """``F.embedding(ids, w)`` for ``w`` a tensor or a ``Packed`` ``[vocab, H]``: ``[*ids.shape, H]``
    (a ``Packed`` gives its ``dtype``)."""
    if isinstance(w, torch.Tensor):
        return F.embedding(ids, w)
    flat = ids.reshape(-1)
    rows = blocks.dequantize(w.fmt, blocks.take(w.parts, flat), w.k, w.dtype)
    return rows.reshape(*ids.shape, w.k)


def nbytes(w) -> int:
    """Bytes ``w`` (a tensor, a ``Packed`` or a ``Group``) holds."""
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    return w.nbytes
